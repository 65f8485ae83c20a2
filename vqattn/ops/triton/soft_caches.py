"""Every block's code cache of soft keys with no (T, S) tensor in memory: the mixture weights are recomputed from
the keys, the codes, τ and one float per key wherever they are needed, forward and backward.

The weights are the GMM posterior of :mod:`.soft_assign`, p_js = softmax_s(x_js), x_js = (k_j·c_s − ‖c_s‖²/2)/τ_h.
The forward stores each key's logsumexp lse_j (:func:`~.soft_assign.soft_logsumexp`); then p_js =
exp2(x_js log2(e) − lse_j) costs one product k·cᵀ. The cache that block b's queries read is

    n_b = n_0 + Σ_{j ≤ b−2} Δ_jᵀ1        C_b = C_0 + Σ_{j ≤ b−2} Δ_jᵀ V_j        (Δ_j: block j's (L, S) weights)

* ``_soft_block_sums_kernel``, one program per (tile of codes, block, batch·head): block j's increments Δ_jᵀ1 and
  Δ_jᵀ V_j, written into slot j + 1 of the caches (the last block's into a tail row); an exclusive scan over the
  slots (:func:`~.utils.exclusive_scan`, from the initial cache) turns them into every block's cache in place.
* Backward, from the caches' gradients dC_b, dn_b: a reverse scan in place gives G_j = Σ_{b ≥ j+2} dC_b (plus the
  kept state's gradient for j < fold), the gradient of block j's increments. With g_js = v_j·G_js + Gn_js, the
  gradient of p_js, and r_j = Σ_s p_js g_js, the scores' gradient is ds_js = p_js (g_js − r_j).
  ``_soft_block_grads_kernel``, one program per (block, batch·head), walks the code tiles twice: for
  dv_j = Σ_s p_js G_js and r_j = v_j·dv_j + Σ_s p_js Gn_js, then for dk_j = Σ_s ds_js c_s / τ and its part of
  dτ = −Σ_js ds_js x_js / τ; ``_soft_code_grads_kernel``, one program per (tile of codes, head, slice of the
  blocks), dc_s = Σ_j ds_js (k_j − c_s) / τ, the slices' sums added atomically (as :mod:`.soft_assign`'s).

So the (T, S) weights, their gradient and the scores' never reach memory: per block only the caches and their
gradients, (S, Dv) each, as the hard keys' per-block design has (:mod:`.block_caches`). The weights are formed five
times (the logsumexp, the sums, twice in the keys' gradient, once in the codes'), 2·S·D FLOPs per key each: the floor
model's ``soft_block_sums`` (benchmarks/kernel_floor.py).
"""

from __future__ import annotations

import torch

from ..utils import triton
from .soft_assign import KEY_SLICES, head_temperatures, soft_logsumexp
from .tuning import configs, tuned
from .utils import (
    CODE_TILE,
    cache_dtype,
    dot_dtype,
    exclusive_scan,
    float32_products,
    register_width,
    stride_args,
    unit_last,
)

if triton is not None:
    import triton.language as tl

    from .soft_assign import _codes
    from .utils import LOG2E, dot_half_rows, load_cache, load_rows, store_cache

# The launch candidates of the three kernels (tuning.py), the first the setting they run with: tiles of CODE_TILE
# codes in 4 warps, as the window-code kernels run theirs, but the keys' gradient in tiles of 32 (compiled for sm_90
# by Triton 3.6, benchmarks/kernel_resources.py: at 64 it spilled 56 bytes, 104 at one stage, 168 in 8 warps; at 32,
# 232 registers and none). None timed on a GPU yet (gpu_check.sh's tune_soft).
SUMS_CONFIGS = configs(dict(BS=CODE_TILE, num_warps=4, num_stages=2), BS=(32, 64, 128), num_warps=(4, 8),
                       num_stages=(1, 2, 3))
