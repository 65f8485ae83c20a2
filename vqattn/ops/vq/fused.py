"""The fused (Triton) impl of causal codebook attention: :func:`fused_forward`, beside :mod:`.chunk`'s
``chunk_forward`` (the same block algorithm in PyTorch) and :mod:`.recurrent`'s ``recurrent_forward``.

The cache of block b holds the keys of blocks ≤ b−2: its counts n_b = n_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ1 and value sums
C_b = C_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ V_{b'}. Three kernel routes, chosen by the keys:

* hard keys (the default): superblock caches, a cache every ``superblocks`` blocks and the keys in between read
  through their codes (:mod:`vqattn.ops.triton.superblock`, one autograd Function);
* hard keys with ``superblocks=0``, and formed soft weights: :class:`VQCausal`, the prefix walk
  (:mod:`vqattn.ops.triton.block_caches`) writing every block's cache and the window-code kernel
  (:mod:`vqattn.ops.triton.window_codes`) reading it. Its backward needs every block's cache gradient, for a tile of
  codes

      dC_b = w_nᵀ dO_b        dn_b = −w_nᵀ Δ_b        w_n = exp2(σ qc·c + β_b − lse)   (the codes' probability per count)

  which the code backward writes for every block, (B·H, nb, S, Dv) in the sums' dtype (1 GB at 8192 tokens, bf16,
  B·H = 128, S = 512), and the reverse cache walk reads; the walk adds its value gradients to the window's (in place
  for hard keys);
* soft keys given unformed (a :class:`~.assign.SoftMixture`, what a first call assigns itself and what a layer's
  codebook hands a GPU call): their weights recomputed in the kernels, none in memory
  (:mod:`vqattn.ops.triton.soft`), then the window-code kernel.

The soft mixture window (``exact_window=False``) has no fused impl: it runs the chunk impl.
"""

from __future__ import annotations

import dataclasses

import torch

from ..blocks import time_range
from ..common.memory_cap import block_memory_bias
from ..triton.block_caches import prefix_forward, reverse_walk
from ..triton.soft import soft_block_caches
from ..triton.superblock import superblock_vq_causal
from ..triton.utils import unit_last
from ..triton.window_codes import (
    TENSORS,
    code_backward,
    codebook_gradient,
    fused_window_code_attention,
    output_delta,
    window_backward,
    window_code_forward,
)
from ..utils import replaced
from .assign import SoftMixture, straight_through_keys, temperature_tensor
from .state import Inputs, VQState, continued, state_after

# the prefix's tensors that the backward reads beside the window-code forward's
PREFIX_TENSORS = ("idx", "wts", "v", "cache_n", "cache_c")


def fused_forward(x: Inputs, state: VQState | None, *, return_state: bool):
    """:func:`~.chunk.chunk_forward` by the kernels: x (:class:`~.state.Inputs`) of exact or hard windows, new
    tokens that may continue ``state``. q, k, v and the window's tensors may be half precision: the kernels
    accumulate in float32. Returns (out, state or None)."""
    T = x.q.shape[2]
    c = continued(x, state)
    a = c.x.assignment
    if a is None:  # soft keys stay unformed: the kernels recompute their weights (no (T, S) tensor)
        a = SoftMixture(c.x.k, c.x.codebook, c.x.temperature) if c.x.assign == "soft" else c.x.assign_keys(c.x.k)
    c = replaced(c, x=replaced(c.x, assignment=a))
    out, counts, sums = _kernels(c, fold_blocks=c.keep // c.x.block_len if return_state else 0)
    out = time_range(out, out.shape[2] - T, out.shape[2])
    return out, state_after(c, counts, sums) if return_state else None


def _kernels(c, *, fold_blocks: int):
    """Every block of ``c.x`` (the window's bad rows read as zeros; no bad assignment rows: the soft mixture
    window, the only kernel that would leak them, runs the chunk impl). Returns out (B, H, T, Dv) and the cache after
    the first ``fold_blocks`` blocks."""
    x, L = c.x, c.x.block_len
    nb = -(-x.q.shape[2] // L)
    counts0, sums0 = c.counts0, c.sums0
    memory_bias = block_memory_bias(c.start // L, nb, L, x.memory_cap, device=x.q.device, dtype=counts0.dtype)
    window_q = x.q if x.q_rot is None else x.q_rot
    fold = min(fold_blocks, nb)
    a = x.assignment
    if isinstance(a, SoftMixture):
        temperature = temperature_tensor(a.temperature, x.codebook.shape[0], a.codes.float())
        cache_n, cache_c, kept_counts, kept_sums = soft_block_caches(a.keys, a.codes, temperature, x.v, counts0, sums0,
                                                                     block_len=L, fold=fold)
        out = fused_window_code_attention(window_q, x.window_k, x.v, scale=x.scale, block_len=L, qc=x.q,
                                          codebook=x.codebook, counts=cache_n, sums=cache_c, code_bias=memory_bias,
                                          bad=x.window_bad)
    else:
        # hard keys' window scores the keys' codes, straight-through to k, unless it is exact
        window_k = x.window_k if x.exact_window else straight_through_keys(x.k, x.codebook.to(x.k.dtype), a.index)
        out, kept_counts, kept_sums = _assigned_kernels(
            window_q, window_k, x.v, x.q, x.codebook, a.index, a.weights, counts0, sums0, code_bias=memory_bias,
            scale=x.scale, block_len=L, fold=fold, bad=x.window_bad, superblocks=x.schedule.superblocks)
    return out, kept_counts.to(counts0.dtype), kept_sums.to(sums0.dtype)


class VQCausal(torch.autograd.Function):
    """Every block's cache (the prefix walk), then the window-code kernel; see :func:`_assigned_kernels`."""

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
def _assigned_kernels(qw, kw, v, qc, codebook, index, weights, counts0, sums0, *, code_bias, scale: float,
                      block_len: int, fold: int, bad=None, superblocks: int = 8):
    """Causal codebook attention of every query block over its window and the cache of the blocks before it, for
    assigned keys.

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
