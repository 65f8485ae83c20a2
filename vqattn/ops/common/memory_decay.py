"""Forgetting in the online memory (``memory_decay``): the fix for training with carried state.

With ``memory_decay`` γ (per key, 0 < γ ≤ 1) each block of L keys keeps g = γ^L of its weight for every block
that has joined the memory after it. Query block b reads the blocks ≤ b − 2:

    n_bs = Σ_{b' ≤ b−2} g^{b−2−b'} n_b's,   K_bs = Σ g^{b−2−b'} K_b's,   V_bs = Σ g^{b−2−b'} V_b's

so every slot's mean key and value is an exponential moving average of the keys and values it took in (an EMA
codebook's forgetting), its count stays below L / (1 − g), and the memory reads a horizon of about 1 / (1 − γ) keys.
The online assignment scores the same moving averages. Without it, a state carried over many segments fills its
slots with the means of thousands of keys from earlier segments, which no gradient of the current one shapes
(docs/evaluation.md measures what that costs).

The naive and recurrent impls multiply the memory by g as each block joins. The block impls weigh block b' of a call
by g^−(b'+1) instead, so that block b reads g^−(b−1) times the decayed memory: the means do not change, and the
count's logit log n gains the bias (b − 1)·log g (:func:`block_decay`). The factors grow as g^−nb, so a call is run
in spans of at most :data:`MAX_DECAY_E_FOLDS` e-folds (:func:`span_blocks`), each continuing the state of the last.
"""

from __future__ import annotations

import math

import torch

# The most that g^−b' may grow within one pass of the block impls: e^30 ≈ 1e13 leaves float32 (and its gradients,
# which shrink as g^b) far from overflow and underflow.
MAX_DECAY_E_FOLDS = 30.0


def check_memory_decay(memory_decay, block_len: int) -> None:
    """None, or γ in (0, 1] with γ^L ≥ e^−10: a block may lose at most 10 e-folds of weight per later block (a
    horizon under L / 10 keys, a fraction of the raw window, would leave no memory to read), so that one pass of the
    block impls spans at least 3 blocks (:func:`span_blocks`)."""
    if memory_decay is None:
        return
    if isinstance(memory_decay, bool) or not isinstance(memory_decay, (int, float)) or not 0 < memory_decay <= 1:
        raise ValueError(f"memory_decay must be a number in (0, 1] (each key's weight in the memory shrinks by this "
                         f"factor per later key; 1: no forgetting) or None, got {memory_decay!r}")
    if block_len * -math.log(memory_decay) > MAX_DECAY_E_FOLDS / 3:
        raise ValueError(f"memory_decay={memory_decay!r} forgets too fast for block_len={block_len}: "
                         f"memory_decay ** block_len must be at least e^-{MAX_DECAY_E_FOLDS / 3:g}, "
                         f"i.e. memory_decay >= {math.exp(-MAX_DECAY_E_FOLDS / 3 / block_len):.6g}")


def block_factor(memory_decay: float | None, block_len: int) -> float | None:
    """g = γ^L, the factor on the memory per block that joins it; None without forgetting (γ None or 1)."""
    if memory_decay is None or memory_decay == 1:
        return None
    return float(memory_decay) ** block_len


def total_count(blocks: int, block_len: int, factor: float | None) -> float:
    """The memory's total count after ``blocks`` blocks of L keys joined it: L·Σ_{j<blocks} g^j (L·blocks without
    forgetting)."""
    if factor is None:
        return blocks * block_len
    return block_len * (1 - factor**blocks) / (1 - factor)


def keys_in_memory(blocks: int, block_len: int, factor: float | None):
    """:func:`total_count` for a decoding step: while ``torch.compile`` traces one, ``blocks`` is symbolic and the
    count with forgetting a 0-d float64 tensor (a Python float of it would be specialised)."""
    if factor is not None and torch.compiler.is_compiling():
        return total_count(torch.full((), blocks, dtype=torch.float64), block_len, factor)
    return total_count(blocks, block_len, factor)


def span_blocks(factor: float | None) -> int | None:
    """The most blocks one pass of the block impls may hold with forgetting g (None: any number)."""
    if factor is None:
        return None
    return int(MAX_DECAY_E_FOLDS / -math.log(factor))


def block_decay(num_blocks: int, factor: float, *, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """For the blocks 0..nb−1 of one pass of the block impls, whose memory before block 1 is the state's: the weights
    g^−(b'+1) (nb,) of the blocks' statistics, and the biases (b − 1)⁺·log g (nb,) on their memory logits (the
    log of the factor g^(b−1) that takes the weighted memory back to the decayed one)."""
    b = torch.arange(num_blocks, device=device, dtype=torch.float64)
    log_g = math.log(factor)
    return (-(b + 1) * log_g).exp().to(dtype), ((b - 1).clamp_min(0) * log_g).to(dtype)


def forget(memory: tuple[torch.Tensor, ...], factor: float | None, blocks: int = 1) -> tuple[torch.Tensor, ...]:
    """The memory's statistics (counts, sums) after ``blocks`` more blocks joined it: each times g^blocks (as they are
    without forgetting)."""
    if factor is None:
        return memory
    return tuple(t * factor**blocks for t in memory)


def weigh_blocks(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """x (B, H, nb, ...) with block b times weights[b] (:func:`block_decay`); x itself for None."""
    if weights is None:
        return x
    return x * weights.view(-1, *[1] * (x.dim() - 3)).to(x.dtype)
