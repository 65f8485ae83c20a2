"""Soft keys in kernels: the GMM posterior's assignment and its gradients, and every block's code cache with no
(T, S) tensor in memory.

**The assignment** and its gradients: the GMM posterior of :mod:`vqattn.ops.vq.assign`,

    p_js = softmax_s(x_js),   x_js = (k_j·c_s − ‖c_s‖²/2) / τ_h        (the −‖k_j‖²/2τ of −‖k_j − c_s‖²/2τ cancels)

for keys k (B, H, T, D), codes c (H, S, D) and one temperature τ_h per head.

PyTorch's form writes the (T, S) scores, reads them back for the softmax, and multiplies float32 operands without
tensor cores; its backward makes three more passes over (T, S) tensors and two more float32 products. Here:

* **forward**: one program per (block of keys, batch·head) walks the code tiles twice, first for the running max and
  sum of exponentials (an online softmax), then for the normalised weights, which are the only (T, S) write;
* **keys' gradient**: with g = dL/dp, r_j = Σ_s g_js p_js and the scores' gradient ds_js = p_js (g_js − r_j), one
  program per key block forms r_j in a first walk, then dk_j = Σ_s ds_js c_s / τ (and, for a learned temperature,
  its part of dτ_h = −Σ_js ds_js x_js / τ_h, from Σ_s ds_js x_js τ = k_j·(Σ_s ds_js c_s) − Σ_s ds_js ‖c_s‖²/2: no
  scores formed);
* **codes' gradient**: dc_s = (Σ_j ds_js k_j − c_s Σ_j ds_js) / τ, one program per (tile of codes, head, slice of
  the keys) walking its key blocks, the slices' sums added atomically.

Products of float32 operands take :func:`~vqattn.ops.triton.utils.float32_precision`'s precision (three TF32
products beside half keys on a GPU; for float32 keys IEEE float32, or TF32 where PyTorch's float32 matmuls may be);
the keys' products with the codes and with the scores' gradient take two
(:func:`~vqattn.ops.triton.utils.dot_half_rows`: half keys are exact in TF32, so only the other operand
splits). Everything accumulates in float32.

**Every block's cache**, with no (T, S) tensor in memory: the mixture weights are recomputed from the keys, the
codes, τ and one float per key wherever they are needed, forward and backward. The weights are the posterior above.
The forward stores each key's logsumexp lse_j (:func:`soft_logsumexp`); then p_js =
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
  blocks), dc_s = Σ_j ds_js (k_j − c_s) / τ, the slices' sums added atomically (as the assignment's's).

So the (T, S) weights, their gradient and the scores' never reach memory: per block only the caches and their
gradients, (S, Dv) each, as the hard keys' per-block design has (:mod:`.block_caches`). The weights are formed five
times (the logsumexp, the sums, twice in the keys' gradient, once in the codes'), 2·S·D FLOPs per key each: the floor
model's ``soft_block_sums`` (benchmarks/kernel_floor.py).
"""

from __future__ import annotations

import torch

from ..utils import empty_like_order, triton
from .nearest import ASSIGN_KEYS, ASSIGN_LAUNCH, KEY_BLOCK
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

    from .utils import LOG2E, dot_half_rows, load_cache, load_rows, store_cache

# Slices of the keys that the codes' gradient sums separately (then atomically): enough programs to fill a GPU
# with a few hundred codes, and few additions into each code.
KEY_SLICES = 16
# The backward kernels stream float32 (T, S) tiles of the weights and their gradient, and stage none of them: one
# stage leaves twice the programs per SM of three, and the soft reverse cache walk, which streams the same tiles,
# is faster at one stage (docs/performance_notes.md, "Kernel resources"; these kernels are not yet timed at either).
BACKWARD_LAUNCH = dict(num_stages=1)
# What _soft_assign_kernel writes (its OUT; the kernel reads them as constexprs).
WEIGHTS, LOGSUMEXP, STATISTICS = 0, 1, 2
if triton is not None:
    _WEIGHTS, _LOGSUMEXP, _STATISTICS = tl.constexpr(WEIGHTS), tl.constexpr(LOGSUMEXP), tl.constexpr(STATISTICS)

