"""The entry point :func:`vq_attention`: validation, precision, and the choice of form (``impl``)."""

from __future__ import annotations

import dataclasses

import torch

from .._checks import check_4d, check_choice, check_positive_int, check_qkv, check_same_device_dtype, compute_dtype
from ..blocks import DEFAULT_BLOCK_LEN, Schedule, as_schedule
from ..common.forms import FORMS, form_of, pick_form
from ..common.statistics import Assignment, code_means, code_statistics, log_counts, map_time
from ..nonfinite import may_be_nonfinite, nonfinite_keys, visible_poison, zero_assignment_rows, zero_rows
from ..precision import autocast_off
from ..triton import require_triton
from ..triton.window_codes import unsupported
from .assign import ASSIGNMENTS, check_assignment, vq_assign
from .chunk import chunk_form
from .naive import naive_vq_attention
from .recurrent import VQState, recurrent_form

IMPLS = FORMS


def _non_causal(q, k, v, c, a: Assignment, scale) -> torch.Tensor:
    """exp(σ QCᵀ + log n) (ΔᵀV / n): every query reads every key through the codes."""
    counts, sums = (x.squeeze(2) for x in code_statistics(a, v, c.shape[1]))  # (B, H, S), (B, H, S, Dv)
    logits = (q * scale) @ c.transpose(-1, -2) + log_counts(counts).unsqueeze(2)
    return torch.softmax(logits, dim=-1) @ code_means(counts, sums)


def _check_codebook(codebook, q, k) -> None:
    if not isinstance(codebook, torch.Tensor) or codebook.dim() not in (2, 3):
        shape = tuple(codebook.shape) if isinstance(codebook, torch.Tensor) else type(codebook).__name__
        raise ValueError(f"codebook must be a tensor of shape (H, S, Dc) or (S, Dc), got {shape}")
    check_same_device_dtype(k=k, codebook=codebook)
    if codebook.shape[-1] != q.shape[-1]:
        raise ValueError(f"codebook D={codebook.shape[-1]} differs from the query D={q.shape[-1]} (q scores the codes)")
    if codebook.dim() == 3 and codebook.shape[0] != k.shape[1]:
        raise ValueError(f"codebook has {codebook.shape[0]} heads but k has H={k.shape[1]}")
    if codebook.shape[-2] == 0:
        raise ValueError("codebook must have at least one code (S >= 1)")


def _check_state(state, k, v, codebook, *, assign, block_len) -> None:
    B, H, _, D = k.shape
    S, Dv = codebook.shape[-2], v.shape[-1]
    if not isinstance(state, VQState):
        raise ValueError(f"state must be a VQState returned by vq_attention, got {type(state).__name__}")
    if block_len is not None and block_len != state.block_len:
        raise ValueError(f"block_len={block_len} differs from the state's block_len={state.block_len}")
    if state.counts.shape != (B, H, S) or state.sums.shape != (B, H, S, Dv) or state.keys.shape[-1] != D:
        raise ValueError(
            f"state does not match the inputs: counts {tuple(state.counts.shape)}, sums {tuple(state.sums.shape)} "
            f"for B={B}, H={H}, S={S}, D={D}, Dv={Dv}"
        )
    check_4d("state.keys", state.keys)
    check_assignment(state.assignment, assign=assign, shape=tuple(state.keys.shape[:3]), num_codes=S,
                     device=k.device)


def _check_rotated(q, k, q_rot, k_rot, *, causal, exact_window) -> None:
    if (q_rot is None) != (k_rot is None):
        raise ValueError("q_rot and k_rot go together: pass both (the window's queries and keys) or neither")
    if q_rot is None:
        return
    if not (causal and exact_window):
        raise ValueError("q_rot and k_rot score the raw-key window: they need causal=True and exact_window=True")
    for name, x, shape in (("q_rot", q_rot, (*q.shape[:3], k.shape[-1])), ("k_rot", k_rot, tuple(k.shape))):
        check_4d(name, x)
        if x.shape != shape:
            raise ValueError(f"{name} must have the shape of {name[0]} with k's D, {shape}, got {tuple(x.shape)}")
    check_same_device_dtype(q=q, q_rot=q_rot, k_rot=k_rot)


