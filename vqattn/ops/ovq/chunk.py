"""The chunk (block-parallel) impl of :func:`~vqattn.ops.ovq.ovq_attention`, for training and prefill.

Every block's queries attend at once through the block kernel of codebook attention
(:class:`~vqattn.ops.common.window_code_blocks.WindowCodeAttention`): one softmax over the window logits (nb, L, 2L) and the
slot logits (nb, L, S), with the slots' value sums read from one running cache (in blocks on CPU, as for
``vq_attention``). The slot logits σ q̃·k̄_s are the kernel's code logits with one codebook per block, the slot
means k̄ = K / n of every block's memory (nb, S, D): one prefix sum over the blocks' statistics. Only the online
assignment runs block after block, without gradient. Time O(T·(L + S)·D), memory O(T·(L + S) + (T/L)·S·D): no T×T
tensor.

The Triton impl (``fused``) is this algorithm with the online assignment
(:func:`~vqattn.ops.triton.online_slots.fused_online_slots`) and the attention
(:func:`~vqattn.ops.ovq.fused.fused_memory_attention`) as kernels.
"""

from __future__ import annotations

import torch

from ..blocks import blocks, group_windows, loops, pad_to_blocks, window_bias, window_start, window_tail
from ..common.memory_cap import block_memory_bias
from ..common.memory_decay import block_decay, forget, span_blocks, weigh_blocks
from ..common.statistics import Assignment, code_statistics
from ..common.window_code_blocks import WindowCodeInputs, window_code_attention
from ..triton.online_slots import fused_online_slots
from ..utils import replaced
from .fused import fused_memory_attention
from .memory import lagged_sum, online_slots, statistics
from .state import Inputs, OVQState


def _with_prefix(x: Inputs, state: OVQState) -> Inputs:
    """The state's raw window (block-aligned) in front of the new tokens; its queries are zeros (outputs
    dropped)."""
    def cat(before, now):
        return now if before is None else torch.cat([before.to(now.dtype), now], 2)

    zeros = x.q.new_zeros(*x.q.shape[:2], state.keys.shape[2], x.q.shape[-1])
    memory_zeros = zeros if x.q_mem is x.q else x.q_mem.new_zeros(*zeros.shape[:3], x.memory_dim)
    memory_keys = state.memory_keys if x.separate_keys else x.memory_part(state.keys)
    return replaced(x, q=cat(zeros, x.q), q_mem=cat(memory_zeros, x.q_mem), k=cat(state.keys, x.k),
                    v=cat(state.values, x.v), k_mem=cat(memory_keys, x.k_mem), slots=cat(state.slots, x.slots),
                    slot_weights=cat(state.slot_weights, x.slot_weights))


