"""Chunked (block-parallel) form of :func:`~vqattn.ops.ovq.ovq_attention`, for training and prefill.

All blocks attend at once: the window logits (nb, L, 2L) and the memory logits (nb, L, S) of every block share one
softmax. The memory each block reads is a prefix sum over the blocks' slot statistics (one cumsum); only the online
assignment runs block after block, without gradient. Time O(T·(L + S)·D), memory O(T·(L + S) + (T/L)·S·D): no
T×T tensor.
"""

from __future__ import annotations

import torch

from ..vq_blocks import blocks, group_windows, pad_to_blocks, window_bias
from ..vq_recurrent import attend_one, window_start
from .memory import block_statistics, memory_logits, online_slots
from .state import Inputs, OVQState


def _memory_state(state: OVQState) -> torch.Tensor:
    """The state's memory as [n, K, V] (B, H, S, 1 + D + Dv)."""
    return torch.cat([state.counts.unsqueeze(-1), state.key_sums, state.value_sums], -1)


def _with_prefix(x: Inputs, state: OVQState) -> Inputs:
    """The state's raw window (block-aligned) in front of the new tokens; its queries are zeros (outputs dropped)."""
    def cat(before, now):
        return now if before is None else torch.cat([before, now], 2)

    zeros = x.q.new_zeros(*x.q.shape[:2], state.keys.shape[2], x.q.shape[-1])
    return x._replace(q=cat(zeros, x.q), q_mem=cat(zeros, x.q_mem), k=cat(state.keys, x.k), v=cat(state.values, x.v),
                      k_mem=cat(state.memory_keys if x.separate_keys else state.keys, x.k_mem),
                      slots=cat(state.slots, x.slots), slot_weights=cat(state.slot_weights, x.slot_weights))


def chunk_forward(x: Inputs, state: OVQState | None, return_state: bool) -> tuple[torch.Tensor, OVQState | None]:
    """out (B, H, T, Dv) of the inputs continuing ``state`` (None: a fresh sequence), and the state after them."""
    B, H, T, D = x.q.shape
    L, S, Dv = x.block_len, x.num_slots, x.v.shape[-1]
    if state is None:
        start, memory0 = 0, x.q.new_zeros(B, H, S, 1 + D + Dv)
    else:
        start, memory0 = state.length - state.keys.shape[2], _memory_state(state)
        x = _with_prefix(x, state)
    length = start + x.k.shape[2]
    # Padding comes after every real query, so the causal mask hides it; a block's statistics reach only blocks
    # two or more later, so the padded last block's are never read, and only whole blocks enter a state.
    q, k, v, q_mem, k_mem, weights = (pad_to_blocks(t, L) for t in (x.q, x.k, x.v, x.q_mem, x.k_mem, x.slot_weights))
    nb = q.shape[2] // L
    slots = pad_to_blocks(x.slots, L)
    if slots is None and weights is None:
        slots = online_slots(k_mem, memory0[..., 0], memory0[..., 1 : 1 + D], L, x.threshold)
    stats = block_statistics(slots, weights, k_mem, v, S, nb)  # (B, H, nb, S, 1 + D + Dv)
    after = memory0.unsqueeze(2) + stats.cumsum(2)  # the memory after each block
    # Block b reads the memory of blocks ≤ b − 2 (the state's memory for b < 2).
    read = torch.cat([memory0.unsqueeze(2).expand(B, H, min(nb, 2), S, -1), after[:, :, : nb - 2]], 2)
    mem_logits, mem_values = memory_logits(blocks(q_mem * x.scale, L), read, D)  # (B, H, nb, L, S), (.., S, Dv)
    zeros = k.new_zeros(B, H, L, D)
    window_logits = blocks(q * x.scale, L) @ group_windows(k, zeros, L).transpose(-1, -2) + \
        window_bias(nb, L, q.device, q.dtype)  # (B, H, nb, L, 2L)
    out = attend_one(window_logits, group_windows(v, v.new_zeros(B, H, L, Dv), L), mem_logits, mem_values)
    out = out.flatten(2, 3)[:, :, x.k.shape[2] - T : x.k.shape[2]]
    if not return_state:
        return out, None
    keep = window_start(length, L) - start  # whole blocks leave the raw window
    counts, key_sums, value_sums = (after[:, :, keep // L - 1] if keep else memory0).split([1, D, Dv], -1)
    raw = lambda t: None if t is None else t[:, :, keep:]  # noqa: E731
    return out, OVQState(counts.squeeze(-1), key_sums, value_sums, raw(x.k), raw(x.v),
                         raw(x.k_mem) if x.separate_keys else None,
                         raw(x.slots), raw(x.slot_weights), length, L)
