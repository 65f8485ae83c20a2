"""The entry point :func:`ovq_attention`, its impls, and the choice of ``impl``."""

from __future__ import annotations

import functools

from ..blocks import resolve_block_len
from ..utils import IMPLS, autocast_off, check_choice, decoding, needs_grad, pick_impl, with_impl
from ..varlen import Segments, varlen
from .chunk import chunk_forward
from .naive import naive_ovq_attention
from .recurrent import recurrent_forward
from .segmented import segmented_forward
from .state import OVQState, fused_unsupported, prepare

__all__ = ["ovq_attention", "chunk_ovq_attention", "recurrent_ovq_attention", "IMPLS"]


@autocast_off
def _run(q, k, v, forward, state, return_state, fused=False, **kwargs):
    x = prepare(q, k, v, state=state, fused=fused, **kwargs)
    out, new_state = forward(x, None if state is None else state.to(x.dtype, raw=x.k.dtype), return_state)
    return (out.to(q.dtype), new_state) if return_state else out.to(q.dtype)


_PER_TOKEN = ("q", "k", "v", "slots", "slot_weights", "q_mem", "k_mem")


@autocast_off
def _segmented(a: dict, segments: Segments):
    """A packed call given :class:`~vqattn.ops.varlen.Segments`: the sequences in their block layout, run by
    :func:`.segmented.segmented_forward` (any ``impl``); None (the length classes, outside the graph) with
    ``memory_decay``, whose block weights the segmented form does not scale per sequence."""
    check_choice("impl", a["impl"], IMPLS)
    if a["memory_decay"] is not None:
        return None
    layout = segments.layout(resolve_block_len(a["block_len"]))
    given = {name: layout.gather(a[name]) for name in _PER_TOKEN}
    if given["slots"] is not None:  # a pad's slot: −1, stored nowhere
        given["slots"] = given["slots"].masked_fill(layout.pads, -1)
    x = prepare(**given, num_slots=a["num_slots"], block_len=layout.block_len, scale=a["scale"],
                threshold=a["threshold"], state=None, memory_cap=a["memory_cap"], overflow=a["overflow"],
                memory_first_pair=a["memory_first_pair"], schedule=a["schedule"])
    return layout.scatter_back(segmented_forward(x, layout)).to(a["q"].dtype)


