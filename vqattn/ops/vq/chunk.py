"""The chunk (block) impl of causal codebook attention: the Transformer-VQ algorithm.

Queries run in blocks of L. Block b attends, with one softmax, to its window (blocks b−1 and b, one logit per key,
causally masked) and to the S codes, which carry the counts n_s and value sums Σ_j Δ_js v_j of blocks ≤ b−2 and
enter with logit σ q·c_s + log n_s and value (Σ_j Δ_js v_j) / n_s. Cost O(T·(L + S)·D), no T×T tensor.

The blocks run in groups (:func:`~vqattn.ops.blocks.block_groups`), each starting from the cache the previous
group leaves, through one of two kernels:

* :func:`_window_group` (:class:`~..common.window_code_blocks.WindowCodeAttention`): hard VQ, whose window logit
  of key j is the code logit σ q·c_{z_j} gathered at its code (straight-through gradient to k_j), and every
  ``exact_window`` call, whose window logits are σ q·k_j of the raw keys;
* :func:`_mixture_group` (:class:`~.mixture.MixtureAttention`): soft VQ, whose window logit log Σ_s e^{σ q·c_s} Δ_js
  is the cache's own formula, so its window is the current block only and the previous one is read through the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..blocks import (
    block_groups,
    blocks,
    cat_groups,
    group_window_bias,
    group_windows,
    loops,
    pad_to_blocks,
    split_groups,
    time_range,
)
from ..common.memory_cap import block_memory_bias
from ..common.statistics import Assignment, code_counts, code_statistics, map_time
from ..common.window_code_blocks import WindowCodeInputs, window_code_attention
from ..nonfinite import zero_assignment_rows
from ..utils import size_max, size_min
from .mixture import mixture_attention
from .state import Inputs, VQState, continued, state_after


class Group(NamedTuple):
    """One group of n blocks: q, the window keys k (B, H, n·L, D), v (B, H, n·L, Dv) and the keys'
    Assignment ``a``; the block before the group k_before, v_before, a_before (B, H, L, ·) (zeros before block 0,
    masked); window_q the queries of the window logits when they are not q (RoPE), else None. The logits' scale is
    carried by the window keys and the codebook, never by the queries."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: Assignment
    k_before: torch.Tensor
    v_before: torch.Tensor
    a_before: Assignment | None
    first: bool
    window_q: torch.Tensor | None = None


class Carry(NamedTuple):
    """What a group hands the next: ``run`` (B, H, S), the counts of the next group's first block's cache without
    ``tail`` (B, H, lag, S), the counts of the last ``lag`` blocks, which enter the caches of the next group's
    blocks one by one; ``sums`` (B, H, S, Dv), the value sums of the next group's first block's cache, and (lag 2)
    ``pending`` (B, H, S, Dv), the value sums of the group's last block, which enter after the next group's first.
    """

    run: torch.Tensor
    tail: torch.Tensor
    sums: torch.Tensor
    pending: torch.Tensor | None = None


def _window_group(g: Group, carry: Carry, *, c, L: int, loop: bool, gathered: bool, scale: float, code_bias=None):
    """Window (raw keys, or gathered code logits when ``gathered``) plus codes (c scaled, their logits biased by
    ``code_bias`` (n,) per block when given); the block b−1 leaving block b's window enters the cache after block b
    (lag 2)."""
    n, S = g.q.shape[2] // L, c.shape[1]
    # The value sums enter from the group's own blocks (and the carried pending ones), so the (n·L, S) weights are
    # never copied shifted by a block, nor their gradient shifted back.
    index, weights = (None if x is None else blocks(x, L) for x in (g.a.index, g.a.weights))
    # The caches' counts add, in order, the tail and the group's own blocks but its last two, which are the next
    # group's tail. One reduction of the whole assignment, split afterwards: the backward pass hands the weights
    # one expanded gradient, not a cat of two; reduced from the same (n, L) view the kernel reads, so that the
    # expanded gradient is added to the kernel's, never copied to be reshaped.
    counts = code_counts(Assignment(weights, g.a.index), S, n, dtype=g.q.dtype)
    counts = torch.cat([carry.tail, counts], 2)  # (B, H, 2 + n, S)
    entering, tail = counts.split([n, 2], 2)
    cache_counts = carry.run.unsqueeze(2) + entering.cumsum(2)  # (B, H, n, S), block b's cache
    inputs = WindowCodeInputs(
        queries=blocks(g.q, L), window_keys=group_windows(g.k, g.k_before, L, scale),
        window_bias=group_window_bias(g.first, n, L, g.q.device, g.q.dtype),
        window_values=group_windows(g.v, g.v_before, L), counts=cache_counts, sums=carry.sums,
        add_values=blocks(g.v, L), add_index=index, add_weights=weights, pending=carry.pending, codebook=c,
        window_codes=group_windows(g.a.index, g.a_before.index, L) if gathered else None,
        window_queries=None if g.window_q is None else blocks(g.window_q, L),
        code_bias=None if code_bias is None else code_bias.view(n, 1, 1))
    out, sums, pending = window_code_attention(inputs, loop)
    return out, Carry(cache_counts[:, :, -1], tail, sums, pending)


def _mixture_group(g: Group, carry: Carry, *, c, L: int, loop: bool):
    """Soft VQ in linear form (c scaled); the block leaves the window right after it (lag 1), so ``run`` holds
    every count."""
    # The values get a column of ones, so the cache's last column is the counts.
    values = torch.cat([g.v, g.v.new_ones(*g.v.shape[:-1], 1)], -1)
    out, run, sums = mixture_attention(blocks(g.q, L), c, blocks(g.a.weights, L), blocks(values, L), carry.run,
                                       carry.sums, loop)
    return out, Carry(run, carry.tail, sums)


