"""The decoding state of :func:`~vqattn.ops.delta_rule.delta_rule_attention`, and the argument checks and casts that
its impls share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import utils
from ..blocks import check_block_len
from ..utils import check_choice, check_qkv, compute_dtype, resolve_scale

# ``impl``: the common causal set; "triton" runs flash-linear-attention's Triton kernels (:mod:`.fused`)
IMPLS = ("auto", "chunk", "recurrent", "naive", "triton")


@dataclass
class DeltaRuleState:
    """The state of the delta rule after ``length`` tokens: ``S`` (B, H, Dv, Dk), the matrix that maps a query to its
    output (out = S·(scale·q)), in float32 (float64 for float64 inputs). Constant size in the length."""

    S: torch.Tensor
    length: int


class Inputs(NamedTuple):
    """A call's inputs checked and cast to the compute dtype: q, k (B, H, T, Dk), v (B, H, T, Dv), beta (B, H, T),
    log_decay (B, H, T) or None, the scale, the incoming state S0 (B, H, Dv, Dk) or None and its length, and the
    dtype the output is returned in."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    log_decay: torch.Tensor | None
    scale: float
    S0: torch.Tensor | None
    length: int
    out_dtype: torch.dtype


def _check_per_token(name: str, x, q: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of shape (B, H, T), got {x!r:.60}")
    if tuple(x.shape) != tuple(q.shape[:3]):
        raise ValueError(f"{name} must have shape (B, H, T) = {tuple(q.shape[:3])}, got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}")


def check_log_decay(log_decay: torch.Tensor) -> None:
    """ValueError unless every log decay is finite and ≤ 0 (a decay factor in (0, 1]), checked where reading the
    tensor on the host is free (CPU eager, :func:`~vqattn.ops.utils.host_read_is_free`). On a GPU, and in a compiled
    graph, the check would cost a synchronisation per call, so it is skipped there: a positive log decay then makes
    the state grow by exp(log_decay) per token (what the formula says), and the chunk impls may overflow."""
    if utils.host_read_is_free(log_decay) and not bool(((log_decay <= 0) & (log_decay > float("-inf"))).all()):
        bad = log_decay[~((log_decay <= 0) & (log_decay > float("-inf")))][0].item()
        raise ValueError(f"log_decay must be finite and <= 0 (the decay exp(log_decay) lies in (0, 1]), got {bad}")


def prepare(q, k, v, beta, log_decay, *, scale, state, block_len, impl) -> Inputs:
    """Check :func:`~vqattn.ops.delta_rule.delta_rule_attention`'s arguments (ValueError naming the bad one) and cast
    the tensors to the compute dtype: float32 for half precision, float64 stays float64."""
    check_qkv(q, k, v, causal=True)
    _check_per_token("beta", beta, q)
    if log_decay is not None:
        _check_per_token("log_decay", log_decay, q)
        check_log_decay(log_decay)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a number or None (Dk**-0.5), got {scale!r:.60}")
    check_block_len(block_len)
    check_choice("impl", impl, IMPLS)
    dt = compute_dtype(q.dtype)
    B, H, _, Dk = k.shape
    S0, length = None, 0
    if state is not None:
        if not isinstance(state, DeltaRuleState):
            raise ValueError(f"state must be a DeltaRuleState or None, got {type(state).__name__}")
        want = (B, H, v.shape[-1], Dk)
        if not isinstance(state.S, torch.Tensor) or tuple(state.S.shape) != want:
            got = tuple(state.S.shape) if isinstance(state.S, torch.Tensor) else type(state.S).__name__
            raise ValueError(f"state.S must have shape (B, H, Dv, Dk) = {want}, got {got}")
        if state.S.device != q.device:
            raise ValueError(f"state is on {state.S.device} but the inputs are on {q.device}")
        S0, length = state.S.to(dt), state.length
    return Inputs(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), None if log_decay is None else log_decay.to(dt),
                  float(resolve_scale(scale, Dk)), S0, length, v.dtype)
