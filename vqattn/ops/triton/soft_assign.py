"""The soft assignment and its gradients in kernels: the GMM posterior of :mod:`vqattn.ops.vq.assign`,

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
"""

from __future__ import annotations

import torch

from ..utils import empty_like_order, triton
from .nearest import ASSIGN_KEYS, ASSIGN_LAUNCH, KEY_BLOCK
from .utils import CODE_TILE, float32_products, register_width, stride_args, unit_last

if triton is not None:
    import triton.language as tl

    from .utils import LOG2E, dot_half_rows, load_rows

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
        scores in base 2, LSE (B·H, T) float32, from which p_js = exp2(x_js log2(e) − lse_j) (:mod:`.soft_caches`
        recomputes them); :data:`STATISTICS`: the soft counts Σ_j p_js added into P (H, S) float32 and each key's
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
