"""Recurrent (decoding) form of causal :func:`~vqattn.ops.vq.vq_attention`: one new token at a time,
O((2L + S)·D) each.

A token at position p attends to the raw window of the state (positions from ``window_start(p, L)`` on) plus
itself, and to the S codes with logit σ q·c_s + log n_s. When a block leaves the window it is folded into the
counts and value sums once. This is the block algorithm's math for a block of one query, so both forms agree to
rounding (tested in float64).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..blocks import attend_one, window_start, window_tail
from ..common.statistics import Assignment, cat_time, code_means, code_statistics, log_counts, map_time
from .assign import mixture_logits


@dataclass
class VQState:
    """Recurrent state of causal :func:`vq_attention` after ``length`` tokens.

    Positions before ``window_start(length, block_len)`` are compressed into ``counts`` (B, H, S) and value
    ``sums`` (B, H, S, Dv); positions from there on are kept raw in ``keys`` (B, H, W, D), ``values``
    (B, H, W, Dv) and their ``assignment`` (W < 2·block_len positions). Its size is constant in the length.
    """

    counts: torch.Tensor
    sums: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    length: int
    block_len: int
    assignment: Assignment

    def to(self, dtype: torch.dtype) -> "VQState":
        cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
        values = {f.name: cast(getattr(self, f.name)) for f in fields(self) if f.name != "assignment"}
        return VQState(**values, assignment=map_time(cast, self.assignment))

    @classmethod
    def empty(cls, k: torch.Tensor, v: torch.Tensor, num_codes: int, block_len: int, assign: str) -> "VQState":
        """The state before the first token, for keys (B, H, ·, D) and values (B, H, ·, Dv)."""
        B, H, _, D = k.shape
        index = k.new_zeros(B, H, 0, dtype=torch.long) if assign == "hard" else None
        weights = None if assign == "hard" else k.new_zeros(B, H, 0, num_codes)
        return cls(k.new_zeros(B, H, num_codes), v.new_zeros(B, H, num_codes, v.shape[-1]), k.new_zeros(B, H, 0, D),
                   v.new_zeros(B, H, 0, v.shape[-1]), 0, block_len, Assignment(weights, index))


def _window_logits(q, keys, c, window: Assignment, code_logits, exact_window: bool):
    """One query's logits over its raw window: σ q·k_j (exact), σ q·k̂_j of the straight-through code key
    k̂_j = c_{z_j} + (k_j − sg(k_j)) (hard), or the mixture log Σ_s e^{σ q·c_s} Δ_js (soft)."""
    if exact_window:
        return q @ keys.transpose(-1, -2)
    if window.index is not None:
        B, H, W, D = keys.shape
        k_hat = torch.gather(c.unsqueeze(0).expand(B, H, -1, -1), 2, window.index.unsqueeze(-1).expand(B, H, W, D))
        return q @ (k_hat + (keys - keys.detach())).transpose(-1, -2)
    return mixture_logits(code_logits, window.weights)


def _step(q, k, v, c, a: Assignment, state: VQState, *, scale, exact_window, q_window=None):
    """One token: q, k (B, H, 1, D), v (B, H, 1, Dv), ``a`` its assignment -> out (B, H, 1, Dv), new state. k is the
    window key (RoPE: rotated) and q_window, when given, the window's query; q scores the codes."""
    keys, values = torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2)
    window = cat_time(state.assignment, a)
    q = q * scale
    code_logits = q @ c.transpose(-1, -2)  # (B, H, 1, S)
    q_window = q if q_window is None else q_window * scale
    out = attend_one(_window_logits(q_window, keys, c, window, code_logits, exact_window), values,
                     code_logits + log_counts(state.counts).unsqueeze(2), code_means(state.counts, state.sums))
    L, length = state.block_len, state.length + 1
    drop = window_start(length, L) - window_start(state.length, L)  # 0, or a whole block leaving the window
    counts, sums = state.counts, state.sums
    if drop:
        n, s = code_statistics(map_time(lambda x: x[:, :, :drop], window), values[:, :, :drop], counts.shape[-1])
        counts, sums = counts + n.squeeze(2), sums + s.squeeze(2)
    return out, VQState(counts, sums, window_tail(keys, drop), window_tail(values, drop), length, L,
                        map_time(lambda x: window_tail(x, drop), window))


def recurrent_form(q, k, v, c, a: Assignment, *, state: VQState, scale, exact_window, q_rot=None,
                           k_rot=None):
    """Token-by-token vq_attention continuing ``state``: q, k (B, H, T, D), v (B, H, T, Dv), c (H, S, D), ``a``
    the new keys' Assignment; q_rot, k_rot the window's queries and keys (RoPE), with which q and c may have
    another width Dc (they score only the codes). Returns out (B, H, T, Dv) and the state after the last token."""
    outs, window_k = [], k if k_rot is None else k_rot
    for t in range(q.shape[2]):
        token = slice(t, t + 1)
        out, state = _step(q[:, :, token], window_k[:, :, token], v[:, :, token], c,
                           map_time(lambda x: x[:, :, token], a), state, scale=scale, exact_window=exact_window,
                           q_window=None if q_rot is None else q_rot[:, :, token])
        outs.append(out)
    return torch.cat(outs, 2), state