def chunk_forward(x: Inputs, state: OVQState | None, return_state: bool,
                  fused: bool = False) -> tuple[torch.Tensor, OVQState | None]:
    """out (B, H, T, Dv) of the inputs continuing ``state`` (None: a fresh sequence), and the state after them;
    ``fused``: the assignment and the attention run as Triton kernels."""
    span = span_blocks(x.decay)
    if span is not None and x.q.shape[2] > (span - 2) * x.block_len:
        return _in_spans(x, state, return_state, fused, (span - 2) * x.block_len)
    T = x.q.shape[2]
    L, S = x.block_len, x.num_slots
    shared_queries = x.q_mem is x.q  # then one product serves the window and the slots (and their gradients)
    start = 0
    if state is None:
        state = OVQState.empty(x.q, x.v, S, L, memory_keys=False, slots=False, slot_weights=False,
                               memory_dim=x.memory_dim).to(x.dtype)
    else:
        start, x = state.length - state.keys.shape[2], _with_prefix(x, state)
    length = start + x.k.shape[2]
    # Padding comes after every real query, so the causal mask hides it; a block's statistics reach only blocks
    # two or more later, so the padded last block's are never read, and only whole blocks enter a state.
    pad = lambda t: None if t is None else pad_to_blocks(t, L)  # noqa: E731
    q, k, v, q_mem, k_mem, weights, slots = map(pad, (x.q, x.k, x.v, x.q_mem, x.k_mem, x.slot_weights, x.slots))
    if slots is None and weights is None:
        slots = (fused_online_slots if fused else online_slots)(k_mem, state.counts, state.key_sums, L, x.threshold,
                                                                x.decay, x.drop)
    nb = q.shape[2] // L
    bias = block_memory_bias(start // L, nb, L, x.memory_cap, device=q.device, dtype=x.dtype, decay=x.decay)
    block_weights = None
    if x.decay is not None:  # the blocks' statistics weigh g^−(b'+1), and block b's memory logits gain (b − 1)·log g
        block_weights, decay_bias = block_decay(nb, x.decay, device=q.device, dtype=x.dtype)
        bias = decay_bias if bias is None else bias + decay_bias
    if fused:
        out = fused_memory_attention(x, state, q, k, v, q_mem, k_mem, slots, weights, bias, block_weights)
    else:
        out = _block_attention(x, state, q, k, v, q_mem, k_mem, slots, weights, shared_queries, bias,
                               block_weights)
    out = out[:, :, x.k.shape[2] - T : x.k.shape[2]]
    if not return_state:
        return out, None
    keep = window_start(length, L) - start  # whole blocks leave the raw window
    head = lambda t: None if t is None else t[:, :, :keep]  # noqa: E731
    n, keys, values = statistics(head(slots), head(weights), head(k_mem).to(x.dtype), head(v).to(x.dtype), S, L,
                                 x.decay)
    # the state's memory has since taken in keep / L blocks
    memory = forget((state.counts, state.key_sums, state.value_sums), x.decay, keep // L)
    raw = lambda t: window_tail(t, keep)  # noqa: E731
    return out, OVQState(memory[0] + n, memory[1] + keys, memory[2] + values, raw(x.k),
                         raw(x.v), raw(x.k_mem) if x.separate_keys else None, raw(x.slots), raw(x.slot_weights),
                         length, L)


def _block_attention(x: Inputs, state: OVQState, q, k, v, q_mem, k_mem, slots, weights, shared_queries: bool,
                     memory_bias=None, block_weights=None) -> torch.Tensor:
    """out (B, H, T, Dv) of block-padded inputs (T = nb·L) whose keys go to ``slots`` or with ``weights``, after
    the memory of ``state``: the PyTorch block kernel; ``memory_bias`` (nb,) on the slot logits (``memory_cap``,
    ``memory_decay``), ``block_weights`` (nb,) on the blocks' statistics (``memory_decay``) or None."""
    (B, H, _, D), L, S, Dv = q.shape, x.block_len, x.num_slots, v.shape[-1]
    nb = q.shape[2] // L
    counts, key_sums = code_statistics(Assignment(weights, slots), k_mem, S, nb)  # (B, H, nb, S), (.., S, Dm)
    add_values = weigh_blocks(blocks(v, L), block_weights)
    if slots is not None and (x.drop or x.slots is not None):  # slots that may hold −1 (a key not stored):
        # the cache adds a key's value at slot max(s, 0), so such a key adds zeros
        add_values = add_values * (blocks(slots, L) >= 0).unsqueeze(-1).to(v.dtype)
        slots = slots.clamp_min(0)
    counts, key_sums = weigh_blocks(counts, block_weights), weigh_blocks(key_sums, block_weights)
    # Block b reads the memory of blocks ≤ b − 2 on top of the state's: counts and key sums here, value sums in
    # the kernel's running cache, which takes in block b − 1 after block b.
    loop = loops(x.schedule, q.device)
    counts = lagged_sum(counts, state.counts, 2, loop)
    key_means = lagged_sum(key_sums, state.key_sums, 2, loop, counts=counts)  # the slots' mean keys k̄
    inputs = WindowCodeInputs(
        queries=blocks(q_mem * x.scale, L), window_keys=group_windows(k, k.new_zeros(B, H, L, D), L),
        window_bias=window_bias(nb, L, q.device, q.dtype), window_values=group_windows(v, v.new_zeros(B, H, L, Dv), L),
        counts=counts, sums=state.value_sums, add_values=add_values,
        add_index=None if slots is None else blocks(slots, L),
        add_weights=None if weights is None else blocks(weights, L), pending=torch.zeros_like(state.value_sums),
        codebook=key_means,
        window_queries=None if shared_queries else blocks(q * x.scale, L),
        code_bias=None if memory_bias is None else memory_bias.view(nb, 1, 1))
    return window_code_attention(inputs, loop)[0]


def _in_spans(x: Inputs, state: OVQState | None, return_state: bool, fused: bool,
              span: int) -> tuple[torch.Tensor, OVQState | None]:
    """:func:`chunk_forward` over ``span`` tokens at a time, each continuing the state of the last: with forgetting
    the block weights g^−b' of one pass must stay within float range (:mod:`~vqattn.ops.common.memory_decay`)."""
    outs = []
    for start in range(0, x.q.shape[2], span):
        part = lambda t: None if t is None else t[:, :, start : start + span]  # noqa: E731
        q, k = part(x.q), part(x.k)
        piece = replaced(x, q=q, k=k, v=part(x.v), q_mem=q if x.q_mem is x.q else part(x.q_mem),
                         k_mem=k if x.k_mem is x.k else part(x.k_mem), slots=part(x.slots),
                         slot_weights=part(x.slot_weights))
        out, state = chunk_forward(piece, state, True, fused)
        outs.append(out)
    return torch.cat(outs, 2), state if return_state else None
