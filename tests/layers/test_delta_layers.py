"""gated_deltanet and deltanet: the layers against their block written out in float64 (with flash-linear-attention's
naive recurrence where fla-core is installed: a definition we did not write), their defaults' state and size, and
bad construction. The registry's contract tests (tests/layers/test_layers.py, tests/model/) cover the rest."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from vqattn.layers import build_attention
from vqattn.ops.delta_rule.naive import naive_forward

from model_helpers import scramble_short_conv

F64 = torch.float64
DIM, HEADS = 16, 2


def _recurrence():
    """fla's naive_recurrent_gated_delta_rule loaded from its file alone (``import fla`` imports every kernel), or
    our own definition where fla-core is absent; both as (q, k, v, beta, g, scale) (B, H, T, ·) -> out."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        return lambda q, k, v, beta, g, scale: naive_forward(q, k, v, beta, g, scale, None)[0]
    path = pathlib.Path(spec.submodule_search_locations[0]) / "ops/gated_delta_rule/naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_reference_gated_delta_rule", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    naive = module.naive_recurrent_gated_delta_rule

    def run(q, k, v, beta, g, scale):
        g = torch.zeros_like(beta) if g is None else g
        out, _ = naive(*(x.transpose(1, 2) for x in (q, k, v, beta, g)), scale=scale)
        return out.transpose(1, 2).to(q.dtype)  # fla's reference computes in float32

    return run


def _written_out(layer, x, recurrence):
    """The block as the class docstring says, from the layer's parameters."""
    b, t, _ = x.shape
    H, Dk, Dv, K = layer.num_heads, layer.head_dim, layer.head_v_dim, layer.short_conv
    h = x @ layer.qkv.weight.T
    h = F.conv1d(F.pad(h.transpose(1, 2), (K - 1, 0)), layer.conv.weight, groups=h.shape[-1]).transpose(1, 2)
    q, k, v = F.silu(h).split([H * Dk, H * Dk, H * Dv], -1)
    q, k = (F.normalize(z.view(b, t, H, Dk), dim=-1).transpose(1, 2) for z in (q, k))
    v = v.view(b, t, H, Dv).transpose(1, 2)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T).transpose(1, 2) * (2 if layer.allow_neg_eigval else 1)
    g = None
    if layer.decay:
        g = (-layer.A_log.exp() * F.softplus(x @ layer.a_proj.weight.T + layer.dt_bias)).transpose(1, 2)
    o = recurrence(q, k, v, beta, g, Dk**-0.5).transpose(1, 2)  # (B, T, H, Dv)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.norm_eps) * layer.o_norm.weight
    if layer.g_proj is not None:
        o = o * F.silu(x @ layer.g_proj.weight.T).view(b, t, H, Dv)
    return o.reshape(b, t, H * Dv) @ layer.proj.weight.T


@pytest.mark.parametrize("name,kwargs", [
    ("gated_deltanet", {}),
    ("gated_deltanet", {"allow_neg_eigval": True, "expand_v": 1.5}),
    ("deltanet", {}),
    ("deltanet", {"output_gate": False}),
])
def test_the_layer_is_its_block_written_out(name, kwargs):
    torch.manual_seed(0)
    layer = scramble_short_conv(build_attention(name, dim=DIM, num_heads=HEADS, head_dim=4, block_len=4,
                                                **kwargs).double().eval())
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)  # not the identity, so that the norm's weight is read
    x = torch.randn(2, 11, DIM, dtype=F64)
    torch.testing.assert_close(layer(x).output, _written_out(layer, x, _recurrence()), rtol=1e-5, atol=1e-6)


def test_defaults_hold_a_state_beside_vq_hards_and_decay_from_mamba2s_init():
    """At the default model's width (128, 4 heads): 4·128·64 + 3·(2·256 + 512) numbers against vq_hard's 4·64·33 +
    2·128·128; the decay's rates A in [1, 16] and steps Δ = softplus(dt_bias) in [0.001, 0.1]."""
    layer = build_attention("gated_deltanet", dim=128, num_heads=4)
    assert layer.state_floats(256) == 35_840
    assert build_attention("vq_hard", dim=128, num_heads=4).state_floats(256) == 41_216
    assert build_attention("deltanet", dim=128, num_heads=4).state_floats(256) == 35_840
    assert 1 <= layer.A_log.exp().min() and layer.A_log.exp().max() <= 16
    step = F.softplus(layer.dt_bias)
    assert 1e-3 * 0.999 <= step.min() and step.max() <= 0.1 * 1.001


@pytest.mark.parametrize("name,kwargs,match", [
    ("gated_deltanet", {"head_dim": 0}, "head_dim must be a positive int"),
    ("gated_deltanet", {"expand_v": 0.3}, "expand_v must be > 0 with head_dim"),
    ("deltanet", {"conv_size": -1}, "conv_size must be an int >= 0"),
    ("deltanet", {"impl": "fast"}, "impl must be one of"),
    ("deltanet", {"norm_eps": 0}, "norm_eps must be > 0"),
    ("gated_deltanet", {"dt_min": 0.5, "dt_max": 0.1}, "dt_min and dt_max"),
    ("gated_deltanet", {"a_init_range": (0, 16)}, "a_init_range must be two numbers"),
])
def test_bad_construction_names_the_argument(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_attention(name, dim=DIM, num_heads=HEADS, **kwargs)
