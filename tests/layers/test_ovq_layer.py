"""OnlineVQAttention: the layer is the op on its projected (and rotated) heads, in every option; L2 q/k
normalisation; chunked decoding with every option; state size; bad arguments. The registry-wide tests
(test_layers, test_model, test_generation, ...) cover the rest."""

from __future__ import annotations

import pytest
import torch

from vqattn.layers import OnlineVQAttention, build_attention, rope_rotate
from vqattn.modules.rope import rope_frequencies
from vqattn.ops.ovq import naive_ovq_attention

from model_helpers import layer_in_chunks

DIM, HEADS, L, S = 16, 2, 4, 6
CLAMP = 2 * L + 1
OPTIONS = [
    dict(rope=False),
    dict(rope=True),
    dict(rope=True, memory_rope="fast"),  # the memory rotates the fast pairs only
    dict(rope=True, memory_rope=False),
    dict(rope=True, memory_rope_clamp=CLAMP),  # the memory's slow pairs rotate by min(position, CLAMP)
    dict(rope=True, slots_by="codebook"),
    dict(rope=True, qk_norm="l2", threshold=0.2),
    dict(rope=True, memory_decay=0.9),  # forgetting: each block keeps 0.9^L of its weight per later block
    dict(rope=True, memory_pairs="all", overflow="nearest"),  # every pair; novel keys join a full memory's nearest
    dict(rope=True, memory_rope="fast", overflow="nearest"),
]


def make(**kwargs) -> OnlineVQAttention:
    torch.manual_seed(0)
    layer = build_attention("ovq", dim=DIM, num_heads=HEADS, num_slots=S, block_len=L, **kwargs)
    return layer.double().eval()


def heads(layer, x):
    b, t, _ = x.shape
    q, k, v = layer.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
    return layer.q_norm(q), layer.k_norm(k), v


def rotate_fast_pairs(layer, z, memory_rope):
    """z with RoPE on the pairs that turn by at least a radian across the raw window (2L) ("fast") or on none."""
    if memory_rope is False:
        return z
    return torch.where(fast_pairs(layer, z.shape[-1]), rope_rotate(z, 0, layer.rope_base), z)


def fast_pairs(layer, dh):
    """(Dh,) bool: the dims of the pairs that turn by at least a radian across the raw window (2L)."""
    fast = rope_frequencies(dh, layer.rope_base).repeat(2) * 2 * L >= 1  # pair m holds dims m and m + Dh/2
    assert 0 < int(fast.sum()) < dh  # the test's shapes mix both kinds
    return fast


