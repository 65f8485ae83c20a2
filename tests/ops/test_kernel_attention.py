import pytest
import torch

from vqattn.functional import kernel_attention, softmax_attention

from references_kernel import naive_kernel_attention, naive_softmax_attention

F64 = torch.float64


def _qkv(Tq=9, Tk=9, D=6, Dv=4, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, Tq, D, generator=g, dtype=F64)
    k = torch.randn(2, 3, Tk, D, generator=g, dtype=F64)
    v = torch.randn(2, 3, Tk, Dv, generator=g, dtype=F64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def _grads(out, inputs):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_exp_equals_softmax_attention(causal, dtype, tol, scale):
    q, k, v = _qkv(dtype=dtype)
    out = kernel_attention(q, k, v, kernel="exp", causal=causal, scale=scale)
    torch.testing.assert_close(out, softmax_attention(q, k, v, causal=causal, scale=scale), rtol=tol, atol=tol)
    if dtype == F64:
        torch.testing.assert_close(out, naive_softmax_attention(q, k, v, causal=causal, scale=scale))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "kernel,degree,normalizer",
    [("exp", 2, "count"), ("rbf", 2, "kernel"), ("rbf", 2, "none"), ("poly", 2, "kernel"), ("poly", 3, "count"),
     ("linear", 1, "count"), ("linear", 1, "none")],
)
def test_kernels_match_naive_values_and_grads(causal, kernel, degree, normalizer):
    inputs = _qkv(seed=degree)
    out = kernel_attention(*inputs, kernel=kernel, causal=causal, degree=degree, normalizer=normalizer)
    ref = naive_kernel_attention(*inputs, kernel=kernel, causal=causal, degree=degree, normalizer=normalizer)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, gr in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-12)


def test_default_normalizer_follows_kernel_sign():
    q, k, v = (x.detach() for x in _qkv())
    for kernel, degree, expected in [("poly", 2, "kernel"), ("poly", 3, "count"), ("linear", 1, "count")]:
        torch.testing.assert_close(
            kernel_attention(q, k, v, kernel=kernel, causal=True, degree=degree),
            naive_kernel_attention(q, k, v, kernel=kernel, causal=True, degree=degree, normalizer=expected),
        )


@pytest.mark.parametrize("kernel", ["exp", "rbf", "poly"])
@pytest.mark.parametrize("causal", [False, True])
def test_position_kernel_product(kernel, causal):
    inputs = _qkv(Tq=7, Tk=7)
    t = torch.arange(7, dtype=F64)
    position = torch.exp(-((t[:, None] - t[None, :]) ** 2) / 8)  # (T, T) RBF on positions
    position[0, 0] = 0.0 if not causal else position[0, 0]  # a zero weight stays exactly zero
    out = kernel_attention(*inputs, kernel=kernel, causal=causal, position_kernel=position)
    ref = naive_kernel_attention(*inputs, kernel=kernel, causal=causal, position=position)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, gr in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", ["exp", "rbf", "linear"])
def test_causality(kernel):
    q, k, v = (x.detach() for x in _qkv(Tq=10, Tk=10))
    out = kernel_attention(q, k, v, kernel=kernel, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:] += 2
    v2[:, :, 6:] -= 3
    out2 = kernel_attention(q, k2, v2, kernel=kernel, causal=True)
    torch.testing.assert_close(out2[:, :, :6], out[:, :, :6], rtol=1e-13, atol=1e-13)
    assert not torch.allclose(out2[:, :, 6:], out[:, :, 6:])


