"""RoPE inside vq_attention (q_rot, k_rot): the window scores rotated queries and keys, the codes the unrotated
queries. Checked in float64 against the doubled-width formulation the layers used before (q' = [Rq, q],
k' = [Rk, 0], c' = [0, c]) and against the library's naive definition, outputs and gradients."""

import pytest
import torch

from vqattn.functional import naive_vq_attention, vq_assign, vq_attention
from vqattn.layers.base import rope_rotate

from test_vq_attention import ASSIGNS, grads, make_inputs

L = 8


def _rotated(q, k):
    return rope_rotate(q, 0, 100.0), rope_rotate(k, 0, 100.0)


def _scored(c, slow: bool):
    """The codebook that scores the codes: all dims, or (as cache_scores="slow") a subset of RoPE pairs."""
    if not slow:
        return c
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=c.dtype).repeat(2)  # pairs (m, m + 4) of D = 8
    return c * mask


def _doubled(q, k, v, c, *, assign, slow, **kw):
    qr, kr = _rotated(q, k)
    a = vq_assign(k, c, assign=assign, temperature=0.7)
    c2 = torch.cat([torch.zeros_like(c), _scored(c, slow)], -1)
    return vq_attention(torch.cat([qr, q], -1), torch.cat([kr, torch.zeros_like(k)], -1), v, c2, assign=assign,
                        assignment=a, scale=q.shape[-1] ** -0.5, exact_window=True, causal=True, block_len=L, **kw)


def _native(q, k, v, c, *, assign, slow, **kw):
    qr, kr = _rotated(q, k)
    a = vq_assign(k, c, assign=assign, temperature=0.7)
    return vq_attention(q, k, v, _scored(c, slow), q_rot=qr, k_rot=kr, assign=assign, assignment=a,
                        exact_window=True, causal=True, block_len=L, **kw)




@pytest.mark.parametrize("assign", ASSIGNS)
@pytest.mark.parametrize("slow", [False, True])
def test_rotated_window_equals_the_doubled_formulation(assign, slow, block_grouping):
    q, k, v, c = make_inputs(B=2, H=2, T=45, D=8, S=16, Dv=5)
    kw = dict(assign=assign, slow=slow, schedule=block_grouping)
    out, g = grads(lambda *x: _native(*x, **kw), q, k, v, c)
    ref, g_ref = grads(lambda *x: _doubled(*x, **kw), q, k, v, c)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkvc", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11, msg=f"grad of {name}")


@pytest.mark.parametrize("assign", ASSIGNS)
def test_rotated_window_matches_the_naive_definition(assign, block_grouping):
    q, k, v, c = make_inputs(B=1, H=2, T=37, D=8, S=16, Dv=5)

    def naive(q, k, v, c):
        qr, kr = _rotated(q, k)
        return naive_vq_attention(q, k, v, c, q_rot=qr, k_rot=kr, causal=True, assign=assign, temperature=0.7,
                                  block_len=L, exact_window=True)

    def fast(q, k, v, c):
        qr, kr = _rotated(q, k)
        return vq_attention(q, k, v, c, q_rot=qr, k_rot=kr, causal=True, assign=assign, temperature=0.7,
                            block_len=L, exact_window=True, schedule=block_grouping)

    out, g = grads(fast, q, k, v, c)
    ref, g_ref = grads(naive, q, k, v, c)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for name, a, b in zip("qkvc", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=f"grad of {name}")


@pytest.mark.parametrize("assign", ASSIGNS)
@pytest.mark.parametrize("sizes", [[13, 1, 2, 1, 23, 5], [5] + [1] * 40])
def test_rotated_window_state_continues_one_call(assign, sizes):
    """Chunked prefill and token-by-token decoding keep the rotated keys in the state."""
    q, k, v, c = make_inputs(B=1, H=2, T=45, D=8, S=16)
    qr, kr = _rotated(q, k)
    a = vq_assign(k, c, assign=assign, temperature=0.7)
    kw = dict(causal=True, assign=assign, exact_window=True, block_len=L)
    full = vq_attention(q, k, v, c, q_rot=qr, k_rot=kr, assignment=a, **kw)
    outs, state, t = [], None, 0
    for n in sizes:
        cut = slice(t, t + n)
        part = [x[:, :, cut] for x in (q, k, v)]
        out, state = vq_attention(*part, c, q_rot=qr[:, :, cut], k_rot=kr[:, :, cut], state=state,
                                  return_state=True, assignment=type(a)(*(None if x is None else x[:, :, cut]
                                                                          for x in a)), **kw)
        outs.append(out)
        t += n
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-12, rtol=0)


def test_rotated_inputs_are_checked():
    q, k, v, c = make_inputs(T=10)
    kw = dict(causal=True, exact_window=True, block_len=4)
    with pytest.raises(ValueError, match="go together"):
        vq_attention(q, k, v, c, q_rot=q, **kw)
    with pytest.raises(ValueError, match="exact_window=True"):
        vq_attention(q, k, v, c, q_rot=q, k_rot=k, causal=True)
    with pytest.raises(ValueError, match="k_rot must have the shape"):
        vq_attention(q, k, v, c, q_rot=q, k_rot=k[:, :, :5], **kw)
    with pytest.raises(ValueError, match="dtype"):
        vq_attention(q, k, v, c, q_rot=q.float(), k_rot=k, **kw)
