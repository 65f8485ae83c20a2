"""The fused causal vq step. Hard keys run with superblock caches (:mod:`.superblock`, a cache every
``superblocks`` blocks, the keys in between read through their codes); soft keys, and hard ones with
``superblocks=0``, run the per-block design below, one autograd Function: the prefix walk (:mod:`.block_caches`)
writes every block's cache and the window-code kernel (:mod:`.window_codes`) reads it.

Its backward needs every block's cache gradient, for a tile of codes

    dC_b = w_nᵀ dO_b        dn_b = −w_nᵀ Δ_b        w_n = exp2(σ qc·c + β_b − lse)   (the codes' probability per count)

which the code backward writes for every block, (B·H, nb, S, Dv) in the sums' dtype (1 GB at 8192 tokens, bf16,
B·H = 128, S = 512), and the reverse cache walk reads; the walk adds its value gradients to the window's (in place
for hard keys) instead of a separate sum.
"""

from __future__ import annotations

import dataclasses

import torch

from .block_caches import prefix_forward, reverse_walk
from .superblock import superblock_vq_causal
from .utils import unit_last
from .window_codes import TENSORS, code_backward, codebook_gradient, output_delta, window_backward, window_code_forward

# the prefix's tensors that the backward reads beside the window-code forward's
PREFIX_TENSORS = ("idx", "wts", "v", "cache_n", "cache_c")


class VQCausal(torch.autograd.Function):
    """See :func:`fused_vq_causal`."""

    @staticmethod
    def forward(ctx, qw, kw, v, qc, codebook, index, weights, counts0, sums0, code_bias, scale: float, L: int,
                fold: int, bad):
        p = prefix_forward(index, weights, v, counts0, sums0, block_len=L, fold=fold)
        f = window_code_forward(qw, kw, v, qc, codebook, p.cache_n, p.cache_c, code_bias, scale, L, bad=bad)
        if p.hard and not ctx.needs_input_grad[7]:  # counts of one-hot rows: no gradient reaches anything
            ctx.mark_non_differentiable(p.fold_n)
        ctx.save_for_backward(*(getattr(f, name) for name in TENSORS), *(getattr(p, name) for name in PREFIX_TENSORS))
        ctx.forward = dataclasses.replace(f, **dict.fromkeys(TENSORS))  # the tensors are saved, not held
        ctx.prefix = dataclasses.replace(p, **dict.fromkeys(PREFIX_TENSORS))
        ctx.dtypes = (None if p.hard else weights.dtype, counts0.dtype, sums0.dtype)
        return f.out, p.fold_n, p.fold_c

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, d_fold_n, d_fold_c):
        saved = ctx.saved_tensors
        f = dataclasses.replace(ctx.forward, **dict(zip(TENSORS, saved[:len(TENSORS)])))
        p = dataclasses.replace(ctx.prefix, **dict(zip(PREFIX_TENSORS, saved[len(TENSORS):])))
        grad_out = unit_last(grad_out)
        delta = output_delta(f, grad_out)
        dqw, dkw, dv = window_backward(f, grad_out, delta)
        counts_grad = not p.hard or ctx.needs_input_grad[7]  # soft weights' gradient holds the counts'
        dqc, dcb, dcnt, dsum = code_backward(f, grad_out, delta, codebook_grad=ctx.needs_input_grad[4],
                                             counts_grad=counts_grad)
        d_values, d_weights, d_n0, d_c0 = reverse_walk(p, d_fold_n, d_fold_c, d_cache_n=dcnt, d_cache_c=dsum,
                                                       d_values=dv)
        w_dtype, n_dtype, c_dtype = ctx.dtypes
        return (dqw, dkw, d_values, dqc[..., :f.code_dims], codebook_gradient(f, dcb), None,
                None if p.hard else d_weights.to(w_dtype), d_n0.to(n_dtype), d_c0.to(c_dtype), None, None, None, None,
                None)


@torch.compiler.disable  # a graph break: torch.compile runs the kernels as they are
def fused_vq_causal(qw, kw, v, qc, codebook, index, weights, counts0, sums0, *, code_bias, scale: float,
                    block_len: int, fold: int, bad=None, superblocks: int = 8):
    """Causal codebook attention of every query block over its window and the cache of the blocks before it.

    qw, kw (B, H, T, D) the window's queries and keys, v (B, H, T, Dv), qc (B, H, T, Dc) the code queries, codebook
    (H, S, Dc); index (B, H, T) long (hard) or weights (B, H, T, S) (soft; the other None); counts0 (B, H, S),
    sums0 (B, H, S, Dv) the cache before position 0; code_bias (nb,) the code logits' bias per query block or
    None; bad (B, H, T) bool the rows of kw read as zeros (non-finite keys; their gradient is 0), or None. Returns
    out (B, H, T, Dv) in the inputs' dtype and the state (B, H, S), (B, H, S, Dv) float32 after the first ``fold``
    blocks; differentiable in every tensor but index, code_bias and bad. ``superblocks``: hard keys' caches every
    that many blocks, or 0: every block's (:class:`~vqattn.ops.blocks.Schedule`).
    """
    if index is not None and superblocks > 0:
        return superblock_vq_causal(qw, kw, v, qc, codebook, index, counts0, sums0, code_bias=code_bias, scale=scale,
                                    block_len=block_len, fold=fold, superblock=superblocks, bad=bad)
    return VQCausal.apply(qw, kw, v, qc, codebook, index, weights, counts0, sums0, code_bias, scale, block_len, fold,
                          bad)
