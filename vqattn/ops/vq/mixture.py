"""Soft codebook attention in linear form: one exp of the code logits serves the window and the cache."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..common.cache import CacheUpdates, LogitGradients, code_logits_of, read_cache, read_cache_backward
from ..common.window_code_blocks import floored_exp_
from ..utils import autocast_off


class MixtureInputs(NamedTuple):
    """The inputs of :class:`MixtureAttention` on (N, nb, ...) tensors (N = batch·heads, nb blocks of L).

    queries (N, nb, L, D) scaled, codebook (N, S, D); weights (N, nb, L, S) the block's keys' assignment (rows sum
    to 1); window_mask (L, L) 0/1 causal; values (N, nb, L, Dv + 1) with a last column of ones; sums
    (N, S, Dv + 1) the cache before the first block (value sums and, last column, counts).
    """

    queries: torch.Tensor
    codebook: torch.Tensor
    weights: torch.Tensor
    window_mask: torch.Tensor
    values: torch.Tensor
    sums: torch.Tensor


class MixtureAttention(torch.autograd.Function):
    """Soft codebook attention of every block's queries in linear form (no log/exp round trip):

        P_is  = e^{code_logits_is − m_i}                                                  (N, nb, L, S)
        A_ij  = (P Wᵀ)_ij · window_mask_ij          window mixture Σ_s e^{σ q_i·c_s} Δ_js   (N, nb, L, L)
        Y     = A V + P C_b                          numerator and normaliser              (N, nb, L, Dv + 1)
        out_i = Y_i[:Dv] / Y_i[Dv]                                                         (N, nb, L, Dv)

    The window is the current block: a soft window logit is the cache's own formula, so the previous block is read
    through the cache. The values carry a last column of ones (linear attention's normaliser as one more value
    column), so the cache C_b (S, Dv + 1) holds the value sums Σ_j Δ_js v_j and, in its last column, the counts
    n_s = Σ_j Δ_js: the counts need no prefix sum of their own, and their gradient reaches the weights with the
    values'. C_{b+1} = C_b + W_bᵀ V_b (:func:`~vqattn.ops.common.cache.read_cache`).

    Query i's normaliser is Σ_s e^{σ q_i·c_s} N_is, with N_is = n_s + Σ_{j ≤ i} Δ_js the mass of code s among the
    keys it sees (:func:`_code_weights`): the shift m_i = max_s (σ q_i·c_s + log N_is) is the largest term actually
    summed, so the normaliser is ≥ 1 at any logit magnitude. (The best code logit alone is not: a query's best codes
    may hold almost none of its keys' mass.) Returns out and the last cache
    (N, S, Dv + 1). ``loop``: the :class:`~vqattn.ops.blocks.Schedule` of the cache reads.
    """

    @staticmethod
    @autocast_off
    def forward(ctx, loop: bool, *args):
        x = MixtureInputs(*args)
        p = _code_weights(code_logits_of(x.queries, x.codebook), x.weights, x.sums[..., -1], x.window_mask)
        num, last, _ = read_cache(p, x.sums, CacheUpdates(x.values, None, x.weights), loop)
        a = torch.matmul(p, x.weights.transpose(-1, -2)).mul_(x.window_mask)  # (N, nb, L, L)
        total = torch.matmul(a, x.values).add_(num)  # (N, nb, L, Dv + 1)
        den = total[..., -1:]
        out = total[..., :-1] / den
        ctx.save_for_backward(*x, p, a, out, den, last)
        ctx.loop = loop
        return out, last

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out, grad_last):
        *inputs, p, a, out, den, last = ctx.saved_tensors
        x = MixtureInputs(*inputs)
        need = MixtureInputs(*ctx.needs_input_grad[1:])
        # dY = [dout / den, −δ] with δ = Σ_d (dout / den)_d out_d: the normaliser's gradient
        grad_num = grad_out / den
        grad_total = torch.cat([grad_num, (grad_num * out).sum(-1, keepdim=True).neg_()], -1)
        grad_a = torch.matmul(grad_total, x.values.transpose(-1, -2)).mul_(x.window_mask)  # (N, nb, L, L)
        grad_weights = torch.matmul(grad_a.transpose(-1, -2), p) if need.weights else None
        grad_values = torch.matmul(a.transpose(-1, -2), grad_total) if need.values else None
        # through exp (the max shift m cancels in out): p ⊙ (dY·C_bᵀ + dA·W)
        logit_grads = LogitGradients(x.queries, x.codebook, need_q=need.queries, need_codebook=need.codebook)
        # the cache's updates are the block's own values and weights: their gradients add up with the window's
        cache = read_cache_backward(
            p, grad_total, x.sums, last, grad_last, CacheUpdates(x.values, None, x.weights),
            need.values or need.weights, lambda b, dp: dp.add_(grad_a[:, b] @ x.weights[:, b]), logit_grads,
            ctx.loop, grad_values, grad_weights)
        grads = MixtureInputs(queries=logit_grads.dq, codebook=logit_grads.dc, weights=cache.weights,
                              window_mask=None, values=cache.values, sums=cache.sums)
        return (None, *grads)


def _code_weights(code_logits: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                  window_mask: torch.Tensor) -> torch.Tensor:
    """P_is = e^{code_logits_is − m_i} (N, nb, L, S), formed in place of the logits, with m_i = max_s
    (code_logits_is + log N_is) over the codes' masses N_is = counts_s + Σ_{j ≤ i} Δ_js seen by query i (counts
    (N, S) before the first block, weights Δ (N, nb, L, S), window_mask (L, L) the causal 0/1 mask). Computed as
    e^{code_logits + log N − m} / N, whose exponent is ≤ 0 (e^{code_logits − m} alone overflows where N
    underflows); codes below e^{−50} of the largest term (:func:`~vqattn.ops.common.window_code_blocks.floored_exp_`) and
    codes of no mass weigh 0."""
    # Prefix sums within each block as a product with the causal mask: 3x faster than a cumsum over L on CPUs.
    mass = torch.matmul(window_mask, weights)  # (N, nb, L, S)
    # Each block adds the mass of the cache and of the blocks before it, summed forwards (no cancellation).
    before = torch.cumsum(torch.cat([counts.unsqueeze(1), mass[:, :-1, -1]], 1), 1)  # (N, nb, S)
    mass.add_(before.unsqueeze(2))
    terms = code_logits.add_(mass.log())  # log 0 = −inf: a code of no mass drops out (no autograd here)
    m = terms.amax(-1, keepdim=True)
    # a query that sees no mass at all (zeroed rows of non-finite keys, no cache) has no finite term
    m = torch.where(m.isfinite(), m, 0.0)
    return floored_exp_(terms.sub_(m)).div_(mass.clamp_min_(torch.finfo(mass.dtype).tiny))


def mixture_attention(q, codebook, weights, values, counts, sums, loop: bool):
    """:class:`MixtureAttention` on (B, H, nb, ...) tensors (flattened to B·H): q (B, H, nb, L, D) scaled,
    codebook (H, S, D), weights (B, H, nb, L, S), values (B, H, nb, L, Dv + 1) with their ones column; the cache
    before the first block as ``counts`` (B, H, S) and ``sums`` (B, H, S, Dv). Returns out (B, H, nb·L, Dv) and
    the counts (B, H, S) and sums (B, H, S, Dv) after the last block."""
    B, H, _, L, _ = values.shape
    flat = lambda x: x.reshape(B * H, *x.shape[2:])  # noqa: E731
    cache = torch.cat([sums, counts.unsqueeze(-1)], -1)  # (B, H, S, Dv + 1)
    mask = torch.ones(L, L, device=q.device, dtype=q.dtype).tril_()
    out, last = MixtureAttention.apply(loop, *MixtureInputs(flat(q), flat(codebook.expand(B, *codebook.shape)),
                                                            flat(weights), mask, flat(values), flat(cache)))
    last = last.view(B, H, *last.shape[1:])
    return out.view(B, H, -1, out.shape[-1]), last[..., -1], last[..., :-1]
