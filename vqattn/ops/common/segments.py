"""Packed sequences laid out block by block: the form of a packed call that ``torch.compile`` traces.

A packed row (1, H, T, ·) of N sequences is laid out in blocks of L so that every sequence starts at a block
boundary: sequence i takes ⌈len_i / L⌉ blocks, its last one padded after its tokens (:class:`BlockLayout`),
T' = Σ_i ⌈len_i / L⌉·L slots in all, less than one block of padding per sequence. Every block then belongs to one
sequence, and a sequence's blocks are numbered from its first, as in a call of its own. What the block algorithms
carry from block to block (the code counts and value sums) restarts at each sequence's first block:
:func:`segment_sums`. Every tensor here has the slots' length T', a size that changes with the documents and that
``torch.compile`` takes as dynamic (:meth:`BlockLayout.build` marks it), so a compiled step neither reads the
boundaries nor recompiles for new documents.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch


class BlockLayout(NamedTuple):
    """The block layout of a packed row for block length ``block_len`` (L).

    ``slots`` (T',) long: the packed token in each slot (a pad repeats its sequence's first token); ``pads``
    (T',) bool: the slot is padding; ``starts`` (T',) long: the first slot of the slot's sequence (a multiple of L);
    ``token_slot`` (T,) long: each token's slot.
    """

    block_len: int
    slots: torch.Tensor
    pads: torch.Tensor
    starts: torch.Tensor
    token_slot: torch.Tensor

    @classmethod
    def build(cls, bounds: Sequence[int], block_len: int, device=None) -> BlockLayout:
        """The layout of the sequences ``bounds`` (cu₀ = 0 < … < cu_N = T, Python ints), formed on the host and
        moved once; the slots' length marked dynamic for ``torch.compile``."""
        L = block_len
        lengths = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])])
        firsts = torch.tensor(list(bounds[:-1]))
        widths = -(-lengths // L) * L  # slots per sequence
        slot_starts = torch.cumsum(widths, 0) - widths
        starts = torch.repeat_interleave(slot_starts, widths)
        offset = torch.arange(int(widths.sum())) - starts
        seq_len = torch.repeat_interleave(lengths, widths)
        pads = offset >= seq_len
        slots = torch.repeat_interleave(firsts, widths) + torch.where(pads, 0, offset)
        token_offset = torch.arange(bounds[-1]) - torch.repeat_interleave(firsts, lengths)
        token_slot = torch.repeat_interleave(slot_starts, lengths) + token_offset
        layout = cls(L, *(t.to(device) for t in (slots, pads, starts, token_slot)))
        for t in layout[1:4]:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return layout

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    def gather(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """x (B, H, T, …) -> (B, H, T', …) in the layout, zeros at the pads."""
        if x is None:
            return None
        out = x.index_select(2, self.slots)
        if out.is_floating_point():
            out = out.masked_fill(self.pads.view(-1, *[1] * (x.dim() - 3)), 0)
        return out

    def scatter_back(self, out: torch.Tensor) -> torch.Tensor:
        """The layout's outputs (B, H, T', …) -> (B, H, T, …) in token order (the pads dropped)."""
        return out.index_select(2, self.token_slot)

    def first_blocks(self) -> torch.Tensor:
        """(n,) long, n = T' / L: each block's sequence's first block."""
        return self.starts.view(-1, self.block_len)[:, 0] // self.block_len

    def block_in_sequence(self) -> torch.Tensor:
        """(n,) long: each block's index in its own sequence."""
        first = self.first_blocks()
        return torch.arange(first.shape[0], device=first.device) - first


def segment_sums(x: torch.Tensor, first: torch.Tensor, lag: int) -> torch.Tensor:
    """Σ_{j = first_b}^{b − lag} x_j (zeros where b − lag < first_b) for every block b along dim 2 of x
    (B, H, n, …): what the blocks of a sequence that starts at block first_b (``first`` (n,) long) have compressed
    ``lag`` blocks behind block b. From prefix sums in float64 (differences of them keep float32 sums exact to
    rounding: the prefix before a sequence cancels in float64, far below float32's resolution), returned in x's
    dtype."""
    n = x.shape[2]
    acc = x.to(torch.float64) if x.dtype != torch.float64 else x
    prefix = torch.nn.functional.pad(acc.cumsum(2), (0, 0) * (x.dim() - 3) + (1, 0))  # (B, H, n + 1, …)
    b = torch.arange(n, device=x.device)
    end = torch.maximum(b - lag + 1, first)
    return (prefix.index_select(2, end) - prefix.index_select(2, first)).to(x.dtype)


def segment_prefix(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Σ_{j = starts_i}^{i} x_j for every slot i along dim 2 of x (B, H, T'): a running sum that restarts at each
    sequence's first slot (``starts`` (T',) long), from float64 prefix sums, in float64."""
    prefix = torch.nn.functional.pad(x.to(torch.float64).cumsum(2), (1, 0))  # (B, H, T' + 1)
    i = torch.arange(x.shape[2], device=x.device)
    return prefix.index_select(2, i + 1) - prefix.index_select(2, starts)


def memory_bias(layout: BlockLayout, memory_cap: int | None, dtype) -> torch.Tensor | None:
    """(n, 1, 1): log min(1, M / n_b) for every block, n_b = max(0, b − 1)·L keys before the window of block b of
    its sequence (:mod:`~vqattn.ops.common.memory_cap`), or None without a cap."""
    if memory_cap is None:
        return None
    held = ((layout.block_in_sequence() - 1).clamp_min(0) * layout.block_len).clamp_min(1).to(torch.float64)
    return (math.log(memory_cap) - held.log()).clamp_max(0).to(dtype).view(-1, 1, 1)


def window_blocks(x: torch.Tensor, L: int, first: torch.Tensor) -> torch.Tensor:
    """x (B, H, n·L, …) -> (B, H, n, 2L, …): every block's window, the previous block then the block itself, with
    zeros for the previous block of a sequence's first block (``first`` (n,) long, each block's first block)."""
    cur = x.view(*x.shape[:2], -1, L, *x.shape[3:])
    prev = torch.cat([torch.zeros_like(cur[:, :, :1]), cur[:, :, :-1]], 2)
    opens = first == torch.arange(first.shape[0], device=first.device)  # (n,)
    prev = prev.masked_fill(opens.view(-1, *[1] * (cur.dim() - 3)), 0)
    return torch.cat([prev, cur], 3)


def window_mask(first: torch.Tensor, L: int) -> torch.Tensor:
    """(n, L, 2L) bool, True where query i of block b may not see window key jj: later than i (jj > i + L), or in
    the previous block when b is its sequence's first."""
    i = torch.arange(L, device=first.device)[:, None]
    jj = torch.arange(2 * L, device=first.device)[None, :]
    opens = first == torch.arange(first.shape[0], device=first.device)
    return (jj > i + L).unsqueeze(0) | (opens.view(-1, 1, 1) & (jj < L).unsqueeze(0))


def window_softmax(logits: torch.Tensor, mask: torch.Tensor, values: torch.Tensor,
                   code_logits: torch.Tensor | None = None, means: torch.Tensor | None = None) -> torch.Tensor:
    """One softmax per query over its window logits (B, H, n, L, 2L), masked where ``mask`` (n, L, 2L), and the
    codes' logits (B, H, n, L, S) if given: Σ p_j v_j over the window values (B, H, n, 2L, Dv) plus Σ p_s m_s over
    the codes' means (B, H, n, S, Dv)."""
    logits = logits.masked_fill(mask, float("-inf"))
    if code_logits is None:
        return torch.softmax(logits, -1) @ values
    p = torch.softmax(torch.cat([logits, code_logits], -1), -1)
    W = logits.shape[-1]
    return p[..., :W] @ values + p[..., W:] @ means


def window_bad_keys(bad: torch.Tensor, L: int, first: torch.Tensor) -> torch.Tensor:
    """bad (B, H, n·L) -> (B, H, n·L, 1) poison: NaN for the queries whose raw window (their block and the
    previous one of the same sequence) holds a non-finite key up to them, else 0."""
    B, H, T = bad.shape
    win = window_blocks(bad.to(torch.float64).unsqueeze(-1), L, first).squeeze(-1)  # (B, H, n, 2L)
    seen = win.cumsum(-1)[..., L:].reshape(B, H, T)  # bad keys up to each query in its window
    return torch.zeros(seen.shape, device=bad.device, dtype=torch.float32).masked_fill(seen > 0, float("nan"))
