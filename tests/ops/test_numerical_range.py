"""Codebook attention at large logit magnitudes: every impl against a float64 reference over a grid of input scales.

Queries, keys, codes and values are drawn N(0, 1) and q, k and the codes multiplied by a scale s. The code logits
σ q·c then spread over ~s²·√D nats and a soft key's log-posterior log Δ over ~s²·D, so at s = 12 (D = 16) a pair's
terms e^{σ q·c_s} Δ_js span thousands of nats, and a query's best codes usually hold almost none of its keys' mass.
Every exp must then be shifted by the largest term it actually sums, and a cache read backwards must not be
recovered by subtraction. The older large-logit test (test_vq_attention) pointed one query at one unused code: its
posteriors spanned under 60 nats, inside what a shift by the best code logit alone still gets right, so it could
not see either failure; this grid does (before the fix: soft outputs off by 0.9, gradients off by up to 1e36).
"""

import pytest
import torch

from vqattn.functional import naive_vq_attention, vq_attention
from vqattn.ops.blocks import Schedule
from vqattn.ops.ovq import ovq_attention

from references import ref_vq_attention
from triton_helpers import needs_triton, on_kernel_device

F64 = torch.float64
WINDOWS = {"mixture": False, "exact": True}  # soft keys' window read through the codes, or the raw keys
VQ_IMPLS = {
    "naive": dict(op=naive_vq_attention),
    "chunk-loop": dict(impl="chunk", schedule=Schedule("loop", 3)),
    "chunk-cumsum": dict(impl="chunk", schedule=Schedule("cumsum", 3)),
    "recurrent": dict(impl="recurrent"),
    "triton": dict(impl="triton"),  # float32 only; under Triton's interpreter without a GPU (conftest)
}


def scaled_inputs(scale: float, *, B=1, H=2, T=100, D=16, S=32, seed=0):
    """q, k (B, H, T, D), v (B, H, T, D), codebook (H, S, D) with q, k and the codes multiplied by ``scale``, and
    an output gradient."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(B, H, T, D, generator=g, dtype=F64) for _ in range(4))
    c = torch.randn(H, S, D, generator=g, dtype=F64)
    return (q * scale, k * scale, v, c * scale), grad


def outputs_and_grads(fn, inputs, grad):
    """fn's output and the gradients of every floating-point input (None where it has none), all in float64."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach().double()] + [None if x.grad is None else x.grad.double() for x in leaves]


def max_errors(got, ref, floor: float = 1.0) -> list[float]:
    """Per tensor: max |got − ref| / max(max |ref|, floor); every tensor of both must be finite."""
    errors = []
    for a, b in zip(got, ref):
        if a is None or b is None:
            continue
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        errors.append(((a - b).abs().max() / max(b.abs().max().item(), floor)).item())
    return errors


def vq_call(impl: str, assign: str, window: str, block_len: int):
    kwargs = dict(VQ_IMPLS[impl])
    op = kwargs.pop("op", vq_attention)
    return lambda q, k, v, c: op(q, k, v, c, causal=True, assign=assign, exact_window=WINDOWS[window],
                                 block_len=block_len, **kwargs)


@pytest.mark.parametrize("scale", [1, 4, 8, 12])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("assign", ["hard", "soft"])
@pytest.mark.parametrize("impl", ["naive", "chunk-loop", "chunk-cumsum", "recurrent"])
def test_vq_impls_match_the_reference_to_1e9_at_any_scale(impl, assign, window, scale):
    """T = 100 in blocks of 16 (7 blocks, the last partial; groups of 3 blocks carry their caches), float64."""
    inputs, grad = scaled_inputs(scale)
    ref = outputs_and_grads(lambda q, k, v, c: ref_vq_attention(q, k, v, c, causal=True, assign=assign,
                                                                 exact_window=WINDOWS[window], block_len=16),
                            inputs, grad)
    got = outputs_and_grads(vq_call(impl, assign, window, 16), inputs, grad)
    assert max(max_errors(got, ref)) < 1e-9


@pytest.mark.parametrize("scale", [1, 4, 8, 12])
@pytest.mark.parametrize("assignment", ["online", "slots", "slot_weights"])
def test_ovq_impls_match_naive_to_1e9_at_any_scale(assignment, scale):
    """Online slots, given slots and given soft slot weights, whose logs spread over ~4·s·3 nats: down to about
    e^{−300}, not into float64's subnormals, where no impl can resolve the gradient 1/n of a slot's mean."""
    (q, k, v, _), grad = scaled_inputs(scale, T=100, D=16)
    S = 8
    g = torch.Generator().manual_seed(1)
    weights = torch.softmax(4 * scale * torch.randn(*q.shape[:3], S, generator=g, dtype=F64), -1)
    given = {"online": {}, "slots": dict(slots=torch.randint(S, q.shape[:3], generator=g)),
             "slot_weights": {}}[assignment]

    def call(impl):
        def attend(q, k, v, w):
            w_kwargs = dict(slot_weights=w) if assignment == "slot_weights" else {}
            return ovq_attention(q, k, v, num_slots=S, block_len=16, impl=impl, **given, **w_kwargs)
        return attend

    ref = outputs_and_grads(call("naive"), (q, k, v, weights), grad)
    for impl in ("chunk", "recurrent"):
        # a slot weight's gradient is tiny next to 1 at large scales: relative to its own size
        assert max(max_errors(outputs_and_grads(call(impl), (q, k, v, weights), grad), ref, floor=0.0)) < 1e-9


@pytest.mark.parametrize("scale", [1, 2, 3])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("assign", ["hard", "soft"])
@pytest.mark.parametrize("impl", ["chunk-loop", "chunk-cumsum", "recurrent"])
def test_vq_float32_matches_float64_at_the_width_users_train(impl, assign, window, scale):
    """D = S = L = 64 as the layers' defaults, T = 200 (4 blocks, the last partial). Stated tolerances, relative to
    each tensor's largest entry: 1e-4 for the outputs, 1e-3 for the gradients (measured: under 2e-5 for all)."""
    inputs, grad = scaled_inputs(scale, T=200, D=64, S=64)
    call = vq_call(impl, assign, window, 64)
    ref = outputs_and_grads(call, inputs, grad)
    out_error, *grad_errors = max_errors(outputs_and_grads(call, [x.float() for x in inputs], grad), ref, 0.0)
    assert out_error < 1e-4 and max(grad_errors) < 1e-3


@pytest.mark.slow  # seconds a case
@needs_triton
@pytest.mark.parametrize("assign,window", [("hard", "mixture"), ("hard", "exact"), ("soft", "exact")])
def test_triton_float32_matches_float64_at_scale_3(assign, window):
    """The fused kernel (no soft mixture window) at the float32 grid's largest scale, same tolerances."""
    inputs, grad = scaled_inputs(3, T=200, D=64, S=64)
    ref = outputs_and_grads(lambda q, k, v, c: ref_vq_attention(q, k, v, c, causal=True, assign=assign,
                                                                 exact_window=WINDOWS[window], block_len=64),
                            inputs, grad)
    got = outputs_and_grads(on_kernel_device(vq_call("triton", assign, window, 64)), [x.float() for x in inputs],
                            grad)
    out_error, *grad_errors = max_errors(got, ref, 0.0)
    assert out_error < 1e-4 and max(grad_errors) < 1e-3