if triton is not None:

    @triton.jit
    def _scores(k, C, HN, h, codes, S, D, BD: tl.constexpr, PREC: tl.constexpr, EXACT_PREC: tl.constexpr,
                HALF_ROWS: tl.constexpr):
        """(k·c_s − ‖c_s‖²/2) for the codes of one tile (−inf past S): k (L, BD) float32, C (H, S, D) float32, HN
        (H, S) the codes' ‖c_s‖²/2 (formed once per call, not per tile of every program)."""
        half_norms = tl.load(HN + h * S + codes, mask=codes < S, other=float("inf"))  # absent codes score −inf
        return dot_half_rows(k, _codes(C, h, codes, S, D, BD), HALF_ROWS, PREC, EXACT_PREC) - half_norms[None, :]

    @triton.jit
    def _codes(C, h, codes, S, D, BD: tl.constexpr):
        """The rows ``codes`` (BS, BD) of head h's codes in C (H, S, D) float32, zeros past S and D."""
        dims = tl.arange(0, BD)
        return tl.load(C + (h * S + codes[:, None]) * D + dims[None, :],
                       mask=(codes[:, None] < S) & (dims[None, :] < D), other=0.0)

    @triton.jit
    def _tile(bh, rows, codes, T, S):
        """Offsets and mask of a (rows, codes) tile of a contiguous (B·H, T, S) tensor."""
        return (bh * T + rows[:, None]) * S + codes[None, :], (rows[:, None] < T) & (codes[None, :] < S)

    @triton.jit
    def _soft_assign_kernel(K, C, HN, TAU, P, LSE, IDX, sk_b, sk_h, sk_t, H, T, S, D, L: tl.constexpr,
                            BS: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, EXACT_PREC: tl.constexpr,
                            HALF_ROWS: tl.constexpr, OUT: tl.constexpr):
        """OUT = :data:`WEIGHTS`: the weights P (B·H, T, S); :data:`LOGSUMEXP`: each key's logsumexp of its scaled
        scores in base 2, LSE (B·H, T) float32, from which p_js = exp2(x_js log2(e) − lse_j) (the block caches
        recompute them); :data:`STATISTICS`: the soft counts Σ_j p_js added into P (H, S) float32 and each key's
        most probable code into IDX (B·H, T) (a codebook's statistics, no (T, S) tensor)."""
        blk, bh = tl.program_id(0), tl.program_id(1)
        h = bh % H
        rows = blk * L + tl.arange(0, L)
        k = load_rows(K, sk_b, sk_h, sk_t, bh // H, h, rows, T, D, BD, tl.float32)
        scale2 = LOG2E / tl.load(TAU + h)  # the softmax in base 2, as the window-code kernels run theirs
        row_max = tl.full([L], float("-inf"), tl.float32)
        row_sum = tl.zeros([L], tl.float32)
        best = tl.zeros([L], tl.int32)
        for s0 in range(0, S, BS):
            x = _scores(k, C, HN, h, s0 + tl.arange(0, BS), S, D, BD, PREC, EXACT_PREC, HALF_ROWS) * scale2
            tile_max = tl.max(x, 1)
            if OUT == _STATISTICS:  # the first code of the largest score, as torch.max's index
                best = tl.where(tile_max > row_max, s0 + tl.argmax(x, 1), best)
            new_max = tl.maximum(row_max, tile_max)
            row_sum = row_sum * tl.exp2(row_max - new_max) + tl.sum(tl.exp2(x - new_max[:, None]), 1)
            row_max = new_max
        if OUT == _LOGSUMEXP:
            tl.store(LSE + bh * T + rows, row_max + tl.log2(row_sum), mask=rows < T)
        else:
            inv_sum = 1.0 / row_sum
            for s0 in range(0, S, BS):
                codes = s0 + tl.arange(0, BS)
                x = _scores(k, C, HN, h, codes, S, D, BD, PREC, EXACT_PREC, HALF_ROWS) * scale2
                at, mask = _tile(bh, rows, codes, T, S)
                p = tl.exp2(x - row_max[:, None]) * inv_sum[:, None]
                if OUT == _WEIGHTS:
                    tl.store(P + at, p, mask=mask)
                else:
                    tl.atomic_add(P + h * S + codes, tl.sum(tl.where(mask, p, 0.0), 0), mask=codes < S)
            if OUT == _STATISTICS:
                tl.store(IDX + bh * T + rows, best.to(tl.int64), mask=rows < T)

    @triton.jit
    def _soft_key_grad_kernel(K, C, HN, TAU, P, G, DK, R, DTAU, sk_b, sk_h, sk_t, sd_b, sd_h, sd_t, H, T, S, D,
                         L: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                         TAU_GRAD: tl.constexpr):
        blk, bh = tl.program_id(0), tl.program_id(1)
        h = bh % H
        rows = blk * L + tl.arange(0, L)
        inv_tau = 1.0 / tl.load(TAU + h)
        r = tl.zeros([L], tl.float32)
        for s0 in range(0, S, BS):
            at, mask = _tile(bh, rows, s0 + tl.arange(0, BS), T, S)
            r += tl.sum(tl.load(G + at, mask=mask, other=0.0) * tl.load(P + at, mask=mask, other=0.0), 1)
        dk = tl.zeros([L, BD], tl.float32)  # Σ_s ds_js c_s, scaled by 1/τ at the store
        ds_hn = tl.zeros([L], tl.float32)  # Σ_s ds_js ‖c_s‖²/2, for the temperature
        for s0 in range(0, S, BS):
            codes = s0 + tl.arange(0, BS)
            at, mask = _tile(bh, rows, codes, T, S)
            ds = tl.load(P + at, mask=mask, other=0.0) * (tl.load(G + at, mask=mask, other=0.0) - r[:, None])
            dk = tl.dot(ds, _codes(C, h, codes, S, D, BD), dk, input_precision=PREC)
            if TAU_GRAD:
                ds_hn += tl.sum(ds * tl.load(HN + h * S + codes, mask=codes < S, other=0.0)[None, :], 1)
        dims = tl.arange(0, BD)
        tl.store(DK + (bh // H) * sd_b + h * sd_h + rows[:, None] * sd_t + dims[None, :], dk * inv_tau,
                 mask=(rows[:, None] < T) & (dims[None, :] < D))
        tl.store(R + bh * T + rows, r, mask=rows < T)
        if TAU_GRAD:  # dτ = −Σ ds·x / τ with x = scores / τ: this block's part
            # Σ_s ds_js (k_j·c_s − ‖c_s‖²/2) = k_j·(Σ_s ds_js c_s) − Σ_s ds_js ‖c_s‖²/2: the scores never formed
            k = load_rows(K, sk_b, sk_h, sk_t, bh // H, h, rows, T, D, BD, tl.float32)
            ds_x = tl.sum(k * dk, 1) - ds_hn
            tl.store(DTAU + bh * tl.num_programs(0) + blk, -tl.sum(ds_x, 0) * inv_tau * inv_tau)

    @triton.jit
    def _soft_code_grad_kernel(K, C, TAU, P, G, R, DC, sk_b, sk_h, sk_t, H, T, S, D, num_blocks, blocks_per_slice,
                          L: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                          EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr):
        tile, h, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        codes = tile * BS + tl.arange(0, BS)
        dims = tl.arange(0, BD)
        acc = tl.zeros([BD, BS], tl.float32)  # Σ_j k_j ds_js, transposed: the keys are the exact operand
        ds_sum = tl.zeros([BS], tl.float32)  # Σ_j ds_js
        first = part * blocks_per_slice
        for i in range(first, tl.minimum(first + blocks_per_slice, num_blocks)):
            b, blk = i // tl.cdiv(T, L), i % tl.cdiv(T, L)
            bh = b * H + h
            rows = blk * L + tl.arange(0, L)
            at, mask = _tile(bh, rows, codes, T, S)
            r = tl.load(R + bh * T + rows, mask=rows < T, other=0.0)
            ds = tl.load(P + at, mask=mask, other=0.0) * (tl.load(G + at, mask=mask, other=0.0) - r[:, None])
            k = load_rows(K, sk_b, sk_h, sk_t, b, h, rows, T, D, BD, tl.float32)
            acc += dot_half_rows(tl.trans(k), tl.trans(ds), HALF_ROWS, PREC, EXACT_PREC)
            ds_sum += tl.sum(ds, 0)
        present = (codes[:, None] < S) & (dims[None, :] < D)
        ptrs = (h * S + codes[:, None]) * D + dims[None, :]
        c = tl.load(C + ptrs, mask=present, other=0.0)
        tl.atomic_add(DC + ptrs, (tl.trans(acc) - c * ds_sum[:, None]) / tl.load(TAU + h), mask=present)


class SoftAssign(torch.autograd.Function):
    """p (B, H, T, S) float32 of keys k (B, H, T, D), codes c (H, S, D) float32 and temperatures τ (H,) float32, by
    the kernels of the module doc."""

    @staticmethod
    def forward(ctx, k, c, tau):
        B, H, T, D = k.shape
        S = c.shape[1]
        k = unit_last(k)
        half_norms = 0.5 * c.square().sum(-1)
        weights = torch.empty(B, H, T, S, device=k.device, dtype=torch.float32)
        _soft_assign_kernel[(triton.cdiv(T, ASSIGN_KEYS), B * H)](  # as the hard assignment's (nearest.py)
            K=k, C=c, HN=half_norms, TAU=tau, P=weights, LSE=weights, IDX=weights, **stride_args("k", k), H=H, T=T,
            S=S, D=D, L=ASSIGN_KEYS, BS=CODE_TILE, BD=register_width(D), **float32_products(k.dtype), OUT=WEIGHTS,
            **ASSIGN_LAUNCH)
        ctx.save_for_backward(k, c, half_norms, tau, weights)
        return weights

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        k, c, half_norms, tau, weights = ctx.saved_tensors
        need_k, need_c, need_tau = ctx.needs_input_grad
        B, H, T, D = k.shape
        S = c.shape[1]
        grad = grad.float().contiguous()
        blocks = triton.cdiv(T, KEY_BLOCK)
        shape = dict(L=KEY_BLOCK, BS=CODE_TILE, BD=register_width(D))
        products = float32_products(k.dtype)
        strides = stride_args("k", k)
        grad_k = empty_like_order(k, dtype=torch.float32)  # in k's memory order (ops/utils.py)
        row_sums = torch.empty(B, H, T, device=k.device, dtype=torch.float32)
        grad_tau = torch.empty(B, H, blocks, device=k.device, dtype=torch.float32) if need_tau else grad_k
        _soft_key_grad_kernel[(blocks, B * H)](K=k, C=c, HN=half_norms, TAU=tau, P=weights, G=grad, DK=grad_k,
                                               R=row_sums, DTAU=grad_tau, **strides, **stride_args("d", grad_k),
                                               H=H, T=T, S=S, D=D, TAU_GRAD=need_tau, **shape,
                                               PREC=products["PREC"], **BACKWARD_LAUNCH)
        grad_c = None
        if need_c:
            grad_c = torch.zeros_like(c)
            slices = min(KEY_SLICES, B * blocks)
            per_slice = triton.cdiv(B * blocks, slices)
            _soft_code_grad_kernel[(triton.cdiv(S, CODE_TILE), H, triton.cdiv(B * blocks, per_slice))](
                K=k, C=c, TAU=tau, P=weights, G=grad, R=row_sums, DC=grad_c, **strides, H=H, T=T, S=S, D=D,
                num_blocks=B * blocks, blocks_per_slice=per_slice, **shape, **products, **BACKWARD_LAUNCH)
        return (grad_k.to(k.dtype) if need_k else None, grad_c,
                grad_tau.sum((0, 2)) if need_tau else None)


def head_temperatures(temperature, num_heads: int, device) -> torch.Tensor:
    """τ_h (H,) float32 contiguous, what the kernels read: from a tensor of 1 or H values (its gradient kept) or a
    number."""
    if isinstance(temperature, torch.Tensor):
        return temperature.float().reshape(-1).expand(num_heads).contiguous()
    return torch.full((num_heads,), float(temperature), device=device, dtype=torch.float32)


def soft_logsumexp(k: torch.Tensor, codes: torch.Tensor, half_norms: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """lse_j = log2 Σ_s exp2(x_js log2(e)) (B·H, T) float32, one float per key, for keys k (B, H, T, D) with unit
    last stride, codes (H, S, D) float32 contiguous, their ‖c_s‖²/2 (H, S) and τ (H,) float32."""
    B, H, T, D = k.shape
    lse = torch.empty(B * H, T, device=k.device, dtype=torch.float32)
    _soft_assign_kernel[(triton.cdiv(T, ASSIGN_KEYS), B * H)](
        K=k, C=codes, HN=half_norms, TAU=tau, P=lse, LSE=lse, IDX=lse, **stride_args("k", k), H=H, T=T,
        S=codes.shape[1], D=D, L=ASSIGN_KEYS, BS=CODE_TILE, BD=register_width(D), **float32_products(k.dtype),
        OUT=LOGSUMEXP, **ASSIGN_LAUNCH)
    return lse


@torch.no_grad()
@torch.compiler.disable  # a graph break: the kernel runs as it is
def soft_statistics(k: torch.Tensor, codebook: torch.Tensor, temperature: torch.Tensor):
    """A codebook's statistics of soft keys, no (T, S) tensor formed: the soft counts Σ_j p(s | k_j) over the batch
    and the keys (H, S) float32, and each key's most probable code (B, H, T) int64 (its nearest). k (B, H, T, D),
    codebook (H, S, D), temperature a tensor of 1 or H values."""
    B, H, T, D = k.shape
    S = codebook.shape[1]
    k = unit_last(k)
    codes = codebook.float().contiguous()
    tau = head_temperatures(temperature, H, k.device)
    counts = torch.zeros(H, S, device=k.device, dtype=torch.float32)
    index = torch.empty(B, H, T, device=k.device, dtype=torch.int64)
    _soft_assign_kernel[(triton.cdiv(T, ASSIGN_KEYS), B * H)](
        K=k, C=codes, HN=0.5 * codes.square().sum(-1), TAU=tau, P=counts, LSE=counts, IDX=index,
        **stride_args("k", k), H=H, T=T, S=S, D=D, L=ASSIGN_KEYS, BS=CODE_TILE, BD=register_width(D),
        **float32_products(k.dtype), OUT=STATISTICS, **ASSIGN_LAUNCH)
    return counts, index


@torch.compiler.disable  # a graph break: compiled graphs keep the PyTorch form, which inductor fuses
def soft_weights(k: torch.Tensor, codebook: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """p(s | k_j) (B, H, T, S) float32 for keys k (B, H, T, D) float16, bfloat16 or float32, codebook (H, S, D) and
    temperature (a tensor of 1 or H values), by the kernels of the module doc; differentiable in all three."""
    H = k.shape[1]
    tau = head_temperatures(temperature, H, k.device)
    return SoftAssign.apply(k, codebook.float().contiguous(), tau)



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
