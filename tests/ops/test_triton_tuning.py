"""Every launch candidate of the tuned kernels (vqattn/ops/triton/tuning.py) computes the same thing: each distinct
set of meta-parameters (the code tile BS; warps and stages do not change what the interpreter computes) runs the
hard superblock step against the float64 definition, outputs and every input's gradient, with more codes than one
tile holds and a partial last tile. Under Triton's interpreter on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

from vqattn.ops.blocks import Schedule
from vqattn.ops.triton import superblock, tuning
from vqattn.ops.vq import naive_vq_attention, vq_attention

from triton_helpers import compare, leaves, nan_empty, needs_triton  # noqa: F401 (a fixture)

pytestmark = [needs_triton, pytest.mark.usefixtures("nan_empty")]
# S: 3 tiles of 64 codes (the last partial), 2 of 128, 1 of 256; one head (the code tiles are a head's own: the
# definition's tests take several)
B, H, D, DV, S, L, T = 1, 1, 16, 8, 160, 16, 100
TUNED = [kernel for kernel in vars(superblock).values() if hasattr(kernel, "candidates")]


def distinct_meta(kernel) -> list:
    """The kernel's candidates with distinct meta-parameters, in order (the first is the one it runs with)."""
    seen = {}
    for config in kernel.candidates:
        seen.setdefault(tuple(sorted(config.kwargs.items())), config)
    return list(seen.values())


def test_the_superblock_kernels_are_tuned():
    names = {kernel.fn.__name__ for kernel in TUNED}
    assert names == {"_superblock_sums_kernel", "_superblock_forward_kernel", "_superblock_code_backward_kernel",
                     "_superblock_cache_grad_kernel", "_superblock_key_backward_kernel"}
    assert all(kernel.configs == kernel.candidates[:1] for kernel in TUNED) or tuning.AUTOTUNE


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("choice", [1, 2])
def test_every_candidate_equals_the_definition(choice, monkeypatch):
    """The choice-th distinct candidate of every tuned kernel (the last one where a kernel has fewer) at once."""
    assert max(len(distinct_meta(kernel)) for kernel in TUNED) == 3  # the code tiles 64, 128 and 256 of the sums
    for kernel in TUNED:
        options = distinct_meta(kernel)
        monkeypatch.setattr(kernel, "configs", [options[min(choice, len(options) - 1)]])
        monkeypatch.setattr(kernel, "cache", {})
    q, k, v, c = leaves((B, H, T, D), (B, H, T, D), (B, H, T, DV), (H, S, D), generator=torch.Generator().manual_seed(0))

    def run(attention, impl=None, **extra):
        extra = extra | ({} if impl is None else {"impl": impl})
        return lambda q, k, v, c: attention(q, k, v, c, causal=True, assign="hard", block_len=L, exact_window=True,
                                            memory_cap=40, **extra)

    two = Schedule(superblocks=2)
    compare(run(naive_vq_attention), run(vq_attention, "triton", schedule=two), [q, k, v, c])


def test_configs_keep_the_first_setting_first():
    candidates = tuning.configs(dict(BS=64, num_warps=4, num_stages=1), BS=(128, 64), num_warps=(8, 4))
    assert (candidates[0].kwargs, candidates[0].num_warps, candidates[0].num_stages) == ({"BS": 64}, 4, 1)
    settings = {(c.kwargs["BS"], c.num_warps, c.num_stages) for c in candidates}
    assert settings == {(64, 4, 1), (128, 8, 1), (128, 4, 1), (64, 8, 1)} and len(candidates) == 4
