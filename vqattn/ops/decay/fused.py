"""``impl="triton"``: flash-linear-attention's chunked kernels (``fla.ops.simple_gla.chunk_simple_gla``, from the
optional ``fla-core`` package) on CUDA tensors. They compute the same recurrence in fla's (B, T, H, D) layout; the
state is asked for in this op's (Dv × Dk) layout (``state_v_first``)."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def fla_installed() -> bool:
    """Whether the ``fla`` package can be found, without importing it (its import compiles nothing but takes
    seconds: it is imported on the first call that runs its kernels)."""
    return importlib.util.find_spec("fla") is not None


def unsupported(q: torch.Tensor) -> str | None:
    """Why fla's kernels cannot run a call on q's device, or None when they can."""
    if not fla_installed():
        return "impl='triton' needs flash-linear-attention (pip install fla-core)"
    if not q.is_cuda:
        return f"impl='triton' needs CUDA tensors, got a tensor on {q.device}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"impl='triton' takes float32, bfloat16 or float16 inputs (fla's kernels), got {q.dtype}"
    return None


def fused_forward(q, k, v, g, scale: float, S0, return_state: bool, cu_seqlens=None, bounds=None):
    """q, k (B, H, T, Dk), v (B, H, T, Dv) in the caller's dtype (bf16 runs bf16 kernels), g (B, H, T), S0 (B, H, Dv,
    Dk) float32 or None -> (out (B, H, T, Dv) in q's dtype, S_T float32 or None). ``cu_seqlens`` (N+1,) and its
    ``bounds`` on the host (or None): B = 1 packs N sequences, each from a zero state (fla's own packed kernels)."""
    from fla.ops.simple_gla import chunk_simple_gla

    packed = {}
    if cu_seqlens is not None:  # the boundaries known on the host spare fla a read of the device tensor
        packed = dict(cu_seqlens=cu_seqlens.long(),
                      cu_seqlens_cpu=None if bounds is None else torch.tensor(bounds, dtype=torch.long))
    o, S = chunk_simple_gla(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2).float(),
                            scale=scale, initial_state=S0, output_final_state=return_state, state_v_first=True,
                            **packed)
    return o.transpose(1, 2), None if S is None else S.float()
