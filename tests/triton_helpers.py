"""What the Triton tests share: the device the kernels run on, the skip mark, the NaN-filled torch.empty, and the
comparison with the float64 definitions by relative RMS (flash-linear-attention's measure)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vqattn.ops.utils import INTERPRET, triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(triton is None or (DEVICE == "cpu" and not INTERPRET),
                                  reason="needs triton, and a GPU or TRITON_INTERPRET=1")


def on_kernel_device(fn):
    """fn run on DEVICE (the GPU when there is one: the kernels take no CPU tensors there), taking and returning CPU
    tensors; autograd carries the gradients back across the moves."""

    def move(x):
        return x.to(DEVICE) if isinstance(x, torch.Tensor) else x

    def run(*args, **kwargs):
        return fn(*map(move, args), **{n: move(x) for n, x in kwargs.items()}).cpu()

    return run


def triton_marked(impls):
    """The names of ``impls`` as parameters, the impl "triton" skipped where its kernels cannot run."""
    return [pytest.param(impl, marks=needs_triton) if impl == "triton" else impl for impl in impls]


def as_impl_runs(op, impl: str):
    """op as ``impl`` runs it: the Triton impl on DEVICE (:func:`on_kernel_device`), every other impl as it is."""
    return on_kernel_device(op) if impl == "triton" else op


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty filled with NaN, so that a kernel that leaves part of a buffer unwritten shows up."""
    empty = torch.empty

    def filled(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", filled)


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖, relative RMS error; a reference of RMS under 0.01 (a gradient that is exactly zero) counts
    as of RMS 0.01."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(x).all()
    return ((x - ref).norm() / ref.norm().clamp_min(0.01 * ref.numel() ** 0.5)).item()


def leaves(*shapes, scale=1.0, generator=None):
    return [(torch.randn(*s, dtype=torch.float64, generator=generator) * scale).requires_grad_() for s in shapes]


def compare(fn_ref, fn_fast, inputs, dtype=torch.float32, tol=1e-5):
    """fn_ref(*float64 CPU inputs) and fn_fast(*inputs in dtype on DEVICE): outputs and the gradients of every
    input for one random output gradient, within ``tol`` relative RMS."""
    ref = fn_ref(*inputs)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, inputs, grad, allow_unused=True)
    fast_inputs = [x.detach().to(DEVICE, dtype).requires_grad_() for x in inputs]
    out = fn_fast(*fast_inputs)
    assert out.dtype == dtype and out.device.type == DEVICE
    grads = torch.autograd.grad(out, fast_inputs, grad.to(DEVICE, dtype), allow_unused=True)
    assert rel_rms(out, ref) < tol
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        r = torch.zeros_like(inputs[i]) if r is None else r
        g = torch.zeros_like(fast_inputs[i]) if g is None else g
        assert rel_rms(g, r) < 10 * tol, f"gradient of input {i}: {rel_rms(g, r)}"


class Allocations(TorchDispatchMode):
    """The shapes of the tensors allocated (empty, zeros and their new_ forms) while it is active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith(("empty", "zeros", "new_empty", "new_zeros")):
            self.shapes.append(tuple(out.shape))
        return out
