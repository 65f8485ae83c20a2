"""Attention layers: registry, shapes, causality, RoPE, q/k normalisation, aux loss, chunked state, errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from vqattn.functional import vq_attention
from vqattn.layers import ATTENTIONS, Attention, build_attention, rope_rotate
from vqattn.modules.rope import rope_rotate_keeping

from model_helpers import NAMES, VQ_NAMES, layer_in_chunks, layer_kwargs, scramble_short_conv

DIM, HEADS = 16, 2
DELTA_NAMES = ("gated_deltanet", "deltanet")


def run(layer: Attention, x: torch.Tensor) -> torch.Tensor:
    """The layer's output tensor (B, T, C)."""
    return layer(x).output


def make(name: str, rope: bool = False, **kwargs) -> Attention:
    torch.manual_seed(0)
    layer = build_attention(name, dim=DIM, num_heads=HEADS, rope=rope, **{**layer_kwargs(name, rope), **kwargs})
    return layer.double().eval()


def heads(layer: Attention, x: torch.Tensor):
    """Projected q, k, v of the layer as (B, H, T, Dh), computed here without the layer's forward."""
    b, t, _ = x.shape
    q, k, v = layer.qkv(x).chunk(3, dim=-1)
    return [z.view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for z in (q, k, v)]


def test_registry_names():
    assert set(ATTENTIONS) == {"softmax", "vq_hard", "vq_soft", "window", "performer", "linear", "taylor",
                               "kernel_rbf", "kernel_poly", "kernel_linear", "ovq", "mamba2", "gated_deltanet",
                               "deltanet"}


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names are: deltanet, gated_deltanet, kernel_linear, kernel_poly, "
                       "kernel_rbf, linear, mamba2, ovq, performer, softmax, taylor, vq_hard, vq_soft, window"):
        build_attention("flash", dim=DIM, num_heads=HEADS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("t", [1, 9])
def test_causal(name, rope, t):
    """Changing future inputs leaves earlier outputs unchanged."""
    layer = make(name, rope)
    x = torch.randn(2, t, DIM, dtype=torch.float64)
    out = run(layer, x)
    assert out.shape == x.shape
    for cut in range(t):
        y = x.clone()
        y[:, cut:] = torch.randn_like(y[:, cut:])
        torch.testing.assert_close(run(layer, y)[:, :cut], out[:, :cut], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rope", [False, True])
def test_chunked_state_matches_full(name, rope):
    layer = make(name, rope)
    x = torch.randn(2, 11, DIM, dtype=torch.float64)
    full = run(layer, x)
    first, _, state = layer(x[:, :6], return_state=True)
    second, _, state = layer(x[:, 6:], state, return_state=True)
    assert state.pos == 11
    torch.testing.assert_close(torch.cat((first, second), dim=1), full, rtol=0, atol=1e-12)


def complex_rope(x: torch.Tensor, start: int, base: float) -> torch.Tensor:
    """Reference: pair (x_m, x_{m+D/2}) as the complex number x_m + i x_{m+D/2}, times e^{i pos θ_m}, float64."""
    half = x.shape[-1] // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = torch.arange(start, start + x.shape[-2], dtype=torch.float64)[:, None] * theta
    x = x.double()
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((z.real, z.imag), dim=-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("layout", ["contiguous", "heads_of_a_projection"])
def test_rope_matches_complex_rotation_outputs_and_grads(dtype, tol, layout):
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64)  # (B, T, H, D), as a projection's output
    x = x.transpose(1, 2)  # (B, H, T, D), a strided view as the layers rotate it
    if layout == "contiguous":
        x = x.contiguous()
    x = x.to(dtype).requires_grad_()
    grad = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    out = rope_rotate(x, 3, 100.0)
    (out.double() * grad).sum().backward()
    x_ref = x.detach().double().requires_grad_()
    expected = complex_rope(x_ref, 3, 100.0)
    (expected * grad).sum().backward()
    assert out.dtype == dtype and x.grad.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("first_pair", [0, 1, 3])
@pytest.mark.parametrize("compiled", [False, True])
def test_rope_rotate_keeping_is_the_rotation_and_the_raw_pairs(first_pair, compiled):
    """Against the complex rotation and the raw dims of the pairs m ≥ first_pair written out, in float64: outputs and
    the one gradient of x that both outputs' gradients make (eager: by hand; compiled: autograd of the formula)."""
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()  # (B, H, T, D) of a projection
    grad_rot, grad_raw = torch.randn(2, 3, 7, 8, dtype=torch.float64), torch.randn(2, 3, 7, 8 - 2 * first_pair,
                                                                                   dtype=torch.float64)
    fn = torch.compile(rope_rotate_keeping, backend="aot_eager", fullgraph=True) if compiled else rope_rotate_keeping
    rotated, raw = fn(x, 3, 100.0, first_pair)
    ((rotated * grad_rot).sum() + (raw * grad_raw).sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    kept = [m for m in range(4) if m >= first_pair]
    expected_raw = x_ref[..., kept + [m + 4 for m in kept]]
    expected = complex_rope(x_ref, 3, 100.0)
    ((expected * grad_rot).sum() + (expected_raw * grad_raw).sum()).backward()
    torch.testing.assert_close(rotated, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(raw, expected_raw, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


def test_rope_scores_depend_on_relative_position():
    q, k = torch.randn(2, 1, 1, 1, 8, dtype=torch.float64).unbind(0)
    score = lambda i, j: (rope_rotate(q, i, 1e4) * rope_rotate(k, j, 1e4)).sum()  # noqa: E731
    torch.testing.assert_close(score(7, 3), score(104, 100), rtol=0, atol=1e-12)
    assert not torch.allclose(score(7, 3), score(3, 7))


def test_rope_cache_serves_training_after_inference_mode():
    # The cached cos/sin of a call under torch.inference_mode() are inference tensors, which a backward pass
    # cannot save: a training call at the same positions must get its own.
    layer = make("softmax", rope=True).float()
    x = torch.randn(2, 9, DIM)
    with torch.inference_mode():
        expected, _, _ = layer(x)
    out, _, _ = layer(x.requires_grad_())
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)


def test_rope_angles_are_the_same_cached_or_not():
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    first = rope_rotate(x, 3, 100.0)  # computes and caches
    torch.testing.assert_close(rope_rotate(x, 3, 100.0), first, rtol=0, atol=0)
    torch.testing.assert_close(rope_rotate(x.float(), 3, 100.0), first.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", VQ_NAMES)
def test_vq_rope_inside_one_block_is_softmax_rope(name):
    """With a single block every key is in the raw-key window: RoPE vq equals RoPE softmax exactly."""
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    vq = make(name, rope=True, block_len=8)
    softmax = make("softmax", rope=True)
    softmax.load_state_dict(vq.state_dict(), strict=False)
    torch.testing.assert_close(run(vq, x), run(softmax, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("cache_scores", ["slow", "all"])
def test_vq_hard_rope_far_cache_uses_position_free_codes(cache_scores):
    """Naive reference: window keys (previous + current block) scored with RoPE, older keys by their code, on the
    RoPE pairs that turn by less than a radian over the 8-token window ("slow": all but the first) or on all."""
    layer = make("vq_hard", rope=True, cache_scores=cache_scores)  # block_len 4
    t, L = 11, 4
    x = torch.randn(1, t, DIM, dtype=torch.float64)
    q, k, v = heads(layer, x)
    codebook = layer.codebook(k)[0]  # (H, S, Dh)
    z = torch.cdist(k, codebook.unsqueeze(0).expand(1, -1, -1, -1)).argmin(-1)  # (B, H, T)
    code_keys = torch.stack([codebook[h][z[0, h]] for h in range(HEADS)])[None]  # (B, H, T, Dh)
    qr, kr = rope_rotate(q, 0, 1e4), rope_rotate(k, 0, 1e4)
    scale = (DIM // HEADS) ** -0.5
    # head_dim 8: pair m turns by 1e4^(-m/4) rad per token, by ≥ 1 rad over 8 tokens only for m = 0
    scored = torch.tensor([0.0, 1, 1, 1] * 2 if cache_scores == "slow" else [1.0] * 8, dtype=torch.float64)
    out = torch.empty_like(v)
    for i in range(t):
        first_window = max(0, (i // L - 1) * L)
        window = scale * (qr[:, :, i : i + 1] * kr[:, :, first_window : i + 1]).sum(-1)
        cache = scale * (q[:, :, i : i + 1] * code_keys[:, :, :first_window] * scored).sum(-1)
        w = torch.softmax(torch.cat((cache, window), dim=-1), dim=-1)
        out[:, :, i] = (w.unsqueeze(-1) * v[:, :, : i + 1]).sum(2)
    expected = layer.proj(out.transpose(1, 2).reshape(1, t, DIM))
    torch.testing.assert_close(run(layer, x), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_qk_norm_makes_layer_invariant_to_qk_scale(name):
    if name in DELTA_NAMES:  # q and k always unit vectors, after the SiLU as in fla: qk_norm has nothing to add
        torch.testing.assert_close(run(make(name, qk_norm=True), x := torch.randn(1, 6, DIM, dtype=torch.float64)),
                                   run(make(name), x), rtol=0, atol=0)
        return
    layer = make(name, qk_norm=True)
    x = torch.randn(1, 6, DIM, dtype=torch.float64)
    out = run(layer, x)
    with torch.no_grad():
        layer.qkv.weight[: 2 * DIM] *= 7.0  # rows producing q and k
    torch.testing.assert_close(run(layer, x), out, rtol=0, atol=1e-6)
    layer_plain = make(name)
    with torch.no_grad():
        layer_plain.qkv.weight[: 2 * DIM] *= 7.0
    assert not torch.allclose(run(layer_plain, x), run(make(name), x), atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_aux_loss_and_usage_stats(name):
    layer = make(name).train()
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    out, aux_loss, state = layer(x)
    assert out.shape == x.shape and state is None
    assert aux_loss.shape == () and torch.isfinite(aux_loss)
    assert not hasattr(layer, "aux_loss")  # returned, never stashed on the module
    stats = layer.usage_stats()
    if name in VQ_NAMES:
        assert {"perplexity", "dead_codes", "quant_error"} <= set(stats)
        assert all(math.isfinite(value) for value in stats.values())
    elif name == "ovq":  # after 9 tokens only block 0 (4 keys) is in the memory; all open slots in an empty memory
        assert aux_loss == 0 and stats == {"occupied_slots": 4.0}
    else:
        assert aux_loss == 0 and stats == {}
    if name == "vq_hard":
        assert aux_loss > 0 and aux_loss.requires_grad


@pytest.mark.parametrize("name", VQ_NAMES)
def test_decoding_steps_record_no_codebook_statistics_but_training_with_a_state_does(name):
    """An eval step with a state (decoding) skips the commitment loss and the usage statistics: its outputs do not
    need them. With a state in training (carried-state training) both are still computed."""
    layer = make(name).eval()
    x = torch.randn(2, 12, DIM, dtype=torch.float64)
    prefix = layer(x[:, :9], return_state=True)  # no state: records, as a full evaluation does
    recorded = layer.codebook.last_stats.clone()
    step = layer(x[:, 9:10] * 50, state=prefix.state, return_state=True)  # far keys would change every statistic
    assert torch.equal(layer.codebook.last_stats, recorded) and step.aux_loss == 0
    layer.train()
    trained = layer(x[:, 9:10] * 50, state=prefix.state)
    assert not torch.equal(layer.codebook.last_stats, recorded)
    if name == "vq_hard":
        assert trained.aux_loss > 0


@pytest.mark.parametrize("name", NAMES)
def test_backward_reaches_every_projection(name):
    layer = make(name).train()
    x = torch.randn(2, 9, DIM, dtype=torch.float64, requires_grad=True)
    out, aux_loss, _ = layer(x)
    (out.square().sum() + aux_loss).backward()
    for param in (layer.qkv.weight, layer.proj.weight, x):
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("softmax", {"dim": 15}, "divisible"),
        ("softmax", {"num_heads": 0}, "num_heads"),
        ("softmax", {"dim": 6, "num_heads": 2, "rope": True}, "even head dim"),
        ("softmax", {"dropout": 1.5}, "dropout"),
        ("vq_hard", {"rope": True, "exact_window": False}, "exact_window=True"),
        ("vq_soft", {"block_len": 0}, "block_len"),
        ("vq_soft", {"num_codes": 0}, "num_codes"),
        ("vq_hard", {"rope": True, "cache_scores": "fast"}, "cache_scores must be one of 'all', 'slow'"),
        ("linear", {"block_len": -2}, "block_len"),
        ("softmax", {"short_conv": -1}, "short_conv must be an int >= 0"),
        ("vq_hard", {"short_conv": 2.5}, "short_conv must be an int >= 0"),
        ("window", {"short_conv": True}, "short_conv must be an int >= 0"),
    ],
)
def test_bad_construction(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_attention(name, **{"dim": DIM, "num_heads": HEADS, **kwargs})


def test_a_bad_state_is_named():
    layer = make("softmax")
    with pytest.raises(ValueError, match="state must be an AttentionState"):
        layer(torch.randn(2, 3, DIM, dtype=torch.float64), state=(0, None))


@pytest.mark.parametrize("name", NAMES)
def test_every_layer_names_a_bad_x_before_computing(name):
    """The same ValueError from every layer, not whatever an op or a matmul of the projections raises first."""
    layer = make(name)
    bad = [
        (torch.randn(2, 0, DIM, dtype=torch.float64), r"x must have at least one position \(T >= 1\)"),
        (torch.randint(0, 5, (2, 3, DIM)), "x must be a floating-point tensor, got dtype torch.int64"),
        (torch.randn(2, 3, DIM + 1, dtype=torch.float64), rf"x must have shape \(B, T, {DIM}\)"),
        (torch.randn(3, DIM, dtype=torch.float64), rf"x must have shape \(B, T, {DIM}\)"),
        ([[0.0] * DIM], rf"x must have shape \(B, T, {DIM}\), got list"),
    ]
    for x, match in bad:
        with pytest.raises(ValueError, match=match):
            layer(x)


@pytest.mark.parametrize("name", NAMES)
def test_state_floats_counts_the_decoding_state(name):
    """state_floats equals the numbers actually held by the decoding state after a sequence (minus the raw-window
    bookkeeping the op keeps in its own layout)."""
    layer = make(name)
    t = 11
    _, _, state = layer(torch.randn(2, t, DIM, dtype=torch.float64), return_state=True)
    inner = state.inner
    if name in VQ_NAMES:
        held = inner.counts[0].numel() + inner.sums[0].numel() + 2 * min(t, 2 * layer.block_len) * DIM
    elif name == "window":
        held = 2 * min(t, 2 * layer.block_len) * DIM  # the bound: the state holds L to 2L − 1 keys
    elif name == "ovq":
        held = sum(x[0].numel() for x in (inner.counts, inner.key_sums, inner.value_sums)) + \
            2 * min(t, 2 * layer.block_len) * DIM
    elif hasattr(inner, "kv"):
        held = inner.kv[0].numel() + inner.k_sum[0].numel()
    elif hasattr(inner, "S"):  # a recurrent layer's matrix state and its own convolution's last inputs
        held = inner.S[0].numel() + (0 if state.conv is None else state.conv[0].numel())
    else:
        held = inner.k[0].numel() + inner.v[0].numel()
    assert layer.state_floats(t) == held


@pytest.mark.parametrize("t", [3, 8, 13])
def test_window_layer_is_banded_rope_softmax(t):
    """Naive float64 reference: query i attends to keys j ≤ i with j ≥ (i // L − 1)·L, RoPE on both."""
    layer = make("window", rope=True)  # block_len 4
    x = torch.randn(2, t, DIM, dtype=torch.float64)
    q, k, v = heads(layer, x)
    q, k = rope_rotate(q, 0, layer.rope_base), rope_rotate(k, 0, layer.rope_base)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    visible = (j <= i) & (j >= (i // 4 - 1) * 4)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS)).masked_fill(~visible, float("-inf"))
    expected = layer.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, t, DIM))
    torch.testing.assert_close(run(layer, x), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", VQ_NAMES)
def test_cache_scores_slow_scores_codes_on_the_slow_rope_pairs_only(name):
    """head_dim 8: RoPE pairs turn by 1, 0.1, 0.01, 0.001 rad per token; over the 8-token window (block_len 4) only
    the first turns by a radian or more. "slow" drops its dims from the code score and nothing else."""
    slow = make(name, rope=True, block_len=4, cache_scores="slow")
    assert slow.slow_start == 1  # pairs 1, 2, 3 of 4: dims [1:4] and [5:8] score the codes
    x = torch.randn(2, 19, DIM, dtype=torch.float64)
    every = make(name, rope=True, block_len=4, cache_scores="all")
    assert not torch.allclose(run(slow, x), run(every, x))
    for layer in (slow, every):  # codes without the fast pair: both score codes alike
        layer.codebook.codes.data[..., [0, 4]] = 0
    torch.testing.assert_close(run(slow, x), run(every, x), rtol=0, atol=1e-12)
    first, _, state = slow(x[:, :10], return_state=True)
    second, _, _ = slow(x[:, 10:], state, return_state=True)
    torch.testing.assert_close(torch.cat((first, second), dim=1), run(slow, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", VQ_NAMES)
def test_cache_scores_default_is_slow_and_needs_rope_to_differ(name):
    """"slow" is the default; without RoPE no pair turns, so it scores every dim, as "all" does."""
    x = torch.randn(2, 19, DIM, dtype=torch.float64)
    torch.testing.assert_close(run(make(name, rope=True), x), run(make(name, rope=True, cache_scores="slow"), x),
                               rtol=0, atol=0)
    torch.testing.assert_close(run(make(name, cache_scores="slow"), x), run(make(name, cache_scores="all"), x),
                               rtol=0, atol=0)


def _masked_attend(layer):
    """The vq layer's attention as cache_scores="slow" was first written: the full-width op, with a codebook whose
    dims of the fast RoPE pairs (turning by ≥ 1 radian over the 2·block_len window) are zeroed."""
    half = layer.head_dim // 2
    turns = [layer.rope_base ** (-2 * m / layer.head_dim) * 2 * layer.block_len for m in range(half)]
    mask = torch.tensor([float(t < 1) for t in turns] * 2, dtype=torch.float64)

    def attend(q, k, v, pos, state, return_state):
        codebook, assignment, aux_loss = layer.codebook(k, record=layer.training or state is None)
        result = vq_attention(q, k, v, codebook * mask, causal=True, assign=layer.codebook.assign,
                              temperature=layer.codebook.temperature, block_len=layer.block_len,
                              scale=layer.head_dim**-0.5, exact_window=True, state=state, return_state=return_state,
                              assignment=assignment, q_rot=layer.rotate(q, pos), k_rot=layer.rotate(k, pos),
                              memory_cap=layer.memory_cap)
        out, op_state = result if return_state else (result, None)
        return out, aux_loss, op_state

    return attend


def _chunked_outputs_and_grads(layer, x, sizes):
    """The layer's output over x fed in chunks of the given sizes (carrying the state), and the gradients of a
    loss on it with respect to x and every parameter (None where a parameter gets none)."""
    x = x.clone().requires_grad_(True)
    out, _ = layer_in_chunks(layer, x, sizes)
    params = [p for _, p in sorted(layer.named_parameters())]
    return out, torch.autograd.grad(out.square().sum(), [x, *params], allow_unused=True)


@pytest.mark.parametrize("name", VQ_NAMES)
@pytest.mark.parametrize("rope_base,code_dims", [(1e4, 6), (2.0, 0)])  # 3 of 4 RoPE pairs slow, or none
@pytest.mark.parametrize("sizes", [[19], [10, 1, 8]])  # one call; prefill, one decoded token, a chunk
def test_cache_scores_slow_equals_the_masked_full_width_codebook(name, rope_base, code_dims, sizes, monkeypatch):
    """"slow" hands the op q and the codebook on the slow pairs' dims only (head_dim 8, block_len 4): outputs and
    gradients (x and every parameter, the codes learned by gradient) equal those of the full-width op with the
    fast dims of the codebook zeroed, for 19 tokens (not a multiple of block_len), also decoded with a state."""
    layer = make(name, rope=True, block_len=4, rope_base=rope_base, codebook=dict(learning="grad"))
    masked = copy.deepcopy(layer)
    masked._attend = _masked_attend(masked)
    widths = []

    def spy(q, k, v, codebook, **kw):  # the code-score widths the layer hands the op
        widths.append((q.shape[-1], codebook.shape[-1]))
        return vq_attention(q, k, v, codebook, **kw)

    monkeypatch.setattr("vqattn.layers.vq.vq_attention", spy)
    x = torch.randn(2, 19, DIM, dtype=torch.float64)
    out, grads = _chunked_outputs_and_grads(layer, x, sizes)
    ref, ref_grads = _chunked_outputs_and_grads(masked, x, sizes)
    assert widths == [(code_dims, code_dims)] * len(sizes)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert [g is None for g in grads] == [g is None for g in ref_grads]
    for g, g_ref in zip(grads, ref_grads):
        if g is not None:
            torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-11)


# ---------------------------------------------------------------- short convolution over q/k/v


class _NaiveShortConv(torch.nn.Module):
    """The fused q/k/v projection followed by out_t = sum_j w_j h_{t-K+1+j} per channel, written as a loop over
    taps with zeros before the sequence (a reference for Attention._convolve)."""

    def __init__(self, qkv: torch.nn.Linear, weight: torch.Tensor):
        super().__init__()
        self.qkv, self.weight = qkv, weight  # weight (3C, 1, K)

    def forward(self, x):
        h = self.qkv(x)  # (B, T, 3C)
        size, t = self.weight.shape[-1], h.shape[1]
        out = torch.zeros_like(h)
        for j in range(size):
            shift = size - 1 - j  # tap j reads the token `shift` steps back
            out[:, shift:] += self.weight[:, 0, j] * h[:, : t - shift]
        return out


@pytest.mark.parametrize("name", ["softmax", "vq_hard", "vq_soft", "linear", "window"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_short_conv_matches_a_naive_convolution(name, size):
    """Outputs and gradients (input, projection, conv taps) of a layer with short_conv equal the same layer without
    it fed the naively convolved projections, in float64; T = 9 is not a multiple of the block length 4."""
    layer = scramble_short_conv(make(name, rope=True, short_conv=size))
    reference = make(name, rope=True)
    reference.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("conv.")})
    weight = layer.conv.weight.detach().clone().requires_grad_()
    reference.qkv = _NaiveShortConv(reference.qkv, weight)
    x = torch.randn(2, 9, DIM, dtype=torch.float64, requires_grad=True)
    out, ref = run(layer, x), run(reference, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, layer.qkv.weight, layer.conv.weight), grad_out)
    want = torch.autograd.grad(ref, (x, reference.qkv.qkv.weight, weight), grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


@pytest.mark.parametrize("name", NAMES)
def test_short_conv_is_causal_and_chunked_decoding_matches_full(name):
    """Chunks of 1 (shorter than the K - 1 = 2 carried projections) and uneven lengths give the full output; the
    future does not leak through the convolution."""
    layer = scramble_short_conv(make(name, rope=True, short_conv=3))
    x = torch.randn(2, 11, DIM, dtype=torch.float64)
    full = run(layer, x)
    chunked, state = layer_in_chunks(layer, x, [1, 1, 5, 1, 3])
    assert state.pos == 11 and state.conv.shape == (2, 2, 3 * DIM)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-12)
    y = x.clone()
    y[:, 6:] = torch.randn_like(y[:, 6:])
    torch.testing.assert_close(run(layer, y)[:, :6], full[:, :6], rtol=0, atol=1e-12)


def test_short_conv_starts_as_the_identity_and_counts_in_the_state():
    plain, conv = make("vq_hard", rope=True), make("vq_hard", rope=True, short_conv=4)
    plain.load_state_dict({k: v for k, v in conv.state_dict().items() if not k.startswith("conv.")})
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    torch.testing.assert_close(run(conv, x), run(plain, x), rtol=0, atol=0)
    _, _, state = conv(x, return_state=True)
    assert conv.state_floats(9) == plain.state_floats(9) + state.conv[0].numel() == plain.state_floats(9) + 3 * 3 * DIM


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("t", [1, 2, 3, 7])
@pytest.mark.parametrize("with_past", [False, True])
def test_short_convolution_module_against_conv1d_of_the_joined_rows(size, t, with_past):
    """ShortConvolution's CPU form (in-place multiply-adds of the taps) against F.conv1d over [past, h] in float64:
    outputs, the carried rows, and the gradients of h, past and the taps, for T shorter and longer than the K − 1
    carried rows."""
    from vqattn.modules.conv import ShortConvolution

    torch.manual_seed(size * 100 + t)
    conv = ShortConvolution(6, size).double()
    with torch.no_grad():
        conv.weight.normal_()
    h = torch.randn(2, t, 6, dtype=torch.float64, requires_grad=True)
    past = torch.randn(2, size - 1, 6, dtype=torch.float64, requires_grad=True) if with_past else None
    out, last = conv(h, past)
    full = torch.cat((past if with_past else h.new_zeros(2, size - 1, 6), h), 1)
    ref = torch.nn.functional.conv1d(full.transpose(1, 2), conv.weight, groups=6).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(last, full[:, full.shape[1] - (size - 1):], rtol=0, atol=0)
    grad_out = torch.randn_like(out)
    inputs = (h, conv.weight) + ((past,) if with_past else ())
    got = torch.autograd.grad(out, inputs, grad_out)
    want = torch.autograd.grad(ref, inputs, grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
