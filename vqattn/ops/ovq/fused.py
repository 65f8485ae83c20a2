"""The fused (Triton) impl of :func:`~vqattn.ops.ovq.ovq_attention`'s attention: vq's fused window + codes kernel
(:mod:`vqattn.ops.triton.window_codes`) with one codebook per block, the slots' mean keys of the memory it reads.

Block b reads the memory M_{b−2} on top of the state's: per slot its count n_bs, mean key k̄_bs = K_bs / n_bs and
value sum V_bs, (nb, S, D) per batch·head, from vq's cache walk (:func:`~vqattn.ops.triton.block_caches.block_caches`,
its slots as the codes' index, or slot weights as soft weights) over the memory keys and values side by side: one
kernel forward and one backward in place of PyTorch's scatter-adds, prefix sums and their flips. Forgetting
(``memory_decay``), which weighs every block's statistics, keeps PyTorch's statistics and lagged prefix sums.
The kernel scores q̃·k̄_bs + log n_bs next to the window in one online softmax and returns the gradients of the
per-block means, counts and value sums, which autograd carries back through the prefix sums to the memory keys,
the values and the slot weights.
"""

from __future__ import annotations

import torch

from ..blocks import loops
from ..common.memory_decay import weigh_blocks
from ..common.statistics import Assignment, code_means, code_statistics
from ..triton.block_caches import block_caches
from ..triton.window_codes import fused_window_code_attention
from .memory import lagged_sum
from .state import Inputs, OVQState


def fused_memory_attention(x: Inputs, state: OVQState, q, k, v, q_mem, k_mem, slots, weights,
                           memory_bias=None, block_weights=None) -> torch.Tensor:
    """out (B, H, T, Dv) of block-padded q, k, q_mem, k_mem (B, H, T, D) and v (B, H, T, Dv) (T = nb·L, any
    supported dtype) whose keys go to ``slots`` (B, H, T) or with ``weights`` (B, H, T, S), after the memory of
    ``state``. The statistics are in x.dtype (float32 for half-precision inputs). ``memory_bias`` (nb,): the slot
    logits' bias per block (``memory_cap``, ``memory_decay``), added in the kernel, or None; ``block_weights`` (nb,):
    the blocks' statistics' weights (``memory_decay``) or None."""
    D, Dv, S, L = k_mem.shape[-1], v.shape[-1], x.num_slots, x.block_len
    nb = k_mem.shape[2] // L
    keys_values = torch.cat([k_mem, v], -1).to(x.dtype)  # one walk forms the key and the value sums side by side
    if block_weights is None:
        counts, sums, _, _ = block_caches(slots, weights, keys_values, state.counts,
                                          torch.cat([state.key_sums, state.value_sums], -1), block_len=L, fold=0)
        key_sums, value_sums = sums.split([D, Dv], -1)  # split, not sliced: one gradient buffer, not two summed
        key_means = code_means(counts, key_sums)
    else:  # blocks weighed by forgetting: PyTorch's statistics and prefix sums
        loop = loops(x.schedule, q.device)
        counts, sums = code_statistics(Assignment(weights, slots), keys_values, S, nb)
        counts, sums = weigh_blocks(counts, block_weights), weigh_blocks(sums, block_weights)
        key_sums, value_sums = sums.split([D, Dv], -1)  # (B, H, nb, S, ·)
        counts = lagged_sum(counts, state.counts, 2, loop)
        key_means = lagged_sum(key_sums, state.key_sums, 2, loop, counts=counts)
        value_sums = lagged_sum(value_sums, state.value_sums, 2, loop)
    return fused_window_code_attention(q, k, v, scale=x.scale, block_len=L, qc=q_mem, codebook=key_means,
                                       counts=counts, sums=value_sums, code_bias=memory_bias)
