"""The block kernel: every block's queries attend, with one softmax, to their window (blocks b−1 and b) and to the
codes (the compressed cache of blocks ≤ b−2). Window attention runs the same kernel without codes."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..utils import autocast_off
from .cache import CacheUpdates, LogitGradients, code_logits_of, read_cache, read_cache_backward

# Floor of the exp arguments (all ≤ 0 after the max shift). On x86 CPUs (measured with AVX-512) exp is about 100×
# slower for arguments below −87.3, where float32 underflows, and 13× for −inf (empty codes, masked keys), and any
# arithmetic on subnormal results (below 1.2e−38) is 30× slower: the weights' products with gradients must stay
# normal. Terms below e^{−50} weigh < S·e^{−50} ≈ 1e−19 of the normaliser at S = 512, below float64 rounding.
EXP_FLOOR = -50.0


def floored_exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x ≤ 0, in place, with every term below 2·e^{−50} set to exactly 0 (−inf included) and never the
    slow underflow path of exp; masked keys and empty codes weigh exactly 0 (see :data:`EXP_FLOOR`)."""
    return F.threshold_(x.clamp_min_(EXP_FLOOR).exp_(), 2 * math.exp(EXP_FLOOR), 0.0)


def floored_exp(x: torch.Tensor) -> torch.Tensor:
    """:func:`floored_exp_` out of place, for autograd and the compiler: exp(x) for x ≤ 0, exactly 0 for terms below
    2·e^{−50}, whose gradient is then 0 too; the exp never meets an argument below :data:`EXP_FLOOR` (−inf included),
    in eager kernels or in the code inductor generates."""
    return F.threshold(x.clamp_min(EXP_FLOOR).exp(), 2 * math.exp(EXP_FLOOR), 0.0)


class WindowCodeInputs(NamedTuple):
    """The inputs of :class:`WindowCodeAttention`, on (N, nb, ...) tensors (N = batch·heads, nb blocks of L).

    queries: (N, nb, L, Dc) scaled queries of the code logits q·cᵀ (and of the window logits, Dc = D, unless
        ``window_queries`` is given); window_keys (N, nb, 2L, D), window_bias broadcastable to (N, nb, L, 2L),
        window_values (N, nb, 2L, Dv).
    Codes (all None for window-only attention): counts (N, nb, S) every block's cache counts; sums (N, S, Dv) the
        value sums of block 0's cache; add_values (N, nb, L, Dv) with add_index (N, nb, L) or add_weights
        (N, nb, L, S) every block's statistics, which enter the cache after the block that follows it
        (:class:`CacheUpdates`), and pending (N, S, Dv) the statistics of the block before block 0, which enter
        after block 0; codebook (N, S, Dc), or (N, nb, S, Dc) one per block.
    window_codes (N, nb, 2L): the code z_j of every window key (hard VQ): the window logits are then the code
        logits q·c_{z_j}, gathered instead of multiplied, with the straight-through gradient to window_keys.
    window_queries (N, nb, L, D): other queries for the window logits (RoPE: rotated queries and keys score the
        window, the unrotated queries score the position-free codes).
    code_bias (nb, 1, 1): a bias on every block's code logits, log min(1, M / n_b) (:mod:`.memory_cap`), or None.
    """

    queries: torch.Tensor
    window_keys: torch.Tensor
    window_bias: torch.Tensor
    window_values: torch.Tensor
    counts: torch.Tensor | None = None
    sums: torch.Tensor | None = None
    add_values: torch.Tensor | None = None
    add_index: torch.Tensor | None = None
    add_weights: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    window_codes: torch.Tensor | None = None
    window_queries: torch.Tensor | None = None
    code_bias: torch.Tensor | None = None


