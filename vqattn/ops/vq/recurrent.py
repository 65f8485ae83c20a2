"""Recurrent (decoding) impl of causal :func:`~vqattn.ops.vq.vq_attention`: one new token at a time,
O((2L + S)·D) each.

A token at position p attends to the raw window of the state (positions from ``window_start(p, L)`` on) plus
itself, and to the S codes with logit σ q·c_s + log n_s. When a block leaves the window it is folded into the
counts and value sums once. This is the block algorithm's math for a block of one query, so both impls agree to
rounding (tested in float64).
"""

from __future__ import annotations

import torch

from ..blocks import attend_one, window_start, window_tail
from ..common.memory_cap import is_unweighed, memory_scale, weigh_memory
from ..common.statistics import Assignment, cat_time, code_means, code_statistics, log_counts, map_time
from ..nonfinite import zero_assignment_rows
from ..triton.decode import fused_decode_step
from .assign import mixture_logits, straight_through_keys
from .state import Inputs, VQState


def _window_logits(q, keys, c, window: Assignment, code_logits, exact_window: bool):
    """One query's logits over its raw window: σ q·k_j (exact), σ q·k̂_j of the straight-through code key
    k̂_j = c_{z_j} + (k_j − sg(k_j)) (hard), or the mixture log Σ_s e^{σ q·c_s} Δ_js (soft)."""
    if exact_window:
        return q @ keys.transpose(-1, -2)
    if window.index is not None:
        return q @ straight_through_keys(keys, c, window.index).transpose(-1, -2)
    return mixture_logits(code_logits, window.weights)


def _attend(q, keys, values, c, window: Assignment, state: VQState, *, scale, exact_window, q_window, weight):
    """One query's softmax over its window (keys, values (B, H, W, ·) with its ``window`` assignment) and the
    codes c (H, S, Dc) with the state's cache, whose counts weigh ``weight`` times (``memory_cap``): out
    (B, H, 1, Dv)."""
    q = q * scale
    code_logits = q @ c.transpose(-1, -2)  # (B, H, 1, S)
    q_window = q if q_window is None else q_window * scale
    counts = state.counts if is_unweighed(weight) else state.counts * weight
    return attend_one(_window_logits(q_window, keys, c, window, code_logits, exact_window), values,
                      code_logits + log_counts(counts).unsqueeze(2), code_means(state.counts, state.sums))


def _attend_fused(q, keys, values, c, window: Assignment, state: VQState, *, scale, exact_window, q_window, weight):
    """:func:`_attend` as one Triton kernel (:mod:`vqattn.ops.triton.decode`), forward only; the hard window scores
    its keys' codes. The soft mixture window has no fused impl (:func:`~vqattn.ops.utils.pick_impl` keeps it
    recurrent)."""
    window_keys = keys if exact_window else straight_through_keys(keys, c.to(keys.dtype), window.index)
    counts, sums = weigh_memory(state.counts, state.sums, weight)
    return fused_decode_step(q if q_window is None else q_window, window_keys, values, scale=scale, qc=q,
                             codebook=c, counts=counts, sums=sums)


def _step(q, k, v, c, a: Assignment, state: VQState, *, scale, exact_window, q_window=None, fused=False,
          memory_cap=None):
    """One token: q, k (B, H, 1, D), v (B, H, 1, Dv), ``a`` its assignment -> out (B, H, 1, Dv), new state. k is the
    window key (RoPE: rotated) and q_window, when given, the window's query; q scores the codes. ``fused``: the
    attention in one Triton kernel."""
    keys, values = torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2)
    window = cat_time(state.assignment, a)
    weight = memory_scale(window_start(state.length, state.block_len), memory_cap)
    out = (_attend_fused if fused else _attend)(q, keys, values, c, window, state, scale=scale,
                                                exact_window=exact_window, q_window=q_window, weight=weight)
    L, length = state.block_len, state.length + 1
    drop = window_start(length, L) - window_start(state.length, L)  # 0, or a whole block leaving the window
    counts, sums = state.counts, state.sums
    if drop:
        n, s = code_statistics(map_time(lambda x: x[:, :, :drop], window), values[:, :, :drop], counts.shape[-1])
        counts, sums = counts + n.squeeze(2), sums + s.squeeze(2)
    return out, VQState(counts, sums, window_tail(keys, drop), window_tail(values, drop), length, L,
                        map_time(lambda x: window_tail(x, drop), window))


def recurrent_forward(x: Inputs, state: VQState | None, fused: bool = False):
    """Token-by-token vq_attention of x (:class:`~vqattn.ops.vq.state.Inputs`, keys assigned) continuing ``state``
    (None: an empty one). With q_rot, k_rot (RoPE) the window scores them, and q and the codebook may have another
    width Dc (they score only the codes). ``fused``: each token's attention is one Triton kernel (forward only).
    Returns out (B, H, T, Dv) and the state after the last token."""
    if state is None:
        state = VQState.empty(x.window_k, x.v, x.codebook.shape[1], x.block_len, x.assign)
    a = zero_assignment_rows(x.assignment, x.bad)
    outs = []
    for t in range(x.q.shape[2]):
        token = slice(t, t + 1)
        out, state = _step(x.q[:, :, token], x.window_k[:, :, token], x.v[:, :, token], x.codebook,
                           map_time(lambda w: w[:, :, token], a), state, scale=x.scale, exact_window=x.exact_window,
                           q_window=None if x.q_rot is None else x.q_rot[:, :, token], fused=fused,
                           memory_cap=x.memory_cap)
        outs.append(out)
    return torch.cat(outs, 2), state
