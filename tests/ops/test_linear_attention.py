import pytest
import torch

from vqattn.functional import LinearState, linear_attention

from references_kernel import naive_linear_attention

F64 = torch.float64


def _inputs(B=2, H=2, T=13, M=6, Dv=5, Tq=None, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    # positive features, as produced by exp / elu+1 maps
    phi_q = torch.rand(B, H, Tq or T, M, generator=g, dtype=F64) + 0.05
    phi_k = torch.rand(B, H, T, M, generator=g, dtype=F64) + 0.05
    v = torch.randn(B, H, T, Dv, generator=g, dtype=F64)
    return [x.to(dtype).requires_grad_() for x in (phi_q, phi_k, v)]


def _grads(out, inputs, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("T,block_len", [(1, 4), (13, 4), (13, 1), (16, 8), (37, 16), (20, None), (9, 64)])
@pytest.mark.parametrize("normalizer", ["kernel", "count", "none"])
def test_causal_chunked_matches_naive(T, block_len, normalizer):
    inputs = _inputs(T=T, seed=T)
    out = linear_attention(*inputs, causal=True, block_len=block_len, normalizer=normalizer)
    ref = naive_linear_attention(*inputs, causal=True, normalizer=normalizer)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, gr in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("Tq,Tk", [(7, 7), (3, 11), (11, 1)])
@pytest.mark.parametrize("normalizer", ["kernel", "count"])
def test_noncausal_matches_naive(Tq, Tk, normalizer):
    inputs = _inputs(T=Tk, Tq=Tq)
    out = linear_attention(*inputs, causal=False, normalizer=normalizer)
    ref = naive_linear_attention(*inputs, causal=False, normalizer=normalizer)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, gr in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-12)


def test_signed_features_count_normalizer():
    # identity-style signed features: "count" is the mean of the raw weights, defined for any sign
    phi_q, phi_k, v = (x.detach() for x in _inputs(T=10))
    phi_q, phi_k = phi_q - 0.5, phi_k - 0.5
    out = linear_attention(phi_q, phi_k, v, causal=True, block_len=3, normalizer="count")
    torch.testing.assert_close(out, naive_linear_attention(phi_q, phi_k, v, causal=True, normalizer="count"))


@pytest.mark.parametrize("block_len", [3, 8])
def test_causality(block_len):
    phi_q, phi_k, v = (x.detach() for x in _inputs(T=17))
    out = linear_attention(phi_q, phi_k, v, causal=True, block_len=block_len)
    t0 = 9
    phi_k2, v2 = phi_k.clone(), v.clone()
    phi_k2[:, :, t0:] = torch.rand_like(phi_k2[:, :, t0:]) * 5
    v2[:, :, t0:] = torch.randn_like(v2[:, :, t0:]) * 5
    out2 = linear_attention(phi_q, phi_k2, v2, causal=True, block_len=block_len)
    torch.testing.assert_close(out2[:, :, :t0], out[:, :, :t0], rtol=1e-13, atol=1e-13)
    assert not torch.allclose(out2[:, :, t0:], out[:, :, t0:])
    # gradients too: early outputs do not depend on later keys / values
    phi_k.requires_grad_(), v.requires_grad_()
    early = linear_attention(phi_q, phi_k, v, causal=True, block_len=block_len)[:, :, :t0].sum()
    gk, gv = torch.autograd.grad(early, (phi_k, v))
    assert gk[:, :, t0:].abs().max() == 0 and gv[:, :, t0:].abs().max() == 0


@pytest.mark.parametrize("splits", [[5, 1, 1, 10], [1] * 6 + [11], [17]])
@pytest.mark.parametrize("normalizer", ["kernel", "count"])
def test_state_pieces_equal_full(splits, normalizer):
    phi_q, phi_k, v = (x.detach() for x in _inputs(T=17))
    full = linear_attention(phi_q, phi_k, v, causal=True, block_len=4, normalizer=normalizer)
    state, outs, start = None, [], 0
    for n in splits:
        sl = slice(start, start + n)
        out, state = linear_attention(
            phi_q[:, :, sl], phi_k[:, :, sl], v[:, :, sl], causal=True, block_len=4, normalizer=normalizer,
            state=state, return_state=True,
        )
        outs.append(out)
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-12, atol=1e-12)
    assert isinstance(state, LinearState) and state.length == 17
    torch.testing.assert_close(state.kv, torch.einsum("bhtm,bhtd->bhmd", phi_k, v))
    torch.testing.assert_close(state.k_sum, phi_k.sum(2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computed_in_float32(dtype):
    phi_q, phi_k, v = (x.detach() for x in _inputs(T=20))
    out = linear_attention(phi_q.to(dtype), phi_k.to(dtype), v.to(dtype), causal=True, block_len=6)
    assert out.dtype == dtype
    ref = naive_linear_attention(phi_q.to(dtype).double(), phi_k.to(dtype).double(), v.to(dtype).double(), causal=True)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2  # one rounding of the output
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # float32 features (what feature maps return for half inputs) with half values
    out32 = linear_attention(phi_q.float(), phi_k.float(), v.to(dtype), causal=True)
    assert out32.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_all_zero_row_gives_zero_not_nan(dtype):
    phi_q, phi_k, v = (x.detach().to(dtype) for x in _inputs(T=6))
    phi_q[:, :, 2] = 0.0  # relu features can vanish
    inputs = [x.requires_grad_() for x in (phi_q, phi_k, 3 * v)]
    out = linear_attention(*inputs, causal=True)
    assert torch.isfinite(out).all() and out[:, :, 2].abs().max() == 0
    # and the gradients stay finite (a clamp at the smallest normal number made them 0·inf = NaN)
    assert all(torch.isfinite(g).all() for g in _grads(3 * out, inputs))


def test_eps_floor_is_kept_on_request():
    phi_q, phi_k, v = (x.detach() for x in _inputs(T=6))
    small = linear_attention(1e-4 * phi_q, 1e-4 * phi_k, v, causal=True)  # row sums ~1e-8
    torch.testing.assert_close(small, linear_attention(phi_q, phi_k, v, causal=True))  # scale-free by default
    floored = linear_attention(1e-4 * phi_q, 1e-4 * phi_k, v, causal=True, eps=1e-6)
    ref = naive_linear_attention(1e-4 * phi_q, 1e-4 * phi_k, v, causal=True, normalizer="none")
    den = naive_linear_attention(1e-4 * phi_q, 1e-4 * phi_k, torch.ones_like(v[..., :1]), causal=True, normalizer="none")
    torch.testing.assert_close(floored, ref / den.clamp_min(1e-6))


def test_bad_input():
    phi_q, phi_k, v = (x.detach() for x in _inputs(T=6))
    with pytest.raises(ValueError, match="phi_q"):
        linear_attention(phi_q[0], phi_k, v, causal=True)
    with pytest.raises(ValueError, match="feature dim"):
        linear_attention(phi_q[..., :3], phi_k, v, causal=True)
    with pytest.raises(ValueError, match="same length"):
        linear_attention(phi_q[:, :, :3], phi_k, v, causal=True)
    with pytest.raises(ValueError, match="normalizer"):
        linear_attention(phi_q, phi_k, v, causal=True, normalizer="softmax")
    with pytest.raises(ValueError, match="block_len"):
        linear_attention(phi_q, phi_k, v, causal=True, block_len=0)
    with pytest.raises(ValueError, match="eps"):
        linear_attention(phi_q, phi_k, v, causal=True, eps=0.0)
    with pytest.raises(ValueError, match="causal=True"):
        linear_attention(phi_q, phi_k, v, causal=False, return_state=True)
    with pytest.raises(ValueError, match="phi_k has dtype"):
        linear_attention(phi_q, phi_k.float(), v, causal=True)
    bad = LinearState(kv=torch.zeros(2, 2, 3, 5, dtype=F64), k_sum=torch.zeros(2, 2, 3, dtype=F64), length=4)
    with pytest.raises(ValueError, match="state does not match"):
        linear_attention(phi_q, phi_k, v, causal=True, state=bad)


# ---------------------------------------------------------------------------------- per-key log scales


def _log_scaled(T, spread, seed=2, dtype=F64):
    phi_q, phi_k, v = (x.detach().to(dtype) for x in _inputs(T=T, seed=seed))
    g = torch.Generator().manual_seed(seed + 1)
    ls = (spread * (torch.rand(2, 2, T, generator=g, dtype=F64) - 0.5)).to(dtype)
    return phi_q, phi_k, v, ls


@pytest.mark.parametrize("causal,impl", [(False, "chunk"), (False, "naive"), (True, "chunk"), (True, "recurrent"),
                                         (True, "naive")])
@pytest.mark.parametrize("normalizer", ["kernel", "count", "none"])
@pytest.mark.parametrize("T,block_len", [(13, 4), (17, 17), (5, 2)])
def test_log_scale_matches_naive_values_and_grads(causal, normalizer, T, block_len, impl):
    """Every form (impl; the recurrent one is causal) against the tests' own reference, outputs and gradients."""
    phi_q, phi_k, v, ls = _log_scaled(T, spread=6.0)
    inputs = [x.requires_grad_() for x in (phi_q, phi_k, v, ls)]
    out = linear_attention(*inputs[:3], causal=causal, k_log_scale=inputs[3], block_len=block_len,
                           normalizer=normalizer, impl=impl)
    ref = naive_linear_attention(*inputs[:3], causal=causal, k_log_scale=inputs[3], normalizer=normalizer)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, gr in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_log_scale_beyond_float32_range(causal):
    # log scales spread over 400 nats: exp of them over/underflows float32, the stabilised op must not
    phi_q, phi_k, v, ls = _log_scaled(29, spread=400.0, seed=5)
    ref = naive_linear_attention(phi_q, phi_k, v, causal=causal, k_log_scale=ls)
    out = linear_attention(phi_q.float(), phi_k.float(), v.float(), causal=causal, k_log_scale=ls.float(), block_len=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [[5, 1, 1, 10], [1] * 6 + [11]])
def test_log_scale_state_pieces_equal_full(splits):
    phi_q, phi_k, v, ls = _log_scaled(17, spread=300.0, seed=7)
    phi_q, phi_k, v, ls = phi_q.float(), phi_k.float(), v.float(), ls.float()
    full = linear_attention(phi_q, phi_k, v, causal=True, block_len=4, k_log_scale=ls)
    state, outs, start = None, [], 0
    for n in splits:
        sl = slice(start, start + n)
        out, state = linear_attention(phi_q[:, :, sl], phi_k[:, :, sl], v[:, :, sl], causal=True, block_len=4,
                                      k_log_scale=ls[:, :, sl], state=state, return_state=True)
        outs.append(out)
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-5, atol=1e-5)
    r = ls.amax(-1)
    torch.testing.assert_close(state.log_scale, r)
    w = torch.exp(ls.double() - r.double().unsqueeze(-1)).unsqueeze(-1)
    torch.testing.assert_close(state.kv.double(), torch.einsum("bhtm,bhtd->bhmd", phi_k.double() * w, v.double()),
                               rtol=1e-5, atol=1e-6)


def test_log_scale_bad_input():
    phi_q, phi_k, v, ls = _log_scaled(6, spread=1.0)
    with pytest.raises(ValueError, match="k_log_scale must have shape"):
        linear_attention(phi_q, phi_k, v, causal=True, k_log_scale=ls[:, :, :3])
    with pytest.raises(ValueError, match="k_log_scale must be a floating-point"):
        linear_attention(phi_q, phi_k, v, causal=True, k_log_scale=ls.long())


# ------------------------------------------------------------------------------------------ autocast


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_float32_inputs_under_autocast_match_float64(causal, amp):
    phi_q, phi_k, v, ls = _log_scaled(19, spread=8.0, seed=3)
    ref = naive_linear_attention(phi_q, phi_k, v, causal=causal, k_log_scale=ls)
    inputs = [x.float().requires_grad_() for x in (phi_q, phi_k, v, ls)]
    with torch.autocast("cpu", dtype=amp):
        out = linear_attention(*inputs[:3], causal=causal, k_log_scale=inputs[3], block_len=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref = naive_linear_attention(*ref_inputs[:3], causal=causal, k_log_scale=ref_inputs[3])
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = torch.autograd.grad((out * w.float()).sum(), inputs)
    for g, gr in zip(grads, torch.autograd.grad((ref * w).sum(), ref_inputs)):
        torch.testing.assert_close(g.double(), gr, rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs_under_autocast_are_finite_and_close():
    phi_q, phi_k, v = (x.detach() for x in _inputs(T=21))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_attention(phi_q.bfloat16(), phi_k.bfloat16(), v.bfloat16(), causal=True, block_len=8)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = naive_linear_attention(*(x.bfloat16().double() for x in (phi_q, phi_k, v)), causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1.6e-2, atol=1.6e-2)  # one bf16 rounding of the output


@pytest.mark.parametrize("scaled_first", [False, True])
def test_recurrent_continues_a_chunked_state(scaled_first):
    """A state from the chunk form, continued token by token (impl="recurrent"), also by keys without log scales
    after scaled ones: the same outputs and final sums as one call."""
    phi_q, phi_k, v, ls = _log_scaled(15, spread=40.0, seed=3)
    ls_first = ls if scaled_first else None
    full_ls = torch.cat([ls[:, :, :9], torch.zeros_like(ls[:, :, 9:])], 2) if scaled_first else None
    full, full_state = linear_attention(phi_q, phi_k, v, causal=True, block_len=4, k_log_scale=full_ls,
                                        return_state=True)
    head, state = linear_attention(phi_q[:, :, :9], phi_k[:, :, :9], v[:, :, :9], causal=True, block_len=4,
                                   k_log_scale=None if ls_first is None else ls_first[:, :, :9], return_state=True)
    tail, state = linear_attention(phi_q[:, :, 9:], phi_k[:, :, 9:], v[:, :, 9:], causal=True, state=state,
                                   return_state=True, impl="recurrent")
    torch.testing.assert_close(torch.cat([head, tail], 2), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.kv, full_state.kv, rtol=1e-10, atol=1e-12)


def test_impls_reject_what_they_cannot_do():
    phi_q, phi_k, v = (x.detach() for x in _inputs())
    with pytest.raises(ValueError, match="impl='naive' takes no state"):
        linear_attention(phi_q, phi_k, v, causal=True, impl="naive", return_state=True)
    with pytest.raises(ValueError, match="impl='recurrent'"):
        linear_attention(phi_q, phi_k, v, causal=False, impl="recurrent")
    with pytest.raises(ValueError, match="impl"):
        linear_attention(phi_q, phi_k, v, causal=True, impl="fused")
