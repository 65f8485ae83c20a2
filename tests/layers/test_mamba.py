"""The mamba2 layer: Mamba-2's block written out token by token in float64 equals the layer (heads in groups, the
convolution, Δ, A, D, the gated norm), its state continues a sequence, its initialisation and defaults are
Mamba-2's, and bad arguments are named. The registry-wide contract tests (tests/layers/test_layers.py, tests/model)
cover it too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vqattn.layers import build_attention

from model_helpers import layer_in_chunks, scramble_short_conv

F64 = torch.float64
# two groups of B and C, each serving two of the four heads; x̂ twice the model's width
KWARGS = dict(dim=16, num_heads=4, expand=2, d_state=6, n_groups=2, block_len=4)


def make(**kwargs):
    torch.manual_seed(0)
    layer = scramble_short_conv(build_attention("mamba2", **{**KWARGS, **kwargs})).double().eval()
    with torch.no_grad():  # larger steps and D ≠ 1, so that every term shows
        layer.dt_bias.add_(1.0)
        layer.D.uniform_(0.5, 1.5)
    return layer


def written_out(layer, x):
    """Mamba-2's block (mamba_ssm's Mamba2 with ngroups, norm_before_gate=False) token by token, head by head."""
    b, t, _ = x.shape
    H, P, G, N, K = layer.num_heads, layer.head_dim, layer.n_groups, layer.d_state, layer.short_conv
    xbc = x @ layer.qkv.weight.T
    w = layer.conv.weight[:, 0]  # (channels, K): tap j reads the token K − 1 − j steps back
    conv = sum(w[:, j] * F.pad(xbc, (0, 0, K - 1 - j, 0))[:, :t] for j in range(K))
    c, bb, xs = F.silu(conv).split([G * N, G * N, H * P], -1)
    c, bb, xs = c.view(b, t, G, N), bb.view(b, t, G, N), xs.view(b, t, H, P)
    dt = F.softplus(x @ layer.dt_proj.weight.T + layer.dt_bias)  # (b, t, H)
    A = -torch.exp(layer.A_log)
    y = torch.zeros(b, t, H, P, dtype=x.dtype)
    for h in range(H):
        g, S = h // (H // G), torch.zeros(b, P, N, dtype=x.dtype)
        for i in range(t):
            S = torch.exp(dt[:, i, h] * A[h])[:, None, None] * S + \
                dt[:, i, h, None, None] * xs[:, i, h, :, None] * bb[:, i, g, None, :]
            y[:, i, h] = (S @ c[:, i, g, :, None])[..., 0] + layer.D[h] * xs[:, i, h]
    gated = (y.reshape(b, t, H * P) * F.silu(x @ layer.gate_proj.weight.T)).view(b, t, G, -1)
    normed = gated / gated.square().mean(-1, keepdim=True).add(layer.norm.eps).sqrt()
    return (normed.reshape(b, t, H * P) * layer.norm.weight) @ layer.proj.weight.T


def test_the_layer_is_mamba2s_block():
    layer = make()
    x = torch.randn(2, 11, 16, dtype=F64)
    torch.testing.assert_close(layer(x).output, written_out(layer, x), rtol=1e-10, atol=1e-12)


def test_pieces_with_the_state_equal_one_call_and_rope_changes_nothing():
    layer = make()
    x = torch.randn(2, 19, 16, dtype=F64)
    full = layer(x).output
    pieces, state = layer_in_chunks(layer, x, [1, 1, 6, 2, 9])  # decoding steps, shorter than the convolution's tail
    torch.testing.assert_close(pieces, full, rtol=1e-10, atol=1e-12)
    assert state.pos == 19 and state.inner.S.shape == (2, 4, 8, 6) and state.conv.shape == (2, 3, 2 * 2 * 6 + 32)
    assert layer.state_floats(19) == state.inner.S[0].numel() + state.conv[0].numel()
    torch.testing.assert_close(make(rope=True)(x).output, full, rtol=0, atol=0)


@pytest.mark.parametrize("qk_norm", ["rms", "l2"])
def test_qk_norm_makes_b_and_c_independent_of_the_projection_scale(qk_norm):
    layer = make(qk_norm=qk_norm)
    x = torch.randn(1, 9, 16, dtype=F64)
    out = layer(x).output
    with torch.no_grad():
        layer.qkv.weight[: 2 * 2 * 6] *= 5.0  # the rows of C and B
    torch.testing.assert_close(layer(x).output, out, rtol=0, atol=1e-8)


def test_initialisation_is_mamba2s():
    torch.manual_seed(0)
    layer = build_attention("mamba2", dim=64, num_heads=8)
    dt = F.softplus(layer.dt_bias)
    assert ((dt >= 0.001 - 1e-9) & (dt <= 0.1 + 1e-9)).all() and dt.max() / dt.min() > 2  # log-uniform
    A = torch.exp(layer.A_log)
    assert ((A >= 1) & (A <= 16)).all()
    assert torch.equal(layer.D, torch.ones(8)) and torch.equal(layer.norm.weight, torch.ones(128))
    assert layer.head_dim == 16 and layer.short_conv == 4
    x = torch.randn(1, 5, 64)
    conv_off = build_attention("mamba2", dim=64, num_heads=8, conv_size=0)
    assert conv_off.conv is None and conv_off(x, return_state=True).state.conv is None
    assert build_attention("mamba2", dim=64, num_heads=8, short_conv=2).conv.kernel_size == (2,)


def test_the_default_state_is_comparable_to_vq_hards():
    """At the default width (128, 4 heads): S holds 4 heads × 64 × 128 and the convolution 3 × (256 + 2·128)."""
    mamba, vq = (build_attention(name, dim=128, num_heads=4) for name in ("mamba2", "vq_hard"))
    assert mamba.state_floats(4096) == 4 * 64 * 128 + 3 * 512 == 34304
    assert vq.state_floats(4096) == 41216


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_groups=3), r"n_groups \(3\) must divide num_heads \(4\)"),
    (dict(d_state=0), "d_state must be a positive int"),
    (dict(expand=1.5), "expand must be a positive int"),
    (dict(conv_size=-1), "conv_size must be an int >= 0"),
    (dict(dt_min=0.2), "0 < dt_min <= dt_max"),
    (dict(dt_init_floor=-1.0), "dt_init_floor must be >= 0"),
    (dict(a_init_range=(2.0, 1.0)), "a_init_range must be two numbers 0 < low <= high"),
    (dict(norm_eps=0.0), "norm_eps must be > 0"),
    (dict(block_len=0), "block_len must be a positive int"),
    (dict(impl="fast"), "impl must be one of"),
    (dict(qk_norm="layer"), "qk_norm must be one of"),
])
def test_bad_construction_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_attention("mamba2", **{**KWARGS, **kwargs})