GRADS_CONFIGS = configs(dict(BS=32, num_warps=4, num_stages=2), BS=(32, 64, 128), num_warps=(4, 8),
                        num_stages=(1, 2))
CODE_GRADS_CONFIGS = configs(dict(BS=CODE_TILE, num_warps=4, num_stages=2), BS=(32, 64, 128), num_warps=(4, 8),
                             num_stages=(1, 2))

if triton is not None:

    @triton.jit
    def _tile_layout(codes, S, DV, BDV: tl.constexpr):
        """Which of ``codes`` exist, and the (BS, BDV) mask and offsets of their rows in one (S, DV) matrix."""
        present = codes < S
        dv = tl.arange(0, BDV)
        return present, present[:, None] & (dv[None, :] < DV), codes[:, None] * DV + dv[None, :]

    @triton.jit
    def _mixture(k, C, HN, LSE, h, bh, rows, codes, T, S, D, scale2, BD: tl.constexpr, KPREC: tl.constexpr,
                 EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr):
        """The weights p (L, BS) float32 of keys k (L, BD) float32 at ``rows`` to ``codes``, recomputed from their
        logsumexp (0 past T and past S), their scores x τ = k·c − ‖c‖²/2, and the codes (BS, BD)."""
        present = codes < S
        c = _codes(C, h, codes, S, D, BD)
        half_norms = tl.load(HN + h * S + codes, mask=present, other=0.0)
        x = dot_half_rows(k, c, HALF_ROWS, KPREC, EXACT_PREC) - half_norms[None, :]
        lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=0.0)
        inside = (rows[:, None] < T) & present[None, :]
        return tl.where(inside, tl.exp2(tl.where(inside, x * scale2 - lse[:, None], 0.0)), 0.0), x, c

    @triton.jit
    def _increment_gradient(GN, GC, FN, FC, bh, blk, nb, fold, S, DV, codes, BDV: tl.constexpr):
        """G for block blk's increments and this tile of codes: slot blk + 1 of the reverse-scanned cache gradients
        (Σ_{b ≥ blk+2} dC_b; none for the last block) plus the kept state's gradient if blk < fold."""
        present, tile_mask, offsets = _tile_layout(codes, S, DV, BDV)
        blocks = blk + tl.zeros_like(codes)  # the block index as a vector: masks of one type
        g_n, g_c = load_cache(GN, GC, bh * nb + blk + 1, S, DV, codes, offsets, present & (blocks + 1 < nb),
                              tile_mask)
        f_n, f_c = load_cache(FN, FC, bh, S, DV, codes, offsets, present & (blocks < fold), tile_mask)
        return g_n + f_n, g_c + f_c

    @tuned(SUMS_CONFIGS, key=("S", "D", "DV", "L"))
    @triton.jit
    def _soft_block_sums_kernel(K, C, HN, TAU, LSE, V, NB, CB, TN, TC, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, H, T, S,
                                D, DV, L: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                                DOT: tl.constexpr, PREC: tl.constexpr, KPREC: tl.constexpr,
                                EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr):
        """Block blk's Δᵀ1 and ΔᵀV for this tile of codes, into slot blk + 1 of NB (B·H, nb, S), CB
        (B·H, nb, S, DV); the last block's into TN (B·H, S), TC (B·H, S, DV)."""
        tile, blk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        nb = tl.cdiv(T, L)
        codes = tile * BS + tl.arange(0, BS)
        present, tile_mask, offsets = _tile_layout(codes, S, DV, BDV)
        rows = blk * L + tl.arange(0, L)
        k = load_rows(K, sk_b, sk_h, sk_t, b, h, rows, T, D, BD, tl.float32)
        p, _, _ = _mixture(k, C, HN, LSE, h, bh, rows, codes, T, S, D, LOG2E / tl.load(TAU + h), BD, KPREC,
                           EXACT_PREC, HALF_ROWS)
        v = load_rows(V, sv_b, sv_h, sv_t, b, h, rows, T, DV, BDV, DOT)
        n = tl.sum(p, 0)
        sums = tl.dot(tl.trans(p.to(DOT)), v, input_precision=PREC)
        blocks = blk + tl.zeros_like(codes)
        store_cache(NB, CB, bh * nb + blk + 1, S, DV, codes, offsets, n, sums, present & (blocks + 1 < nb),
                    tile_mask)
        store_cache(TN, TC, bh, S, DV, codes, offsets, n, sums, present & (blocks + 1 == nb), tile_mask)

    @tuned(GRADS_CONFIGS, key=("S", "D", "DV", "L"))
    @triton.jit
    def _soft_block_grads_kernel(K, C, HN, TAU, LSE, V, GN, GC, FN, FC, DK, DVAL, R, DTAU, sk_b, sk_h, sk_t, sv_b,
                                 sv_h, sv_t, H, T, S, D, DV, fold, L: tl.constexpr, BS: tl.constexpr,
                                 BD: tl.constexpr, BDV: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                                 KPREC: tl.constexpr, EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr,
                                 TAU_GRAD: tl.constexpr):
        """Block blk's keys' and values' gradients through its increments, DK (B·H, T, D) and DVAL (B·H, T, DV)
        float32; r_j into R (B·H, T); with TAU_GRAD the block's part of dτ into DTAU (B·H, nb). Two walks over the
        code tiles: the first forms dv_j = Σ_s p_js G_js and r_j = v_j·dv_j + Σ_s p_js Gn_js, the second
        ds = p (g − r) and Σ_s ds_js c_s (forming ds before multiplying by the codes keeps saturated weights
        exact: Σ p g c − r Σ p c would cancel)."""
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        nb = tl.cdiv(T, L)
        rows = blk * L + tl.arange(0, L)
        k = load_rows(K, sk_b, sk_h, sk_t, b, h, rows, T, D, BD, tl.float32)
        v = load_rows(V, sv_b, sv_h, sv_t, b, h, rows, T, DV, BDV, DOT)
        inv_tau = 1.0 / tl.load(TAU + h)
        dv = tl.zeros([L, BDV], tl.float32)
        p_gn = tl.zeros([L], tl.float32)  # Σ_s p Gn
        p_sum = tl.zeros([L], tl.float32)  # Σ_s p: 1 but for the rounding of the stored logsumexp
        for s0 in range(0, S, BS):
            codes = s0 + tl.arange(0, BS)
            p, _, _ = _mixture(k, C, HN, LSE, h, bh, rows, codes, T, S, D, LOG2E * inv_tau, BD, KPREC, EXACT_PREC,
                               HALF_ROWS)
            g_n, g_c = _increment_gradient(GN, GC, FN, FC, bh, blk, nb, fold, S, DV, codes, BDV)
            dv = tl.dot(p.to(DOT), g_c.to(DOT), dv, input_precision=PREC)
            p_gn += tl.sum(p * g_n[None, :], 1)
            p_sum += tl.sum(p, 1)
        # dv and r = Σ_s p g (g = v·G + Gn) over Σ_s p: a logsumexp of scores in the thousands is off by its last
        # bit, so the recomputed weights sum to 1 + ε; divided so, dv is exact and ds = p (g − r) off by ε relative
        # (ε·p·r otherwise, large beside the small ds of saturated weights)
        p_sum = tl.where(rows < T, p_sum, 1.0)
        dv = dv / p_sum[:, None]
        r = tl.sum(v.to(tl.float32) * dv, 1) + p_gn / p_sum
        ds_c = tl.zeros([L, BD], tl.float32)  # Σ_s ds_js c_s
        ds_x = tl.zeros([L], tl.float32)  # Σ_s ds_js x_js τ, for dτ
        for s0 in range(0, S, BS):
            codes = s0 + tl.arange(0, BS)
            p, x, c = _mixture(k, C, HN, LSE, h, bh, rows, codes, T, S, D, LOG2E * inv_tau, BD, KPREC, EXACT_PREC,
                               HALF_ROWS)
            g_n, g_c = _increment_gradient(GN, GC, FN, FC, bh, blk, nb, fold, S, DV, codes, BDV)
            g = tl.dot(v, tl.trans(g_c.to(DOT)), input_precision=PREC) + g_n[None, :]
            ds = p * (g - r[:, None])
            ds_c = tl.dot(ds, c, ds_c, input_precision=KPREC)
            if TAU_GRAD:
                ds_x += tl.sum(ds * x, 1)
        dims, dvs = tl.arange(0, BD), tl.arange(0, BDV)
        inside = rows[:, None] < T
        tl.store(DK + (bh * T + rows[:, None]) * D + dims[None, :], ds_c * inv_tau, mask=inside & (dims[None, :] < D))
        tl.store(DVAL + (bh * T + rows[:, None]) * DV + dvs[None, :], dv, mask=inside & (dvs[None, :] < DV))
        tl.store(R + bh * T + rows, r, mask=rows < T)
        if TAU_GRAD:  # dτ = −Σ ds·x / τ (x the logits, x τ the scores)
            tl.store(DTAU + bh * nb + blk, -tl.sum(ds_x, 0) * inv_tau * inv_tau)

    @tuned(CODE_GRADS_CONFIGS, key=("S", "D", "DV", "L"), reset_to_zero=["DC"])  # added into atomically
    @triton.jit
    def _soft_code_grads_kernel(K, C, HN, TAU, LSE, V, GN, GC, FN, FC, R, DC, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, H,
                                T, S, D, DV, fold, num_blocks, blocks_per_slice, L: tl.constexpr, BS: tl.constexpr,
                                BD: tl.constexpr, BDV: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                                KPREC: tl.constexpr, EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr):
        """dc_s = (Σ_j ds_js k_j − c_s Σ_j ds_js) / τ for this tile of codes over a slice of the (batch, block)
        pairs, added atomically into DC (H, S, D) float32."""
        tile, h, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        nb = tl.cdiv(T, L)
        codes = tile * BS + tl.arange(0, BS)
        inv_tau = 1.0 / tl.load(TAU + h)
        acc = tl.zeros([BD, BS], tl.float32)  # Σ_j k_j ds_js, transposed: the keys are the exact operand
        ds_sum = tl.zeros([BS], tl.float32)
        first = part * blocks_per_slice
        for i in range(first, tl.minimum(first + blocks_per_slice, num_blocks)):
            b, blk = i // nb, i % nb
            bh = b * H + h
            rows = blk * L + tl.arange(0, L)
            k = load_rows(K, sk_b, sk_h, sk_t, b, h, rows, T, D, BD, tl.float32)
            v = load_rows(V, sv_b, sv_h, sv_t, b, h, rows, T, DV, BDV, DOT)
            p, _, _ = _mixture(k, C, HN, LSE, h, bh, rows, codes, T, S, D, LOG2E * inv_tau, BD, KPREC, EXACT_PREC,
                               HALF_ROWS)
            g_n, g_c = _increment_gradient(GN, GC, FN, FC, bh, blk, nb, fold, S, DV, codes, BDV)
            g = tl.dot(v, tl.trans(g_c.to(DOT)), input_precision=PREC) + g_n[None, :]
            r = tl.load(R + bh * T + rows, mask=rows < T, other=0.0)
            ds = p * (g - r[:, None])
            acc += dot_half_rows(tl.trans(k), tl.trans(ds), HALF_ROWS, KPREC, EXACT_PREC)
            ds_sum += tl.sum(ds, 0)
        dims = tl.arange(0, BD)
        present = (codes[:, None] < S) & (dims[None, :] < D)
        at = (h * S + codes[:, None]) * D + dims[None, :]
        c = tl.load(C + at, mask=present, other=0.0)
        tl.atomic_add(DC + at, (tl.trans(acc) - c * ds_sum[:, None]) * inv_tau, mask=present)


