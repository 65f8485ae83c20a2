"""window_attention against the naive band-masked float64 reference; state, causality, autocast."""

import pytest
import torch

from vqattn.functional import WindowState, window_attention
from vqattn.ops.blocks import DEFAULT_BLOCK_LEN, group_windows
from vqattn.ops.utils import RECURRENT_MAX_LEN

from memory_helpers import largest_tensor
from references import ref_softmax_attention, ref_window_attention

F64 = torch.float64


def make_qkv(B=2, H=3, T=50, D=8, Dv=5, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=g, dtype=dtype) for d in (D, D, Dv)]


def grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype))
    return out.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("T,block_len", [(1, 4), (37, 8), (100, 7)])
def test_naive_impl_is_the_band_reference(T, block_len):
    q, k, v = make_qkv(T=T)
    out, g = grads(lambda *x: window_attention(*x, block_len=block_len, scale=0.4, impl="naive"), q, k, v)
    ref, g_ref = grads(lambda *x: ref_window_attention(*x, block_len=block_len, scale=0.4), q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkv", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11, msg=f"grad of {name}")
    with pytest.raises(ValueError, match="impl='naive' takes no state"):
        window_attention(q, k, v, block_len=block_len, impl="naive", return_state=True)


@pytest.mark.parametrize("T,block_len", [(1, 4), (5, 8), (37, 8), (64, 16), (100, 7), (300, None)])
def test_matches_band_reference_outputs_and_grads(T, block_len, block_grouping):
    q, k, v = make_qkv(T=T)
    out, g = grads(lambda *x: window_attention(*x, block_len=block_len, scale=0.4, schedule=block_grouping), q, k, v)
    ref, g_ref = grads(lambda *x: ref_window_attention(*x, block_len=block_len or DEFAULT_BLOCK_LEN, scale=0.4),
                       q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkv", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11, msg=f"grad of {name}")


@pytest.mark.parametrize("n,scale", [(1, 1.0), (3, 1.0), (4, 0.3)])
def test_group_windows_are_the_scaled_previous_and_current_blocks(n, scale):
    """Every block's window [block b − 1, block b] (block −1: ``before``), times scale, written out block by block;
    outputs and gradients of the piece and the block before it, float64."""
    L = 4
    piece, before = torch.randn(2, 3, n * L, 5, dtype=F64), torch.randn(2, 3, L, 5, dtype=F64)

    def reference(piece, before):
        blocks = [before] + list(piece.split(L, 2))
        return scale * torch.stack([torch.cat(blocks[b : b + 2], 2) for b in range(n)], 2)

    out, g = grads(lambda p, b: group_windows(p, b, L, scale), piece, before)
    ref, g_ref = grads(reference, piece, before)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-14)


def test_is_softmax_while_the_sequence_fits_in_two_blocks():
    q, k, v = make_qkv(T=13)
    torch.testing.assert_close(window_attention(q, k, v, block_len=8), ref_softmax_attention(q, k, v, causal=True))
    assert not torch.allclose(window_attention(q, k, v, block_len=4), ref_softmax_attention(q, k, v, causal=True))


@pytest.mark.parametrize("sizes", [[13, 1, 2, 1, 23, 21], [1] * 61, [5, 56]])
def test_chunked_and_token_by_token_match_one_call(sizes):
    q, k, v = make_qkv(T=61)
    L = 8
    full = window_attention(q, k, v, block_len=L)
    pieces, state, a = [], None, 0
    for n in sizes:
        out, state = window_attention(q[:, :, a : a + n], k[:, :, a : a + n], v[:, :, a : a + n], block_len=L,
                                      state=state, return_state=True)
        pieces.append(out)
        a += n
        assert isinstance(state, WindowState) and state.length == a and state.keys.shape[2] < 2 * L
    torch.testing.assert_close(torch.cat(pieces, 2), full, atol=1e-12, rtol=0)


def test_recurrent_gradients_match_one_call():
    q, k, v = make_qkv(T=21)
    L = 4

    def stepwise(q, k, v):
        outs, state = [], None
        for t in range(21):
            n = 6 if t == 0 else 1
            if t and t < 6:
                continue
            out, state = window_attention(q[:, :, t : t + n], k[:, :, t : t + n], v[:, :, t : t + n], block_len=L,
                                          state=state, return_state=True)
            outs.append(out)
        return torch.cat(outs, 2)

    assert RECURRENT_MAX_LEN >= 1
    out, g = grads(stepwise, q, k, v)
    ref, g_ref = grads(lambda *x: ref_window_attention(*x, block_len=L), q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for name, a, b in zip("qkv", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0, msg=f"grad of {name}")


def test_causality_and_locality(block_grouping):
    q, k, v = make_qkv(T=53)
    L = 8
    out = window_attention(q, k, v, block_len=L, schedule=block_grouping)
    for t0 in (0, 9, 30, 52):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t0 + 1 :] += 5
        v2[:, :, t0 + 1 :] += 5
        torch.testing.assert_close(window_attention(q, k2, v2, block_len=L, schedule=block_grouping)[:, :, : t0 + 1],
                                   out[:, :, : t0 + 1], atol=0, rtol=0)
    # keys older than the previous block are invisible
    k3, v3 = k.clone(), v.clone()
    k3[:, :, :8], v3[:, :, :8] = 9.0, 9.0
    torch.testing.assert_close(window_attention(q, k3, v3, block_len=L, schedule=block_grouping)[:, :, 16:],
                               out[:, :, 16:], atol=0, rtol=0)


def test_autocast_and_half_inputs():
    q, k, v = make_qkv(T=45, D=16)
    ref = ref_window_attention(q, k, v, block_len=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = window_attention(q.float(), k.float(), v.float(), block_len=8)
        half = window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), block_len=8)
    assert out.dtype == torch.float32 and half.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert (half.double() - ref).abs().max() < 0.05


def test_no_t_by_t_tensor():
    T, L = 512, 16
    q, k, v = make_qkv(B=1, H=1, T=T, D=4, Dv=4)
    biggest = largest_tensor(lambda: window_attention(q, k, v, block_len=L))
    assert biggest <= T * 2 * L


def test_bad_arguments_raise_value_error():
    q, k, v = make_qkv(T=10)
    with pytest.raises(ValueError, match="block_len"):
        window_attention(q, k, v, block_len=0)
    with pytest.raises(ValueError, match="same length"):
        window_attention(q[:, :, :5], k, v, block_len=4)
    _, state = window_attention(q, k, v, block_len=4, return_state=True)
    with pytest.raises(ValueError, match="block_len"):
        window_attention(q, k, v, block_len=8, state=state)
    with pytest.raises(ValueError, match="WindowState"):
        window_attention(q, k, v, block_len=4, state=(k, v))
    with pytest.raises(ValueError, match="state does not match"):
        window_attention(q[:, :2], k[:, :2], v[:, :2], state=state)