def _check_code_width(q, k, q_rot, assignment) -> None:
    """q and the codebook score the codes on Dc dims, k (and q_rot, k_rot) has D. Dc ≠ D (e.g. the slow RoPE dims
    only) is well defined only when nothing multiplies q by k or k by a code: the window is scored by
    q_rot·k_rot and the keys come assigned."""
    if q.shape[-1] != k.shape[-1] and (q_rot is None or assignment is None):
        raise ValueError(
            f"q and k must share the feature dim D, got q D={q.shape[-1]} and k D={k.shape[-1]}: q and the codebook "
            "may score the codes on other dims than k's only with q_rot and k_rot (the window's queries and keys, "
            "of k's D) and a precomputed assignment of k"
        )


def _validate(q, k, v, codebook, *, causal, assign, block_len, exact_window, state, return_state, impl, q_rot,
              k_rot, assignment) -> None:
    check_qkv(q, k, v, causal=causal, same_dim=False)  # q's D is the codes' width: _check_code_width
    _check_rotated(q, k, q_rot, k_rot, causal=causal, exact_window=exact_window)
    _check_codebook(codebook, q, k)
    _check_code_width(q, k, q_rot, assignment)
    if assign == "kernel":
        raise ValueError("assign must be 'hard' or 'soft'; the kernel assignment makes codebook attention linear "
                         "attention: use linear_attention with vqattn.analysis.codebook_kernel_features")
    check_choice("assign", assign, ASSIGNMENTS)
    check_choice("impl", impl, IMPLS)
    if block_len is not None:
        check_positive_int("block_len", block_len)
    if not causal and (exact_window or state is not None or return_state or impl in ("recurrent", "triton")):
        raise ValueError("exact_window, state, return_state and impl='recurrent' or 'triton' need causal=True "
                         "(non-causal attention has no window)")
    if impl == "naive" and (state is not None or return_state):
        raise ValueError("impl='naive' takes no state and returns none; use impl='chunk' or 'recurrent'")
    if impl == "triton":
        require_triton(q)
        reason = _fused_unsupported(q, k, v, assign=assign, exact_window=exact_window, block_len=block_len,
                                    state=state)
        if reason is not None:
            raise ValueError(reason)
    if state is not None:
        _check_state(state, k, v, codebook, assign=assign, block_len=block_len)
    if assignment is not None:
        check_assignment(assignment, assign=assign, shape=tuple(k.shape[:3]), num_codes=codebook.shape[-2],
                         device=q.device)


def _fused_unsupported(q, k, v, *, assign, exact_window, block_len, state) -> str | None:
    """Why the Triton form cannot compute this call, or None."""
    if assign == "soft" and not exact_window:
        return "impl='triton' has no soft mixture window: pass exact_window=True, or impl='chunk'"
    L = block_len or (state.block_len if state is not None else DEFAULT_BLOCK_LEN)
    return unsupported(L, (q.shape[-1], k.shape[-1], v.shape[-1]), q.dtype)


def _form(impl: str, q, k, v, *, causal, assign, exact_window, block_len, state) -> str:
    """The form that runs a call (:func:`~vqattn.ops.common.forms.pick_form`); only causal calls have a fused
    kernel."""
    fused_unsupported = None if not causal else lambda: _fused_unsupported(
        q, k, v, assign=assign, exact_window=exact_window, block_len=block_len, state=state)
    return pick_form(impl, q, state=state, fused_unsupported=fused_unsupported)


