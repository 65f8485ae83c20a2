"""The hard vq step with superblock caches: a compressed cache only every K blocks, the keys in between read
through their codes.

Blocks of L tokens; superblock g holds blocks gK .. gK + K − 1. Query i of block b (per batch·head, scale σ,
memory bias β_b) reads in one online softmax

    window    the keys j ≤ i of blocks b−1 and b          logit σ qw_i·kw_j                    value v_j
    gathered  the keys of blocks c_b .. b−2               logit σ qc_i·c_{z_j} + β_b           value v_j
    cache     s = 1..S, superblock g_b's cache            logit σ qc_i·c_s + log n_gs + β_b    value C_gs / n_gs

with g_b = ⌊max(b−1, 0)/K⌋, c_b = K g_b, and cache g = the keys of blocks < gK (and the state before the sequence):
n_g = n_0 + Σ_{j < gK·L} e_{z_j}, C_g = C_0 + Σ_{j < gK·L} e_{z_j} v_jᵀ. A hard key j read through its code adds
exp(σ qc·c_{z_j} + β) v_j to the numerator and exp(σ qc·c_{z_j} + β) to the normaliser: exactly its share of a
cache. So the output equals the per-block caches' of :class:`vqattn.ops.vq.fused.VQCausal` (K = 1 is that
design), while the caches that reach memory are K times fewer (docs/triton_kernels.md, "The floor model").

Kernels, in launch order (all parallel; the only sequential pass is the scan over ⌈nb/K⌉ superblocks):

* :func:`_superblock_sums_kernel`: every superblock's own counts and value sums; :func:`.utils.exclusive_scan`
  turns them into the caches (fla's ``chunk_h_split``);
* :func:`_superblock_forward_kernel`: one program per query block: window, gathered keys, cache;
* backward: Δ and the window's gradients (:mod:`.window_codes`); :func:`_superblock_code_backward_kernel`
  (query-major: dqc, the codebook's share of the cache codes); :func:`_superblock_cache_grad_kernel` (code-major:
  each cache's gradient dC_g = Σ w_nᵀ dO over the K query blocks that read it, from qc, dO and the logsumexp; no
  per-block gradient reaches memory), scanned in reverse into G_g = Σ_{g' > g} dC_g';
  :func:`_superblock_key_backward_kernel` (key-major: a key's value gradient from the query blocks that gathered it,
  plus row z_j of G at its superblock, added to the window's in place; the gathered keys' codebook gradient).
"""

from __future__ import annotations

import dataclasses

import torch

from ..utils import empty_like_order, triton
from .tuning import configs, tuned
from .utils import (
    CODE_TILE,
    aligned_code_dims,
    cache_dtype,
    dot_dtype,
    exclusive_scan,
    register_width,
    stride_args,
    sum_dot,
    unit_last,
)
from .window_codes import (
    FORWARD_LAUNCH,
    TENSORS,
    WindowCodes,
    codebook_gradient,
    output_delta,
    window_backward,
)

if triton is not None:
    import triton.language as tl

    from .utils import (
        LOG2E,
        add_codebook_grad,
        attend_window,
        block_bias,
        cache_grad_of_queries,
        code_tile,
        code_tile_grads,
        code_tile_layout,
        hard_index,
        load_rows,
        online_softmax_step,
        output_grads,
        store_cache,
        store_rows,
    )

# Codes per tile of the caches' scan (a (BS, Dv) float32 tile in registers).
SUM_CODE_TILE = 64
# Each kernel's launch candidates (:mod:`.tuning`), the first the one it runs with; BS: codes per tile. The first
# ones are @triton.autotune's choices on an H200 (bf16, D = 64, S = 512, 8k and 32k tokens; docs/triton_kernels.md):
# they took the step's kernels from 6.72 to 5.97 ms.
SUMS_CONFIGS = configs(dict(BS=256, num_warps=4, num_stages=3), BS=(64, 128, 256), num_warps=(4, 8),
                       num_stages=(1, 3))
