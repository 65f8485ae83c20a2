"""A bound on the compressed memory's weight: the fix for reading past the training length.

Query i reads its window of raw keys and the memory (codes or slots) that holds the n_i older keys, each code s
with logit σ q·c_s + log n_is and its mean value. With ``memory_cap`` M the memory weighs as if it held at most M
keys: every memory logit gets the bias

    log min(1, M / n_i),    n_i = window_start(i) = max(0, block(i) − 1)·L, the keys before query i's window,

(with ``memory_decay``, n_i is the memory's total count, :func:`~.memory_decay.total_count`), which keeps each
code's share of the memory and its mean value, and only stops the memory's total weight growing
without bound against the window's. A model trained on sequences of T ≤ M tokens never sees the bias (n_i < T);
past T the memory's log-counts stay in the range of training (docs/evaluation.md measures why this matters). It is
a function of the positions alone, so it needs no gradient, and every impl applies it to the same keys: the block
impls per block (all queries of block b share n_b), the recurrent impls per token, the naive impls per query.
"""

from __future__ import annotations

import math

import torch

from .memory_decay import total_count


def _is_bound(memory_cap) -> bool:
    """Whether ``memory_cap`` is a bound the ops take: None or a positive int."""
    return memory_cap is None or (isinstance(memory_cap, int) and not isinstance(memory_cap, bool) and memory_cap >= 1)


def check_memory_cap(memory_cap) -> None:
    if not _is_bound(memory_cap):
        raise ValueError(f"memory_cap must be a positive int (keys) or None (no bound), got {memory_cap!r}")


# A layer's memory_cap (its default): the raw window's size, 2 × block_len keys.
RAW_WINDOW = "window"


def layer_memory_cap(memory_cap, block_len: int) -> int | None:
    """The op's ``memory_cap`` for a layer's: ``"window"`` is :data:`RAW_WINDOW`'s 2 × block_len keys, with which a
    model reads past its training length as its raw window does (docs/evaluation.md); an int is that many keys;
    None: no bound."""
    if memory_cap == RAW_WINDOW:
        return 2 * block_len
    if not _is_bound(memory_cap):
        raise ValueError(f"memory_cap must be a positive int (keys), {RAW_WINDOW!r} (2 × block_len keys, the "
                         f"default) or None (no bound), got {memory_cap!r}")
    return memory_cap


def memory_scale(keys_in_memory, memory_cap: int | None) -> float | torch.Tensor:
    """min(1, M / n): the factor on the memory's counts and value sums for a query whose memory holds n keys (an int
    or float, or a 0-d tensor from :func:`~vqattn.ops.common.memory_decay.keys_in_memory`).

    A Python float, or while ``torch.compile`` traces a decoding step a 0-d float32 tensor: there n is the state's
    symbolic length, and a float of it would be specialised, so every block decoded past M would recompile the step
    (until the recompile limit sends it back to eager)."""
    if memory_cap is None:
        return 1.0
    if isinstance(keys_in_memory, torch.Tensor) or torch.compiler.is_compiling():
        n = keys_in_memory.float() if isinstance(keys_in_memory, torch.Tensor) \
            else torch.full((), keys_in_memory, dtype=torch.float32)
        return (memory_cap / n.clamp_min(1)).clamp_max(1)
    return 1.0 if keys_in_memory <= memory_cap else memory_cap / keys_in_memory


def is_unweighed(weight) -> bool:
    """Whether a :func:`memory_scale` weight is a plain 1: no extra pass while the cap is not reached."""
    return isinstance(weight, float) and weight == 1


def log_weight(weight) -> float | torch.Tensor:
    """log of a :func:`memory_scale` weight, the bias on the memory's logits."""
    return math.log(weight) if isinstance(weight, float) else weight.log()


def weigh_memory(counts: torch.Tensor, sums: torch.Tensor, weight):
    """The memory's counts and value sums times one query's weight min(1, M / n) (:func:`memory_scale`; returned as
    they are at 1), for the decoding kernels that add log n themselves: the logit gains log weight, every mean value
    stays. (The block kernel adds the per-block log weight to its code logits instead.)"""
    if is_unweighed(weight):
        return counts, sums
    return counts * weight, (sums * weight).to(sums.dtype)


def block_memory_bias(first_block: int, num_blocks: int, block_len: int, memory_cap: int | None, *,
                      device, dtype, decay: float | None = None) -> torch.Tensor | None:
    """log min(1, M / n_b) (num_blocks,) for the blocks first_block.. of block_len keys (their memory holds the
    blocks ≤ b − 2: n_b = max(0, b − 1)·L, or with forgetting ``decay`` g its total count L·Σ_{j<b−1} g^j,
    :mod:`.memory_decay`); None when no block's memory exceeds M (the bias is then 0)."""
    last = first_block + num_blocks - 1
    if memory_cap is None or total_count(max(0, last - 1), block_len, decay) <= memory_cap:
        return None
    blocks = (torch.arange(first_block, last + 1, device=device, dtype=torch.float64) - 1).clamp_min(0)
    n = total_count(blocks, block_len, decay)
    return (math.log(memory_cap) - n.clamp_min(1).log()).clamp_max(0).to(dtype)


def query_memory_bias(T: int, block_len: int, memory_cap: int | None, *, device, dtype) -> torch.Tensor | None:
    """log min(1, M / n_i) (T, 1) for queries 0..T−1 (the naive impls: n_i = max(0, i // L − 1)·L), or None."""
    bias = block_memory_bias(0, -(-T // block_len), block_len, memory_cap, device=device, dtype=dtype)
    return None if bias is None else bias.repeat_interleave(block_len)[:T, None]
