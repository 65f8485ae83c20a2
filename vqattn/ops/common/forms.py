"""How a causal op picks the form that computes a call (flash-linear-attention's ``mode``): one rule for all."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..blocks import RECURRENT_MAX_LEN
from ..triton import triton_device

FORMS = ("auto", "chunk", "recurrent", "naive", "triton")


def pick_form(impl: str, q: torch.Tensor, *, state, fused_unsupported: Callable[[], str | None] | None) -> str:
    """``impl`` itself, or for "auto": recurrent for a ``state`` and at most ``RECURRENT_MAX_LEN`` new tokens (a
    decoding step costs O(window + codes), flat in the length); triton for other calls on CUDA tensors when Triton
    imports and the op's fused kernel supports the call (``fused_unsupported()`` gives no reason; None: the op has
    no fused kernel or the call cannot use it); chunk otherwise. q: (B, H, T, D); any other shape is left to the
    op's validation."""
    if impl != "auto":
        return impl
    if state is not None and q.dim() == 4 and q.shape[2] <= RECURRENT_MAX_LEN:
        return "recurrent"
    if fused_unsupported is not None and q.is_cuda and triton_device(q) and fused_unsupported() is None:
        return "triton"
    return "chunk"


def form_of(op: Callable, impl: str) -> Callable:
    """``op`` with its form fixed to ``impl``: the public ``chunk_*`` / ``recurrent_*`` functions, which take the
    op's own arguments (one signature family) and never pick another form."""

    @functools.wraps(op)
    def form(*args, **kwargs):
        return op(*args, impl=impl, **kwargs)

    form.__name__ = form.__qualname__ = f"{impl}_{op.__name__}"
    form.__doc__ = f"``{op.__name__}(..., impl={impl!r})``: the {impl} form, with :func:`{op.__name__}`'s arguments."
    return form