def _naive(q, k, v, codebook, dtype, *, assignment, **kwargs) -> torch.Tensor:
    """:func:`naive_vq_attention` computed in ``dtype`` (float32 for half precision), returned in q's dtype."""
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    if assignment is not None:
        assignment = map_time(lambda x: x.to(dtype) if x.is_floating_point() else x, assignment)
    kwargs.update(q_rot=cast(kwargs["q_rot"]), k_rot=cast(kwargs["k_rot"]),
                  block_len=kwargs["block_len"] or DEFAULT_BLOCK_LEN)
    out = naive_vq_attention(cast(q), cast(k), cast(v), cast(codebook), assignment=assignment, **kwargs)
    return out.to(q.dtype)


def _without_nonfinite_keys(k, k_rot, *, causal: bool, state):
    """k and k_rot with the rows of non-finite keys zeroed, those rows ``bad`` (B, H, T), and the poison (B, H, T, 1)
    that makes NaN the outputs that see them. Inside the kernels a bad key would also reach queries that cannot see
    it, so it reaches the outputs only through the poison (:mod:`vqattn.ops.nonfinite`). ``bad`` and the poison are
    None when no key is bad and that is known for free (:func:`~vqattn.ops.nonfinite.may_be_nonfinite`)."""
    bad, poison = nonfinite_keys(k) if k_rot is None else nonfinite_keys(k, k_rot)
    if not may_be_nonfinite(bad):
        return k, k_rot, None, None
    k, k_rot = zero_rows(k, bad), None if k_rot is None else zero_rows(k_rot, bad)
    return k, k_rot, bad, visible_poison(poison, causal=causal, state_counts=None if state is None else state.counts)


def _poisoned(out: torch.Tensor, poison: torch.Tensor | None) -> torch.Tensor:
    return out if poison is None else out + poison


def _keys_assignment(assignment: Assignment | None, dtype, assign_keys, k, *, whole: bool) -> Assignment | None:
    """The given assignment in the compute ``dtype``; else k assigned here when ``whole``, or None (the chunk form
    then assigns group by group, so that no (T, S) tensor exists at once)."""
    if assignment is not None:
        return map_time(lambda x: x.to(dtype) if x.is_floating_point() else x, assignment)
    return assign_keys(k) if whole else None


def _causal_form(q, k, v, c, a, bad, *, form: str, assign, state, block_len, scale, exact_window, assign_keys,
                 return_state, schedule, q_rot, k_rot):
    """The recurrent or the chunk form of causal attention: (out, the state after the new tokens or None). The
    chunk form zeroes the ``bad`` rows of a given assignment ``a`` itself, only where its kernels would leak them;
    the triton form is the chunk form with the Triton kernel for its blocks."""
    L = block_len or (state.block_len if state is not None else DEFAULT_BLOCK_LEN)
    if form == "recurrent":
        state = VQState.empty(k, v, c.shape[1], L, assign) if state is None else state
        return recurrent_form(q, k, v, c, zero_assignment_rows(a, bad), state=state, scale=scale,
                                      exact_window=exact_window, q_rot=q_rot, k_rot=k_rot)
    return chunk_form(q, k, v, c, a, assign=assign, state=state, block_len=L, scale=scale,
                              exact_window=exact_window, assign_keys=assign_keys, return_state=return_state,
                              schedule=schedule, q_rot=q_rot, k_rot=k_rot, bad=bad, fused=form == "triton")


