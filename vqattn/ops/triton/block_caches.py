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
its code (a masked store); soft ones add over tiles (atomic adds). The caches' gradients dC_b are read from what
the vq step's code backward writes (:class:`vqattn.ops.vq.fused.VQCausal`). :func:`block_caches` is the walk pair
as an op of its own, which the tests check against a loop over blocks. The walks' helpers take each tensor's
strides as one (batch, head, token) tuple. Besides vq's formed assignments (hard keys with per-block caches,
``Schedule(superblocks=0)``; soft weights handed in or continuing a state), ovq's fused impl sums its slots' keys and
values with them (:mod:`vqattn.ops.ovq.fused`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..utils import empty_like_order, triton
from .utils import cache_dtype, dot_dtype, register_width, three_programs_per_sm, unit_last

if triton is not None:
    import triton.language as tl

    from .utils import code_tile_layout, hard_index, load_cache, load_rows, store_cache

# Floats of one program's running tile of value sums (codes × value dims) kept in registers.
TILE_FLOATS = 4096


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
    def _prefix_kernel(IDX, WTS, V, N0, C0, NB, CB, NF, CF, sv_b, sv_h, sv_t, H, T, S, DV, fold, L: tl.constexpr,
                       BS: tl.constexpr, BDV: tl.constexpr, HARD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
        """The walk's steps blk = 0 .. nb, one program per (tile of codes, batch·head), from the initial cache
        N0 (B·H, S), C0 (B·H, S, DV); the state after step ``fold`` is stored at NF, CF."""
        sv = (sv_b, sv_h, sv_t)  # strides as a tuple
        bh = tl.program_id(1)
        nb = tl.cdiv(T, L)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        tile = (codes, present, tile_mask, offsets)
        n, sums = load_cache(N0, C0, bh, S, DV, codes, offsets, present, tile_mask)
        # two walks, the state after step ``fold`` stored once between them
        for blk in range(0, fold + 1):
            n, sums = _prefix_step(IDX, WTS, V, NB, CB, n, sums, blk, bh, nb, sv, H, T, S, DV, tile, L, BS, BDV, HARD,
                                   DOT, PREC)
        store_cache(NF, CF, bh, S, DV, codes, offsets, n, sums, present, tile_mask)
        for blk in range(fold + 1, nb + 1):
            n, sums = _prefix_step(IDX, WTS, V, NB, CB, n, sums, blk, bh, nb, sv, H, T, S, DV, tile, L, BS, BDV, HARD,
                                   DOT, PREC)

    @triton.jit
    def _block_cache_grad(DNB, DCB, blk, bh, nb, S, DV, tile, BS: tl.constexpr):
        """The gradient of block blk's cache for this tile of codes, read from DNB (B·H, nb, S), DCB (B·H, nb, S,
        DV); 0 for blk ≥ nb."""
        codes, present, tile_mask, offsets = tile
        blocks = blk + tl.zeros([BS], tl.int32)
        return load_cache(DNB, DCB, bh * nb + blk, S, DV, codes, offsets, present & (blocks < nb), tile_mask)

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
    def _reverse_step(IDX, WTS, V, DNB, DCB, DVAL, DWTS, g_n, g_sums, blk, bh, nb, sv, sd, H, T, S, DV, tile,
                      L: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr, HARD: tl.constexpr, DOT: tl.constexpr,
                      PREC: tl.constexpr, ADD_TO_DVAL: tl.constexpr):
        """Block blk of the reverse walk: the gradient of block blk + 2's cache added to the running sums g, which
        then hold the gradient of block blk's statistics; the block's value (and soft weight) gradients written from
        g; returns g. ``sv``, ``sd``: the strides of V and DVAL; ``tile``: :func:`~.utils.code_tile_layout`'s four."""
        d_n, d_sums = _block_cache_grad(DNB, DCB, blk + 2, bh, nb, S, DV, tile, BS)
        g_n += d_n
        g_sums += d_sums
        _value_grads(IDX, WTS, V, DVAL, DWTS, g_n, g_sums, blk, bh, sv, sd, H, T, S, DV, tile[0], tile[1], L, BS, BDV,
                     HARD, DOT, PREC, ADD_TO_DVAL)
        return g_n, g_sums

    @triton.jit
    def _prefix_backward_kernel(IDX, WTS, V, DNB, DCB, DNF, DCF, DN0, DC0, DVAL, DWTS, sv_b, sv_h, sv_t, sd_b, sd_h,
                                sd_t, H, T, S, DV, fold, L: tl.constexpr, BS: tl.constexpr, BDV: tl.constexpr,
                                HARD: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, ADD_TO_DVAL: tl.constexpr):
        """The reverse walk, one program per (tile of codes, batch·head). DVAL (B, H, T, DV) with strides sd_*:
        written row by row for hard (each row once, by the tile of its code, in the values' dtype; added to what it
        holds with ADD_TO_DVAL), added into (float32) for soft; DWTS (BH, T, S) float32, soft only. The caches'
        gradients are read from DNB, DCB; the state's from DNF, DCF; the initial cache's is written to DN0, DC0."""
        sv, sd = (sv_b, sv_h, sv_t), (sd_b, sd_h, sd_t)  # strides as tuples
        bh = tl.program_id(1)
        nb = tl.cdiv(T, L)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        tile = (codes, present, tile_mask, offsets)
        g_n = tl.zeros([BS], tl.float32)
        g_sums = tl.zeros([BS, BDV], tl.float32)
        # The gradient of block blk's statistics sums those of the caches of blocks ≥ blk + 2 and, for blocks
        # < fold, the state's: two walks, the state's gradient added once between them
        for back in range(0, nb - fold):
            g_n, g_sums = _reverse_step(IDX, WTS, V, DNB, DCB, DVAL, DWTS, g_n, g_sums, nb - 1 - back, bh, nb, sv, sd,
                                        H, T, S, DV, tile, L, BS, BDV, HARD, DOT, PREC, ADD_TO_DVAL)
        f_n, f_sums = load_cache(DNF, DCF, bh, S, DV, codes, offsets, present, tile_mask)
        g_n += f_n
        g_sums += f_sums
        for back in range(0, fold):
            g_n, g_sums = _reverse_step(IDX, WTS, V, DNB, DCB, DVAL, DWTS, g_n, g_sums, fold - 1 - back, bh, nb, sv,
                                        sd, H, T, S, DV, tile, L, BS, BDV, HARD, DOT, PREC, ADD_TO_DVAL)
        # the initial cache is in every block's cache, and in the state
        for blk in range(0, tl.minimum(nb, 2)):
            d_n, d_sums = _block_cache_grad(DNB, DCB, blk, bh, nb, S, DV, tile, BS)
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

    @property
    def hard(self) -> bool:
        return self.meta["HARD"]


def prefix_forward(index, weights, v, counts0, sums0, *, block_len: int, fold: int) -> Prefix:
    """Every block's cache and the state after ``fold`` blocks (see :func:`block_caches`)."""
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
    _prefix_kernel[grid](IDX=idx, WTS=wts, V=v, N0=n0, C0=c0, NB=cache_n, CB=cache_c, NF=fold_n, CF=fold_c,
                         sv_b=v.stride(0), sv_h=v.stride(1), sv_t=v.stride(2), H=H, T=T, S=S, DV=DV, fold=fold, **meta,
                         **_launch(hard, True, v.device))
    return Prefix(idx, wts, v, meta, grid, fold, cache_n, cache_c, fold_n, fold_c)


def reverse_walk(p: Prefix, d_fold_n, d_fold_c, *, d_cache_n=None, d_cache_c=None, d_values=None):
    """The prefix's backward: the values' gradient (in their dtype and memory order), the soft weights' (float32
    (B, H, T, S); None for hard) and the initial cache's (float32). The caches' gradients are d_cache_n,
    d_cache_c (B, H, nb, S[, Dv], or the code backward's (B·H, nb, S[, Dv]): the same memory; None: zeros).
    ``d_values``: a gradient of the values (of their dtype and memory order) the walk adds its own to (in place for
    hard)."""
    B, H, T, DV = p.v.shape
    nb, S, hard = p.cache_n.shape[2], p.cache_n.shape[-1], p.hard
    f32 = dict(device=p.v.device, dtype=torch.float32)
    d_fold_n, d_fold_c = (g.contiguous() if g is not None else torch.zeros(shape, **f32)
                          for g, shape in ((d_fold_n, (B, H, S)), (d_fold_c, (B, H, S, DV))))
    d_cache_n = d_cache_n.contiguous() if d_cache_n is not None else torch.zeros(B, H, nb, S, **f32)
    d_cache_c = d_cache_c.contiguous() if d_cache_c is not None else torch.zeros(B, H, nb, S, DV, **f32)
    d_n0, d_c0 = torch.empty(B, H, S, **f32), torch.empty(B, H, S, DV, **f32)
    # in v's memory order (ops/utils.py); soft rows add up over the code tiles, in float32
    if hard:
        dval = d_values if d_values is not None else empty_like_order(p.v)
    else:
        dval = empty_like_order(p.v, dtype=torch.float32)
        dval.copy_(d_values) if d_values is not None else dval.zero_()
    d_weights = dval if hard else torch.empty(B, H, T, S, **f32)
    _prefix_backward_kernel[p.grid](
        IDX=p.idx, WTS=p.wts, V=p.v, DNB=d_cache_n, DCB=d_cache_c, DNF=d_fold_n, DCF=d_fold_c, DN0=d_n0, DC0=d_c0,
        DVAL=dval, DWTS=d_weights, sv_b=p.v.stride(0), sv_h=p.v.stride(1), sv_t=p.v.stride(2), sd_b=dval.stride(0),
        sd_h=dval.stride(1), sd_t=dval.stride(2), H=H, T=T, S=S, DV=DV, fold=p.fold, **p.meta,
        ADD_TO_DVAL=hard and d_values is not None, **_launch(hard, False, p.v.device))
    return dval.to(p.v.dtype), None if hard else d_weights, d_n0, d_c0


class BlockCaches(torch.autograd.Function):
    """See :func:`block_caches`."""

    @staticmethod
    def forward(ctx, index, weights, v, counts0, sums0, block_len: int, fold: int):
        p = prefix_forward(index, weights, v, counts0, sums0, block_len=block_len, fold=fold)
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
                None)


@torch.compiler.disable  # a graph break: torch.compile runs the kernels as they are
def block_caches(index, weights, v, counts0, sums0, *, block_len: int, fold: int):
    """Every block's cache and the state after ``fold`` blocks (see the module doc), differentiable in v, the soft
    weights and the initial cache.

    index (B, H, T) long (hard; −1: a key of no code) or weights (B, H, T, S) (soft; the other None); v (B, H, T,
    Dv); counts0 (B, H, S), sums0 (B, H, S, Dv) the cache before position 0. Returns the caches n (B, H, nb, S)
    and C (B, H, nb, S, Dv) (nb = ⌈T/L⌉) and the state (B, H, S), (B, H, S, Dv) after the first ``fold`` ≤ nb
    blocks, all float32.
    """
    return BlockCaches.apply(index, weights, v, counts0, sums0, block_len, fold)
