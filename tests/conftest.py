import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter, which is read when they are defined: before the
# first import of vqattn.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The token files the trainer's tests make go to a directory of this run (shared by its xdist workers, which inherit
# the variable), not to the user's cache (~/.cache/vqattn/tokens), unless the caller chose one.
if "VQATTN_CACHE_DIR" not in os.environ:
    os.environ["VQATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="vqattn-test-tokens-")
    atexit.register(shutil.rmtree, os.environ["VQATTN_CACHE_DIR"], ignore_errors=True)

from vqattn.ops.blocks import Schedule  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts) starts one worker per core that other work leaves idle as the suite
    starts, as the trainer's ``threads: auto`` counts them (at least 1; ``--maxprocesses`` still caps it): on a busy
    machine more workers than idle cores stall one another."""
    from vqattn.utils import idle_cores

    return max(1, idle_cores())


def pytest_configure(config):
    """Under pytest-xdist every worker is one core: one intra-op thread, also for the processes its tests start
    (train.py, DDP ranks), and inductor compiles in the worker instead of a pool of its own. Workers that each spin
    as many OpenMP threads as there are cores run many times slower."""
    if hasattr(config, "workerinput"):
        import torch._inductor.config

        torch.set_num_threads(1)
        torch._inductor.config.compile_threads = 1
        os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    """The modules with the most slow tests run first, each module's tests together and in their own order: the
    workers then end on short tests together, instead of one of them idling while the other finishes a run of
    subprocesses that started last."""
    def module(item):
        return item.nodeid.split("::")[0]

    slow = {}
    for item in items:
        slow[module(item)] = slow.get(module(item), 0) + (item.get_closest_marker("slow") is not None)
    order = {name: rank for rank, name in enumerate(dict.fromkeys(map(module, items)))}
    items.sort(key=lambda item: (-slow[module(item)], order[module(item)]))


@pytest.fixture(params=[(None, "loop"), (1, "loop"), (3, "loop"), (None, "cumsum"), (3, "cumsum")],
                ids=["one_group", "block_by_block", "groups_of_3", "one_group-cumsum", "groups_of_3-cumsum"])
def block_grouping(request) -> Schedule:
    """A Schedule for the block algorithms (vq and window): groups of this many blocks (None: all blocks in one
    group), as ``block_groups`` picks them on CPU for long sequences, so short test sequences take every path;
    and the code caches read with the loop over blocks (CPU eager) or by one cumsum (GPUs, torch.compile)."""
    size, cache = request.param
    return Schedule(cache, size if size is not None else 10**9)
