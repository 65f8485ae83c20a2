"""The entry point :func:`vq_attention`: validation, precision, and the choice of ``impl``."""

from __future__ import annotations

import dataclasses

import torch

from ..blocks import Schedule, as_schedule, resolve_block_len
from ..common.statistics import Assignment, code_means, code_statistics, log_counts, map_time
from ..nonfinite import zero_assignment_rows
from ..utils import autocast_off, compute_dtype, decoding, needs_grad, pick_impl, with_impl
from ..varlen import Segments, varlen
from .chunk import chunk_forward
from .fused import fused_forward
from .naive import naive_vq_attention
from .recurrent import recurrent_forward
from .segmented import segmented_forward
from .state import IMPLS, Inputs, VQState, fused_unsupported, prepare, validate

__all__ = ["vq_attention", "chunk_vq_attention", "recurrent_vq_attention", "IMPLS"]


def _non_causal(x: Inputs) -> torch.Tensor:
    """exp(σ QCᵀ + log n) (ΔᵀV / n): every query reads every key through the codes."""
    a = zero_assignment_rows(x.assignment, x.bad)
    counts, sums = (t.squeeze(2) for t in code_statistics(a, x.v, x.codebook.shape[1]))  # (B, H, S), (B, H, S, Dv)
    logits = (x.q * x.scale) @ x.codebook.transpose(-1, -2) + log_counts(counts).unsqueeze(2)
    return torch.softmax(logits, dim=-1) @ code_means(counts, sums)


def _pick_impl(impl: str, q, k, v, *, causal, assign, exact_window, block_len, state) -> str:
    """The impl that runs a call (:func:`~vqattn.ops.utils.pick_impl`); only causal calls have a fused
    kernel."""
    why_not_fused = None if not causal else lambda: fused_unsupported(
        q, k, v, assign=assign, exact_window=exact_window, block_len=block_len, state=state)
    return pick_impl(impl, q, state=state, fused_unsupported=why_not_fused)


def _naive(q, k, v, codebook, dtype, *, assignment, **kwargs) -> torch.Tensor:
    """:func:`naive_vq_attention` computed in ``dtype`` (float32 for half precision), returned in q's dtype."""
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    if assignment is not None:
        assignment = map_time(lambda x: x.to(dtype) if x.is_floating_point() else x, assignment)
    kwargs.update(q_rot=cast(kwargs["q_rot"]), k_rot=cast(kwargs["k_rot"]),
                  block_len=resolve_block_len(kwargs["block_len"]))
    out = naive_vq_attention(cast(q), cast(k), cast(v), cast(codebook), assignment=assignment, **kwargs)
    return out.to(q.dtype)


def _poisoned(out: torch.Tensor, poison: torch.Tensor | None) -> torch.Tensor:
    return out if poison is None else out + poison


@autocast_off
def _segmented(a: dict, segments: Segments) -> torch.Tensor:
    """A packed causal call given :class:`~vqattn.ops.varlen.Segments`: the sequences in their block layout, run
    by :func:`.segmented.segmented_forward` (any ``impl``: the one form a compiled graph traces whole)."""
    validate(a["q"], a["k"], a["v"], a["codebook"], causal=True, assign=a["assign"], block_len=a["block_len"],
             exact_window=a["exact_window"], state=None, return_state=False, impl=a["impl"], q_rot=a["q_rot"],
             k_rot=a["k_rot"], assignment=a["assignment"], memory_cap=a["memory_cap"])
    layout = segments.layout(resolve_block_len(a["block_len"]))
    q, k, v, q_rot, k_rot = (layout.gather(a[name]) for name in ("q", "k", "v", "q_rot", "k_rot"))
    assignment = None if a["assignment"] is None else map_time(layout.gather, a["assignment"])
    x, _, _ = prepare(q, k, v, a["codebook"], impl="chunk", causal=True, assign=a["assign"],
                      temperature=a["temperature"], block_len=layout.block_len, scale=a["scale"],
                      exact_window=a["exact_window"], state=None, assignment=assignment, q_rot=q_rot, k_rot=k_rot,
                      schedule=as_schedule(a["schedule"]), memory_cap=a["memory_cap"])
    return layout.scatter_back(segmented_forward(x, layout)).to(a["q"].dtype)