def rotate_clamped(layer, z, clamp):
    """z with RoPE, its slow pairs rotated at min(position, clamp): token by token, each at its own positions."""
    fast = fast_pairs(layer, z.shape[-1])
    tokens = [torch.where(fast, rope_rotate(z[:, :, t:t + 1], t, layer.rope_base),
                          rope_rotate(z[:, :, t:t + 1], min(t, clamp), layer.rope_base)) for t in range(z.shape[2])]
    return torch.cat(tokens, 2)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_layer_is_the_naive_op_on_its_heads(options):
    layer = make(**options)
    x = torch.randn(2, 4 * L + 3, DIM, dtype=torch.float64)
    q, k, v = heads(layer, x)
    rotate = (lambda z: rope_rotate(z, 0, layer.rope_base)) if options["rope"] else (lambda z: z)  # noqa: E731
    kwargs = dict(num_slots=S, block_len=L, scale=(DIM // HEADS) ** -0.5, memory_cap=layer.memory_cap,
                  memory_decay=options.get("memory_decay"))
    assert layer.memory_cap == 2 * L  # the default, which these 4 blocks and 3 tokens exceed
    if options.get("slots_by") == "codebook":
        kwargs["slots"] = ((k.unsqueeze(-2) - layer.codebook.codes.unsqueeze(1)) ** 2).sum(-1).argmin(-1)
    else:
        kwargs["threshold"] = layer.threshold
        kwargs["overflow"] = options.get("overflow", "drop")
    memory_rope = options.get("memory_rope", True)
    q_mem, k_mem = rotate(q), rotate(k)
    if options["rope"] and memory_rope is not True:
        q_mem, k_mem = rotate_fast_pairs(layer, q, memory_rope), rotate_fast_pairs(layer, k, memory_rope)
    if "memory_rope_clamp" in options:
        q_mem, k_mem = rotate_clamped(layer, q, CLAMP), rotate_clamped(layer, k, CLAMP)
    if options["rope"] and options.get("memory_pairs", "slow") == "slow":  # the slow pairs' dims alone
        slow = ~fast_pairs(layer, q.shape[-1])
        q_mem, k_mem = q_mem[..., slow], k_mem[..., slow]
    out = naive_ovq_attention(rotate(q), rotate(k), v, q_mem=q_mem, k_mem=k_mem, **kwargs)
    expected = layer.proj(out.transpose(1, 2).reshape(x.shape))
    torch.testing.assert_close(layer(x).output, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_chunked_decoding_matches_one_call(options):
    layer = make(**options)
    x = torch.randn(2, 5 * L + 1, DIM, dtype=torch.float64)
    full = layer(x).output
    chunked, _ = layer_in_chunks(layer, x, [7, 1, 1, 8, 5 * L + 1 - 17])
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-12)


def test_rope_clamp_changes_nothing_up_to_the_clamp():
    """A sequence no longer than the clamp computes exactly what the layer without one does, gradients too."""
    x = torch.randn(2, 3 * L + 1, DIM, dtype=torch.float64)
    results = []
    for clamp in (None, 3 * L):
        layer = make(rope=True, memory_rope_clamp=clamp).train()
        out = layer(x).output
        out.square().sum().backward()
        results.append([out, layer.qkv.weight.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_l2_qk_norm_gives_unit_keys_and_a_learned_query_scale():
    layer = make(rope=True, qk_norm="l2")
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    q, k, _ = heads(layer, x)
    torch.testing.assert_close(k.norm(dim=-1), torch.ones_like(k[..., 0]))
    torch.testing.assert_close(q.norm(dim=-1), torch.full_like(q[..., 0], DIM // HEADS))  # the scale starts at Dh
    out = layer.train()(x).output
    (grad,) = torch.autograd.grad(out.square().sum(), layer.q_norm.scale)
    assert grad.shape == (HEADS, 1, 1) and grad.abs().amin() > 0
    with torch.no_grad():  # invariant to the scale of the projections, like RMS normalisation
        layer.qkv.weight[: 2 * DIM] *= 7.0
    torch.testing.assert_close(layer.eval()(x).output, out.detach(), rtol=0, atol=1e-9)


def test_codebook_assignment_learns_the_codebook_and_returns_its_loss():
    layer = make(rope=True, slots_by="codebook").train()
    x = torch.randn(2, 3 * L, DIM, dtype=torch.float64)
    _, aux_loss, _ = layer(x)
    _, aux_loss, _ = layer(x)  # the first training step initialises the codes from its keys
    assert aux_loss > 0 and aux_loss.requires_grad
    stats = layer.usage_stats()
    assert {"perplexity", "dead_codes", "quant_error", "occupied_slots"} <= set(stats)


def test_state_floats_counts_every_option():
    """One layer's decoding state, counted from the state itself: the slots, and per token of the longest raw window
    its keys and values and its memory keys where the memory has its own (of the slow pairs' width by default)."""
    for options in (dict(rope=True), dict(rope=True, memory_pairs="all"), dict(rope=True, memory_rope="fast"),
                    dict(rope=True, memory_rope=False), dict(rope=False, memory_rope="fast"),
                    dict(rope=True, memory_rope_clamp=5), dict(rope=True, memory_rope_clamp=5, memory_pairs="all")):
        layer = make(**options)
        t = 11
        _, _, state = layer(torch.randn(2, t, DIM, dtype=torch.float64), return_state=True)
        inner = state.inner
        memory = sum(z[0].numel() for z in (inner.counts, inner.key_sums, inner.value_sums))
        raw = (inner.keys, inner.values) + (() if inner.memory_keys is None else (inner.memory_keys,))
        per_token = sum(z[0, :, 0].numel() for z in raw)  # counted for the longest raw window, 2L tokens
        assert layer.state_floats(t) == memory + per_token * min(t, 2 * L), options
        separate = options.get("memory_rope", True) is not True and options["rope"] or "memory_rope_clamp" in options
        assert (inner.memory_keys is None) == (not separate)
        slow = options["rope"] and options.get("memory_pairs", "slow") == "slow"
        width = int((~fast_pairs(layer, DIM // HEADS)).sum()) if slow else DIM // HEADS
        assert inner.key_sums.shape[-1] == width


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_slots=0), "num_slots"),
    (dict(block_len=0), "block_len"),
    (dict(slots_by="kmeans"), "slots_by"),
    (dict(memory_pairs="fast"), "memory_pairs"),
    (dict(overflow="evict"), "overflow"),
    (dict(memory_rope="slow"), "memory_rope"),
    (dict(memory_rope=1), "memory_rope"),
    (dict(memory_rope_clamp=0), "memory_rope_clamp"),
    (dict(memory_rope_clamp=2.5), "memory_rope_clamp"),
    (dict(threshold=-0.1), "threshold"),
    (dict(threshold="0.5"), "threshold"),
    (dict(codebook={"decay": 0.9}), "codebook"),
    (dict(qk_norm="layer"), "qk_norm"),
    (dict(memory_decay=0), "memory_decay"),
    (dict(memory_decay=0.01), "memory_decay"),  # forgets a block within L keys: too fast for L = 4
])
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_attention("ovq", dim=DIM, num_heads=HEADS, **kwargs)
