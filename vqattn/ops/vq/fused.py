"""The fused (Triton) impl of causal codebook attention (:mod:`vqattn.ops.triton.vq_causal`): every block's cache
from one chunked prefix kernel (:mod:`vqattn.ops.triton.block_caches`), then one kernel for the window and the
codes (:mod:`vqattn.ops.triton.window_codes`).

The cache of block b holds the keys of blocks ≤ b−2: its counts n_b = n_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ1 and value sums
C_b = C_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ V_{b'}. One backward walks the blocks in reverse with the caches' gradients,
carrying them to the values, the soft weights and the initial cache. Soft keys given unformed (a
:class:`~.assign.SoftMixture`, what a first call assigns itself and what a layer's codebook hands a GPU call) take
:mod:`vqattn.ops.triton.soft_caches` instead: their weights recomputed in the kernels, none in memory. The soft
mixture window (``exact_window=False``) has no fused impl: it runs the chunk impl.
"""

from __future__ import annotations

import torch

from ..common.statistics import Assignment
from ..triton.soft_caches import soft_block_caches
from ..triton.vq_causal import fused_vq_causal
from ..triton.window_codes import fused_window_code_attention
from .assign import SoftMixture, temperature_tensor


def straight_through_keys(k: torch.Tensor, codebook: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """k̂_j = c_{z_j} + (k_j − sg(k_j)): the hard window's keys, whose gradient reaches both the code and the key.
    k (B, H, T, D), codebook (H, S, D), index (B, H, T) -> (B, H, T, D)."""
    B, H, T, D = k.shape
    codes = codebook.unsqueeze(0).expand(B, -1, -1, -1).gather(2, index.unsqueeze(-1).expand(B, H, T, D))
    return codes + (k - k.detach())


def _recomputed_soft(q, v, c, a: SoftMixture, *, L: int, scale: float, counts0, sums0, fold: int, window_k,
                     window_q, memory_bias, window_bad):
    """Soft keys whose weights are never formed: every block's cache from :func:`soft_block_caches`, then the
    window-code kernel reads them (an exact window: the mixture's own window has no fused impl)."""
    temperature = temperature_tensor(a.temperature, c.shape[0], a.codes.float())
    cache_n, cache_c, kept_counts, kept_sums = soft_block_caches(a.keys, a.codes, temperature, v, counts0, sums0,
                                                                 block_len=L, fold=fold)
    out = fused_window_code_attention(q if window_q is None else window_q, window_k, v, scale=scale, block_len=L,
                                      qc=q, codebook=c, counts=cache_n, sums=cache_c, code_bias=memory_bias,
                                      bad=window_bad)
    return out, kept_counts.to(counts0.dtype), kept_sums.to(sums0.dtype)


def fused_causal(q, k, v, c, a: Assignment | SoftMixture, *, L: int, scale: float, exact_window: bool, counts0, sums0,
                 fold_blocks: int, window_k, window_q=None, memory_bias=None, window_bad=None,
                 superblocks: int = 8):
    """The fused impl of :func:`~vqattn.ops.vq.chunk._causal`: q (B, H, T, Dc), c (H, S, Dc), window_k
    (B, H, T, D) the window's keys and window_q its queries (None: q); ``a`` the keys' Assignment (in float32 or
    float64), or a :class:`~.assign.SoftMixture` whose weights the kernels recompute; counts0 (B, H, S), sums0
    (B, H, S, Dv) the cache before position 0 (float32). q, k, v and the window's
    tensors may be half precision: the kernel accumulates in float32. ``memory_bias`` (nb,): the codes' logit bias
    per block (``memory_cap``), added to the block's code logits in the kernel, or None; ``window_bad`` (B, H, T) rows
    of window keys the kernels read as zeros (non-finite keys), or None; ``superblocks`` hard keys' caches every
    that many blocks (0: every block's). Returns out (B, H, T, Dv) and the cache after the first ``fold_blocks``
    blocks."""
    nb = -(-q.shape[2] // L)
    if isinstance(a, SoftMixture):
        return _recomputed_soft(q, v, c, a, L=L, scale=scale, counts0=counts0, sums0=sums0,
                                fold=min(fold_blocks, nb), window_k=window_k, window_q=window_q,
                                memory_bias=memory_bias, window_bad=window_bad)
    if not exact_window:  # hard: the window scores the keys' codes (straight-through to k)
        window_k = straight_through_keys(k, c.to(k.dtype), a.index)
    out, kept_counts, kept_sums = fused_vq_causal(
        q if window_q is None else window_q, window_k, v, q, c, a.index, a.weights,
        counts0, sums0, code_bias=memory_bias, scale=scale, block_len=L, fold=min(fold_blocks, nb), bad=window_bad,
        superblocks=superblocks)
    return out, kept_counts.to(counts0.dtype), kept_sums.to(sums0.dtype)
