import pytest


@pytest.fixture(params=[(None, True), (1, True), (3, True), (None, False), (3, False)],
                ids=["one_group", "block_by_block", "groups_of_3", "one_group-batched", "groups_of_3-batched"])
def block_grouping(request, monkeypatch):
    """Run the block algorithms (vq and window) in groups of this many blocks (None: all blocks in one group), as
    ``block_groups`` picks them on CPU for long sequences, so short test sequences take every path; and read the
    code caches with the CPU loop over blocks, or ("batched") as GPUs and torch.compile do (``_scans``)."""
    import vqattn.ops.vq as vq_module
    import vqattn.ops.vq_blocks as blocks_module
    import vqattn.ops.window as window_module

    size, scans = request.param
    if not scans:
        monkeypatch.setattr(blocks_module, "_scans", lambda device: False)
    if size is not None:
        def groups(num_blocks, bytes_per_block, device):
            return [(b0, min(b0 + size, num_blocks)) for b0 in range(0, num_blocks, size)]

        monkeypatch.setattr(vq_module, "block_groups", groups)
        monkeypatch.setattr(window_module, "block_groups", groups)
    return size
