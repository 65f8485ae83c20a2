"""Recurrent (decoding) impl of :func:`~vqattn.ops.ovq.ovq_attention`: one token at a time, O((2L + S)·D) each.

A token at position p attends to the state's raw window (positions from ``window_start(p, L)`` on) plus itself,
and to the S memory slots. When a block leaves the window it is assigned (online: against the memory as it stands,
which holds exactly the blocks before it) and absorbed, once: the chunked algorithm's math for one query.
"""

from __future__ import annotations

import torch

from ..blocks import attend_one, window_start, window_tail
from ..common.memory_cap import is_unweighed, log_weight, memory_scale, weigh_memory
from ..common.memory_decay import forget, keys_in_memory
from ..common.statistics import code_means
from ..triton.decode import fused_decode_step
from .memory import assign_block, memory_logits, statistics
from .state import Inputs, OVQState


def _absorb(x: Inputs, state: OVQState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state's memory (times the forgetting factor g) plus its first L raw positions (the block leaving the
    window, assigned against the memory before it): counts, key and value sums."""
    L, dtype = state.block_len, state.counts.dtype  # the raw window may be in half precision (the Triton impl)
    keys = x.memory_part(state.keys) if state.memory_keys is None else state.memory_keys
    memory_keys = keys[:, :, :L].to(dtype)
    weights = None if state.slot_weights is None else state.slot_weights[:, :, :L]
    slots = None if state.slots is None else state.slots[:, :, :L]
    if slots is None and weights is None:
        slots = assign_block(memory_keys, state.counts, state.key_sums, x.threshold, x.drop)
    n, keys, values = statistics(slots, weights, memory_keys, state.values[:, :, :L].to(dtype),
                                 state.counts.shape[-1])
    counts, key_sums, value_sums = forget((state.counts, state.key_sums, state.value_sums), x.decay)
    return counts + n, key_sums + keys, value_sums + values


def _attend(x: Inputs, token: slice, state: OVQState, keys, values) -> torch.Tensor:
    """The token's softmax over its window (keys, values (B, H, W, ·), its own last) and the state's memory."""
    mem_logits, mem_values = memory_logits(x.q_mem[:, :, token] * x.scale, state.counts, state.key_sums,
                                           state.value_sums)
    weight = _memory_weight(x, state)
    if not is_unweighed(weight):
        mem_logits = mem_logits + log_weight(weight)
    return attend_one((x.q[:, :, token] * x.scale) @ keys.transpose(-1, -2), values, mem_logits, mem_values)


def _attend_fused(x: Inputs, token: slice, state: OVQState, keys, values) -> torch.Tensor:
    """:func:`_attend` as one Triton kernel (:mod:`vqattn.ops.triton.decode`) with the slots' mean keys as each
    sequence's codebook; forward only."""
    counts, sums = weigh_memory(state.counts, state.value_sums, _memory_weight(x, state))
    return fused_decode_step(x.q[:, :, token], keys, values, scale=x.scale, qc=x.q_mem[:, :, token],
                             codebook=code_means(state.counts, state.key_sums), counts=counts, sums=sums)


def _memory_weight(x: Inputs, state: OVQState) -> float | torch.Tensor:
    """min(1, M / n) for the next token, whose memory holds window_start(p) keys of total count n (``memory_cap``
    M; n is their number without ``memory_decay``)."""
    L = state.block_len
    return memory_scale(keys_in_memory(window_start(state.length, L) // L, L, x.decay), x.memory_cap)


def _step(x: Inputs, t: int, state: OVQState, fused: bool) -> tuple[torch.Tensor, OVQState]:
    """Token t of the inputs: out (B, H, 1, Dv) and the state after it (``fused``: the attention in one Triton
    kernel)."""
    token = slice(t, t + 1)
    cat = lambda old, new: None if old is None else torch.cat([old, new[:, :, token]], 2)  # noqa: E731
    grown = OVQState(state.counts, state.key_sums, state.value_sums, cat(state.keys, x.k), cat(state.values, x.v),
                     cat(state.memory_keys, x.k_mem), cat(state.slots, x.slots),
                     cat(state.slot_weights, x.slot_weights), state.length + 1, state.block_len)
    out = (_attend_fused if fused else _attend)(x, token, state, grown.keys, grown.values)
    L = state.block_len
    if window_start(grown.length, L) == window_start(state.length, L):
        return out, grown
    counts, key_sums, value_sums = _absorb(x, grown)
    drop = lambda t: window_tail(t, L)  # noqa: E731
    return out, OVQState(counts, key_sums, value_sums, drop(grown.keys), drop(grown.values), drop(grown.memory_keys),
                         drop(grown.slots), drop(grown.slot_weights), grown.length, L)


def recurrent_forward(x: Inputs, state: OVQState | None, return_state: bool,
                      fused: bool = False) -> tuple[torch.Tensor, OVQState | None]:
    """Token by token from ``state`` (None: an empty memory at position 0): out (B, H, T, Dv) and the state;
    ``fused``: each token's attention is one Triton kernel (forward only)."""
    if state is None:
        state = OVQState.empty(x.q, x.v, x.num_slots, x.block_len, memory_keys=x.separate_keys,
                               slots=x.slots is not None, slot_weights=x.slot_weights is not None,
                               memory_dim=x.memory_dim)
        state = state.to(x.dtype, raw=x.k.dtype)
    outs = []
    for t in range(x.q.shape[2]):
        out, state = _step(x, t, state, fused)
        outs.append(out)
    return torch.cat(outs, 2), state if return_state else None