class WindowCodeAttention(torch.autograd.Function):
    """Softmax attention of every block's queries over two key groups, with one shared max:

        window  logits  qw·wkᵀ + window_bias        (N, nb, L, 2L)   values  wv            (N, nb, 2L, Dv)
        codes   logits  q·cᵀ + log n_b + bias_b     (N, nb, L, S)    values  C_b / n_b     (N, S, Dv) per block

    (:class:`WindowCodeInputs`; qw = window_queries or queries). Hand-written forward and backward
    (flash-attention style: dS = P ⊙ (dP − rowsum(dO ⊙ O))): the two groups are never concatenated and only the
    probabilities are kept for the backward pass. The code means are never formed: the code probabilities are
    divided by the counts instead. Returns out (N, nb, L, Dv), the cache after the last block and the last block's
    statistics (the next group's ``pending``), both (N, S, Dv), or None without codes. ``loop``: the
    :class:`~vqattn.ops.blocks.Schedule` of the cache reads.
    """

    @staticmethod
    @autocast_off
    def forward(ctx, loop: bool, *args):
        x = WindowCodeInputs(*args)
        N, nb, W, _ = x.window_values.shape
        L = x.window_bias.shape[-2]
        window_queries = x.queries if x.window_queries is None else x.window_queries
        code_logits = None if x.codebook is None else code_logits_of(x.queries, x.codebook)
        window_codes = None
        if x.window_codes is not None:
            window_codes = x.window_codes.unsqueeze(2).expand(N, nb, L, W)
            p_window = code_logits.gather(-1, window_codes).add_(x.window_bias)  # (N, nb, L, 2L)
        else:
            p_window = torch.matmul(window_queries, x.window_keys.transpose(-1, -2)).add_(x.window_bias)
        m = p_window.amax(-1, keepdim=True)  # finite: the diagonal is always visible
        p_codes = last = pending = None
        if code_logits is not None:
            p_codes, num, last, pending, z_codes = _read_codes(x, code_logits, m, loop)
        floored_exp_(p_window.sub_(m))
        z = p_window.sum(-1, keepdim=True)  # (N, nb, L, 1)
        # p_* stay unnormalised: dividing the (L, Dv) output is cheaper than the (L, 2L + S) probabilities.
        out = torch.matmul(p_window, x.window_values)
        if p_codes is not None:
            z.add_(z_codes)
            out.add_(num)
        out.div_(z)
        # With window codes the keys are not needed: their gradient ds_windowᵀ·qb does not read them.
        keys = x.window_keys if window_codes is None else None
        ctx.save_for_backward(x.queries, keys, x.window_values, x.counts, p_window, p_codes, out, z, window_codes,
                              x.codebook, x.sums, last, x.add_values, x.add_index, x.add_weights, x.pending,
                              x.window_queries)
        ctx.window_bias_shape, ctx.loop = x.window_bias.shape, loop
        return out, last, pending

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out, grad_last, grad_pending):
        (queries, keys, values, counts, p_window, p_codes, out, z, window_codes, codebook, sums, last, add_values,
         add_index, add_weights, pending, window_queries) = ctx.saved_tensors
        need = WindowCodeInputs(*ctx.needs_input_grad[1:])
        grads = {}
        grad_out = grad_out / z  # with P = p / z, every P-term below becomes a p-term of this scaled gradient
        delta = (grad_out * out).sum(-1, keepdim=True)  # (N, nb, L, 1)
        ds_window = torch.matmul(grad_out, values.transpose(-1, -2)).sub_(delta).mul_(p_window)  # (N, nb, L, 2L)
        qw = queries if window_queries is None else window_queries
        if need.window_keys:
            grads["window_keys"] = torch.matmul(ds_window.transpose(-1, -2), qw)
        if need.window_bias:
            grads["window_bias"] = _sum_to_shape(ds_window, ctx.window_bias_shape)
        if need.window_values:
            grads["window_values"] = torch.matmul(p_window.transpose(-1, -2), grad_out)
        if p_codes is not None:
            grads.update(_codes_backward(ctx, need, grad_out, (grad_last, grad_pending), delta, ds_window, p_codes,
                                         counts, queries, codebook, (sums, last, pending),
                                         CacheUpdates(add_values, add_index, add_weights), window_codes))
        if window_codes is None and (need.window_queries or need.queries):
            dq_window = torch.matmul(ds_window, keys)
            if window_queries is not None:
                grads["window_queries"] = dq_window
            else:
                grads["queries"] = dq_window if grads.get("queries") is None else grads["queries"].add_(dq_window)
        return (None, *WindowCodeInputs(**{f: grads.get(f) for f in WindowCodeInputs._fields}))


