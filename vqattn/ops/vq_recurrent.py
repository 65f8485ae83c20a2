"""Recurrent (decoding) form of causal :func:`~vqattn.ops.vq.vq_attention` and
:func:`~vqattn.ops.window.window_attention`: one new token at a time, O((2L + S)·D) each.

A token at position p attends to the raw window of the state (positions from ``window_start(p, L)`` on) plus
itself, and, for codebook attention, to the S codes with logit σ q·c_s + log n_s. When a block leaves the
window it is folded into the counts and value sums once. This is the chunked algorithm's math for a block of
one query, so both forms agree to rounding (tested in float64).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .vq_assign import Assignment, cat_time, code_bias, code_means, code_statistics, count_scale, map_time, \
    mixture_logits

# Chunks of up to this many new tokens that continue a state run token by token; longer ones (prefill) run the
# block algorithm, whose per-call cost is re-running the state's window (< 2L tokens) once.
RECURRENT_MAX_LEN = 4


def window_start(length: int, block_len: int) -> int:
    """First position still uncompressed for the next query at ``length`` (start of its previous block)."""
    return max(0, (length // block_len - 1) * block_len)


@dataclass
class VQState:
    """Recurrent state of causal :func:`vq_attention` after ``length`` tokens.

    Positions before ``window_start(length, block_len)`` are compressed into ``counts`` (B, H, S) and value
    ``sums`` (B, H, S, Dv), both in units of e^{log_scale} (0, or (B, H, 1, 1) for kernel assignments);
    positions from there on are kept raw in ``keys`` (B, H, W, D), ``values`` (B, H, W, Dv) and their
    ``assignment`` (W < 2·block_len positions). Its size is constant in the length.
    """

    counts: torch.Tensor
    sums: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    length: int
    block_len: int
    assignment: Assignment
    log_scale: torch.Tensor | float = 0.0

    def to(self, dtype: torch.dtype) -> "VQState":
        cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["assignment"] = Assignment(*(cast(x) for x in self.assignment))
        return VQState(**{n: values[n] if n == "assignment" else cast(values[n]) for n in values})


def attend_one(window_logits, window_values, code_logits=None, means=None) -> torch.Tensor:
    """One query's softmax over its window keys (B, H, 1, W) and, if given, the codes (B, H, 1, S)."""
    if code_logits is None:
        return torch.softmax(window_logits, -1) @ window_values
    probs = torch.softmax(torch.cat([window_logits, code_logits], -1), -1)
    W = window_logits.shape[-1]
    return probs[..., :W] @ window_values + probs[..., W:] @ means


def _fold(state: VQState, a: Assignment, v: torch.Tensor, detach_cache: bool):
    """Counts and sums of ``state`` plus one leaving block (assignment ``a``, values v (B, H, L, Dv))."""
    G = count_scale(a, state.log_scale)
    counts, sums = state.counts, state.sums
    if isinstance(state.log_scale, torch.Tensor):
        rescale = torch.exp(state.log_scale - G)
        counts, sums = counts * rescale.squeeze(-1), sums * rescale
    n, s = (x.squeeze(2) for x in code_statistics(a, v, counts.shape[-1], 1, G))
    if detach_cache:
        n, s = n.detach(), s.detach()
    return counts + n, sums + s, G


def _step(q, k, v, c, a: Assignment, state: VQState, *, scale, exact_window, detach_cache):
    """One token: q, k (B, H, 1, D), v (B, H, 1, Dv), ``a`` its assignment -> out (B, H, 1, Dv), new state."""
    keys, values = torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2)
    window = cat_time(state.assignment, a)
    q = q * scale
    code_logits = q @ c.transpose(-1, -2)  # (B, H, 1, S)
    if exact_window:
        window_logits = q @ keys.transpose(-1, -2)
    elif window.index is not None:
        B, H, W, D = keys.shape
        k_hat = torch.gather(c.unsqueeze(0).expand(B, H, -1, -1), 2, window.index.unsqueeze(-1).expand(B, H, W, D))
        window_logits = q @ (k_hat + (keys - keys.detach())).transpose(-1, -2)
    else:
        window_logits = mixture_logits(code_logits, window)
    bias = code_bias(state.counts, state.log_scale).unsqueeze(2)  # (B, H, 1, S)
    out = attend_one(window_logits, values, code_logits + bias, code_means(state.counts, state.sums))

    L, length = state.block_len, state.length + 1
    drop = window_start(length, L) - window_start(state.length, L)  # 0, or a whole block leaving the window
    counts, sums, G = state.counts, state.sums, state.log_scale
    if drop:
        counts, sums, G = _fold(state, map_time(lambda x: x[:, :, :drop], window), values[:, :, :drop], detach_cache)
    return out, VQState(counts, sums, keys[:, :, drop:], values[:, :, drop:], length, L,
                        map_time(lambda x: x[:, :, drop:], window), G)


def vq_recurrent(q, k, v, c, a: Assignment, *, state: VQState, scale, exact_window, detach_cache):
    """Token-by-token vq_attention continuing ``state``: q, k (B, H, T, D), v (B, H, T, Dv), c (H, S, D)."""
    outs = []
    for t in range(q.shape[2]):
        token = slice(t, t + 1)
        out, state = _step(q[:, :, token], k[:, :, token], v[:, :, token], c, map_time(lambda x: x[:, :, token], a),
                           state, scale=scale, exact_window=exact_window, detach_cache=detach_cache)
        outs.append(out)
    return torch.cat(outs, 2), state