def _causal(x: Inputs, *, L: int, counts0, sums0, fold_blocks: int, first_block: int = 0):
    """The block algorithm, group by group, over x (:class:`~vqattn.ops.vq.state.Inputs`): q (B, H, T, Dc),
    codebook (H, S, Dc), the window's keys x.window_k (B, H, T, D) and its queries q_rot when they are not q (RoPE;
    Dc may then differ from D); x.assignment the keys' Assignment, or None to assign each group's keys k (so no
    (T, S) tensor exists at once); counts0/sums0: the cache before position 0; x.bad (B, H, T): the rows of the
    assignment to zero (non-finite keys), zeroed group by group, so that a soft assignment's (T, S) weights are never
    copied whole to mask them. L: the block length this call runs; ``first_block``: the index in the sequence of
    its first block (the memory cap's n_b). Returns out (B, H, T, Dv) and the cache after the first ``fold_blocks``
    blocks."""
    q, k, v, c, a, bad, scale = x.q, x.k, x.v, x.codebook, x.assignment, x.bad, x.scale
    window_k, window_q, assign, exact_window, schedule = x.window_k, x.q_rot, x.assign, x.exact_window, x.schedule
    B, H, T, D = q.shape
    S = c.shape[1]
    # Padding sits after every real query, so the causal mask hides it; its block statistics are never read
    # because block b's cache only holds blocks ≤ b−1.
    a = None if a is None else map_time(lambda t: pad_to_blocks(t, L), a)
    nb = -(-T // L)
    mixture = assign == "soft" and not exact_window
    lag = 1 if mixture else 2
    gathered = not mixture and not exact_window  # window logits gathered at the window keys' codes (hard VQ)
    groups = block_groups(nb, block_bytes(B, H, L, S, q.element_size()), q.device, schedule.group_blocks)
    split = lambda t: None if t is None else split_groups(pad_to_blocks(t, L), groups, L)  # noqa: E731
    qs, vs, window_ks, window_qs = split(q), split(v), split(window_k), split(window_q)
    assign_ks = None if a is not None else window_ks if k is window_k else split(k)
    a_splits, bads = None if a is None else [split(t) for t in a], split(bad)
    carry = Carry(counts0, q.new_zeros(B, H, lag, S), sums0, None if mixture else torch.zeros_like(sums0))
    outs, fold_counts, fold_sums = [], counts0, sums0
    loop = loops(schedule, q.device)
    # The scale goes into the codes (S rows) and the copied window keys: scaling the queries would cost one more
    # query-sized product forward and backward.
    scaled_c = c * scale
    for i, (b0, b1) in enumerate(groups):
        (q_g, _), (k_g, k_before), (v_g, v_before) = qs[i], window_ks[i], vs[i]
        if a is None:
            a_g, a_before = x.assign_keys(assign_ks[i][0]), (x.assign_keys(assign_ks[i][1]) if gathered else None)
        else:
            a_g, a_before = (Assignment(*parts) for parts in zip(*((None, None) if t is None else t[i]
                                                                    for t in a_splits)))
            if bads is not None:
                a_g, a_before = (zero_assignment_rows(t, rows) for t, rows in zip((a_g, a_before), bads[i]))
        g = Group(q_g, k_g, v_g, a_g, k_before, v_before, a_before, b0 == 0,
                  None if window_qs is None else window_qs[i][0])
        if mixture:
            out, carry = _mixture_group(g, carry, c=scaled_c, L=L, loop=loop)
        else:
            bias = block_memory_bias(first_block + b0, b1 - b0, L, x.memory_cap, device=q.device, dtype=q.dtype)
            out, carry = _window_group(g, carry, c=scaled_c, L=L, loop=loop, gathered=gathered, scale=scale,
                                       code_bias=bias)
        outs.append(out)
        fold = size_min(size_max(fold_blocks - b0, 0), b1 - b0) * L
        if fold:
            n, s = code_statistics(map_time(lambda t: t[:, :, :fold], a_g), v_g[:, :, :fold], S)
            fold_counts, fold_sums = fold_counts + n.squeeze(2), fold_sums + s.squeeze(2)
    return time_range(cat_groups(outs), 0, T), fold_counts, fold_sums


def block_bytes(B: int, H: int, L: int, S: int, element_size: int) -> int:
    """The size of one block's temporaries: its (L, S + 2L) logit tiles over every batch·head."""
    return B * H * L * (S + 2 * L) * element_size


def chunk_forward(x: Inputs, state: VQState | None, *, return_state: bool):
    """Causal block algorithm over x (:class:`~vqattn.ops.vq.state.Inputs`), new tokens that may continue ``state``,
    whose raw window is re-run in front (a state keeps the window's keys: k_rot with RoPE). Returns (out, state or
    None)."""
    T = x.q.shape[2]
    c = continued(x, state)
    # Short sequences fit in one block; a shorter block gives the same result with less padding.
    L = c.x.block_len if state is not None or return_state else size_min(c.x.block_len, c.x.v.shape[2])
    out, counts, sums = _causal(c.x, L=L, counts0=c.counts0, sums0=c.sums0,
                                fold_blocks=c.keep // c.x.block_len if return_state else 0,
                                first_block=c.start // c.x.block_len)
    out = time_range(out, out.shape[2] - T, out.shape[2])
    return out, state_after(c, counts, sums) if return_state else None
