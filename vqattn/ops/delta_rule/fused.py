"""The delta rule on CUDA by flash-linear-attention's Triton kernels (the optional ``fla-core`` package): its chunk
kernels (``chunk_gated_delta_rule``, ``chunk_delta_rule``) for training and prefill, its ``fused_recurrent`` kernel
for a decoding step. fla is imported on the first call that runs here, never by ``import vqattn`` (it takes seconds
to import, and CPU calls never need it)."""

from __future__ import annotations

import importlib.util

import torch

from ..utils import triton

MAX_KEY_DIM = 256  # fla's chunk kernels hold a key in one tile: "current kernel does not support head dimension > 256"


def unsupported(q: torch.Tensor) -> str | None:
    """Why fla's kernels cannot run this call (q (B, H, T, Dk) as given), or None."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed (pip install 'vqattn[fla]', or fla-core)"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"fla's kernels take float16, bfloat16 or float32 inputs, not {q.dtype}"
    if q.shape[-1] > MAX_KEY_DIM:
        return f"fla's kernels take keys of at most {MAX_KEY_DIM} dims, got Dk = {q.shape[-1]}"
    return None


def check_supported(q: torch.Tensor) -> None:
    """ValueError naming what ``impl="triton"`` needs, unless fla's kernels can run this call. CUDA tensors only: fla's
    kernels are not run under Triton's CPU interpreter."""
    if triton is None or not q.is_cuda:
        raise ValueError(f"impl='triton' runs flash-linear-attention's Triton kernels, which need CUDA tensors and the "
                         f"triton package; got a tensor on {q.device}")
    reason = unsupported(q)
    if reason is not None:
        raise ValueError(f"impl='triton' cannot run this call: {reason}")


def fla_forward(q, k, v, beta, log_decay, scale: float, S0, *, step: bool, return_state: bool):
    """q, k, v (B, H, T, ·) in their own dtype, beta (B, H, T), log_decay (B, H, T) or None, S0 (B, H, Dv, Dk) float32
    or None -> (out (B, H, T, Dv) in v's dtype, the final state float32 or None). ``step``: a decoding step (no
    gradient), by the fused recurrent kernel. fla's layout is (B, T, H, ·), its gated kernels keep the state as
    (Dv, Dk) with ``state_v_first``; the ungated chunk kernel keeps (Dk, Dv) and takes half precision only, so a
    float32 call without decay runs the gated kernel with g = 0."""
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    beta = beta.to(q.dtype).transpose(1, 2).contiguous()
    g = None if log_decay is None else log_decay.float().transpose(1, 2).contiguous()
    S0 = None if S0 is None else S0.float().contiguous()
    if step:
        out, S = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=S0,
                                                  output_final_state=return_state, state_v_first=True)
    elif g is None and q.dtype != torch.float32:
        S0 = None if S0 is None else S0.transpose(-1, -2).contiguous()
        out, S = chunk_delta_rule(q, k, v, beta, scale=scale, initial_state=S0, output_final_state=return_state)
        S = None if S is None else S.transpose(-1, -2)
    else:
        g = q.new_zeros(q.shape[:3], dtype=torch.float32) if g is None else g
        out, S = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=S0,
                                        output_final_state=return_state, state_v_first=True)
    return out.transpose(1, 2), S
