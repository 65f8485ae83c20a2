"""RoPE inside vq_attention (q_rot, k_rot): the window scores rotated queries and keys, the codes the unrotated
queries. Checked in float64 against the doubled-width formulation the layers used before (q' = [Rq, q],
k' = [Rk, 0], c' = [0, c]) and against the library's naive definition, outputs and gradients."""

import pytest
import torch

from vqattn.functional import naive_vq_attention, vq_assign, vq_attention
from vqattn.modules.rope import rope_rotate
from vqattn.ops.common.statistics import map_time

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


def _narrow(x):
    """The dims of the pairs that _scored keeps, alone: (..., 8) -> (..., 4)."""
    return torch.cat((x[..., 1:3], x[..., 5:7]), -1)


def _in_chunks(q, k, v, c, sizes, *, q_rot, k_rot, assignment, **kw):
    """vq_attention over consecutive chunks of the given sizes, threading the state: every per-position input is
    cut, the codebook is not."""
    outs, state, t = [], None, 0
    for n in sizes:
        cut = slice(t, t + n)
        q_n, k_n, v_n, qr_n, kr_n = (x[:, :, cut] for x in (q, k, v, q_rot, k_rot))
        out, state = vq_attention(q_n, k_n, v_n, c, q_rot=qr_n, k_rot=kr_n, state=state, return_state=True,
                                  assignment=map_time(lambda x: x[:, :, cut], assignment), **kw)  # noqa: B023
        outs.append(out)
        t += n
    return torch.cat(outs, 2)


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
    chunked = _in_chunks(q, k, v, c, sizes, q_rot=qr, k_rot=kr, assignment=a, **kw)
    torch.testing.assert_close(chunked, full, atol=1e-12, rtol=0)


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


@pytest.mark.parametrize("assign", ASSIGNS)
@pytest.mark.parametrize("impl", ["chunk", "recurrent", "decode"])
def test_narrow_code_scores_match_the_naive_definition(assign, impl, block_grouping):
    """q and the codebook on Dc = 4 of the D = 8 dims of k, q_rot and k_rot, the keys assigned at D (as the
    layers' cache_scores="slow" calls the op): outputs and gradients of q, k, v, c match the naive definition, in
    one call of either impl and decoded in chunks carrying a state ("decode")."""
    q, k, v, c = make_inputs(B=1, H=2, T=37, D=8, S=16, Dv=5)
    kw = dict(causal=True, assign=assign, block_len=L, exact_window=True)

    def narrowed(q, k, c):
        qr, kr = _rotated(q, k)
        return _narrow(q), _narrow(c), dict(q_rot=qr, k_rot=kr,
                                            assignment=vq_assign(k, c, assign=assign, temperature=0.7))

    def fast(q, k, v, c):
        q_c, c_c, rest = narrowed(q, k, c)
        if impl == "decode":
            return _in_chunks(q_c, k, v, c_c, [13, 1, 2, 1, 20], schedule=block_grouping, **rest, **kw)
        return vq_attention(q_c, k, v, c_c, impl=impl, schedule=block_grouping, **rest, **kw)

    def naive(q, k, v, c):
        q_c, c_c, rest = narrowed(q, k, c)
        return naive_vq_attention(q_c, k, v, c_c, **rest, **kw)

    out, g = grads(fast, q, k, v, c)
    ref, g_ref = grads(naive, q, k, v, c)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for name, a, b in zip("qkvc", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=f"grad of {name}")


def test_narrow_code_scores_are_checked():
    """q and the codebook may have fewer dims than k only when k is neither scored (the window scores q_rot·k_rot)
    nor assigned here (the assignment is given)."""
    q, k, v, c = make_inputs(T=10)
    qr, kr = _rotated(q, k)
    a = vq_assign(k, c, assign="hard")
    kw = dict(causal=True, exact_window=True, block_len=4)
    narrow = r"q and k must share the feature dim D, got q D=4 and k D=8: .* q_rot and k_rot .* assignment"
    with pytest.raises(ValueError, match=narrow):  # the window would score q·k
        vq_attention(_narrow(q), k, v, _narrow(c), assignment=a, **kw)
    with pytest.raises(ValueError, match=narrow):  # k would be assigned to codes of another width
        vq_attention(_narrow(q), k, v, _narrow(c), q_rot=qr, k_rot=kr, **kw)
    with pytest.raises(ValueError, match="codebook D=8 differs from the query D=4"):
        vq_attention(_narrow(q), k, v, c, q_rot=qr, k_rot=kr, assignment=a, **kw)
    with pytest.raises(ValueError, match=r"q_rot must have the shape of q with k's D, \(2, 3, 10, 8\)"):
        vq_attention(_narrow(q), k, v, _narrow(c), q_rot=_narrow(qr), k_rot=kr, assignment=a, **kw)