FORWARD_CONFIGS = configs(dict(BS=CODE_TILE, **FORWARD_LAUNCH), BS=(64, 128), num_warps=(4, 8), num_stages=(1, 2))
CODE_BACKWARD_CONFIGS = configs(dict(BS=CODE_TILE, num_warps=4, num_stages=1), BS=(64, 128), num_warps=(4, 8),
                                num_stages=(1, 3))
CACHE_GRAD_CONFIGS = configs(dict(BS=128, num_warps=4, num_stages=1), BS=(64, 128), num_warps=(4, 8),
                             num_stages=(1, 3))
KEY_BACKWARD_CONFIGS = configs(dict(num_warps=4, num_stages=1), num_warps=(4, 8), num_stages=(1, 2, 3))


def superblocks(nb: int, K: int) -> int:
    """The caches a sequence of nb blocks reads: g_b = ⌊max(b−1, 0)/K⌋ for b < nb."""
    return max(nb - 2, 0) // K + 1


if triton is not None:

    @triton.jit
    def gathered_keys(CB, IDX, bh, h, cols, T, S, DC, BDC: tl.constexpr, DOT: tl.constexpr):
        """The keys ``cols`` read through their codes: their codes z (L,) int32 (−1 outside the sequence) and the
        code vectors c_z (L, BDC) of the head's codebook CB (H, S, DC) as DOT (0 outside)."""
        z = hard_index(IDX, bh, cols, T)
        dc = tl.arange(0, BDC)
        ck = tl.load(CB + (h * S + z[:, None]) * DC + dc[None, :], mask=(z[:, None] >= 0) & (dc[None, :] < DC),
                     other=0.0)
        return z, ck.to(DOT)

    @triton.jit
    def gathered_block(CB, IDX, V, sv_b, sv_h, sv_t, b, h, bh, j, T, S, DC, DV, L: tl.constexpr, BDC: tl.constexpr,
                       BDV: tl.constexpr, DOT: tl.constexpr):
        """Key block j as a query reads it through its codes: :func:`gathered_keys` and the values (L, BDV) as
        DOT."""
        keys = j * L + tl.arange(0, L)
        codes, ck = gathered_keys(CB, IDX, bh, h, keys, T, S, DC, BDC, DOT)
        return codes, ck, load_rows(V, sv_b, sv_h, sv_t, b, h, keys, T, DV, BDV, DOT)

    @triton.jit
    def gathered_logits(qc, ck, z, bias, scale2, PREC: tl.constexpr):
        """σ qc·c_zᵀ + β (rows, L) in base 2, −inf for keys outside the sequence (z < 0)."""
        s = tl.dot(qc, tl.trans(ck), input_precision=PREC) * scale2 + bias * LOG2E
        return tl.where(z[None, :] >= 0, s, float("-inf"))

    @tuned(SUMS_CONFIGS)
    @triton.jit
    def _superblock_sums_kernel(IDX, V, TN, TC, sv_b, sv_h, sv_t, H, T, S, DV, start, span, limit, nout,
                                L: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr, DOT: tl.constexpr,
                                PREC: tl.constexpr):
        """TN (B·H, nout, S) float32, TC (B·H, nout, S, DV): program p's counts Δᵀ1 and value sums Δᵀ V of blocks
        start + p·span .. start + (p+1)·span − 1, none from ``limit`` on, one program per (tile of codes, batch·head,
        p)."""
        bh, piece = tl.program_id(1), tl.program_id(2)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        n = tl.zeros([BS], tl.float32)
        sums = tl.zeros([BS, BDV], tl.float32)
        first = start + piece * span
        for blk in range(first, tl.minimum(first + span, limit)):
            rows = blk * L + tl.arange(0, L)
            w = (hard_index(IDX, bh, rows, T)[:, None] == codes[None, :]).to(tl.float32)  # one-hot rows, 0 past T
            v = load_rows(V, sv_b, sv_h, sv_t, bh // H, bh % H, rows, T, DV, BDV, DOT)
            n += tl.sum(w, 0)
            sums = tl.dot(tl.trans(w.to(DOT)), v, sums, input_precision=PREC)
        store_cache(TN, TC, bh * nout + piece, S, DV, codes, offsets, n, sums, present, tile_mask)

    @tuned(FORWARD_CONFIGS)
    @triton.jit
    def _superblock_forward_kernel(QW, KW, V, QC, CB, IDX, CNT, SUM, BIAS, BAD, O, LSE,
                                   sqw_b, sqw_h, sqw_t, skw_b, skw_h, skw_t, sv_b, sv_h, sv_t, sqc_b, sqc_h, sqc_t,
                                   so_b, so_h, so_t, H, T, S, D, DC, DV, K, nsb, scale,
                                   L: tl.constexpr, BD: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr,
                                   BS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                                   SUM_DOT: tl.constexpr, PREC: tl.constexpr, HAS_BAD: tl.constexpr):
        """out (B, H, T, DV) and the logsumexp LSE (B·H, T) (base 2) of query block blk: its window, the keys of
        blocks c_b .. b−2 through their codes, and the S codes of its superblock's cache (CNT (B·H, nsb, S) float32, SUM
        (B·H, nsb, S, DV))."""
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = blk * L + tl.arange(0, L)
        scale2 = scale * LOG2E
        m, z, acc = attend_window(QW, KW, V, BAD, sqw_b, sqw_h, sqw_t, skw_b, skw_h, skw_t, sv_b, sv_h, sv_t, b, h, bh,
                                  rows, T, D, DV, scale2, L, BD, BDV, DOT, PREC, HAS_BAD)
        ones = tl.full([L], 1.0, tl.float32)
        qc = load_rows(QC, sqc_b, sqc_h, sqc_t, b, h, rows, T, DC, BDC, DOT)
        bias = block_bias(BIAS, blk, HAS_BIAS)
        g = tl.maximum(blk - 1, 0) // K
        for j in range(g * K, blk - 1):
            codes, ck, vj = gathered_block(CB, IDX, V, sv_b, sv_h, sv_t, b, h, bh, j, T, S, DC, DV, L, BDC, BDV, DOT)
            m, z, acc = online_softmax_step(m, z, acc, gathered_logits(qc, ck, codes, bias, scale2, PREC), vj, ones,
                                             DOT, PREC)
        for s0 in range(0, S, BS):
            logits, c, counts, sums = code_tile(CB, CNT, SUM, h, bh * nsb + g, bias, s0, S, DC, DV, qc, scale2, BS,
                                                BDC, BDV, DOT, SUM_DOT, PREC)
            m, z, acc = online_softmax_step(m, z, acc, logits, sums, counts, SUM_DOT, PREC)
        store_rows(O, so_b, so_h, so_t, b, h, rows, T, DV, acc / z[:, None], BDV)
        tl.store(LSE + bh * T + rows, m + tl.log2(z), mask=rows < T)

    @tuned(CODE_BACKWARD_CONFIGS, reset_to_zero=["DCB"])
    @triton.jit
    def _superblock_code_backward_kernel(QC, CB, IDX, V, CNT, SUM, BIAS, DO, LSE, DELTA, DQC, DCB,
                                         sqc_b, sqc_h, sqc_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                                         sdqc_b, sdqc_h, sdqc_t, H, T, S, DC, DV, K, nsb, scale,
                                         L: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr,
                                         HAS_BIAS: tl.constexpr, DOT: tl.constexpr, SUM_DOT: tl.constexpr,
                                         PREC: tl.constexpr, CODEBOOK_GRAD: tl.constexpr):
        """Query block blk's code queries' gradient dqc, from its gathered keys (ds = p (dO·vᵀ − Δ)) and its cache's
        codes; with CODEBOOK_GRAD the cache codes' share of the codebook's gradient, added atomically into its
        sequence's row of DCB (B·H, S, DC) (the gathered keys' share is the key-major kernel's)."""
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = blk * L + tl.arange(0, L)
        scale2 = scale * LOG2E
        do, lse, delta = output_grads(DO, LSE, DELTA, sdo_b, sdo_h, sdo_t, b, h, bh, rows, T, DV, BDV, DOT)
        qc = load_rows(QC, sqc_b, sqc_h, sqc_t, b, h, rows, T, DC, BDC, DOT)
        dqc = tl.zeros([L, BDC], tl.float32)
        bias = block_bias(BIAS, blk, HAS_BIAS)
        g = tl.maximum(blk - 1, 0) // K
        for j in range(g * K, blk - 1):
            codes, ck, vj = gathered_block(CB, IDX, V, sv_b, sv_h, sv_t, b, h, bh, j, T, S, DC, DV, L, BDC, BDV, DOT)
            p = tl.exp2(gathered_logits(qc, ck, codes, bias, scale2, PREC) - lse[:, None])
            p = tl.where(rows[:, None] < T, p, 0.0)
            ds = p * (tl.dot(do, tl.trans(vj), input_precision=PREC) - delta[:, None])
            dqc = tl.dot(ds.to(DOT), ck, dqc, input_precision=PREC)
        do_sums = do.to(SUM_DOT)
        for s0 in range(0, S, BS):
            dqc, ds_codes, w_n = code_tile_grads(CB, CNT, SUM, h, bh * nsb + g, bias, s0, S, DC, DV, qc, do_sums, lse,
                                               delta, rows, T, dqc, scale2, BS, BDC, BDV, DOT, SUM_DOT, PREC)
            if CODEBOOK_GRAD:
                codes = s0 + tl.arange(0, BS)
                add_codebook_grad(DCB, bh, codes, codes < S, ds_codes, qc, scale, S, DC, BDC, DOT, PREC, False)
        store_rows(DQC, sdqc_b, sdqc_h, sdqc_t, b, h, rows, T, DC, dqc * scale, BDC)

    @tuned(CACHE_GRAD_CONFIGS)
    @triton.jit
    def _superblock_cache_grad_kernel(QC, CB, IDX, CNT, BIAS, DO, LSE, DELTA, TN, TC, sqc_b, sqc_h, sqc_t, sdo_b, sdo_h,
                                      sdo_t, H, T, S, DC, DV, K, nsb, scale, L: tl.constexpr, BS: tl.constexpr,
                                      BDC: tl.constexpr, BDV: tl.constexpr, HAS_BIAS: tl.constexpr,
                                      COUNTS_GRAD: tl.constexpr, DOT: tl.constexpr, SUM_DOT: tl.constexpr,
                                      PREC: tl.constexpr):
        """TN (B·H, nsb, S) float32, TC (B·H, nsb, S, DV): cache g's gradient for a tile of codes, summed over the
        query blocks that read it (b = 0 .. K for g = 0, gK + 1 .. gK + K after), from their code queries, output
        gradients and logsumexp (:func:`~.utils.cache_grad_of_queries`); its counts' only with COUNTS_GRAD (hard
        counts take a gradient only from the state's). One program per (tile of codes, batch·head, g)."""
        bh, g = tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        nb = tl.cdiv(T, L)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        dc = tl.arange(0, BDC)
        c = tl.load(CB + (h * S + codes[:, None]) * DC + dc[None, :], mask=present[:, None] & (dc[None, :] < DC),
                    other=0.0).to(DOT)
        n = tl.load(CNT + (bh * nsb + g) * S + codes, mask=present, other=0.0)
        g_n = tl.zeros([BS], tl.float32)
        g_sums = tl.zeros([BS, BDV], tl.float32)
        # A code empty in the cache but held by a gathered key is not empty to the query (the per-block caches'
        # convention, where that key is in the cache): its share of the cache's gradient counts. ``seen``: the
        # codes of the blocks gK .. b−2 that query block b gathers.
        seen = tl.zeros([BS], tl.int32)
        first = tl.where(g == 0, 0, g * K + 1)
        for blk in range(first, tl.minimum(g * K + K + 1, nb)):
            gathered = blk - 2  # the block b gathers that b − 1 did not
            held = hard_index(IDX, bh, gathered * L + tl.arange(0, L), T)
            hit = (held[:, None] == codes[None, :]) & (gathered >= g * K)
            seen = tl.maximum(seen, tl.max(hit.to(tl.int32), 0))
            rows = blk * L + tl.arange(0, L)
            d_n, d_sums = cache_grad_of_queries(QC, c, (n > 0) | (seen > 0), block_bias(BIAS, blk, HAS_BIAS), DO,
                                                LSE, DELTA, sqc_b, sqc_h, sqc_t, sdo_b, sdo_h, sdo_t, b, h, bh, rows,
                                                T, DC, DV, scale * LOG2E, BDC, BDV, COUNTS_GRAD, DOT, SUM_DOT, PREC)
            g_n += d_n
            g_sums += d_sums
        store_cache(TN, TC, bh * nsb + g, S, DV, codes, offsets, g_n, g_sums, present, tile_mask)

    @tuned(KEY_BACKWARD_CONFIGS, restore_value=["DVAL", "DCB"])
    @triton.jit
    def _superblock_key_backward_kernel(QC, CB, IDX, V, BIAS, DO, LSE, DELTA, GC, DFC, DVAL, DCB,
                                        sqc_b, sqc_h, sqc_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                                        sd_b, sd_h, sd_t, H, T, S, DC, DV, K, nsb, fold, scale,
                                        L: tl.constexpr, BDC: tl.constexpr, BDV: tl.constexpr,
                                        HAS_BIAS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                                        CODEBOOK_GRAD: tl.constexpr):
        """Key block j's value gradient through its code, added to the window's in DVAL (B, H, T, DV) (strides
        sd_*, in place): from the query blocks that gather it (j+2 .. gK + K, g = ⌊j/K⌋), pᵀ dO; from the caches
        that hold it (superblocks after g), row z_j of GC (B·H, nsb, S, DV), their gradients' exclusive suffix sum;
        and for j < fold, row z_j of the kept state's gradient DFC (B·H, S, DV). With CODEBOOK_GRAD the gathered
        keys' share of the codebook's gradient, σ Σ_b dsᵀ qc_b, added atomically into rows z_j of DCB (B·H, S, DC).
        """
        j, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        nb = tl.cdiv(T, L)
        keys = j * L + tl.arange(0, L)
        scale2 = scale * LOG2E
        codes, ck = gathered_keys(CB, IDX, bh, h, keys, T, S, DC, BDC, DOT)
        vj = load_rows(V, sv_b, sv_h, sv_t, b, h, keys, T, DV, BDV, DOT)
        dv = tl.zeros([L, BDV], tl.float32)
        dk = tl.zeros([L, BDC], tl.float32)
        g = j // K
        for blk in range(j + 2, tl.minimum(g * K + K + 1, nb)):
            rows = blk * L + tl.arange(0, L)
            do, lse, delta = output_grads(DO, LSE, DELTA, sdo_b, sdo_h, sdo_t, b, h, bh, rows, T, DV, BDV, DOT)
            qc = load_rows(QC, sqc_b, sqc_h, sqc_t, b, h, rows, T, DC, BDC, DOT)
            logits = gathered_logits(qc, ck, codes, block_bias(BIAS, blk, HAS_BIAS), scale2, PREC)
            p = tl.where(rows[:, None] < T, tl.exp2(logits - lse[:, None]), 0.0)
            dv = tl.dot(tl.trans(p.to(DOT)), do, dv, input_precision=PREC)
            if CODEBOOK_GRAD:
                ds = p * (tl.dot(do, tl.trans(vj), input_precision=PREC) - delta[:, None])
                dk = tl.dot(tl.trans(ds.to(DOT)), qc, dk, input_precision=PREC)
        inside = codes >= 0
        dv_cols = tl.arange(0, BDV)
        row_mask = inside[:, None] & (dv_cols[None, :] < DV)
        at = codes[:, None] * DV + dv_cols[None, :]
        gs = g + tl.zeros([L], tl.int32)  # the superblock as a vector: masks of one type
        dv += tl.load(GC + (bh * nsb + g) * S * DV + at, mask=row_mask & (gs < nsb)[:, None], other=0.0).to(tl.float32)
        dv += tl.load(DFC + bh * S * DV + at, mask=row_mask & (keys < fold * L)[:, None], other=0.0)
        value_at = DVAL + b * sd_b + h * sd_h + keys[:, None] * sd_t + dv_cols[None, :]
        dv += tl.load(value_at, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(value_at, dv.to(DVAL.dtype.element_ty), mask=row_mask)
        if CODEBOOK_GRAD:
            dc = tl.arange(0, BDC)
            tl.atomic_add(DCB + (bh * S + codes[:, None]) * DC + dc[None, :], dk * scale,
                          mask=inside[:, None] & (dc[None, :] < DC))


def _code_sums(idx, v, *, L: int, start: int, span: int, limit: int, pieces: int, dtype: torch.dtype):
    """The counts (B·H, pieces, S) float32 and value sums (B·H, pieces, S, Dv) in ``dtype`` of blocks
    start + p·span .. start + (p+1)·span − 1 (none from ``limit`` on), for p < pieces."""
    B, H, T, DV = v.shape
    S = idx.S
    tn = torch.empty(B * H, pieces, S, device=v.device, dtype=torch.float32)
    tc = torch.empty(B * H, pieces, S, DV, device=v.device, dtype=dtype)
    dot, prec = dot_dtype(v.dtype)
    _superblock_sums_kernel[lambda meta: (triton.cdiv(S, meta["BS"]), B * H, pieces)](
        IDX=idx.index, V=v, TN=tn, TC=tc, **stride_args("v", v), H=H, T=T, S=S, DV=DV, start=start, span=span,
        limit=limit, nout=pieces, L=L, BDV=register_width(DV), DOT=dot, PREC=prec)
    return tn, tc


@dataclasses.dataclass
class Codes:
    """A hard index (B, H, T) long, contiguous, into S codes."""

    index: torch.Tensor
    S: int


def caches_and_state(idx: Codes, v, n0, c0, *, L: int, K: int, fold: int):
    """The superblock caches, counts (B·H, nsb, S) float32 and value sums (B·H, nsb, S, Dv) (:func:`cache_dtype`:
    bfloat16 beside bfloat16 values, the largest tensors the forward writes), and the state after ``fold`` blocks
    (B·H, S), (B·H, S, Dv) float32, from the initial cache n0, c0 (B·H, S[, Dv]) float32."""
    T = v.shape[2]
    nb = triton.cdiv(T, L)
    nsb = superblocks(nb, K)
    cache_n, cache_c = _code_sums(idx, v, L=L, start=0, span=K, limit=nb, pieces=nsb, dtype=cache_dtype(v.dtype))
    exclusive_scan(cache_n, cache_c, code_tile=SUM_CODE_TILE, base=(n0, c0))
    if fold == 0:
        return cache_n, cache_c, n0.clone(), c0.clone()
    # the state a caller continues from, summed in float32 from the start: a prefill or a carried state, not the
    # training step's hot path
    part_n, part_c = _code_sums(idx, v, L=L, start=0, span=fold, limit=fold, pieces=1, dtype=torch.float32)
    return cache_n, cache_c, n0 + part_n[:, 0], c0 + part_c[:, 0]


def superblock_forward(qw, kw, v, qc, codebook, idx: Codes, code_bias, caches, *, scale: float, L: int, K: int,
                       bad) -> WindowCodes:
    """The forward kernel's launch; ``.out`` holds the output, ``.cnt`` and ``.sm`` the caches it read."""
    B, H, T, D = qw.shape
    S, code_dims = codebook.shape[-2:]
    DV = v.shape[-1]
    qw, kw = unit_last(qw), unit_last(kw)
    qc, cb = aligned_code_dims(unit_last(qc)), aligned_code_dims(codebook).contiguous()
    cnt, sm = caches
    bias = code_bias.float().contiguous() if code_bias is not None else qw
    bad_rows = bad.contiguous().view(torch.uint8) if bad is not None else qw
    out = empty_like_order(v)  # token-major in a layer: the output projection reads a view
    lse = torch.empty(B * H, T, device=qw.device, dtype=torch.float32)
    dot, prec = dot_dtype(qw.dtype)
    DC = cb.shape[-1]
    meta = dict(L=L, BD=register_width(D), BDC=register_width(DC), BDV=register_width(DV),
                HAS_BIAS=code_bias is not None, DOT=dot, SUM_DOT=sum_dot(dot), PREC=prec, HAS_BAD=bad is not None)
    _superblock_forward_kernel[(triton.cdiv(T, L), B * H)](
        QW=qw, KW=kw, V=v, QC=qc, CB=cb, IDX=idx.index, CNT=cnt, SUM=sm, BIAS=bias, BAD=bad_rows, O=out, LSE=lse,
        **stride_args("qw", qw), **stride_args("kw", kw), **stride_args("v", v), **stride_args("qc", qc),
        **stride_args("o", out), H=H, T=T, S=S, D=D, DC=DC, DV=DV, K=K, nsb=cnt.shape[1], scale=float(scale),
        **meta)
    # the record the window's backward reads (window_codes.py), with this kernel's caches
    return WindowCodes(qw, kw, v, qc, cb, cnt, sm, bias, bad_rows, out, lse,
                       dict(meta, HAS_CODES=True, PER_BLOCK=False, K=K), float(scale), code_dims)


def superblock_backward(f: WindowCodes, idx: Codes, grad_out, d_fold_n, d_fold_c, *, fold: int, codebook_grad: bool,
                        counts_grad: bool):
    """dqw, dkw, dv, dqc (padded), the codebook's gradient ((B·H, S, DC) float32, or None) and the initial cache's
    (B·H, S), (B·H, S, Dv) float32."""
    B, H, T, _ = f.qw.shape
    S, DC = f.cb.shape[-2:]
    DV, L, K = f.v.shape[-1], f.meta["L"], f.meta["K"]
    nsb = f.cnt.shape[1]
    f32 = dict(device=f.qw.device, dtype=torch.float32)
    grad_out = unit_last(grad_out)
    delta = output_delta(f, grad_out)
    dqw, dkw, dv = window_backward(f, grad_out, delta)
    dqc = empty_like_order(f.qc)
    dcb = torch.zeros(B * H, S, DC, **f32) if codebook_grad else None
    meta = {key: f.meta[key] for key in ("L", "BDC", "BDV", "HAS_BIAS", "DOT", "PREC")}
    common = dict(H=H, T=T, S=S, DC=DC, DV=DV, K=K, nsb=nsb, scale=f.scale)
    grid = (triton.cdiv(T, L), B * H)
    _superblock_code_backward_kernel[grid](
        QC=f.qc, CB=f.cb, IDX=idx.index, V=f.v, CNT=f.cnt, SUM=f.sm, BIAS=f.bias, DO=grad_out, LSE=f.lse,
        DELTA=delta, DQC=dqc, DCB=dqc if dcb is None else dcb, **stride_args("qc", f.qc), **stride_args("v", f.v),
        **stride_args("do", grad_out), **stride_args("dqc", dqc), **common, **meta, SUM_DOT=f.meta["SUM_DOT"],
        CODEBOOK_GRAD=codebook_grad)
    # the caches' gradients in the sums' dtype, as the caches (their suffix sums are scanned in float32)
    tn, tc = torch.empty(B * H, nsb, S, **f32), torch.empty(B * H, nsb, S, DV, device=f.qw.device, dtype=f.sm.dtype)
    _superblock_cache_grad_kernel[lambda launch: (triton.cdiv(S, launch["BS"]), B * H, nsb)](
        QC=f.qc, CB=f.cb, IDX=idx.index, CNT=f.cnt, BIAS=f.bias, DO=grad_out, LSE=f.lse, DELTA=delta, TN=tn,
        TC=tc, **stride_args("qc", f.qc), **stride_args("do", grad_out), **common, **meta,
        COUNTS_GRAD=counts_grad, SUM_DOT=f.meta["SUM_DOT"])
    d_n0, d_c0 = exclusive_scan(tn, tc, code_tile=SUM_CODE_TILE, reverse=True, total=True)
    d_fold_c = d_fold_c.reshape(B * H, S, DV).float().contiguous() if d_fold_c is not None else None
    _superblock_key_backward_kernel[grid](
        QC=f.qc, CB=f.cb, IDX=idx.index, V=f.v, BIAS=f.bias, DO=grad_out, LSE=f.lse, DELTA=delta, GC=tc,
        DFC=tc if d_fold_c is None else d_fold_c, DVAL=dv, DCB=dqc if dcb is None else dcb,
        **stride_args("qc", f.qc), **stride_args("v", f.v), **stride_args("do", grad_out), **stride_args("d", dv),
        **common, fold=fold if d_fold_c is not None else 0, **meta, CODEBOOK_GRAD=codebook_grad)
    if d_fold_n is not None:
        d_n0 += d_fold_n.reshape(B * H, S)
    if d_fold_c is not None:
        d_c0 += d_fold_c
    return dqw, dkw, dv, dqc, dcb, d_n0, d_c0


class SuperblockVQ(torch.autograd.Function):
    """See :func:`superblock_vq_causal`."""

    @staticmethod
    def forward(ctx, qw, kw, v, qc, codebook, index, counts0, sums0, code_bias, scale: float, L: int, fold: int,
                bad, K: int):
        B, H, T, DV = v.shape
        S = codebook.shape[-2]
        idx = Codes(index.contiguous(), S)
        v = unit_last(v)
        n0 = counts0.float().reshape(B * H, S).contiguous()
        c0 = sums0.float().reshape(B * H, S, DV).contiguous()
        cache_n, cache_c, fold_n, fold_c = caches_and_state(idx, v, n0, c0, L=L, K=K, fold=fold)
        f = superblock_forward(qw, kw, v, qc, codebook, idx, code_bias, (cache_n, cache_c), scale=scale, L=L, K=K,
                               bad=bad)
        if not ctx.needs_input_grad[6]:  # counts of one-hot rows: no gradient reaches anything
            ctx.mark_non_differentiable(fold_n)
        ctx.save_for_backward(*(getattr(f, name) for name in TENSORS), idx.index)
        ctx.forward = dataclasses.replace(f, **dict.fromkeys(TENSORS))  # the tensors are saved, not held
        ctx.fold, ctx.S = fold, S
        ctx.dtypes = (counts0.dtype, sums0.dtype)
        return f.out, fold_n.view(B, H, S), fold_c.view(B, H, S, DV)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, d_fold_n, d_fold_c):
        saved = ctx.saved_tensors
        f = dataclasses.replace(ctx.forward, **dict(zip(TENSORS, saved[:len(TENSORS)])))
        idx = Codes(saved[-1], ctx.S)
        dqw, dkw, dv, dqc, dcb, d_n0, d_c0 = superblock_backward(
            f, idx, grad_out, d_fold_n, d_fold_c, fold=ctx.fold, codebook_grad=ctx.needs_input_grad[4],
            counts_grad=ctx.needs_input_grad[6])
        B, H, T, DV = f.v.shape
        n_dtype, c_dtype = ctx.dtypes
        return (dqw, dkw, dv, dqc[..., :f.code_dims], codebook_gradient(f, dcb), None, d_n0.view(B, H, ctx.S).to(n_dtype),
                d_c0.view(B, H, ctx.S, DV).to(c_dtype), None, None, None, None, None, None)


@torch.compiler.disable  # a graph break: torch.compile runs the kernels as they are
def superblock_vq_causal(qw, kw, v, qc, codebook, index, counts0, sums0, *, code_bias, scale: float, block_len: int,
                         fold: int, superblock: int, bad=None):
    """Causal hard codebook attention with superblock caches of ``superblock`` (K) blocks (see the module doc).

    qw, kw (B, H, T, D) the window's queries and keys, v (B, H, T, Dv), qc (B, H, T, Dc) the code queries, codebook
    (H, S, Dc), index (B, H, T) long the keys' codes; counts0 (B, H, S), sums0 (B, H, S, Dv) the cache before
    position 0; code_bias (nb,) the code logits' bias per query block or None; bad (B, H, T) bool the rows of kw
    read as zeros (non-finite keys; their gradient is 0), or None. Returns out (B, H, T, Dv) in the inputs' dtype
    and the state (B, H, S), (B, H, S, Dv) float32 after the first ``fold`` blocks; differentiable in every tensor
    but index, code_bias and bad.
    """
    return SuperblockVQ.apply(qw, kw, v, qc, codebook, index, counts0, sums0, code_bias, scale, block_len, fold, bad,
                              superblock)
