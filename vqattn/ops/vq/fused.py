"""The fused (Triton) form of causal codebook attention: every block's cache from one per-block prefix, then one
kernel for the window and the codes (:mod:`vqattn.ops.triton.window_codes`).

The cache of block b holds the keys of blocks ≤ b−2: its counts n_b = n_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ1 and value sums
C_b = C_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ V_{b'}, formed for all blocks at once from the per-block statistics (a scatter-add
for hard assignments, a product for soft ones) and one cumulative sum, all differentiable, so autograd carries the
kernel's cache gradients back to the values and the soft weights. The soft mixture window (``exact_window=False``)
has no fused form: it runs the chunk form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..blocks import pad_to_blocks
from ..common.memory_cap import weigh_memory
from ..common.statistics import Assignment, code_statistics, map_time
from ..triton.window_codes import fused_window_code_attention


def lagged_prefix(stats: torch.Tensor) -> torch.Tensor:
    """Σ_{b' ≤ b−2} stats_{b'} for every block b: (B, H, nb, ...) -> (B, H, nb, ...)."""
    nb = stats.shape[2]
    pad = (0, 0) * (stats.dim() - 3) + (2, 0)
    return F.pad(stats.cumsum(2), pad)[:, :, :nb]


def straight_through_keys(k: torch.Tensor, codebook: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """k̂_j = c_{z_j} + (k_j − sg(k_j)): the hard window's keys, whose gradient reaches both the code and the key.
    k (B, H, T, D), codebook (H, S, D), index (B, H, T) -> (B, H, T, D)."""
    B, H, T, D = k.shape
    codes = codebook.unsqueeze(0).expand(B, -1, -1, -1).gather(2, index.unsqueeze(-1).expand(B, H, T, D))
    return codes + (k - k.detach())


def fused_causal(q, k, v, c, a: Assignment, *, L: int, scale: float, exact_window: bool, counts0, sums0,
                 fold_blocks: int, window_k, window_q=None, memory_bias=None):
    """The fused form of :func:`~vqattn.ops.vq.chunk._causal`: q (B, H, T, Dc), c (H, S, Dc), window_k
    (B, H, T, D) the window's keys and window_q its queries (None: q); ``a`` the keys' Assignment (in float32 or
    float64); counts0 (B, H, S), sums0 (B, H, S, Dv) the cache before position 0 (float32). q, k, v and the window's
    tensors may be half precision: the kernel accumulates in float32. ``memory_bias`` (nb,): the codes' logit bias
    per block (``memory_cap``), applied as a factor e^bias on the block's cache counts and sums, or None. Returns out
    (B, H, T, Dv) and the cache after the first ``fold_blocks`` blocks."""
    T, S = q.shape[2], c.shape[1]
    nb = -(-T // L)
    stats_dtype = counts0.dtype
    # Keys after T (padding) enter only the caches of blocks ≥ nb + 1, which no query reads.
    padded = map_time(lambda x: pad_to_blocks(x, L), a)
    counts, sums = code_statistics(padded, pad_to_blocks(v.to(stats_dtype), L), S, nb)  # (B, H, nb, S[, Dv])
    if not exact_window:  # hard: the window scores the keys' codes (straight-through to k)
        window_k = straight_through_keys(k, c.to(k.dtype), a.index)
    cache_counts, cache_sums = counts0.unsqueeze(2) + lagged_prefix(counts), sums0.unsqueeze(2) + lagged_prefix(sums)
    if memory_bias is not None:
        cache_counts, cache_sums = weigh_memory(cache_counts, cache_sums, memory_bias.exp())
    out = fused_window_code_attention(
        q if window_q is None else window_q, window_k, v, scale=scale, block_len=L, qc=q, codebook=c,
        counts=cache_counts, sums=cache_sums)
    fold = min(fold_blocks, nb)
    return out, counts0 + counts[:, :, :fold].sum(2), sums0 + sums[:, :, :fold].sum(2)