def test_noncausal_different_lengths_and_half_precision():
    q, k, v = (x.detach() for x in _qkv(Tq=3, Tk=8))
    torch.testing.assert_close(
        kernel_attention(q, k, v, kernel="rbf", causal=False), naive_kernel_attention(q, k, v, kernel="rbf", causal=False)
    )
    out = kernel_attention(q.half(), k.half(), v.half(), kernel="exp", causal=False)
    assert out.dtype == torch.float16
    ref = naive_softmax_attention(q.half().double(), k.half().double(), v.half().double(), causal=False)
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_bad_input():
    q, k, v = (x.detach() for x in _qkv())
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernel_attention(q, k, v, kernel="cosine", causal=False)
    with pytest.raises(ValueError, match="degree"):
        kernel_attention(q, k, v, kernel="poly", degree=0, causal=False)
    with pytest.raises(ValueError, match="feature dim"):
        kernel_attention(q, k[..., :3], v, causal=False)
    with pytest.raises(ValueError, match="scale"):
        kernel_attention(q, k, v, causal=False, scale=-1.0)
    with pytest.raises(ValueError, match="normalizer"):
        kernel_attention(q, k, v, causal=False, normalizer="l1")
    with pytest.raises(ValueError, match="position_kernel must end in"):
        kernel_attention(q, k, v, causal=False, position_kernel=torch.ones(9, 8, dtype=F64))
    with pytest.raises(ValueError, match="non-negative"):
        kernel_attention(q, k, v, causal=False, position_kernel=-torch.ones(9, 9, dtype=F64))
    with pytest.raises(ValueError, match="does not broadcast"):
        kernel_attention(q, k, v, causal=False, position_kernel=torch.ones(5, 9, 9, dtype=F64))


@pytest.mark.parametrize("kernel,degree,normalizer", [("exp", 2, "kernel"), ("rbf", 2, "kernel"), ("poly", 3, "count"),
                                                      ("linear", 1, "count")])
def test_causal_queries_are_the_last_positions_when_q_is_shorter(kernel, degree, normalizer):
    """Causal with Tq < Tk (a KV-cache step): the rows equal the last Tq rows of the full causal call."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 11, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full = naive_kernel_attention(q, k, v, kernel=kernel, causal=True, degree=degree, normalizer=normalizer)
    for tq in (1, 4, 11):
        part = kernel_attention(q[:, :, -tq:], k, v, kernel=kernel, causal=True, degree=degree, normalizer=normalizer)
        torch.testing.assert_close(part, full[:, :, -tq:], atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="no longer than k"):
        kernel_attention(q, k[:, :, :5], v[:, :, :5], kernel=kernel, causal=True)


@pytest.mark.parametrize("kernel,degree", [("exp", 2), ("rbf", 2), ("poly", 2), ("linear", 1)])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_float32_inputs_under_autocast_match_float64(kernel, degree, amp):
    q, k, v = (x.detach() for x in _qkv(Tq=7, Tk=11, seed=4))
    ref = naive_kernel_attention(q, k, v, kernel=kernel, causal=False, degree=degree,
                                 normalizer="count" if kernel == "linear" else "kernel")
    with torch.autocast("cpu", dtype=amp):
        out = kernel_attention(q.float(), k.float(), v.float(), kernel=kernel, causal=False, degree=degree)
        causal = kernel_attention(q.float(), k.float(), v.float(), kernel=kernel, causal=True, degree=degree)
    assert out.dtype == causal.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    ref_causal = kernel_attention(q, k, v, kernel=kernel, causal=True, degree=degree)  # float64, checked above
    torch.testing.assert_close(causal.double(), ref_causal, rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_under_autocast_are_finite_and_close():
    q, k, v = (x.detach() for x in _qkv(seed=5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernel_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), kernel="exp", causal=True)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = naive_softmax_attention(*(x.bfloat16().double() for x in (q, k, v)), causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_normaliser_is_scale_free(causal):
    # (s·q·k)² normalised is invariant to the scale of q and k; an absolute clamp at 1e-6 broke that at 1e-3 scale
    q, k, v = (x.detach() for x in _qkv(seed=6))
    unit = kernel_attention(q, k, v, kernel="poly", degree=2, causal=causal)
    tiny = kernel_attention(1e-3 * q, 1e-3 * k, v, kernel="poly", degree=2, causal=causal)
    torch.testing.assert_close(tiny, unit, rtol=1e-9, atol=1e-10)
