"""The segmented block form of causal codebook attention: a packed row of sequences in one traced computation.

The inputs come in a :class:`~vqattn.ops.common.segments.BlockLayout` (every sequence starts at a block boundary),
so block b of a sequence attends, as in :mod:`.chunk`, to its window and to the codes, whose counts n_s and value
sums Σ_j Δ_js v_j are those of its own sequence's blocks ≤ b − 2 (≤ b − 1 for the soft mixture window), summed by
:func:`~vqattn.ops.common.segments.segment_sums`. Every block at once, in plain PyTorch with autograd's gradients:
no loop over sequences or blocks, no host read, one graph for any documents. It keeps every block's (S, Dv) cache,
n·S·Dv numbers per batch·head, where the chunk impl runs one cache through its blocks.
"""

from __future__ import annotations

import torch

from ..blocks import blocks
from ..common import segments
from ..common.segments import (
    BlockLayout,
    memory_bias,
    segment_cache_read,
    segment_prefix,
    segment_sums,
    window_blocks,
    window_mask,
    window_softmax,
)
from ..common.statistics import code_counts, code_statistics, log_counts
from ..common.window_code_blocks import floored_exp
from ..nonfinite import zero_assignment_rows
from .state import Inputs


def _window_keys(x: Inputs, index: torch.Tensor | None) -> torch.Tensor:
    """The keys the window scores: the raw keys (``exact_window``; k_rot under RoPE), else the hard code keys
    k̂_j = c_{z_j} + (k_j − sg(k_j)) (straight-through)."""
    if x.exact_window:
        return x.window_k
    H = x.codebook.shape[0]
    codes = x.codebook[torch.arange(H, device=index.device).view(1, H, 1), index.clamp_min(0)]
    return codes + (x.k - x.k.detach())


def _cache_reads(x: Inputs, a, first: torch.Tensor, L: int, lag: int):
    """read(p) = p_b · C_b for every block (p (B, H, n, L, S), C_b the value sums of the blocks first_b … b − lag of
    b's sequence), and (B, H, n, S) the counts of those blocks. On a CPU one walk with a running cache
    (:func:`~vqattn.ops.common.segments.segment_cache_read`); elsewhere every block's cache at once."""
    B, H, T, Dv = x.v.shape
    n, S = T // L, x.codebook.shape[1]
    if segments.cache_walk_runs(first):
        counts = segment_sums(code_counts(a, S, n, dtype=x.v.dtype), first, lag)
        flat = lambda t: None if t is None else t.reshape(B * H, n, L, *t.shape[3:])  # noqa: E731
        values, index, weights = flat(x.v), flat(a.index), flat(a.weights)
        return (lambda p: segment_cache_read(p.flatten(0, 1), values, index, weights, first, lag).view(B, H, n, L, Dv)), \
            counts
    counts, sums = (segment_sums(t, first, lag) for t in code_statistics(a, x.v, S, n))  # (B, H, n, S), (…, Dv)
    return (lambda p: p @ sums), counts


def _mixture(x: Inputs, weights: torch.Tensor, code_logits, read, counts, L: int) -> torch.Tensor:
    """The soft mixture window: query i weighs key j ≤ i of its block by Σ_s e^{σ q_i·c_s} Δ_js, and the codes of
    its sequence's earlier blocks by e^{σ q_i·c_s} n_s (value the mean), in one normalisation."""
    e = floored_exp(code_logits - code_logits.amax(-1, keepdim=True).detach())  # (B, H, n, L, S), ≤ 1
    pair = e @ blocks(weights, L).transpose(-1, -2)  # (B, H, n, L, L)
    pair = pair.masked_fill(torch.ones(L, L, dtype=torch.bool, device=pair.device).triu(1), 0)
    num = pair @ blocks(x.v, L) + read(e)
    den = pair.sum(-1, keepdim=True) + e @ counts.unsqueeze(-1)
    return num / den


def segmented_forward(x: Inputs, layout: BlockLayout) -> torch.Tensor:
    """Causal codebook attention of x (:class:`~.state.Inputs`, tensors (B, H, T', ·) in ``layout``, no state)
    -> out (B, H, T', Dv), NaN exactly for the queries that see a non-finite key of their own sequence."""
    L = layout.block_len
    B, H, T, _ = x.q.shape
    a = x.assignment if x.assignment is not None else x.assign_keys(x.k)
    kept = zero_assignment_rows(a, x.bad)
    first = layout.first_blocks()
    mixture = x.assign == "soft" and not x.exact_window
    read, counts = _cache_reads(x, kept, first, L, 1 if mixture else 2)
    # one product per head over all T' queries, viewed as blocks after: the codebook's gradient is then one (S, T')
    # by (T', D) product per head, where a codebook broadcast over the blocks formed an (n, S, D) gradient to sum
    code_logits = blocks((x.scale * x.q) @ x.codebook.transpose(-1, -2), L)  # (B, H, n, L, S)
    if mixture:
        out = _mixture(x, kept.weights, code_logits, read, counts, L)
    else:
        bias = memory_bias(layout, x.memory_cap, code_logits.dtype)
        if bias is not None:
            code_logits = code_logits + bias
        queries = blocks(x.q if x.q_rot is None else x.q_rot, L)
        keys = window_blocks(_window_keys(x, a.index), L, first)  # (B, H, n, 2L, D)
        # the code means C_b / n_b are never formed: the codes' weights are divided by the counts instead
        tiny = torch.finfo(counts.dtype).tiny
        out = window_softmax(x.scale * queries @ keys.transpose(-1, -2), window_mask(first, L),
                             window_blocks(x.v, L, first), code_logits + log_counts(counts).unsqueeze(-2),
                             read=lambda p: read(p / counts.clamp_min(tiny).unsqueeze(-2)))
    out = out.reshape(B, H, T, -1)
    if x.bad is not None:  # NaN from the first bad key of a sequence on
        seen = segment_prefix(x.bad.to(out.dtype), layout.starts)
        out = out + torch.zeros_like(seen, dtype=out.dtype).masked_fill(seen > 0, float("nan")).unsqueeze(-1)
    return out
