"""The hard assignment in one kernel: every key's nearest code, z_j = argmax_s k_j·c_s − ‖c_s‖²/2 (the argmin of
‖k_j − c_s‖², whose ‖k_j‖² is the same for every code); and, for the commitment loss's backward pass, the keys'
residuals a·(k_j − c_{z_j}) in one pass.

One program per (block of keys, batch·head) scores the codes a tile at a time and keeps a running maximum and its
index, so the (T, S) scores, which PyTorch writes, reads back for the bias and reads again for the maximum, never
reach memory. Ties go to the first code, as ``torch.max`` and ``argmax`` break them. The scores are float32: IEEE
products under the interpreter and for float32 keys (TF32 where PyTorch's float32 matmuls may be, as
:func:`~vqattn.ops.triton.float32_tensor_cores` tells), and on a GPU for half keys two TF32 products of exact operands,
the keys with the codes' leading and trailing TF32 parts (about float32's accuracy at tensor-core speed;
:func:`~vqattn.ops.triton.utils.dot_half_rows`), the codebook split once per call
(:func:`~vqattn.ops.triton.utils.tf32_parts`) rather than every tile in every program.
"""

from __future__ import annotations

import torch

from ..utils import empty_like_order, triton
from .utils import (
    CODE_TILE,
    code_parts,
    float32_products,
    register_width,
    stride_args,
    unit_last,
)

if triton is not None:
    import triton.language as tl

    from .utils import dot_code_parts, load_rows, store_rows

KEY_BLOCK = 64
# The keys of one program of an assignment's forward kernel (this one, and the soft assignment's), and its launch:
# every program reads the codebook (the two TF32 parts of each tile, from L2), so 128 keys a program halve that
# traffic against 64; in 8 warps each warp holds as many keys as with 64 in 4. 2 stages: two programs share an SM
# without spilling, where 3 stages' shared memory would leave one (docs/performance_notes.md, "Kernel resources").
ASSIGN_KEYS = 128
ASSIGN_LAUNCH = dict(num_warps=8, num_stages=2)


if triton is not None:

    @triton.jit
    def _nearest_kernel(K, C, C_LO, HALF_NORMS, OUT, sk_b, sk_h, sk_t, H, T, S, D, L: tl.constexpr, BS: tl.constexpr,
                        BD: tl.constexpr, PREC: tl.constexpr, EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr):
        blk, bh = tl.program_id(0), tl.program_id(1)
        h = bh % H
        rows = blk * L + tl.arange(0, L)
        k = load_rows(K, sk_b, sk_h, sk_t, bh // H, h, rows, T, D, BD, tl.float32)
        dims = tl.arange(0, BD)
        best = tl.full([L], float("-inf"), tl.float32)
        best_code = tl.zeros([L], tl.int32)
        for s0 in range(0, S, BS):
            codes = s0 + tl.arange(0, BS)
            present = codes < S
            dots = dot_code_parts(k, C, C_LO, (h * S + codes[:, None]) * D + dims[None, :],
                                   present[:, None] & (dims[None, :] < D), HALF_ROWS, PREC, EXACT_PREC)
            # absent codes score −inf
            half_norms = tl.load(HALF_NORMS + h * S + codes, mask=present, other=float("inf"))
            scores = dots - half_norms[None, :]
            tile_best, tile_code = tl.max(scores, 1, return_indices=True, return_indices_tie_break_left=True)
            better = tile_best > best  # strictly: a tie keeps the earlier code
            best_code = tl.where(better, s0 + tile_code, best_code)
            best = tl.where(better, tile_best, best)
        tl.store(OUT + bh * T + rows, best_code.to(tl.int64), mask=rows < T)

    @triton.jit
    def _residual_kernel(K, C, IDX, FACTOR, OUT, sk_b, sk_h, sk_t, so_b, so_h, so_t, H, T, S, D, L: tl.constexpr,
                         BD: tl.constexpr):
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = blk * L + tl.arange(0, L)
        k = load_rows(K, sk_b, sk_h, sk_t, b, h, rows, T, D, BD, tl.float32)
        index = tl.load(IDX + bh * T + rows, mask=rows < T, other=0)
        dims = tl.arange(0, BD)
        c = tl.load(C + (h * S + index[:, None]) * D + dims[None, :], mask=(rows[:, None] < T) & (dims[None, :] < D),
                    other=0.0)
        store_rows(OUT, so_b, so_h, so_t, b, h, rows, T, D, (k - c) * tl.load(FACTOR), BD)


@torch.compiler.disable  # a graph break: compiled graphs keep the PyTorch form, which inductor fuses
def nearest_codes(k: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The nearest code of every key: k (B, H, T, D) float16, bfloat16 or float32, codebook (H, S, D) -> index
    (B, H, T) int64, by the kernel of the module doc."""
    B, H, T, D = k.shape
    S = codebook.shape[1]
    k, codebook = unit_last(k), codebook.float().contiguous()
    half_norms = 0.5 * codebook.square().sum(-1)  # (H, S), once per call rather than per tile of every program
    index = torch.empty(B, H, T, device=k.device, dtype=torch.int64)
    grid = (triton.cdiv(T, ASSIGN_KEYS), B * H)
    c_hi, c_lo = code_parts(codebook, k.dtype)
    _nearest_kernel[grid](K=k, C=c_hi, C_LO=c_lo, HALF_NORMS=half_norms, OUT=index, **stride_args("k", k), H=H, T=T,
                          S=S, D=D, L=ASSIGN_KEYS, BS=CODE_TILE, BD=register_width(D),
                          **float32_products(k.dtype), **ASSIGN_LAUNCH)
    return index


@torch.compiler.disable  # a graph break: compiled graphs keep the PyTorch form, which inductor fuses
def code_residuals(k: torch.Tensor, codebook: torch.Tensor, index: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """a·(k_j − c_{z_j}) for keys k (B, H, T, D) (float16, bfloat16 or float32), codebook (H, S, D), their codes'
    index z (B, H, T) and a one-element tensor ``factor`` a (read by the kernel: no host synchronisation): the
    commitment loss's keys' gradient, formed in float32 and written in k's dtype and memory order
    (:mod:`vqattn.ops.utils`) in one pass, where PyTorch gathers the codes into a float32 (B, H, T, D) tensor,
    subtracts the keys and scales into a third."""
    B, H, T, D = k.shape
    out = empty_like_order(k)
    k, codebook, index = unit_last(k), codebook.float().contiguous(), index.contiguous()
    _residual_kernel[(triton.cdiv(T, KEY_BLOCK), B * H)](
        K=k, C=codebook, IDX=index, FACTOR=factor.float().reshape(1), OUT=out, **stride_args("k", k),
        **stride_args("o", out), H=H, T=T, S=codebook.shape[1], D=D, L=KEY_BLOCK, BD=register_width(D))
    return out
