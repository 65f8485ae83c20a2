"""RoPE's rotation in one pass on a GPU (:mod:`vqattn.modules.rope`):

    out = [x1·cos − sign·x2·sin, x2·cos + sign·x1·sin]      for the halves x1, x2 of x (..., D), cos and sin (T, D/2)

in float32, written in the output's dtype; sign −1 is the inverse rotation, the backward pass, which can also add
the gradient of the unrotated pairs m ≥ ``first_pair`` (``rope_rotate_keeping``'s second output) in the same pass.
PyTorch's form makes a float32 copy of a half x, four products into a float32 result and a copy back: about ten
times the memory traffic of one read and one write, in six kernels.
"""

from __future__ import annotations

import torch

from ..utils import empty_in_order, triton
from .utils import MAX_DIM, SUPPORTED_DTYPES, register_width, stride_args

if triton is not None:
    import triton.language as tl

ROW_BLOCK = 64

if triton is not None:

    @triton.jit
    def _rotation_kernel(X, COS, SIN, RAW, OUT, sx_b, sx_h, sx_t, sr_b, sr_h, sr_t, so_b, so_h, so_t, H, T, HALF,
                         first_pair, sign, R: tl.constexpr, BH: tl.constexpr, ADD_RAW: tl.constexpr):
        blk, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = blk * R + tl.arange(0, R)
        cols = tl.arange(0, BH)
        mask = (rows[:, None] < T) & (cols[None, :] < HALF)
        x = X + b * sx_b + h * sx_h + rows[:, None] * sx_t + cols[None, :]
        x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
        angle = rows[:, None] * HALF + cols[None, :]
        cos = tl.load(COS + angle, mask=mask, other=0.0)
        sin = tl.load(SIN + angle, mask=mask, other=0.0)
        out1 = x1 * cos - sign * x2 * sin
        out2 = x2 * cos + sign * x1 * sin
        if ADD_RAW:  # RAW (B, H, T, 2·(HALF − first_pair)): the gradients of pairs first_pair.. of each half
            kept = mask & (cols[None, :] >= first_pair)
            raw = RAW + b * sr_b + h * sr_h + rows[:, None] * sr_t + (cols[None, :] - first_pair)
            out1 += tl.load(raw, mask=kept, other=0.0).to(tl.float32)
            out2 += tl.load(raw + (HALF - first_pair), mask=kept, other=0.0).to(tl.float32)
        out = OUT + b * so_b + h * so_h + rows[:, None] * so_t + cols[None, :]
        tl.store(out, out1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(out + HALF, out2.to(OUT.dtype.element_ty), mask=mask)


def runs_rotation_kernel(x: torch.Tensor) -> bool:
    """Whether x (B, H, T, D) rotates in the kernel: a CUDA tensor of a supported dtype and width with a unit last
    stride, Triton installed, outside torch.compile (whose inductor fuses PyTorch's form itself)."""
    return (triton is not None and x.is_cuda and x.dim() == 4 and x.dtype in SUPPORTED_DTYPES
            and x.shape[-1] <= MAX_DIM and x.stride(-1) == 1 and not torch.compiler.is_compiling())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float, raw_grad: torch.Tensor | None = None,
           first_pair: int = 0, order: tuple[int, ...] = (0, 1, 2, 3)) -> torch.Tensor:
    """x (B, H, T, D) rotated by the angles with cos and sin (T, D/2) float32 (sign 1) or back (sign −1), plus
    ``raw_grad`` (B, H, T, D − 2·first_pair) added to the pairs m ≥ first_pair when given; a tensor of x's dtype
    laid out in ``order`` (contiguous by default; the backward pass gives the rotated input's, :mod:`vqattn.ops.utils`),
    by the kernel of the module doc (:func:`runs_rotation_kernel` says when it applies)."""
    B, H, T, D = x.shape
    out = empty_in_order(x.shape, order, dtype=x.dtype, device=x.device)
    raw = raw_grad if raw_grad is not None else x
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    _rotation_kernel[(triton.cdiv(T, ROW_BLOCK), B * H)](
        X=x, COS=cos.contiguous(), SIN=sin.contiguous(), RAW=raw, OUT=out, **stride_args("x", x),
        **stride_args("r", raw), **stride_args("o", out), H=H, T=T, HALF=D // 2, first_pair=first_pair,
        sign=float(sign), R=ROW_BLOCK, BH=register_width(D // 2),
        ADD_RAW=raw_grad is not None)
    return out
