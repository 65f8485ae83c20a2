"""Fused Triton forms of the block-causal ops, for CUDA tensors.

Triton is optional: without it (or on a CPU) the ops run their PyTorch forms. ``TRITON_INTERPRET=1`` runs the same
kernels on CPU tensors under Triton's interpreter, slowly but exactly: that is how the test suite checks them
against the float64 definitions on machines without a GPU.
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
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


def float32_tensor_cores() -> bool:
    """Whether float32 operands may multiply on tensor cores, in TF32, as PyTorch's own float32 matmuls then do:
    ``torch.backends.cuda.matmul.fp32_precision == "tf32"``, which ``torch.set_float32_matmul_precision("high")``
    and ``torch.backends.cuda.matmul.allow_tf32 = True`` set (Lightning suggests the first on GPUs with tensor
    cores). PyTorch's default is IEEE float32."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")  # "none": set by neither API (torch < 2.9: the flag alone)
    return precision == "tf32" if precision != "none" else bool(matmul.allow_tf32)