@varlen(_PER_TOKEN, segmented=_segmented)
def ovq_attention(q, k, v, *, num_slots: int, block_len: int | None = None, scale: float | None = None,
                  threshold: float | None = None, slots=None, slot_weights=None, q_mem=None, k_mem=None,
                  impl: str = "auto", state: OVQState | None = None, return_state: bool = False,
                  memory_cap: int | None = None, memory_decay: float | None = None, overflow: str = "nearest",
                  memory_first_pair: int = 0, schedule="auto"):
    """Causal online codebook attention (see the module docstring for the math).

    Args:
        q, k: (B, H, T, D) window queries and keys; v: (B, H, T, Dv).
        num_slots: S, the memory's slots.
        block_len: L (default 64, or the state's).
        scale: σ, multiplies q·k and q̃·k̄; defaults to D**-0.5.
        threshold: online assignment only: a key opens a slot (while slots remain) when its squared distance to
            every slot's mean key exceeds ``threshold`` times its squared norm. Default 0: every key not exactly on
            a slot's mean (so the first S keys fill the memory); inf: only the first block opens slots.
        slots: (B, H, T) integer slot of every key (given assignment; −1: the key is not stored), or
        slot_weights: (B, H, T, S) non-negative weights of every key (given soft assignment, with gradients).
        q_mem, k_mem: (B, H, T, Dm) the memory's queries and keys, when not q and k (e.g. without RoPE, or
            some RoPE pairs alone); Dm may differ from D when both are given: the slots then keep Dm-dim key sums.
        impl: "chunk", "recurrent", "naive", "triton" (the chunk impl's online assignment and attention as
            Triton kernels, forward and backward: CUDA tensors, or the CPU under ``TRITON_INTERPRET=1``; float32 or
            half precision, block_len a power of two from 16 to 128; with a state and at most ``RECURRENT_MAX_LEN``
            new tokens and no gradient needed, the fused decoding step, :mod:`vqattn.ops.triton.decode`), or
            "auto": for a state and at most ``RECURRENT_MAX_LEN`` new tokens the fused step on CUDA with grad mode
            off, else recurrent; triton for other CUDA calls it supports, chunk otherwise
            (:func:`~vqattn.ops.utils.pick_impl`).
        state: an :class:`OVQState` from an earlier call; the inputs then continue that sequence.
        return_state: also return the state after this call.
        memory_cap: the memory weighs as if it held at most this many keys: a bias log min(1, memory_cap / n) on
            the slot logits, where n keys lie before the query's window (their total count with
            ``memory_decay``; :mod:`vqattn.ops.common.memory_cap`); the layer's default is 2 × block_len, with which
            a model reads past its training length as its raw window does. None: no bound.
        memory_decay: γ in (0, 1]: forgetting. Each block of L keys keeps γ^L of its weight in the memory for
            every block that joins it later, so the slots' mean keys and values are moving averages over about 1 / (1 − γ) keys
            (:mod:`vqattn.ops.common.memory_decay`): what a state carried over many segments needs to train as
            well as independent ones (docs/evaluation.md). None (or 1): the memory keeps every key at full weight.
        overflow: online assignment only: what becomes of a novel key when every slot is taken. "nearest": it joins
            its nearest slot (moving that slot's mean key and mixing its value). "drop": it is not stored (slot
            −1); a slot then takes in only keys near its mean key, and what the memory holds stays as it was stored.
        memory_first_pair: m0: the memory scores, assigns and stores only the feature pairs (x_m, x_{m+D/2}) with
            m ≥ m0 of q_mem and k_mem (of q and k when not given; :func:`~vqattn.ops.common.pairs.pair_dims`): under
            RoPE, the slow pairs, which a far key's logit keeps while the fast ones average out. The slots' key sums
            then hold Dm − 2·m0 features, and a state keeps no separate memory keys for them. 0: every feature.
        schedule: "auto", "loop" or "cumsum": how the chunk impl reads the slots' value sums
            (:class:`~vqattn.ops.blocks.Schedule`); never what it computes. A ``state`` is continued by re-running its
            raw window (under 2L tokens) in front of the new ones.

    Returns:
        out (B, H, T, Dv) in the input dtype, or (out, state) when ``return_state``.
    """
    check_choice("impl", impl, IMPLS)
    kwargs = dict(num_slots=num_slots, block_len=block_len, scale=scale, threshold=threshold, slots=slots,
                  slot_weights=slot_weights, q_mem=q_mem, k_mem=k_mem, memory_cap=memory_cap, memory_decay=memory_decay,
                  overflow=overflow, memory_first_pair=memory_first_pair)
    if impl == "naive":
        if state is not None or return_state:
            raise ValueError("impl='naive' takes no state and returns none; use impl='chunk' or 'recurrent'")
        return naive_ovq_attention(q, k, v, **kwargs)
    impl = pick_impl(impl, q, state=state, fused_unsupported=lambda: fused_unsupported(q, v, block_len, state))
    if impl == "triton":  # one fused step per token when decoding without gradients, else the chunk impl's kernels
        step = decoding(q, state) and not needs_grad(q, k, v, q_mem, k_mem, slot_weights)
        forward = functools.partial(recurrent_forward if step else chunk_forward, fused=True)
        return _run(q, k, v, forward, state, return_state, fused=True, **kwargs)
    forward = chunk_forward if impl == "chunk" else recurrent_forward
    return _run(q, k, v, forward, state, return_state, schedule=schedule, **kwargs)


chunk_ovq_attention = with_impl(ovq_attention, "chunk")
recurrent_ovq_attention = with_impl(ovq_attention, "recurrent")
