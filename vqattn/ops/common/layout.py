"""Gradients in their inputs' memory order.

A layer's q, k and v are (B, H, T, D) views of one (B, T, 3, H, D) projection: token-major memory. Autograd stacks
their gradients back into that layout. Gradients laid out (B, H, T, D)-contiguous make that stack a transposing copy
(on an H200, 0.75 ms of the vq_hard layer's 18.6 ms step at 64k tokens); gradients in the views' own order make it a
plain one, as flash attention's are. So the kernels write each gradient in its input's order.
"""

from __future__ import annotations

import torch


def memory_order(x: torch.Tensor) -> tuple[int, ...]:
    """x's dims from the outermost in memory to the innermost (by stride; ties in logical order)."""
    return tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), d)))


def empty_in_order(shape, order: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised dense tensor of ``shape`` whose memory runs in ``order`` (:func:`memory_order`'s form).
    Made by ``torch.empty``, so that tests which fill it with NaN see every element a kernel leaves unwritten."""
    physical = torch.empty([shape[d] for d in order], dtype=dtype, device=device)
    return physical.permute(sorted(range(len(order)), key=order.__getitem__))


def empty_like_order(x: torch.Tensor, *, dtype: torch.dtype | None = None, leading: tuple[int, ...] = ()
                     ) -> torch.Tensor:
    """An uninitialised tensor of x's shape (after ``leading`` outer dims) in x's memory order: ``torch.empty_like``
    keeps a layout only for dense x, and a layer's q, k and v are not dense (each is a third of the projection)."""
    order = tuple(range(len(leading))) + tuple(len(leading) + d for d in memory_order(x))
    return empty_in_order((*leading, *x.shape), order, dtype=dtype or x.dtype, device=x.device)
