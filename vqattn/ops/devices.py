"""Where the fused Triton kernels can run: whether Triton imports, whether the interpreter is on, and the predicate
on a tensor's device that the ops (and :mod:`vqattn.ops.common.impls`' "auto" rule) ask; and whether reading a
tensor on the host is free (:func:`host_read_is_free`). It imports no kernel, so every op package may import it.

Triton is optional: without it (or on a CPU) the ops run their PyTorch impls. ``TRITON_INTERPRET=1`` runs the same
kernels on CPU tensors under Triton's interpreter, slowly but exactly.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # the op library needs torch alone
    triton = None

# Read when the kernels are defined, as Triton itself reads it: set it before the first import of vqattn.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_device(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on x's device: CUDA with Triton installed, or the CPU under
    ``TRITON_INTERPRET=1``."""
    if triton is None:
        return False
    return x.device.type == "cuda" or (INTERPRET and x.device.type == "cpu")


def require_triton(x: torch.Tensor) -> None:
    """ValueError naming what ``impl="triton"`` needs, unless the kernels can run on x's device."""
    if triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install triton)")
    if not triton_device(x):
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on a CPU), got a tensor on "
                         f"{x.device}")


def host_read_is_free(x: torch.Tensor) -> bool:
    """Whether reading x's value in Python costs nothing: on a CPU in eager mode. A GPU would synchronise, and a
    compiled graph cannot branch on a value."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()
