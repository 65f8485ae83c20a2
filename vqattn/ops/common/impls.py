"""How a causal op picks the impl that computes a call (flash-linear-attention's ``mode``): one rule for all."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..blocks import RECURRENT_MAX_LEN
from ..devices import triton_device

# ``impl``: the values every causal op takes (linear attention: all but triton)
IMPLS = ("auto", "chunk", "recurrent", "naive", "triton")


def decoding(q: torch.Tensor, state) -> bool:
    """Whether a call continues a ``state`` by at most ``RECURRENT_MAX_LEN`` tokens (q: (B, H, T, D)): a decoding
    step, which the recurrent impls (and the fused step, :mod:`vqattn.ops.triton.decode`) compute in
    O(window + codes) per token, flat in the length."""
    return state is not None and q.dim() == 4 and q.shape[2] <= RECURRENT_MAX_LEN


def needs_grad(*tensors) -> bool:
    """Whether autograd would record a call on these tensors (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def pick_impl(impl: str, q: torch.Tensor, *, state, fused_unsupported: Callable[[], str | None] | None) -> str:
    """``impl`` itself, or for "auto": for a decoding step (:func:`decoding`) triton when it is fusable (below) and
    grad mode is off (the fused step is forward only: generation), else recurrent; for other calls triton when
    fusable, else chunk. Fusable: CUDA tensors, Triton imports and the op's fused kernel supports the call
    (``fused_unsupported()`` gives no reason; None: the op has no fused kernel). On a CPU, under the interpreter
    too, "auto" never picks triton. An op given triton for a decoding step runs its fused step when no input needs a
    gradient (:func:`needs_grad`), else its Triton block kernels."""
    if impl != "auto":
        return impl
    fusable = fused_unsupported is not None and q.is_cuda and triton_device(q) and fused_unsupported() is None
    if decoding(q, state):
        return "triton" if fusable and not torch.is_grad_enabled() else "recurrent"
    return "triton" if fusable else "chunk"


def with_impl(op: Callable, impl: str) -> Callable:
    """``op`` with its ``impl`` fixed: the public ``chunk_*`` / ``recurrent_*`` functions, which take the
    op's own arguments (one signature family) and never pick another impl."""

    @functools.wraps(op)
    def fixed(*args, **kwargs):
        return op(*args, impl=impl, **kwargs)

    fixed.__name__ = fixed.__qualname__ = f"{impl}_{op.__name__}"
    fixed.__doc__ = f"``{op.__name__}(..., impl={impl!r})``: the {impl} impl, with :func:`{op.__name__}`'s arguments."
    return fixed