def _meta(k: torch.Tensor, v: torch.Tensor, block_len: int) -> dict:
    """The constexprs of the module's kernels: the values' product type (as the cache walks'), the keys' float32
    products against the codes (as the soft assignment's)."""
    dot, prec = dot_dtype(v.dtype)
    products = float32_products(k.dtype)
    return dict(L=block_len, BD=register_width(k.shape[-1]), BDV=register_width(v.shape[-1]), DOT=dot,
                PREC=prec, KPREC=products["PREC"], EXACT_PREC=products["EXACT_PREC"],
                HALF_ROWS=products["HALF_ROWS"])


def _fold_state(cache_n, cache_c, totals, tail, fold: int):
    """The cache after ``fold`` blocks, n_0 + Σ_{j < fold} (increments): block fold + 1's cache, or, past the
    caches, the scan's total (every block but the last) and the tail (the last)."""
    nb = cache_n.shape[2]
    if fold + 1 < nb:
        # copies, not views of the caches: an output of the Function of its own
        return cache_n[:, :, fold + 1].clone(), cache_c[:, :, fold + 1].to(torch.float32, copy=True)
    n, c = (x.view(cache_n.shape[0], cache_n.shape[1], *x.shape[1:]) for x in totals)
    if fold == nb:
        n, c = (x + t.view_as(x) for x, t in zip((n, c), tail))
    return n, c


