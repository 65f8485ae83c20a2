"""Fused Triton kernels of the block-causal ops (their ``impl="triton"``), for CUDA tensors.

Triton is optional: without it (or on a CPU) the ops run their PyTorch impls. ``TRITON_INTERPRET=1`` runs the same
kernels on CPU tensors under Triton's interpreter, slowly but exactly: that is how the test suite checks them
against the float64 definitions on machines without a GPU. Whether Triton imports and whether the kernels can run
on a tensor's device: :mod:`vqattn.ops.utils`.
"""

from __future__ import annotations

import torch


def float32_tensor_cores() -> bool:
    """Whether float32 operands may multiply on tensor cores, in TF32, as PyTorch's own float32 matmuls then do:
    ``torch.backends.cuda.matmul.fp32_precision == "tf32"``, which ``torch.set_float32_matmul_precision("high")``
    and ``torch.backends.cuda.matmul.allow_tf32 = True`` set (Lightning suggests the first on GPUs with tensor
    cores). PyTorch's default is IEEE float32."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")  # "none": set by neither API (torch < 2.9: the flag alone)
    return precision == "tf32" if precision != "none" else bool(matmul.allow_tf32)
