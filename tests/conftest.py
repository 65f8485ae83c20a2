import pytest

from vqattn.ops.blocks import Schedule


@pytest.fixture(params=[(None, "loop"), (1, "loop"), (3, "loop"), (None, "cumsum"), (3, "cumsum")],
                ids=["one_group", "block_by_block", "groups_of_3", "one_group-cumsum", "groups_of_3-cumsum"])
def block_grouping(request) -> Schedule:
    """A Schedule for the block algorithms (vq and window): groups of this many blocks (None: all blocks in one
    group), as ``block_groups`` picks them on CPU for long sequences, so short test sequences take every path;
    and the code caches read with the loop over blocks (CPU eager) or by one cumsum (GPUs, torch.compile)."""
    size, cache = request.param
    return Schedule(cache, size if size is not None else 10**9)
