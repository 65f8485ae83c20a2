"""Which rows of a (B, H, T, D) tensor hold a NaN or ±inf entry, in one pass on a GPU.

PyTorch's reductions over a last dim of 64 are slow on a GPU (many times one read of the tensor at the memory's
speed: docs/performance_notes.md, "Kernel resources"), and the check takes two of them per key tensor
(:func:`vqattn.ops.nonfinite._nonfinite_rows`). One program here reads a block of rows once.
"""

from __future__ import annotations

import torch

from ..utils import triton
from .utils import register_width, stride_args, unit_last

if triton is not None:
    import triton.language as tl

ROW_BLOCK = 128

if triton is not None:

    @triton.jit
    def _nonfinite_rows_kernel(X, OUT, sx_b, sx_h, sx_t, H, T, D, R: tl.constexpr, BD: tl.constexpr):
        blk, bh = tl.program_id(0), tl.program_id(1)
        rows = blk * R + tl.arange(0, R)
        cols = tl.arange(0, BD)
        mask = (rows[:, None] < T) & (cols[None, :] < D)
        x = tl.load(X + (bh // H) * sx_b + (bh % H) * sx_h + rows[:, None] * sx_t + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        # x − x is 0 for finite x and NaN for NaN and ±inf; NaN ≠ NaN
        bad = (x - x) != 0.0
        tl.store(OUT + bh * T + rows, tl.max(bad.to(tl.int32), 1) > 0, mask=rows < T)


@torch.compiler.disable
def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, H, T) bool: the row holds a NaN or ±inf entry."""
    B, H, T, D = x.shape
    x = unit_last(x.detach())
    out = torch.empty(B, H, T, device=x.device, dtype=torch.bool)
    grid = (triton.cdiv(T, ROW_BLOCK), B * H)
    _nonfinite_rows_kernel[grid](X=x, OUT=out, **stride_args("x", x), H=H, T=T, D=D, R=ROW_BLOCK,
                                 BD=register_width(D))
    return out
