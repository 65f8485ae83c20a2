"""vq_attention under autocast, with a precomputed Assignment, and decoding token by token (the recurrent path),
all against the float64 reference."""

import pytest
import torch

from vqattn.functional import vq_attention

from references import ref_vq_attention
from test_vq_attention import ASSIGN_WINDOW, ASSIGNS, F64, grads, make_inputs


@pytest.mark.parametrize("assign,exact_window", ASSIGN_WINDOW)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_computes_in_fp32(assign, exact_window, autocast_dtype):
    """fp32 inputs inside CPU autocast: the op (forward and its custom backward) ignores autocast."""
    q, k, v, c = make_inputs(B=1, H=2, T=45, D=16, S=32)
    kw = dict(causal=True, assign=assign, temperature=0.7, block_len=8, exact_window=exact_window)
    ref, g_ref = grads(lambda *x: ref_vq_attention(*x, **kw), q, k, v, c)

    def fn(*x):
        with torch.autocast("cpu", dtype=autocast_dtype):
            out = vq_attention(*(t.float() for t in x), **kw)
        assert out.dtype == torch.float32
        return out.double()

    out, g = grads(fn, q, k, v, c)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkvc", g, g_ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"grad of {name}")


def test_autocast_backward_inside_autocast_and_bf16_inputs():
    q, k, v, c = make_inputs(B=1, H=2, T=37, D=16, S=32)
    kw = dict(causal=True, assign="soft", block_len=8)
    half = [t.to(torch.bfloat16).requires_grad_(True) for t in (q, k, v, c)]
    ref, g_ref = grads(lambda *x: ref_vq_attention(*x, **kw), *[t.detach().double() for t in half])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = vq_attention(*half, **kw)
        assert out.dtype == torch.bfloat16
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(123), dtype=F64)
        out.backward(g.to(out.dtype))  # backward inside autocast, as some training loops do
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out.double(), ref, atol=2 * eps, rtol=2 * eps)
    for name, t, b in zip("qkvc", half, g_ref):
        # the gradients are rounded to bf16 once; the error is not accumulated in bf16
        torch.testing.assert_close(t.grad.double(), b, atol=4 * eps * b.abs().max().item(), rtol=4 * eps,
                                   msg=f"grad of {name}")


@pytest.mark.parametrize("assign", ASSIGNS)
@pytest.mark.parametrize("causal", [True, False])
def test_precomputed_assignment_gives_same_outputs_and_grads(assign, causal):
    from vqattn.functional import vq_assign

    q, k, v, c = make_inputs(B=2, H=3, T=29)
    tau = torch.tensor([0.7, 1.1, 1.6], dtype=F64)
    kw = dict(causal=causal, assign=assign, block_len=8)

    def given(q, k, v, c, t):
        a = vq_assign(k, c, assign=assign, temperature=t)
        return vq_attention(q, k, v, c, temperature=t, assignment=a, **kw)

    out, g = grads(lambda *x: vq_attention(*x[:4], temperature=x[4], **kw), q, k, v, c, tau)
    out_a, g_a = grads(given, q, k, v, c, tau)
    torch.testing.assert_close(out_a, out, atol=1e-12, rtol=0)
    for name, a, b in zip(["q", "k", "v", "c", "temperature"], g_a, g):
        if b is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=f"grad of {name}")


def test_assignment_shape_and_kind_are_checked():
    from vqattn.functional import Assignment, vq_assign

    q, k, v, c = make_inputs(T=10)
    hard, soft = vq_assign(k, c, assign="hard"), vq_assign(k, c, assign="soft")
    with pytest.raises(ValueError, match="integer code index"):
        vq_attention(q, k, v, c, causal=True, assign="hard", assignment=soft)
    with pytest.raises(ValueError, match=r"\(B, H, T\)"):
        vq_attention(q, k, v, c, causal=True, assign="hard", assignment=Assignment(None, hard.index[:, :, :5]))
    with pytest.raises(ValueError, match="weights of shape"):
        vq_attention(q, k, v, c, causal=True, assign="soft", assignment=hard)
    with pytest.raises(ValueError, match="weights of shape"):
        vq_attention(q, k, v, c, causal=True, assign="soft", assignment=Assignment(soft.weights[..., :3], None))
    with pytest.raises(ValueError, match="assignment must be an Assignment"):
        vq_attention(q, k, v, c, causal=True, assignment=hard.index)


def _decode(q, k, v, c, sizes, impls=None, **kw):
    """Outputs of consecutive vq_attention calls over chunks of the given sizes (each with its ``impl``), threading
    the state."""
    outs, state, a = [], None, 0
    for n, impl in zip(sizes, impls or ["auto"] * len(sizes)):
        out, state = vq_attention(q[:, :, a : a + n], k[:, :, a : a + n], v[:, :, a : a + n], c, state=state,
                                  return_state=True, impl=impl, **kw)
        outs.append(out)
        a += n
        assert state.length == a and state.keys.shape[2] < 2 * state.block_len
    return torch.cat(outs, 2)


@pytest.mark.parametrize("assign,exact_window", ASSIGN_WINDOW)
@pytest.mark.parametrize("prefill_impl", ["chunk", "recurrent"])
def test_token_by_token_recurrence_matches_reference_outputs_and_grads(assign, exact_window, prefill_impl):
    """Prefill 5 tokens, then 36 single tokens with impl="recurrent" (the block algorithm is never called for them;
    with a recurrent prefill, never at all)."""
    q, k, v, c = make_inputs(B=1, H=2, T=41)
    kw = dict(causal=True, assign=assign, temperature=0.8, block_len=8, exact_window=exact_window)
    impls = [prefill_impl] + ["recurrent"] * 36
    out, g = grads(lambda *x: _decode(*x, [5] + [1] * 36, impls=impls, **kw), q, k, v, c)
    ref, g_ref = grads(lambda *x: ref_vq_attention(*x, **kw), q, k, v, c)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for name, a, b in zip("qkvc", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=f"grad of {name}")


@pytest.mark.parametrize("assign", ASSIGNS)
def test_autocast_non_causal(assign):
    q, k, v, c = make_inputs(B=1, H=2, T=30, D=16, S=32)
    ref = ref_vq_attention(q, k, v, c, causal=False, assign=assign, temperature=0.7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = vq_attention(q.float(), k.float(), v.float(), c.float(), causal=False, assign=assign, temperature=0.7)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
