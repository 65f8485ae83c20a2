"""The public scalar-decay op: its checks, its state, packed sequences and the choice of a form
(:mod:`vqattn.ops.decay`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import utils
from ..blocks import check_block_len, resolve_block_len
from ..utils import autocast_off, check_choice, check_qkv, compute_dtype, decoding, pick_impl, resolve_scale, with_impl
from ..varlen import Packing, Segments, as_packing, check_state_list
from .chunk import chunk_forward
from .fused import fused_forward, unsupported
from .recurrent import recurrent_forward

# ``impl``: the common causal set; "triton" runs flash-linear-attention's Triton kernels (:mod:`.fused`)
IMPLS = ("auto", "chunk", "recurrent", "naive", "triton")


@dataclass
class DecayState:
    """The state after ``length`` tokens: ``S`` (B, H, Dv, Dk), the matrix that maps a query to its output
    (out = S·(scale·q)), in float32 (float64 for float64 inputs). Constant size in the length."""

    S: torch.Tensor
    length: int


def _check_log_decay(log_decay, q: torch.Tensor) -> None:
    """ValueError unless ``log_decay`` is a floating-point (B, H, T) tensor on q's device whose entries are ≤ 0. The
    values are read only where that is free (CPU eager, :func:`~vqattn.ops.utils.host_read_is_free`): on a GPU or in
    a compiled graph the check would synchronise every call, and a positive entry there grows the state by
    exp(log_decay) per token, as the formula says (the chunked forms may then overflow)."""
    if not isinstance(log_decay, torch.Tensor) or not log_decay.is_floating_point():
        raise ValueError(f"log_decay must be a floating-point tensor of shape (B, H, T), got {log_decay!r:.60}")
    if tuple(log_decay.shape) != tuple(q.shape[:3]):
        raise ValueError(f"log_decay must have shape (B, H, T) = {tuple(q.shape[:3])}, got {tuple(log_decay.shape)}")
    if log_decay.device != q.device:
        raise ValueError(f"log_decay is on {log_decay.device} but q is on {q.device}")
    if utils.host_read_is_free(log_decay) and bool((log_decay > 0).any()):
        raise ValueError(f"log_decay must be <= 0 (the decay exp(log_decay) lies in [0, 1]), got a maximum of "
                         f"{log_decay.max().item():.4g}")


def _check_state(state, q: torch.Tensor, v: torch.Tensor) -> None:
    if not isinstance(state, DecayState):
        raise ValueError(f"state must be a DecayState or None, got {type(state).__name__}")
    want = (*q.shape[:2], v.shape[-1], q.shape[-1])
    if not isinstance(state.S, torch.Tensor) or tuple(state.S.shape) != want:
        got = tuple(state.S.shape) if isinstance(state.S, torch.Tensor) else type(state.S).__name__
        raise ValueError(f"state.S must have shape (B, H, Dv, Dk) = {want}, got {got}")
    if state.S.device != q.device:
        raise ValueError(f"state is on {state.S.device} but the inputs are on {q.device}")


def _check(q, k, v, log_decay, scale, block_len, impl) -> None:
    check_qkv(q, k, v, causal=True)
    _check_log_decay(log_decay, q)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a number or None (Dk**-0.5), got {scale!r:.60}")
    check_block_len(block_len)
    check_choice("impl", impl, IMPLS)


@autocast_off
def decay_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    *,
    scale: float | None = None,
    block_len: int | None = None,
    state: DecayState | list | None = None,
    return_state: bool = False,
    cu_seqlens: torch.Tensor | Packing | Segments | None = None,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, DecayState | list]:
    """Causal linear attention whose state decays by exp(log_decay) per token (:mod:`vqattn.ops.decay`):
    S_t = exp(g_t)·S_{t−1} + v_t k_tᵀ, out_t = S_t (scale·q_t).

    q, k: (B, H, T, Dk), v: (B, H, T, Dv), log_decay g: (B, H, T), every entry ≤ 0 -> (B, H, T, Dv) in v's dtype.
    ``scale`` defaults to Dk^−½ (fla's); Mamba-2 uses 1. ``block_len``: the chunk form's chunk length (default 64),
    which never changes the result.

    ``state`` (a :class:`DecayState`) holds S after the tokens before q; with ``return_state=True`` the call returns
    ``(out, new_state)``, and feeding a sequence in pieces gives one call's outputs. Half precision is computed in
    float32 (under autocast too) and the state stays float32.

    ``cu_seqlens`` (int32 (N+1,), B = 1; or a :class:`~vqattn.ops.varlen.Packing` or
    :class:`~vqattn.ops.varlen.Segments`): N packed sequences, each attended as a call of its own
    (:mod:`vqattn.ops.varlen`). Without states that is one call in which each sequence's first token drops the
    state before it; with states, ``state`` is a list of N states (None entries start fresh), ``return_state``
    returns such a list, and each sequence runs alone.

    impl: "chunk", "recurrent", "naive" (the recurrence in float64: the reference), "triton" (fla's kernels:
    CUDA and fla-core), or "auto": recurrent for a ``state`` and at most ``RECURRENT_MAX_LEN`` new tokens, else
    triton on CUDA with fla installed, else chunk (:func:`~vqattn.ops.utils.pick_impl`).
    """
    _check(q, k, v, log_decay, scale, block_len, impl)
    if cu_seqlens is None:
        return _call(q, k, v, log_decay, scale, block_len, state, return_state, impl)
    if isinstance(cu_seqlens, Segments):  # tensors only: the starts are a mask, which a compiled graph traces
        cu_seqlens.check(batch=q.shape[0], length=q.shape[2], state=state, return_state=return_state)
        starts = cu_seqlens.positions == 0
        return _call(q, k, v, log_decay, scale, block_len, None, False, impl, starts, cu_seqlens.cu_seqlens)
    packing = as_packing(cu_seqlens, batch=q.shape[0], length=q.shape[2])
    bounds = packing.bounds
    if state is None and not return_state:
        starts = torch.zeros(q.shape[2], dtype=torch.bool)
        starts[list(bounds[:-1])] = True
        return _call(q, k, v, log_decay, scale, block_len, None, False, impl, starts.to(q.device),
                     packing.cu_seqlens, bounds)
    check_state_list(state, bounds, "DecayStates")
    outs, states = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        part = (x[:, :, a:b] for x in (q, k, v, log_decay))
        out, new = _call(*part, scale, block_len, None if state is None else state[i], True, impl)
        outs.append(out)
        states.append(new)
    out = torch.cat(outs, 2)
    return (out, states) if return_state else out


def _call(q, k, v, g, scale, block_len, state, return_state, impl, starts=None, cu_seqlens=None, bounds=None):
    """One call of checked inputs (packed when ``starts`` is given: then without state)."""
    if state is not None:
        _check_state(state, q, v)
    scale = resolve_scale(scale, q.shape[-1])
    fusable = None if decoding(q, state) else (lambda: unsupported(q))  # decoding: the recurrent step
    impl = pick_impl(impl, q, state=state, fused_unsupported=fusable)
    out_dtype, dt = v.dtype, compute_dtype(q.dtype)
    S0 = None if state is None else state.S.to(dt)
    length = q.shape[2] + (0 if state is None else state.length)
    if impl == "triton":
        reason = unsupported(q)
        if reason is not None:
            raise ValueError(reason)
        out, S = fused_forward(q, k, v, g, scale, S0, return_state, cu_seqlens, bounds)
    elif impl == "naive":  # the definition in float64, whatever the inputs
        f64 = torch.float64
        out, S = recurrent_forward(q.to(f64), k.to(f64), v.to(f64), g.to(f64), scale,
                                   None if S0 is None else S0.to(f64), starts)
        S = S.to(dt)
    else:
        q, k, v, g = q.to(dt), k.to(dt), v.to(dt), g.to(dt)
        if impl == "recurrent":
            out, S = recurrent_forward(q, k, v, g, scale, S0, starts)
        else:
            out, S = chunk_forward(q, k, v, g, scale, S0, resolve_block_len(block_len), starts)
    out = out.to(out_dtype)
    return (out, DecayState(S, length)) if return_state else out


chunk_decay_attention = with_impl(decay_attention, "chunk")
recurrent_decay_attention = with_impl(decay_attention, "recurrent")
naive_decay_attention = with_impl(decay_attention, "naive")
