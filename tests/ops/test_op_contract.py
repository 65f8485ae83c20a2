"""The contract every causal op keeps (docs/math.md): the keywords ``block_len``, ``impl``, ``state`` and
``return_state``; ``impl`` in {auto, chunk, recurrent, naive} (plus triton where a fused kernel exists); public
``chunk_*`` / ``recurrent_*`` / ``naive_*`` forms that give the op's result; out, or (out, state) with
``return_state``."""

import inspect

import pytest
import torch

from vqattn.ops import decay, delta_rule, linear, ovq, vq, window

F64 = torch.float64


def _qkv(T=37, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, T, D, generator=g, dtype=F64) for _ in range(3)]


def _codebook():
    return torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(1), dtype=F64)


# name: (op, chunk form, recurrent form, naive form, inputs -> (args, kwargs))
OPS = {
    "vq": (vq.vq_attention, vq.chunk_vq_attention, vq.recurrent_vq_attention, vq.naive_vq_attention,
           lambda q, k, v: ((q, k, v, _codebook()), dict(causal=True, assign="soft", exact_window=True))),
    "window": (window.window_attention, window.chunk_window_attention, window.recurrent_window_attention,
               window.naive_window_attention, lambda q, k, v: ((q, k, v), {})),
    "linear": (linear.linear_attention, linear.chunk_linear_attention, linear.recurrent_linear_attention,
               linear.naive_linear_attention, lambda q, k, v: ((q.exp(), k.exp(), v), dict(causal=True))),
    "ovq": (ovq.ovq_attention, ovq.chunk_ovq_attention, ovq.recurrent_ovq_attention, ovq.naive_ovq_attention,
            lambda q, k, v: ((q, k, v), dict(num_slots=4))),
    "decay": (decay.decay_attention, decay.chunk_decay_attention, decay.recurrent_decay_attention,
              decay.naive_decay_attention, lambda q, k, v: ((q, k, v, -q[..., 0].sigmoid()), {})),
    "delta_rule": (delta_rule.delta_rule_attention, delta_rule.chunk_delta_rule_attention,
                   delta_rule.recurrent_delta_rule_attention, delta_rule.naive_delta_rule_attention,
                   lambda q, k, v: ((q, torch.nn.functional.normalize(k, dim=-1), v, k[..., 0].sigmoid(),
                                     -torch.nn.functional.softplus(v[..., 0])), {})),
}


@pytest.mark.parametrize("name", OPS)
def test_op_takes_the_contract_keywords(name):
    op = OPS[name][0]
    parameters = inspect.signature(op).parameters
    assert {"block_len", "impl", "state", "return_state"} <= set(parameters)
    assert parameters["impl"].default == "auto"
    impls = inspect.getmodule(op).IMPLS
    assert {"auto", "chunk", "recurrent", "naive"} <= set(impls) <= {"auto", "chunk", "recurrent", "naive", "triton"}


@pytest.mark.parametrize("name", OPS)
def test_impls_agree_and_return_the_same_convention(name):
    """T = 37 in blocks of 8, float64: the chunk, recurrent and naive forms and every impl of the op agree;
    return_state gives (out, state) and the state continues the sequence."""
    op, chunk, recurrent, naive, inputs = OPS[name]
    args, kwargs = inputs(*_qkv())
    kwargs = dict(kwargs, block_len=8)
    ref = naive(*args, **kwargs)
    for fixed in (chunk, recurrent):
        torch.testing.assert_close(fixed(*args, **kwargs), ref, rtol=1e-10, atol=1e-12)
    for impl in ("auto", "chunk", "recurrent", "naive"):
        torch.testing.assert_close(op(*args, impl=impl, **kwargs), ref, rtol=1e-10, atol=1e-12)
    per_token = [x.dim() >= 3 and x.shape[2] == 37 for x in args]  # q, k, v and (B, H, T) inputs such as decays
    head = [x[:, :, :30] if split else x for x, split in zip(args, per_token)]
    tail = [x[:, :, 30:] if split else x for x, split in zip(args, per_token)]
    out, state = op(*head, return_state=True, **kwargs)
    rest, _ = op(*tail, state=state, return_state=True, **kwargs)
    torch.testing.assert_close(torch.cat([out, rest], 2), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", OPS)
def test_fixed_impls_take_no_impl(name):
    _, chunk, _, _, inputs = OPS[name]
    args, kwargs = inputs(*_qkv(T=5))
    with pytest.raises(TypeError, match="impl"):
        chunk(*args, impl="naive", **kwargs)