@varlen(("q", "k", "v", "q_rot", "k_rot", "assignment"), segmented=_segmented)
@autocast_off
def vq_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codebook: torch.Tensor, *, causal: bool,
                 assign: str = "hard", temperature: float | torch.Tensor = 1.0, block_len: int | None = None,
                 scale: float | None = None, exact_window: bool = False, state: VQState | None = None,
                 return_state: bool = False, assignment: Assignment | None = None, q_rot: torch.Tensor | None = None,
                 k_rot: torch.Tensor | None = None, impl: str = "auto", schedule: str | Schedule = "auto",
                 memory_cap: int | None = None):
    """Codebook attention (see :mod:`vqattn.ops.vq` for the math, :func:`naive_vq_attention` for the definition).

    Args:
        q, k: (B, H, T, D); v: (B, H, T, Dv). Non-causal calls may give k and v another length than q. With
            ``q_rot``, ``k_rot`` and ``assignment``, q may have another width Dc (it only scores the codes).
        codebook: (H, S, Dc), one codebook per head, or (S, Dc) shared by all heads; Dc = q's D.
        causal: block-wise linear-time causal attention; else exp(QCᵀ)(ΔᵀV) over all keys.
        assign: "hard" (Transformer-VQ) or "soft" (GMM posterior).
        temperature: τ > 0 of soft assignments: a number, or a tensor with 1 or H elements (learnable).
        block_len: causal block length L (default 64, or T when T < 64). The window is the current and the
            previous block; older blocks are compressed.
        scale: multiplies q·k and q·c; defaults to D**-0.5 as in SDPA (k's D).
        exact_window: the window scores the raw keys σ q·k (exact softmax nearby, codes only for the far past),
            which RoPE needs; otherwise hard keys are scored by their code (straight-through) and soft keys by
            their mixture, which is cheaper (docs/performance.md).
        state: a :class:`VQState` from an earlier call; the inputs then continue that sequence.
        return_state: also return the :class:`VQState` after this call (causal only).
        assignment: the keys' :class:`Assignment`, ``vq_assign(k, codebook, assign=assign, temperature=...)``,
            when the caller already has it (e.g. from its codebook module); computed here otherwise. With it,
            ``temperature`` is not used (it is in the assignment, with its gradient for soft).
        q_rot, k_rot: (B, H, T, D), the window's own queries and keys (``exact_window``): its logits are then
            σ q_rot·k_rot, the codes' σ q·c, and k is assigned. RoPE passes the rotated q and k, so the window is RoPE
            attention and the codes stay position-free (a state keeps k_rot). With an ``assignment`` too, q and the
            codebook may be narrower (Dc < D): the codes are scored on those dims alone, at Dc/D of the work.
        impl: what computes it, as flash-linear-attention's ``mode``: "chunk" (the block algorithm),
            "recurrent" (token by token, O(1) per token: decoding), "naive" (the definition,
            :func:`naive_vq_attention`, one (T, T) softmax: for checking, no state), "triton" (the block algorithm
            as one fused kernel forward and one backward, :mod:`vqattn.ops.triton`: CUDA tensors, or the CPU under
            ``TRITON_INTERPRET=1``; with a ``state`` and at most ``RECURRENT_MAX_LEN`` new tokens and no gradient
            needed, the fused decoding step, :mod:`vqattn.ops.triton.decode`), or "auto": for a ``state`` and at
            most ``RECURRENT_MAX_LEN`` new tokens the fused step on CUDA with grad mode off, else recurrent; triton
            for other causal CUDA calls it supports (docs/ops.md), chunk otherwise
            (:func:`~vqattn.ops.utils.pick_impl`, the rule of every causal op). All give the same result
            to rounding.
        schedule: how the chunk impl runs its blocks (:class:`~vqattn.ops.blocks.Schedule`): "auto", "loop"
            or "cumsum", and (its ``kernels``) which design the triton impl runs; never changes the result.
        memory_cap: causal only: the codes weigh as if they held at most this many keys, a bias
            log min(1, memory_cap / n) on their logits where n keys lie before the query's window
            (:mod:`vqattn.ops.common.memory_cap`); set it to the training length to read past it. None: no bound.
            Not with the soft mixture window (``exact_window=False``).

    Returns:
        out (B, H, T, Dv) in the input dtype, or (out, state) when ``return_state``. Computed in float32 for
        half-precision inputs and inside autocast (float64 stays float64). As in softmax attention, a key with a NaN
        or infinite entry makes NaN exactly the outputs of the queries that see it (and a state's later ones).
    """
    validate(q, k, v, codebook, causal=causal, assign=assign, block_len=block_len, exact_window=exact_window,
             state=state, return_state=return_state, impl=impl, q_rot=q_rot, k_rot=k_rot, assignment=assignment,
             memory_cap=memory_cap)
    impl = _pick_impl(impl, q, k, v, causal=causal, assign=assign, exact_window=exact_window, block_len=block_len,
                      state=state)
    in_dtype = q.dtype
    if impl == "naive":
        return _naive(q, k, v, codebook, compute_dtype(in_dtype), causal=causal, assign=assign,
                      temperature=temperature, block_len=block_len, scale=scale, exact_window=exact_window,
                      assignment=assignment, q_rot=q_rot, k_rot=k_rot, memory_cap=memory_cap)
    x, state, poison = prepare(q, k, v, codebook, impl=impl, causal=causal, assign=assign, temperature=temperature,
                               block_len=block_len, scale=scale, exact_window=exact_window, state=state,
                               assignment=assignment, q_rot=q_rot, k_rot=k_rot, schedule=as_schedule(schedule),
                               memory_cap=memory_cap)
    if not causal:
        return _poisoned(_non_causal(x), poison).to(in_dtype)
    fused_step = impl == "triton" and decoding(q, state) and not needs_grad(
        x.q, x.k, x.v, x.codebook, x.q_rot, x.k_rot, x.assignment.weights)
    if impl == "recurrent" or fused_step:
        out, new_state = recurrent_forward(x, state, fused=fused_step)
    else:
        forward = fused_forward if impl == "triton" else chunk_forward
        out, new_state = forward(x, state, return_state=return_state)
    out = _poisoned(out, poison).to(in_dtype)
    if return_state and poison is not None:  # the state carries the poison in its counts
        new_state = dataclasses.replace(new_state, counts=new_state.counts + poison[:, :, -1])
    return (out, new_state) if return_state else out


chunk_vq_attention = with_impl(vq_attention, "chunk")
recurrent_vq_attention = with_impl(vq_attention, "recurrent")