class SoftBlockCaches(torch.autograd.Function):
    """See :func:`soft_block_caches`."""

    @staticmethod
    def forward(ctx, k, codes, tau, v, counts0, sums0, block_len: int, fold: int):
        B, H, T, D = k.shape
        S, DV = codes.shape[1], v.shape[-1]
        nb = triton.cdiv(T, block_len)
        k, v = unit_last(k), unit_last(v)
        codes = codes.float().contiguous()
        half_norms = 0.5 * codes.square().sum(-1)
        lse = soft_logsumexp(k, codes, half_norms, tau)
        f32 = dict(device=k.device, dtype=torch.float32)
        cache_n = torch.empty(B, H, nb, S, **f32)
        cache_c = torch.empty(B, H, nb, S, DV, device=k.device, dtype=cache_dtype(v.dtype))
        cache_n[:, :, 0], cache_c[:, :, 0] = 0, 0  # slot 0 adds nothing: block 0's cache is the initial one
        tail = torch.empty(B * H, S, **f32), torch.empty(B * H, S, DV, **f32)
        meta = _meta(k, v, block_len)
        _soft_block_sums_kernel[lambda launch: (triton.cdiv(S, launch["BS"]), nb, B * H)](
            K=k, C=codes, HN=half_norms, TAU=tau, LSE=lse, V=v, NB=cache_n, CB=cache_c, TN=tail[0], TC=tail[1],
            **stride_args("k", k), **stride_args("v", v), H=H, T=T, S=S, D=D, DV=DV, **meta)
        base = counts0.float().reshape(B * H, S).contiguous(), sums0.float().reshape(B * H, S, DV).contiguous()
        totals = exclusive_scan(cache_n.view(B * H, nb, S), cache_c.view(B * H, nb, S, DV), code_tile=CODE_TILE,
                                base=base, total=True)
        fold_n, fold_c = _fold_state(cache_n, cache_c, totals, tail, fold)
        ctx.save_for_backward(k, codes, half_norms, tau, lse, v)
        ctx.fold, ctx.block_len = fold, block_len
        ctx.dtypes = counts0.dtype, sums0.dtype
        return cache_n, cache_c, fold_n, fold_c

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_cache_n, d_cache_c, d_fold_n, d_fold_c):
        k, codes, half_norms, tau, lse, v = ctx.saved_tensors
        need_k, need_codes, need_tau, need_v, need_n0, need_c0 = ctx.needs_input_grad[:6]
        B, H, T, D = k.shape
        S, DV = codes.shape[1], v.shape[-1]
        L, fold = ctx.block_len, ctx.fold
        nb = triton.cdiv(T, L)
        f32 = dict(device=k.device, dtype=torch.float32)
        # the caches' gradients, reverse-scanned in place (each is this Function's alone): slot b then holds
        # Σ_{b' > b} dC_b', which is the gradient of block b − 1's increments
        grads = []
        for g, shape, dtype in ((d_cache_n, (B * H, nb, S), torch.float32),
                                (d_cache_c, (B * H, nb, S, DV), cache_dtype(v.dtype))):
            grads.append(torch.zeros(shape, device=k.device, dtype=dtype) if g is None
                         else g.reshape(shape).to(dtype).contiguous())
        g_n, g_c = grads
        totals = exclusive_scan(g_n, g_c, code_tile=CODE_TILE, reverse=True, total=True)
        d_fold_n, d_fold_c = (torch.zeros(shape, **f32) if g is None else g.float().reshape(shape).contiguous()
                              for g, shape in ((d_fold_n, (B * H, S)), (d_fold_c, (B * H, S, DV))))
        kernel_args = dict(K=k, C=codes, HN=half_norms, TAU=tau, LSE=lse, V=v, GN=g_n, GC=g_c, FN=d_fold_n,
                           FC=d_fold_c, **stride_args("k", k), **stride_args("v", v), H=H, T=T, S=S, D=D, DV=DV,
                           fold=fold, **_meta(k, v, L))
        grad_k = torch.empty(B, H, T, D, **f32)
        grad_v = torch.empty(B, H, T, DV, **f32)
        row_sums = torch.empty(B * H, T, **f32)
        grad_tau = torch.empty(B * H, nb, **f32) if need_tau else row_sums
        _soft_block_grads_kernel[(nb, B * H)](DK=grad_k, DVAL=grad_v, R=row_sums, DTAU=grad_tau, **kernel_args,
                                              TAU_GRAD=need_tau)
        grad_codes = None
        if need_codes:
            grad_codes = torch.zeros(H, S, D, **f32)
            slices = min(KEY_SLICES, B * nb)
            per_slice = triton.cdiv(B * nb, slices)
            _soft_code_grads_kernel[lambda launch: (triton.cdiv(S, launch["BS"]), H, triton.cdiv(B * nb, per_slice))](
                R=row_sums, DC=grad_codes, **kernel_args, num_blocks=B * nb, blocks_per_slice=per_slice)
        n_dtype, c_dtype = ctx.dtypes
        d_n0 = (totals[0] + d_fold_n).view(B, H, S).to(n_dtype) if need_n0 else None
        d_c0 = (totals[1] + d_fold_c).view(B, H, S, DV).to(c_dtype) if need_c0 else None
        return (grad_k.to(k.dtype) if need_k else None, grad_codes,
                grad_tau.view(B, H, nb).sum((0, 2)) if need_tau else None, grad_v.to(v.dtype) if need_v else None,
                d_n0, d_c0, None, None)


@torch.compiler.disable  # a graph break: torch.compile runs the kernels as they are
def soft_block_caches(k, codes, temperature, v, counts0, sums0, *, block_len: int, fold: int):
    """Every block's cache of soft keys and the state after ``fold`` blocks (see the module doc), differentiable in
    the keys, the codes, the temperature, the values and the initial cache.

    k (B, H, T, D) the keys the mixture weighs, codes (H, S, D), temperature a tensor of 1 or H values (or a
    number), v (B, H, T, Dv); counts0 (B, H, S), sums0 (B, H, S, Dv) the cache before position 0. Returns the caches
    n (B, H, nb, S) float32 and C (B, H, nb, S, Dv) (:func:`~.utils.cache_dtype`; nb = ⌈T/L⌉) and the state
    (B, H, S), (B, H, S, Dv) float32 after the first ``fold`` ≤ nb blocks.
    """
    tau = head_temperatures(temperature, k.shape[1], k.device)
    return SoftBlockCaches.apply(k, codes, tau, v, counts0, sums0, block_len, fold)
