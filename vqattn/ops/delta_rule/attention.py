"""The entry point :func:`delta_rule_attention`, its impls, and the choice of ``impl``."""

from __future__ import annotations

from ..blocks import resolve_block_len
from ..utils import autocast_off, check_choice, decoding, needs_grad, pick_impl, with_impl
from ..varlen import Segments, varlen
from .chunk import chunk_forward, segmented_forward
from .fused import check_supported, fla_forward, unsupported
from .naive import naive_forward
from .recurrent import recurrent_forward
from .state import IMPLS, DeltaRuleState, prepare

__all__ = ["delta_rule_attention", "chunk_delta_rule_attention", "recurrent_delta_rule_attention",
           "naive_delta_rule_attention", "IMPLS"]

_PER_TOKEN = ("q", "k", "v", "beta", "log_decay")


@autocast_off
def _segmented(a: dict, segments: Segments):
    """A packed call given :class:`~vqattn.ops.varlen.Segments`: the sequences in their block layout, run by
    :func:`.chunk.segmented_forward` whatever the ``impl`` (the form a compiled graph traces whole)."""
    check_choice("impl", a["impl"], IMPLS)
    layout = segments.layout(resolve_block_len(a["block_len"]))
    x = prepare(*(layout.gather(a[name]) for name in _PER_TOKEN), scale=a["scale"], state=None,
                block_len=a["block_len"], impl=a["impl"])
    out = segmented_forward(x.q, x.k, x.v, x.beta, x.log_decay, x.scale, layout)
    return layout.scatter_back(out).to(x.out_dtype)


@varlen(_PER_TOKEN, segmented=_segmented)
@autocast_off
def delta_rule_attention(q, k, v, beta, log_decay=None, *, scale: float | None = None, block_len: int | None = None,
                         state: DeltaRuleState | None = None, return_state: bool = False, impl: str = "auto"):
    """The (gated) delta rule, causal (see :mod:`vqattn.ops.delta_rule` for the math and the forms).

    Per batch and head, with the state S (Dv × Dk) starting at zero (or at ``state``):

        S_t = exp(g_t) · S_{t−1} · (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,    out_t = S_t (scale · q_t).

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv); one dtype and device.
        beta: (B, H, T), the writing strength β_t (in [0, 1] keeps the update a contraction for unit keys; fla's
            ``allow_neg_eigval`` layers use [0, 2)); any floating dtype.
        log_decay: (B, H, T), g_t ≤ 0 and finite (Gated DeltaNet's α_t = exp(g_t)); None: no decay (DeltaNet).
            Checked where reading it on the host is free (a CPU in eager mode); on a GPU or in a compiled graph the
            check would synchronise, and is skipped.
        scale: multiplies q; default Dk**-0.5 (fla's default too).
        block_len: the chunk impl's chunk C (default 64); never what the call computes.
        state: a :class:`DeltaRuleState` from an earlier call; the inputs then continue that sequence.
        return_state: also return the state after this call.
        impl: "chunk" (the WY / UT-transform chunks, :mod:`.chunk`), "recurrent" (token by token, O(Dv·Dk) per
            token: decoding), "naive" (the definition, the (Dk × Dk) erase matrix formed per token: for checking),
            "triton" (flash-linear-attention's Triton kernels: CUDA tensors with ``fla-core`` installed, float16,
            bfloat16 or float32, Dk ≤ 256; a decoding step without gradients runs its fused recurrent kernel), or
            "auto": triton for CUDA calls it supports (decoding steps: with grad mode off), else recurrent for a
            ``state`` and at most ``RECURRENT_MAX_LEN`` new tokens, chunk otherwise
            (:func:`~vqattn.ops.utils.pick_impl`).
        cu_seqlens: packed sequences (B = 1; :mod:`vqattn.ops.varlen`): each starts from a zero state; with
            ``state`` / ``return_state``, a list of one state per sequence.

    Returns:
        out (B, H, T, Dv) in v's dtype, or (out, DeltaRuleState) when ``return_state``. Half-precision inputs are
        computed in float32 (fla: accumulated in float32) and the state is float32; under ``torch.autocast`` the op
        still computes in float32.
    """
    x = prepare(q, k, v, beta, log_decay, scale=scale, state=state, block_len=block_len, impl=impl)
    chosen = pick_impl(impl, q, state=state, fused_unsupported=lambda: unsupported(q))
    if chosen == "triton":
        check_supported(q)
        step = decoding(q, state) and not needs_grad(q, k, v, beta, log_decay, x.S0)
        out, S = fla_forward(q, k, v, beta, log_decay, x.scale, x.S0, step=step, return_state=return_state)
    elif chosen == "naive":
        out, S = naive_forward(x.q, x.k, x.v, x.beta, x.log_decay, x.scale, x.S0)
    elif chosen == "recurrent":
        out, S = recurrent_forward(x.q, x.k, x.v, x.beta, x.log_decay, x.scale, x.S0)
    else:
        out, S = chunk_forward(x.q, x.k, x.v, x.beta, x.log_decay, x.scale, x.S0, resolve_block_len(block_len))
    out = out.to(x.out_dtype)
    return (out, DeltaRuleState(S, x.length + q.shape[2])) if return_state else out


chunk_delta_rule_attention = with_impl(delta_rule_attention, "chunk")
recurrent_delta_rule_attention = with_impl(delta_rule_attention, "recurrent")
naive_delta_rule_attention = with_impl(delta_rule_attention, "naive")
