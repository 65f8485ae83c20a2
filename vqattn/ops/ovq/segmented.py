"""The segmented block form of online codebook attention: a packed row of sequences in one traced computation.

In a :class:`~vqattn.ops.common.segments.BlockLayout` every sequence starts at a block boundary, so the memory of
block b is that of its own sequence's blocks ≤ b − 2: the online assignment empties the memory before each
sequence's first block (:func:`~.memory.online_slots`, one opaque operator as in the chunk impl), and the slots'
counts, key sums and value sums are :func:`~vqattn.ops.common.segments.segment_sums` of the blocks' statistics.
Every block then attends at once, in plain PyTorch with autograd's gradients, to its window and to the slots' mean
keys and values, as :mod:`.chunk` computes them: no loop over sequences, no host read, one graph for any documents.
"""

from __future__ import annotations

import torch

from ..blocks import blocks
from ..common.segments import BlockLayout, memory_bias, segment_sums, window_blocks, window_mask, window_softmax
from ..common.statistics import Assignment, code_statistics
from .memory import memory_logits, online_slots
from .state import Inputs


def segmented_forward(x: Inputs, layout: BlockLayout) -> torch.Tensor:
    """Online codebook attention of x (:class:`~.state.Inputs`, tensors (B, H, T', ·) in ``layout``, no state, no
    forgetting) -> out (B, H, T', Dv)."""
    L, S = layout.block_len, x.num_slots
    B, H, T, _ = x.q.shape
    first = layout.first_blocks()
    slots, weights = x.slots, x.slot_weights
    if slots is None and weights is None:
        opens = first == torch.arange(first.shape[0], device=first.device)
        empty = x.k_mem.new_zeros(B, H, S)
        slots = online_slots(x.k_mem, empty, x.k_mem.new_zeros(B, H, S, x.memory_dim), L, x.threshold, None,
                             x.drop, opens)
    counts, sums = code_statistics(Assignment(weights, slots), torch.cat([x.k_mem, x.v], -1), S, T // L)
    counts, sums = segment_sums(counts, first, 2), segment_sums(sums, first, 2)  # the memory of each block
    key_sums, value_sums = sums.split([x.memory_dim, x.v.shape[-1]], -1)
    slot_logits, means = memory_logits(blocks(x.q_mem * x.scale, L), counts, key_sums, value_sums)
    bias = memory_bias(layout, x.memory_cap, slot_logits.dtype)
    out = window_softmax(x.scale * blocks(x.q, L) @ window_blocks(x.k, L, first).transpose(-1, -2),
                         window_mask(first, L), window_blocks(x.v, L, first),
                         slot_logits if bias is None else slot_logits + bias, means)
    return out.reshape(B, H, T, -1)