def _read_codes(x: WindowCodeInputs, code_logits, m, loop: bool):
    """The codes' unnormalised probabilities e^{q·c + log n − m} / n = e^{q·c − m} (m raised to the codes' max,
    in place; 0 for empty codes), formed in place of ``code_logits`` for every block at once, the numerators
    p_b·C_b, the last cache, the last block's statistics and the codes' share of the row sums."""
    tiny = torch.finfo(x.counts.dtype).tiny
    log_n = torch.where(x.counts > 0, x.counts.clamp_min(tiny).log(), float("-inf"))  # log 0 = −inf
    p = code_logits.add_(log_n.unsqueeze(-2))  # (N, nb, L, S)
    if x.code_bias is not None:  # a constant of the positions: the saved p carries it into every gradient
        p.add_(x.code_bias)
    torch.maximum(m, p.amax(-1, keepdim=True), out=m)
    floored_exp_(p.sub_(m))
    z_codes = p.sum(-1, keepdim=True)
    p.div_(x.counts.clamp_min(tiny).unsqueeze(-2))  # empty codes: 0 / tiny
    updates = CacheUpdates(x.add_values, x.add_index, x.add_weights)
    num, last, pending = read_cache(p, x.sums, updates, loop, x.pending)
    return p, num, last, pending, z_codes


def _codes_backward(ctx, need, grad_out, grad_caches, delta, ds_window, p_codes, counts, queries, codebook, caches,
                    updates: CacheUpdates, window_codes) -> dict:
    """Gradients through the codes: of the queries and the codebook (through the code logits, and the gathered
    window logits), the counts, the first cache, the updates and the pending statistics. ``caches``: the first and
    last caches and the pending statistics; ``grad_caches``: the gradients of the last cache and of the last
    block's statistics."""
    (sums, last, pending), (grad_last, grad_pending) = caches, grad_caches
    # With window codes, q's window gradient goes through the code logits (scattered at z_j).
    logit_grads = LogitGradients(queries, codebook, need_q=need.queries, need_codebook=need.codebook,
                                 window_codes=window_codes, ds_window=ds_window)
    # (dO·mean_s − δ) p_s = (dO·C_s − δ n_s) p_s / n_s (p_codes is divided by the counts)
    cache = read_cache_backward(
        p_codes, grad_out, sums, last, grad_last, updates, need.add_values or need.add_weights,
        lambda b, dp: dp.addcmul_(delta[:, b], counts[:, b].unsqueeze(-2), value=-1), logit_grads, ctx.loop,
        pending=pending, grad_pending=grad_pending)
    grads = dict(queries=logit_grads.dq, codebook=logit_grads.dc, sums=cache.sums, add_values=cache.values,
                 add_weights=cache.weights, pending=cache.pending)
    if need.counts:
        # The output depends on n only through the row sums Σ_s e^{q·c_s} n_s (the numerators e^{q·c_s} C_s hold
        # no n): d/dn_s = −Σ_i δ_i e^{q_i·c_s} / z_i, where δ_i = dO_i·out_i.
        # (δᵀ p) rather than (pᵀ δ): a row vector times p reads p row by row; pᵀ times a column strided it, 8× slower
        grads["counts"] = torch.matmul(delta.transpose(-1, -2), p_codes).squeeze(-2).neg_()
    return grads


def _sum_to_shape(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    lead = x.dim() - len(shape)
    dims = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and x.shape[i + lead] != 1)
    return x.sum(dims, keepdim=True).view(shape) if dims else x


def window_code_attention(inputs: WindowCodeInputs, loop: bool):
    """:class:`WindowCodeAttention` on (B, H, nb, ...) tensors, flattened to B·H for the kernel; codebook (H, S, D)
    and window_bias (nb, L, 2L) are broadcast (a codebook (B, H, nb, S, D) gives every block its own codes).
    Returns out (B, H, nb·L, Dv), the cache after the last block and the last block's statistics (B, H, S, Dv), or
    None and None without codes."""
    B, H, nb, W, Dv = inputs.window_values.shape
    flat = {f: None if x is None else x.reshape(B * H, *x.shape[2:])
            for f, x in inputs._asdict().items() if f not in ("window_bias", "codebook", "code_bias")}
    codebook = inputs.codebook
    if codebook is not None:  # (H, S, D) shared by the batch, or (B, H, nb, S, D) per sequence and block
        codebook = codebook.flatten(0, 1) if codebook.dim() == 5 else codebook.expand(B, *codebook.shape).flatten(0, 1)
    x = WindowCodeInputs(**flat, window_bias=inputs.window_bias, codebook=codebook, code_bias=inputs.code_bias)
    out, last, pending = WindowCodeAttention.apply(loop, *x)
    unflat = lambda t: None if t is None else t.view(B, H, *t.shape[1:])  # noqa: E731
    return out.view(B, H, -1, Dv), unflat(last), unflat(pending)