@autocast_off
def vq_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codebook: torch.Tensor, *, causal: bool,
                 assign: str = "hard", temperature: float | torch.Tensor = 1.0, block_len: int | None = None,
                 scale: float | None = None, exact_window: bool = False, state: VQState | None = None,
                 return_state: bool = False, assignment: Assignment | None = None, q_rot: torch.Tensor | None = None,
                 k_rot: torch.Tensor | None = None, impl: str = "auto", schedule: str | Schedule = "auto"):
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
        impl: the form that computes it, as flash-linear-attention's ``mode``: "chunk" (the block algorithm),
            "recurrent" (token by token, O(1) per token: decoding), "naive" (the definition,
            :func:`naive_vq_attention`, one (T, T) softmax: for checking, no state), "triton" (the block algorithm
            as one fused kernel forward and one backward, :mod:`vqattn.ops.triton`: CUDA tensors, or the CPU under
            ``TRITON_INTERPRET=1``), or "auto": recurrent for a ``state`` and at most ``RECURRENT_MAX_LEN`` new
            tokens, triton for causal CUDA calls it supports (docs/ops.md), chunk otherwise
            (:func:`~vqattn.ops.common.forms.pick_form`, the rule of every causal op). All give the same result
            to rounding.
        schedule: how the chunk form runs its blocks (:class:`~vqattn.ops.blocks.Schedule`): "auto", "loop"
            or "cumsum"; never changes the result.

    Returns:
        out (B, H, T, Dv) in the input dtype, or (out, state) when ``return_state``. Computed in float32 for
        half-precision inputs and inside autocast (float64 stays float64). As in softmax attention, a key with a NaN
        or infinite entry makes NaN exactly the outputs of the queries that see it (and a state's later ones).
    """
    _validate(q, k, v, codebook, causal=causal, assign=assign, block_len=block_len, exact_window=exact_window,
              state=state, return_state=return_state, impl=impl, q_rot=q_rot, k_rot=k_rot, assignment=assignment)
    form = _form(impl, q, k, v, causal=causal, assign=assign, exact_window=exact_window, block_len=block_len,
                 state=state)
    schedule, (in_dtype, dtype) = as_schedule(schedule), (q.dtype, compute_dtype(q.dtype))
    if form == "naive":
        return _naive(q, k, v, codebook, dtype, causal=causal, assign=assign, temperature=temperature,
                      block_len=block_len, scale=scale, exact_window=exact_window, assignment=assignment,
                      q_rot=q_rot, k_rot=k_rot)
    # The Triton kernel reads half-precision q, k, v as they are and accumulates in float32; the codebook, the
    # assignment and the caches are float32 in every form.
    tensor_dtype = in_dtype if form == "triton" else dtype
    q, k, v, q_rot, k_rot = (None if x is None else x.to(tensor_dtype) for x in (q, k, v, q_rot, k_rot))
    c = codebook.to(dtype)
    c = c.unsqueeze(0).expand(q.shape[1], -1, -1) if c.dim() == 2 else c  # (H, S, Dc)
    scale = k.shape[-1] ** -0.5 if scale is None else scale  # k's D: q's may be the codes' narrower width
    k, k_rot, bad, poison = _without_nonfinite_keys(k, k_rot, causal=causal, state=state)
    assign_keys = lambda keys: vq_assign(keys, c, assign=assign, temperature=temperature)  # noqa: E731
    if state is not None:
        state = state.to(dtype)
        state = dataclasses.replace(state, keys=state.keys.to(tensor_dtype), values=state.values.to(tensor_dtype))
    a = _keys_assignment(assignment, dtype, assign_keys, k,
                         whole=not causal or state is not None or form == "recurrent")
    if not causal:
        return _poisoned(_non_causal(q, k, v, c, zero_assignment_rows(a, bad), scale), poison).to(in_dtype)
    out, new_state = _causal_form(q, k, v, c, a, bad, form=form, assign=assign, state=state,
                                  block_len=block_len, scale=scale, exact_window=exact_window,
                                  assign_keys=assign_keys, return_state=return_state, schedule=schedule,
                                  q_rot=q_rot, k_rot=k_rot)
    out = _poisoned(out, poison).to(in_dtype)
    if return_state and poison is not None:  # the state carries the poison in its counts
        new_state = dataclasses.replace(new_state, counts=new_state.counts + poison[:, :, -1])
    return (out, new_state) if return_state else out


chunk_vq_attention = form_of(vq_attention, "chunk")
recurrent_vq_attention = form_of(vq_attention, "recurrent")
