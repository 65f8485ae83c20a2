"""vq_assign against the explicit-distance reference (tests/references.py) in float64: outputs and gradients to the
keys, the codebook and a learned temperature, for every tiling of the keys (tiles that do not divide T included)."""

import pytest
import torch

from vqattn.functional import vq_assign

from references import ref_assignment_log_weights

F64 = torch.float64
TILINGS = [None, 1, 5, 16, 1000]  # default, one key per tile, uneven tiles, exact division, one tile


def _inputs(B=2, H=3, T=37, D=8, S=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g, dtype=F64)
    c = torch.randn(H, S, D, generator=g, dtype=F64)
    tau = torch.rand(H, generator=g, dtype=F64) + 0.5
    return k, c, tau


@pytest.mark.parametrize("tile_rows", TILINGS)
def test_soft_weights_and_gradients_match_the_reference(tile_rows):
    k, c, tau = (x.requires_grad_() for x in _inputs())
    weights = vq_assign(k, c, assign="soft", temperature=tau, tile_rows=tile_rows).weights
    expected = ref_assignment_log_weights(k, c, "soft", tau).exp()
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-13)
    grad = torch.randn(weights.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = torch.autograd.grad(weights, (k, c, tau), grad)
    want = torch.autograd.grad(expected, (k, c, tau), grad)
    for name, x, y in zip(("k", "codebook", "temperature"), got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12, msg=f"gradient to {name}")


@pytest.mark.parametrize("tile_rows", TILINGS)
def test_hard_index_is_the_nearest_code(tile_rows):
    k, c, _ = _inputs(T=53, seed=2)
    index = vq_assign(k, c, assign="hard", tile_rows=tile_rows).index
    torch.testing.assert_close(index, ref_assignment_log_weights(k, c, "hard", 1.0).argmax(-1), rtol=0, atol=0)


def test_soft_gradient_reaches_only_what_requires_it():
    k, c, _ = _inputs()
    c.requires_grad_()
    weights = vq_assign(k, c, assign="soft", temperature=0.7, tile_rows=4).weights
    (weights * weights).sum().backward()
    assert k.grad is None and c.grad is not None and torch.isfinite(c.grad).all()


@pytest.mark.parametrize("tile_rows", [0, -3, 2.5, True])
def test_tile_rows_must_be_a_positive_int(tile_rows):
    k, c, _ = _inputs()
    with pytest.raises(ValueError, match="tile_rows"):
        vq_assign(k, c, assign="soft", tile_rows=tile_rows)
