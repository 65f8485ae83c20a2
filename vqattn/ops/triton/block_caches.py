"""Every block's code cache in one pass: the chunked prefix of the fused vq impl (fla's ``chunk_fwd_h``).

The cache that block b's queries read holds the keys of blocks ≤ b−2 and what came before the sequence:

    n_b = n_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ1        C_b = C_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ V_{b'}

with Δ_{b'} (L, S) block b''s assignment (one-hot rows for hard VQ, the soft weights otherwise). One program per
(tile of codes, batch·head) walks the blocks in order with its tile of the running cache in registers and writes
each block's cache once, so the per-block statistics, their cumulative sum and the initial cache's broadcast never
reach memory as separate passes. It also writes the state after the first ``fold`` blocks (n_0 plus those blocks'
statistics), which a caller continuing the sequence keeps.

The backward walks the blocks in reverse with the running suffix sum of the cache gradients,
G_j = Σ_{b ≥ j+2} dC_b (plus the state's gradient for j < fold), and writes block j's value gradients Δ_j G_j and,
for soft weights, their gradient V_j G_jᵀ + Gn_j. A hard key's value gradient comes from the one tile that holds
its code (a masked store); soft ones add over tiles (atomic adds). The caches' gradients dC_b are read from memory
or, for the vq step's :mod:`.vq_causal` with ``KernelDesign.walk_cache_gradient``, formed in the walk from the queries
that read the caches. :func:`block_caches` is the walk pair as an op of its own, which the tests check against a loop
over blocks. The walks' helpers take each tensor's strides as one (batch, head, token) tuple. Besides vq's formed
assignments (hard keys with ``KernelDesign(superblock_blocks=0)``, soft weights handed in or continuing a state), ovq's
fused impl sums its slots' keys and values with them (:mod:`vqattn.ops.ovq.fused`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..common.layout import empty_like_order
from ..devices import triton
from .scans import exclusive_scan
from .utils import cache_dtype, dot_dtype, register_width, three_programs_per_sm, unit_last
from .window_codes import WindowCodes

if triton is not None:
    import triton.language as tl

    from .utils import LOG2E, cache_grad_of_queries, code_tile_layout, hard_index, load_cache, load_rows, store_cache

# Floats of one program's running tile of value sums (codes × value dims) kept in registers.
TILE_FLOATS = 4096
# A cache walk's segments (KernelDesign.segment_steps): one program per tile of codes and sequence walks the blocks
# in sequence, each step waiting on memory; split into segments (fla's chunk_h_split), the segments' sums are
# formed in parallel, a short scan gives every segment its start, and the segments walk in parallel: more programs,
# each walk shorter, for twice the steps and the segments' sums in memory. That can pay only where the unsplit
# programs leave SMs idle; off by default (docs/triton_kernels.md, "Split walks at 65536 tokens"). Where the GPU
# chooses (segment_steps=None, :func:`walk_segments`): the programs of a walk per SM that fill it (the walks fit two
# per SM by their registers), and the fewest steps of a segment.
WALK_PROGRAMS_PER_SM = 2
MIN_SEGMENT_STEPS = 8


if triton is not None:

    @triton.jit
    def _assignment_tile(IDX, WTS, bh, rows, codes, T, S, HARD: tl.constexpr):
        """Δ (L, BS) float32 of the keys ``rows`` to the codes ``codes``: one-hot rows of the hard index (BH, T),
        or the soft weights (BH, T, S); 0 past T and past S."""
        if HARD:
            return (hard_index(IDX, bh, rows, T)[:, None] == codes[None, :]).to(tl.float32)
        return tl.load(WTS + (bh * T + rows[:, None]) * S + codes[None, :],
                       mask=(rows[:, None] >= 0) & (rows[:, None] < T) & (codes[None, :] < S), other=0.0).to(tl.float32)

    @triton.jit
    def _add_block(IDX, WTS, V, n, sums, blk, bh, sv, H, T, S, DV, codes, L: tl.constexpr,
                   BDV: tl.constexpr, HARD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
        """n, sums plus block blk's statistics Δᵀ1 and ΔᵀV for this tile of codes (nothing outside the
        sequence)."""
        rows = blk * L + tl.arange(0, L)
        w = _assignment_tile(IDX, WTS, bh, rows, codes, T, S, HARD)
        v = load_rows(V, sv[0], sv[1], sv[2], bh // H, bh % H, rows, T, DV, BDV, DOT)
        return n + tl.sum(w, 0), tl.dot(tl.trans(w.to(DOT)), v, sums, input_precision=PREC)

    @triton.jit
    def _prefix_step(IDX, WTS, V, NB, CB, n, sums, blk, bh, nb, sv, H, T, S, DV, tile, L: tl.constexpr,
                     BS: tl.constexpr, BDV: tl.constexpr, HARD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
        """Step blk of the walk: n, sums (the keys of blocks ≤ blk − 2) stored as block blk's cache (a mask, not a
        branch, for blk = nb: a straight loop body lets the compiler prefetch the next block's keys while this one
        is summed), then block blk − 1's statistics added (none for blk = 0); returns the new n, sums. ``sv``: the
        values' strides (batch, head, token); ``tile``: :func:`~.utils.code_tile_layout`'s four."""
        codes, present, tile_mask, offsets = tile
        blocks = blk + tl.zeros([BS], tl.int32)  # the block index as a vector: masks of one type
        store_cache(NB, CB, bh * nb + blk, S, DV, codes, offsets, n, sums, present & (blocks < nb), tile_mask)
        return _add_block(IDX, WTS, V, n, sums, blk - 1, bh, sv, H, T, S, DV, codes, L, BDV, HARD, DOT, PREC)

    @triton.jit
    def _prefix_kernel(IDX, WTS, V, N0, C0, NB, CB, NF, CF, sv_b, sv_h, sv_t, H, T, S, DV, fold, nseg, seg_steps,
                       L: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr, HARD: tl.constexpr,
                       DOT: tl.constexpr, PREC: tl.constexpr):
        """The walk's steps blk = 0 .. nb in segments of ``seg_steps``, one program per (tile of codes, batch·head,
        segment), each from its segment's first cache, row bh·nseg + seg of N0 (·, S), C0 (·, S, DV) (the
        initial cache itself for one segment). The program whose segment holds step ``fold`` stores the state
        after it."""
        sv = (sv_b, sv_h, sv_t)  # strides as a tuple
        bh, seg = tl.program_id(1), tl.program_id(2)
        nb = tl.cdiv(T, L)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        tile = (codes, present, tile_mask, offsets)
        n, sums = load_cache(N0, C0, bh * nseg + seg, S, DV, codes, offsets, present, tile_mask)
        start = seg * seg_steps
        end = tl.minimum(start + seg_steps, nb + 1)
        mid = tl.minimum(tl.maximum(fold + 1, start), end)
        # two walks, the state after step ``fold`` stored once between them (by the segment that holds it)
        for blk in range(start, mid):
            n, sums = _prefix_step(IDX, WTS, V, NB, CB, n, sums, blk, bh, nb, sv, H, T, S, DV, tile, L, BS, BDV, HARD,
                                   DOT, PREC)
        folds = fold + tl.zeros([BS], tl.int32)
        store_cache(NF, CF, bh, S, DV, codes, offsets, n, sums, present & (folds >= start) & (folds < end),
                     tile_mask)
        for blk in range(mid, end):
            n, sums = _prefix_step(IDX, WTS, V, NB, CB, n, sums, blk, bh, nb, sv, H, T, S, DV, tile, L, BS, BDV, HARD,
                                   DOT, PREC)

    @triton.jit
    def _prefix_segment_kernel(IDX, WTS, V, TN, TC, sv_b, sv_h, sv_t, H, T, S, DV, nseg, seg_steps,
                               L: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr, HARD: tl.constexpr,
                               DOT: tl.constexpr, PREC: tl.constexpr):
        """TN (B·H, nseg, S), TC (B·H, nseg, S, DV) float32: what the steps of segment seg add, the statistics of
        blocks seg·seg_steps − 1 .. (seg + 1)·seg_steps − 2 (fla's ``chunk_h_split``: every segment's local sum in
        parallel, then a short scan over the segments)."""
        sv = (sv_b, sv_h, sv_t)  # strides as a tuple
        bh, seg = tl.program_id(1), tl.program_id(2)
        nb = tl.cdiv(T, L)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        n = tl.zeros([BS], tl.float32)
        sums = tl.zeros([BS, BDV], tl.float32)
        start = seg * seg_steps
        for blk in range(start, tl.minimum(start + seg_steps, nb + 1)):
            n, sums = _add_block(IDX, WTS, V, n, sums, blk - 1, bh, sv, H, T, S, DV, codes, L, BDV,
                                 HARD, DOT, PREC)
        store_cache(TN, TC, bh * nseg + seg, S, DV, codes, offsets, n, sums, present, tile_mask)

    @triton.jit
    def _walk_cache_grad(queries, blk, bh, nb, H, T, S, DC, DV, codes, present, scale2, L: tl.constexpr,
                         BS: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr, HAS_BIAS: tl.constexpr,
                         COUNTS_GRAD: tl.constexpr, DOT: tl.constexpr, SUM_DOT: tl.constexpr, PREC: tl.constexpr):
        """The gradient of block blk's cache for this tile of codes, from the block's queries, as the window-code
        backward would write it (window_codes.py): with w_n = exp2(σ qc·c + β_blk − lse) the codes' probabilities
        per count (0 for empty codes and past T), dC = w_nᵀ dO (BS, BDV) and dn = −w_nᵀ Δ (BS,) (with
        COUNTS_GRAD, else 0). Zero for blk ≥ nb. ``queries``: the code queries QC, this tile of codes c (BS, BDC),
        the caches' counts CNT, the memory bias BIAS, DO, LSE, DELTA, and the strides of QC and DO (each (batch, head,
        token))."""
        QC, c, CNT, BIAS, DO, LSE, DELTA, sqc, sdo = queries
        rows = blk * L + tl.arange(0, L)
        blocks = blk + tl.zeros([BS], tl.int32)  # the block index as a vector: masks of one type
        n = tl.load(CNT + (bh * nb + blk) * S + codes, mask=present & (blocks < nb), other=0.0)
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(BIAS + tl.minimum(blk, nb - 1))  # past the last block every row is outside anyway
        return cache_grad_of_queries(QC, c, n > 0, bias, DO, LSE, DELTA, sqc[0], sqc[1], sqc[2], sdo[0], sdo[1],
                                     sdo[2], bh // H, bh % H, bh, rows, T, DC, DV, scale2, BDC, BDV, COUNTS_GRAD, DOT,
                                     SUM_DOT, PREC)

    @triton.jit
    def _block_cache_grad(DNB, DCB, queries, blk, bh, nb, H, T, S, DC, DV, tile, scale2, L: tl.constexpr,
                          BS: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr, HAS_BIAS: tl.constexpr,
                          COUNTS_GRAD: tl.constexpr, DOT: tl.constexpr, SUM_DOT: tl.constexpr, PREC: tl.constexpr,
                          WALK_DC: tl.constexpr):
        """The gradient of block blk's cache for this tile of codes (0 for blk ≥ nb): read from DNB, DCB, or with
        WALK_DC formed from the block's queries (:func:`_walk_cache_grad`)."""
        codes, present, tile_mask, offsets = tile
        if WALK_DC:
            d_n, d_sums = _walk_cache_grad(queries, blk, bh, nb, H, T, S, DC, DV, codes, present, scale2, L, BS, BDC,
                                           BDV, HAS_BIAS, COUNTS_GRAD, DOT, SUM_DOT, PREC)
        else:
            blocks = blk + tl.zeros([BS], tl.int32)
            d_n, d_sums = load_cache(DNB, DCB, bh * nb + blk, S, DV, codes, offsets, present & (blocks < nb),
                                      tile_mask)
        return d_n, d_sums

    @triton.jit
    def _value_grads(IDX, WTS, V, DVAL, DWTS, g_n, g_sums, blk, bh, sv, sd, H, T, S, DV, codes, present,
                     L: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr, HARD: tl.constexpr, DOT: tl.constexpr,
                     PREC: tl.constexpr, ADD_TO_DVAL: tl.constexpr):
        """Block blk's value gradients Δ g (added to DVAL's with ADD_TO_DVAL) and the soft weights' V gᵀ + g_n
        from g, the gradient of its statistics; ``sv``, ``sd`` the strides of V and DVAL."""
        rows = blk * L + tl.arange(0, L)
        w = _assignment_tile(IDX, WTS, bh, rows, codes, T, S, HARD)
        # (L, BDV); a hard row selects one code's gradient, which rounds to DOT exactly as the result would
        d_values = tl.dot(w.to(DOT), g_sums.to(DOT), input_precision=PREC)
        dv = tl.arange(0, BDV)
        row_mask = (rows[:, None] < T) & (dv[None, :] < DV)
        value_offsets = (bh // H) * sd[0] + (bh % H) * sd[1] + rows[:, None] * sd[2] + dv[None, :]
        if HARD:
            # this tile holds the row's code: its index against the tile's range, not a row sum over the one-hot
            first = tl.program_id(0) * BS
            # a key of no code (−1) gets its zero row of d_values (w's row is zero) from the tile of code 0
            index = tl.maximum(hard_index(IDX, bh, rows, T), 0)
            held = (index >= first) & (index < first + BS)
            if ADD_TO_DVAL:
                d_values += tl.load(DVAL + value_offsets, mask=row_mask & held[:, None], other=0.0).to(tl.float32)
            tl.store(DVAL + value_offsets, d_values.to(DVAL.dtype.element_ty), mask=row_mask & held[:, None])
        else:
            tl.atomic_add(DVAL + value_offsets, d_values, mask=row_mask)
            v = load_rows(V, sv[0], sv[1], sv[2], bh // H, bh % H, rows, T, DV, BDV, DOT)
            d_w = tl.dot(v, tl.trans(g_sums.to(DOT)), input_precision=PREC) + g_n[None, :]
            tl.store(DWTS + (bh * T + rows[:, None]) * S + codes[None, :], d_w,
                     mask=(rows[:, None] < T) & present[None, :])

    @triton.jit
    def _reverse_step(IDX, WTS, V, DNB, DCB, DVAL, DWTS, queries, g_n, g_sums, blk, bh, nb, sv, sd, H, T, S, DC, DV,
                      tile, scale2, L: tl.constexpr, BS: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr,
                      HARD: tl.constexpr, HAS_BIAS: tl.constexpr, COUNTS_GRAD: tl.constexpr, DOT: tl.constexpr,
                      SUM_DOT: tl.constexpr, PREC: tl.constexpr, WALK_DC: tl.constexpr, ADD_TO_DVAL: tl.constexpr):
        """Block blk of the reverse walk: the gradient of block blk + 2's cache added to the running sums g, which
        then hold the gradient of block blk's statistics; the block's value (and soft weight) gradients written from
        g; returns g. ``queries``: :func:`_walk_cache_grad`'s; ``sv``, ``sd``: the strides of V and DVAL; ``tile``:
        :func:`~.utils.code_tile_layout`'s four."""
        d_n, d_sums = _block_cache_grad(DNB, DCB, queries, blk + 2, bh, nb, H, T, S, DC, DV, tile, scale2, L, BS, BDC,
                                        BDV, HAS_BIAS, COUNTS_GRAD, DOT, SUM_DOT, PREC, WALK_DC)
        g_n += d_n
        g_sums += d_sums
        _value_grads(IDX, WTS, V, DVAL, DWTS, g_n, g_sums, blk, bh, sv, sd, H, T, S, DV, tile[0], tile[1], L, BS, BDV,
                     HARD, DOT, PREC, ADD_TO_DVAL)
        return g_n, g_sums

    @triton.jit
    def _walk_codes(CB, bh, H, S, DC, codes, present, BS: tl.constexpr, BDC: tl.constexpr, DOT: tl.constexpr,
                    WALK_DC: tl.constexpr):
        """This program's tile of codes (BS, BDC) of the head's codebook CB (H, S, DC), read once for a whole
        walk that forms the caches' gradients (zeros otherwise)."""
        c = tl.zeros([BS, BDC], DOT)
        if WALK_DC:
            dc = tl.arange(0, BDC)
            c = tl.load(CB + ((bh % H) * S + codes[:, None]) * DC + dc[None, :],
                        mask=present[:, None] & (dc[None, :] < DC), other=0.0).to(DOT)
        return c

    @triton.jit
    def _reverse_segment_kernel(DNB, DCB, TN, TC, QC, CB, CNT, BIAS, DO, LSE, DELTA, sqc_b, sqc_h, sqc_t, sdo_b,
                                sdo_h, sdo_t, H, T, S, DC, DV, scale, nseg, seg_steps, L: tl.constexpr,
                                BS: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr, HAS_BIAS: tl.constexpr,
                                COUNTS_GRAD: tl.constexpr, DOT: tl.constexpr, SUM_DOT: tl.constexpr,
                                PREC: tl.constexpr, WALK_DC: tl.constexpr):
        """TN (B·H, nseg, S), TC (B·H, nseg, S, DV) float32: what the reverse walk's steps of segment seg (blocks
        seg·seg_steps .. (seg + 1)·seg_steps − 1) add to its running sum, the gradients of the caches two blocks
        later."""
        sqc, sdo = (sqc_b, sqc_h, sqc_t), (sdo_b, sdo_h, sdo_t)  # strides as tuples
        bh, seg = tl.program_id(1), tl.program_id(2)
        nb = tl.cdiv(T, L)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        tile = (codes, present, tile_mask, offsets)
        c = _walk_codes(CB, bh, H, S, DC, codes, present, BS, BDC, DOT, WALK_DC)
        queries = (QC, c, CNT, BIAS, DO, LSE, DELTA, sqc, sdo)  # what forms the caches' gradients
        g_n = tl.zeros([BS], tl.float32)
        g_sums = tl.zeros([BS, BDV], tl.float32)
        start = seg * seg_steps
        for blk in range(start, tl.minimum(start + seg_steps, nb)):
            d_n, d_sums = _block_cache_grad(DNB, DCB, queries, blk + 2, bh, nb, H, T, S, DC, DV, tile, scale * LOG2E,
                                            L, BS, BDC, BDV, HAS_BIAS, COUNTS_GRAD, DOT, SUM_DOT, PREC, WALK_DC)
            g_n += d_n
            g_sums += d_sums
        store_cache(TN, TC, bh * nseg + seg, S, DV, codes, offsets, g_n, g_sums, present, tile_mask)

    @triton.jit
    def _prefix_backward_kernel(IDX, WTS, V, DNB, DCB, DNF, DCF, DN0, DC0, DVAL, DWTS, TN, TC, sv_b, sv_h, sv_t,
                                sd_b, sd_h, sd_t, H, T, S, DV, fold, nseg, seg_steps,
                                QC, CB, CNT, BIAS, DO, LSE, DELTA, sqc_b, sqc_h, sqc_t, sdo_b, sdo_h, sdo_t, DC, scale,
                                L: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr, HARD: tl.constexpr,
                                DOT: tl.constexpr, PREC: tl.constexpr, WALK_DC: tl.constexpr, BDC: tl.constexpr,
                                HAS_BIAS: tl.constexpr, COUNTS_GRAD: tl.constexpr, SUM_DOT: tl.constexpr,
                                ADD_TO_DVAL: tl.constexpr, SPLIT: tl.constexpr):
        """The reverse walk of blocks seg·seg_steps .. (seg + 1)·seg_steps − 1, one program per (tile of codes,
        batch·head, segment), from the running sum its later segments leave (TN, TC (B·H, nseg, S[, DV]), with
        SPLIT; else from 0). DVAL (B, H, T, DV) with strides sd_*: written row by row for hard (each row once, by
        the tile of its code, in the values' dtype; added to what it holds with ADD_TO_DVAL), added into (float32)
        for soft; DWTS (BH, T, S) float32, soft only. The caches' gradients come from DNB, DCB or, with WALK_DC,
        from the queries (QC, the codebook CB (H, S, DC), the caches' counts CNT, the memory bias BIAS, DO, LSE,
        DELTA). Segment 0 also writes the initial cache's gradient DN0, DC0."""
        # strides as tuples
        sv, sd, sqc, sdo = (sv_b, sv_h, sv_t), (sd_b, sd_h, sd_t), (sqc_b, sqc_h, sqc_t), (sdo_b, sdo_h, sdo_t)
        bh, seg = tl.program_id(1), tl.program_id(2)
        nb = tl.cdiv(T, L)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        tile = (codes, present, tile_mask, offsets)
        scale2 = scale * LOG2E
        c = _walk_codes(CB, bh, H, S, DC, codes, present, BS, BDC, DOT, WALK_DC)
        queries = (QC, c, CNT, BIAS, DO, LSE, DELTA, sqc, sdo)  # what forms the caches' gradients
        g_n = tl.zeros([BS], tl.float32)
        g_sums = tl.zeros([BS, BDV], tl.float32)
        if SPLIT:
            g_n, g_sums = load_cache(TN, TC, bh * nseg + seg, S, DV, codes, offsets, present, tile_mask)
        lo = seg * seg_steps
        hi = tl.minimum(lo + seg_steps, nb)
        mid = tl.minimum(tl.maximum(fold, lo), hi)
        # The gradient of block blk's statistics sums those of the caches of blocks ≥ blk + 2 and, for blocks
        # < fold, the state's: two walks, the state's gradient added once between them, or already in the running
        # sum when its first block lies in a later segment
        folds = fold + tl.zeros([BS], tl.int32)
        f_n, f_sums = load_cache(DNF, DCF, bh, S, DV, codes, offsets, present & (folds > hi), tile_mask)
        g_n += f_n
        g_sums += f_sums
        for back in range(0, hi - mid):
            blk = hi - 1 - back
            g_n, g_sums = _reverse_step(IDX, WTS, V, DNB, DCB, DVAL, DWTS, queries, g_n, g_sums, blk, bh, nb, sv, sd, H,
                                        T, S, DC, DV, tile, scale2, L, BS, BDC, BDV, HARD, HAS_BIAS, COUNTS_GRAD, DOT,
                                        SUM_DOT, PREC, WALK_DC, ADD_TO_DVAL)
        f_n, f_sums = load_cache(DNF, DCF, bh, S, DV, codes, offsets, present & (folds > lo) & (folds <= hi),
                                  tile_mask)
        g_n += f_n
        g_sums += f_sums
        for back in range(0, mid - lo):
            blk = mid - 1 - back
            g_n, g_sums = _reverse_step(IDX, WTS, V, DNB, DCB, DVAL, DWTS, queries, g_n, g_sums, blk, bh, nb, sv, sd, H,
                                        T, S, DC, DV, tile, scale2, L, BS, BDC, BDV, HARD, HAS_BIAS, COUNTS_GRAD, DOT,
                                        SUM_DOT, PREC, WALK_DC, ADD_TO_DVAL)
        if seg == 0:
            # the initial cache is in every block's cache, and in the state (fold = 0: only there)
            f_n, f_sums = load_cache(DNF, DCF, bh, S, DV, codes, offsets, present & (folds == 0), tile_mask)
            g_n += f_n
            g_sums += f_sums
            for blk in range(0, tl.minimum(nb, 2)):
                d_n, d_sums = _block_cache_grad(DNB, DCB, queries, blk, bh, nb, H, T, S, DC, DV, tile, scale2, L, BS,
                                                BDC, BDV, HAS_BIAS, COUNTS_GRAD, DOT, SUM_DOT, PREC, WALK_DC)
                g_n += d_n
                g_sums += d_sums
            store_cache(DN0, DC0, bh, S, DV, codes, offsets, g_n, g_sums, present, tile_mask)

def _launch(hard: bool, forward: bool, device: torch.device) -> dict:
    """Launch settings (the figures behind them: docs/performance_notes.md, "Kernel resources"). The hard backward
    walk takes Triton's default prefetching (3 stages); the soft walks keep one stage, since staging their float32
    weight tiles too slowed them. The hard prefix walk runs in 8 warps: fewer registers per thread, so two programs
    of 8 warps share an SM instead of three of 4, and each block's step, the walk's sequential chain, is split over
    twice the warps. The reverse walks stay at 4 warps: in 8, one program would fit per SM where two fit now. The
    soft prefix walk is capped at three programs per SM
    (:func:`~vqattn.ops.triton.window_codes.three_programs_per_sm`), where it fits without spilling; the soft
    reverse walk would spill there, so it is not capped."""
    if hard:
        return dict(num_warps=8) if forward else {}
    return dict(num_stages=1, **three_programs_per_sm(device)) if forward else dict(num_stages=1)


def walk_code_tile(dv_width: int, float32_operands: bool = False) -> int:
    """Codes per program of a walk: a (codes, dv_width) running tile of :data:`TILE_FLOATS`, half of it with float32
    operands (ovq's keys and values side by side, 128 wide: at 32 codes its reverse walk spilled 240 bytes on sm_90,
    benchmarks/kernel_resources.py)."""
    return max(16, min(64, TILE_FLOATS // dv_width // (2 if float32_operands else 1)))


@dataclasses.dataclass
class Prefix:
    """The prefix walk's launch and what its backward reads: the hard index or the soft weights (the other a
    placeholder), the values, the constexprs, the grid and ``fold``; and its outputs, every block's cache n
    (B, H, nb, S) float32 and C (B, H, nb, S, Dv) (:func:`cache_dtype`), and the state after ``fold`` blocks."""

    idx: torch.Tensor
    wts: torch.Tensor
    v: torch.Tensor
    meta: dict
    grid: tuple
    fold: int
    cache_n: torch.Tensor
    cache_c: torch.Tensor
    fold_n: torch.Tensor
    fold_c: torch.Tensor
    segment_steps: int | None = 0

    @property
    def hard(self) -> bool:
        return self.meta["HARD"]


def prefix_forward(index, weights, v, counts0, sums0, *, block_len: int, fold: int,
                   segment_steps: int | None = 0) -> Prefix:
    """Every block's cache and the state after ``fold`` blocks (see :func:`block_caches`); the walk, and its reverse
    in the backward pass, split as :func:`walk_segments` says for ``segment_steps``."""
    B, H, T, DV = v.shape
    S = counts0.shape[-1]
    nb = triton.cdiv(T, block_len)
    hard = index is not None
    idx = index.contiguous() if hard else v
    wts = weights.contiguous() if not hard else v
    v = unit_last(v)
    n0, c0 = counts0.float().contiguous(), sums0.float().contiguous()
    f32 = dict(device=v.device, dtype=torch.float32)
    # Every block's value sums in bfloat16 for bfloat16 values (cache_dtype): the largest tensor of the fused
    # impl (the counts, and the running sums, stay float32).
    cache_c = torch.empty(B, H, nb, S, DV, device=v.device, dtype=cache_dtype(v.dtype))
    cache_n = torch.empty(B, H, nb, S, **f32)
    fold_n, fold_c = torch.empty(B, H, S, **f32), torch.empty(B, H, S, DV, **f32)
    # Half values multiply in their own type, soft weights and gradient sums rounded to it (as flash attention
    # rounds its probabilities); float32 values in float32 (window_codes.dot_dtype: IEEE, or TF32 if allowed).
    dot, prec = dot_dtype(v.dtype)
    BDV = register_width(DV)
    meta = dict(L=block_len, BS=walk_code_tile(BDV, v.dtype == torch.float32), BDV=BDV, HARD=hard, DOT=dot, PREC=prec)
    grid = (triton.cdiv(S, meta["BS"]), B * H)
    inputs = dict(IDX=idx, WTS=wts, V=v, sv_b=v.stride(0), sv_h=v.stride(1), sv_t=v.stride(2), H=H, T=T, S=S, DV=DV)
    # the walk's steps: one per block, and one past the last
    seg_steps, nseg = walk_segments(nb + 1, grid[0] * grid[1], v.device, segment_steps)
    base_n, base_c = n0, c0
    if nseg > 1:  # every segment's first cache, from the segments' sums
        base_n, base_c = torch.empty(B * H, nseg, S, **f32), torch.empty(B * H, nseg, S, DV, **f32)
        _prefix_segment_kernel[(*grid, nseg)](TN=base_n, TC=base_c, **inputs, nseg=nseg, seg_steps=seg_steps, **meta,
                                              **_launch(hard, True, v.device))
        exclusive_scan(base_n, base_c, code_tile=meta["BS"], base=(n0.view(B * H, S), c0.view(B * H, S, DV)))
    _prefix_kernel[(*grid, nseg)](N0=base_n, C0=base_c, NB=cache_n, CB=cache_c, NF=fold_n, CF=fold_c, **inputs,
                                  fold=fold, nseg=nseg, seg_steps=seg_steps, **meta, **_launch(hard, True, v.device))
    return Prefix(idx, wts, v, meta, grid, fold, cache_n, cache_c, fold_n, fold_c, segment_steps)


def walk_segments(steps: int, programs: int, device: torch.device, segment_steps: int | None) -> tuple[int, int]:
    """A walk of ``steps`` sequential steps in each of ``programs`` programs, split into segments: (steps per
    segment, segments). ``segment_steps`` (:class:`~vqattn.ops.blocks.KernelDesign`): 0 never splits, n > 0 splits
    into segments of n steps; None: on a GPU whose SMs (:data:`WALK_PROGRAMS_PER_SM` each) hold at least twice the
    unsplit programs, as many segments as fill them, each of at least :data:`MIN_SEGMENT_STEPS` steps; one segment
    under the interpreter."""
    seg_steps = segment_steps
    if seg_steps is None:
        slots = WALK_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 0
        wanted = slots // programs  # segments per walk that at least double the programs in flight
        seg_steps = max(MIN_SEGMENT_STEPS, triton.cdiv(steps, wanted)) if wanted > 1 else 0
    seg_steps = seg_steps if 0 < seg_steps < steps else steps
    return seg_steps, triton.cdiv(steps, seg_steps)


class CacheQueries(NamedTuple):
    """The queries that read every block's cache, from which the reverse walk forms the caches' gradients: the
    window-code forward that read them, its output's gradient dO, Δ = dO·out (B·H, T) float32, and whether the
    counts' gradient is wanted (always for soft weights, whose gradient holds it)."""

    forward: WindowCodes
    grad_out: torch.Tensor
    delta: torch.Tensor
    counts_grad: bool


def reverse_walk(p: Prefix, d_fold_n, d_fold_c, *, d_cache_n=None, d_cache_c=None,
                 queries: CacheQueries | None = None, d_values=None):
    """The prefix's backward: the values' gradient (in their dtype and memory order), the soft weights' (float32
    (B, H, T, S); None for hard) and the initial cache's (float32). The caches' gradients are d_cache_n,
    d_cache_c (B, H, nb, S[, Dv]; None: zeros), or, given ``queries``, formed in the walk block by block: no
    per-block cache gradient reaches memory. ``d_values``: a gradient of the values (of their dtype and memory
    order) the walk adds its own to (in place for hard)."""
    B, H, T, DV = p.v.shape
    S, hard = p.cache_n.shape[-1], p.hard
    f32 = dict(device=p.v.device, dtype=torch.float32)
    d_fold_n, d_fold_c = (g.contiguous() if g is not None else torch.zeros(shape, **f32)
                          for g, shape in ((d_fold_n, (B, H, S)), (d_fold_c, (B, H, S, DV))))
    d_n0, d_c0 = torch.empty(B, H, S, **f32), torch.empty(B, H, S, DV, **f32)
    # in v's memory order (common/layout.py); soft rows add up over the code tiles, in float32
    if hard:
        dval = d_values if d_values is not None else empty_like_order(p.v)
    else:
        dval = empty_like_order(p.v, dtype=torch.float32)
        dval.copy_(d_values) if d_values is not None else dval.zero_()
    d_weights = dval if hard else torch.empty(B, H, T, S, **f32)
    walk = _walk_arguments(p, queries) if queries is not None else _read_arguments(p, d_cache_n, d_cache_c)
    # the reverse walk's steps: one per block
    seg_steps, nseg = walk_segments(triton.cdiv(T, p.meta["L"]), p.grid[0] * p.grid[1], p.v.device,
                                    p.segment_steps)
    totals_n = totals_c = d_n0  # unread without segments
    if nseg > 1:  # every segment's running sum from its later segments' sums
        totals_n, totals_c = torch.empty(B * H, nseg, S, **f32), torch.empty(B * H, nseg, S, DV, **f32)
        meta = {key: value for key, value in p.meta.items() if key != "HARD"}
        _reverse_segment_kernel[(*p.grid, nseg)](
            TN=totals_n, TC=totals_c, **walk, H=H, T=T, S=S, DV=DV, nseg=nseg, seg_steps=seg_steps, **meta,
            **_launch(hard, False, p.v.device))
        exclusive_scan(totals_n, totals_c, code_tile=p.meta["BS"], reverse=True)
    _prefix_backward_kernel[(*p.grid, nseg)](
        IDX=p.idx, WTS=p.wts, V=p.v, DNF=d_fold_n, DCF=d_fold_c, DN0=d_n0, DC0=d_c0, DVAL=dval, DWTS=d_weights,
        TN=totals_n, TC=totals_c, sv_b=p.v.stride(0), sv_h=p.v.stride(1), sv_t=p.v.stride(2), sd_b=dval.stride(0),
        sd_h=dval.stride(1), sd_t=dval.stride(2), H=H, T=T, S=S, DV=DV, fold=p.fold, nseg=nseg, seg_steps=seg_steps,
        **walk, **p.meta, ADD_TO_DVAL=hard and d_values is not None, SPLIT=nseg > 1,
        **_launch(hard, False, p.v.device))
    return dval.to(p.v.dtype), None if hard else d_weights, d_n0, d_c0


def _read_arguments(p: Prefix, d_cache_n, d_cache_c) -> dict:
    """The reverse walk's arguments that read every block's cache gradient from memory."""
    B, H, nb, S, DV = p.cache_c.shape
    f32 = dict(device=p.v.device, dtype=torch.float32)
    # (B, H, nb, S[, DV]), or the code backward's (B·H, nb, S[, DV]): the same memory
    dnb = d_cache_n.contiguous() if d_cache_n is not None else torch.zeros(B, H, nb, S, **f32)
    dcb = d_cache_c.contiguous() if d_cache_c is not None else torch.zeros(B, H, nb, S, DV, **f32)
    unused = dict.fromkeys(("QC", "CB", "CNT", "BIAS", "DO", "LSE", "DELTA"), dnb)
    strides = dict.fromkeys(("sqc_b", "sqc_h", "sqc_t", "sdo_b", "sdo_h", "sdo_t"), 0)
    return dict(DNB=dnb, DCB=dcb, **unused, **strides, DC=0, scale=0.0, WALK_DC=False, BDC=16, HAS_BIAS=False,
                COUNTS_GRAD=False, SUM_DOT=p.meta["DOT"])


def _walk_arguments(p: Prefix, queries: CacheQueries) -> dict:
    """The reverse walk's arguments that form every block's cache gradient from the queries that read it."""
    f, qc, do = queries.forward, queries.forward.qc, queries.grad_out
    strides = {f"s{name}_{axis}": stride for name, x in (("qc", qc), ("do", do))
               for axis, stride in zip("bht", (x.stride(0), x.stride(1), x.stride(2)))}
    return dict(DNB=p.cache_n, DCB=p.cache_c, QC=qc, CB=f.cb, CNT=f.cnt, BIAS=f.bias, DO=do, LSE=f.lse,
                DELTA=queries.delta, **strides, DC=f.cb.shape[-1], scale=f.scale, WALK_DC=True, BDC=f.meta["BDC"],
                HAS_BIAS=f.meta["HAS_BIAS"], COUNTS_GRAD=not p.hard or queries.counts_grad,
                SUM_DOT=f.meta["SUM_DOT"])


class BlockCaches(torch.autograd.Function):
    """See :func:`block_caches`."""

    @staticmethod
    def forward(ctx, index, weights, v, counts0, sums0, block_len: int, fold: int, segment_steps: int | None):
        p = prefix_forward(index, weights, v, counts0, sums0, block_len=block_len, fold=fold,
                           segment_steps=segment_steps)
        if p.hard and not ctx.needs_input_grad[3]:  # counts of one-hot rows: no gradient reaches anything
            ctx.mark_non_differentiable(p.cache_n, p.fold_n)
        ctx.save_for_backward(p.idx, p.wts, p.v, p.cache_n, p.cache_c)
        ctx.prefix = dataclasses.replace(p, idx=None, wts=None, v=None, cache_n=None, cache_c=None)
        ctx.dtypes = (None if p.hard else weights.dtype, counts0.dtype, sums0.dtype)
        return p.cache_n, p.cache_c, p.fold_n, p.fold_c

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_cache_n, d_cache_c, d_fold_n, d_fold_c):
        idx, wts, v, cache_n, cache_c = ctx.saved_tensors
        p = dataclasses.replace(ctx.prefix, idx=idx, wts=wts, v=v, cache_n=cache_n, cache_c=cache_c)
        d_values, d_weights, d_n0, d_c0 = reverse_walk(p, d_fold_n, d_fold_c, d_cache_n=d_cache_n,
                                                       d_cache_c=d_cache_c)
        w_dtype, n_dtype, c_dtype = ctx.dtypes
        return (None, None if p.hard else d_weights.to(w_dtype), d_values, d_n0.to(n_dtype), d_c0.to(c_dtype), None,
                None, None)


@torch.compiler.disable  # a graph break: torch.compile runs the kernels as they are
def block_caches(index, weights, v, counts0, sums0, *, block_len: int, fold: int, segment_steps: int | None = 0):
    """Every block's cache and the state after ``fold`` blocks (see the module doc), differentiable in v, the soft
    weights and the initial cache.

    index (B, H, T) long (hard; −1: a key of no code) or weights (B, H, T, S) (soft; the other None); v (B, H, T,
    Dv); counts0 (B, H, S), sums0 (B, H, S, Dv) the cache before position 0. Returns the caches n (B, H, nb, S)
    and C (B, H, nb, S, Dv) (nb = ⌈T/L⌉) and the state (B, H, S), (B, H, S, Dv) after the first ``fold`` ≤ nb
    blocks, all float32.
    ``segment_steps``: the walks' segments (:func:`walk_segments`).
    """
    return BlockCaches.apply(index, weights, v, counts0, sums0, block_len, fold, segment_steps)
