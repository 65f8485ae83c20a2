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

from .. import utils
from .window_code_blocks import floored_exp


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
        if not x.is_floating_point():
            return x.index_select(2, self.slots)
        return _Relayout.apply(x, self.slots, self.pads, self.token_slot, None)

    def scatter_back(self, out: torch.Tensor) -> torch.Tensor:
        """The layout's outputs (B, H, T', …) -> (B, H, T, …) in token order (the pads dropped)."""
        return _Relayout.apply(out, self.token_slot, None, self.slots, self.pads)

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
    ``lag`` blocks behind block b, with its gradient. One opaque operator to ``torch.compile`` (a loop over the
    blocks would unroll into its graph):

    - on a CPU (where reading the first blocks costs nothing, :func:`~vqattn.ops.utils.host_read_is_free`) a
      walk over the blocks with one running sum that restarts at each sequence's first block: the sums of a sequence
      alone, to the bit, and contiguous adds where a cumsum along the blocks strides over S·Dv floats;
    - elsewhere differences of float64 prefix sums (two kernels, no host read), which keep float32 sums exact to
      rounding: the prefix before a sequence cancels in float64, far below float32's resolution.
    """
    return _segment_sums_op(x, first, lag)


def _walk_sums(x: torch.Tensor, first: list[int], lag: int) -> torch.Tensor:
    out, run = torch.zeros_like(x), torch.zeros_like(x[:, :, 0])
    n = x.shape[2]
    for j in range(n):
        if first[j] == j:
            run.zero_()
        run.add_(x[:, :, j])
        if j + lag < n and first[j + lag] <= j:  # block j enters the sums of block j + lag, in its sequence
            out[:, :, j + lag] = run
    return out


def _walk_sums_transposed(grad: torch.Tensor, first: list[int], lag: int) -> torch.Tensor:
    """The gradient of :func:`_walk_sums`: Σ over the blocks b ≥ j + lag of j's sequence of grad_b."""
    out, run = torch.zeros_like(grad), torch.zeros_like(grad[:, :, 0])
    n = grad.shape[2]
    for j in range(n - 1, -1, -1):
        if j + 1 < n and first[j + 1] == j + 1:  # j ends its sequence
            run.zero_()
        if j + lag < n and first[j + lag] == first[j]:
            run.add_(grad[:, :, j + lag])
        out[:, :, j] = run
    return out


def _prefix(x: torch.Tensor, flip: bool = False) -> torch.Tensor:
    """Inclusive prefix sums (suffix sums with ``flip``) along dim 2 in float64, with a zero in front (behind)."""
    acc = x.to(torch.float64)
    pad = (0, 0) * (x.dim() - 3)
    if flip:
        return torch.nn.functional.pad(acc.flip(2).cumsum(2).flip(2), pad + (0, 1))
    return torch.nn.functional.pad(acc.cumsum(2), pad + (1, 0))


def _prefix_sums(x: torch.Tensor, first: torch.Tensor, lag: int) -> torch.Tensor:
    prefix = _prefix(x)  # (B, H, n + 1, …): the sums before each block
    end = torch.maximum(torch.arange(x.shape[2], device=x.device) - lag + 1, first)
    return (prefix.index_select(2, end) - prefix.index_select(2, first)).to(x.dtype)


def _prefix_sums_transposed(grad: torch.Tensor, first: torch.Tensor, lag: int) -> torch.Tensor:
    n = grad.shape[2]
    suffix = _prefix(grad, flip=True)  # (B, H, n + 1, …): the sums from each block on
    last = torch.searchsorted(first, first, right=True)  # one past each block's sequence's last block
    begin = torch.minimum(torch.arange(n, device=grad.device) + lag, last)
    return (suffix.index_select(2, begin) - suffix.index_select(2, last)).to(grad.dtype)


@torch.library.custom_op("vqattn::segment_sums", mutates_args=())
def _segment_sums_op(x: torch.Tensor, first: torch.Tensor, lag: int) -> torch.Tensor:
    if utils.host_read_is_free(first):  # the walk reads the sequences' first blocks
        return _walk_sums(x, first.tolist(), lag)
    return _prefix_sums(x, first, lag)


@torch.library.custom_op("vqattn::segment_sums_transposed", mutates_args=())
def _segment_sums_transposed_op(grad: torch.Tensor, first: torch.Tensor, lag: int) -> torch.Tensor:
    if utils.host_read_is_free(first):
        return _walk_sums_transposed(grad, first.tolist(), lag)
    return _prefix_sums_transposed(grad, first, lag)


@_segment_sums_op.register_fake
def _(x, first, lag):
    return torch.empty_like(x)


@_segment_sums_transposed_op.register_fake
def _(grad, first, lag):
    return torch.empty_like(grad)


def _setup(ctx, inputs, output):
    ctx.first, ctx.lag = inputs[1], inputs[2]


def _backward(ctx, grad):
    return _segment_sums_transposed_op(grad.contiguous(), ctx.first, ctx.lag), None, None


torch.library.register_autograd("vqattn::segment_sums", _backward, setup_context=_setup)


def cache_walk_runs(first: torch.Tensor) -> bool:
    """Whether the blocks of ``first`` read their caches by :func:`segment_cache_read`'s walk: on a CPU (the walk
    reads the first blocks on the host, inside its operator); elsewhere every block's cache is formed at once."""
    return first.device.type == "cpu"


def segment_cache_read(p: torch.Tensor, values: torch.Tensor, index: torch.Tensor | None,
                       weights: torch.Tensor | None, first: torch.Tensor, lag: int) -> torch.Tensor:
    """num_b = p_b · C_b for every block b: p (N, n, L, S) the blocks' code weights, C_b (S, Dv) the value sums of
    the blocks first_b … b − lag of b's own sequence, from values (N, n, L, Dv) and the keys' codes ``index``
    (N, n, L) (hard; −1: no code) or their ``weights`` (N, n, L, S) (soft). Returns num (N, n, L, Dv).

    As :func:`segment_sums` followed by p_b · C_b, but a walk over the blocks with one running (S, Dv) cache per
    batch·head, restarted at each sequence's first block (as the chunk impl's :func:`~.cache.read_cache`): no
    cache of every block (n·S·Dv floats, and as many for its gradient) is formed. A CPU's form (the walk reads the
    first blocks on the host); one opaque operator to ``torch.compile``, with its own backward walk."""
    return _cache_read_op(p, values, index, weights, first, lag)


def _add_stats(cache: torch.Tensor, values, slots, weights, b: int) -> None:
    """cache (N, S (+ 1), Dv) += block b's statistics."""
    if slots is not None:
        cache.view(-1, cache.shape[-1]).index_add_(0, slots[:, b].flatten(), values[:, b].flatten(0, 1))
    else:
        cache.baddbmm_(weights[:, b].transpose(-1, -2), values[:, b])


def _cache_slots(index: torch.Tensor | None, S: int) -> torch.Tensor | None:
    """(N, n, L) codes -> rows of the flattened (N·(S + 1), Dv) cache, a key of no code in its head's row S."""
    if index is None:
        return None
    rows = torch.arange(index.shape[0], device=index.device).view(-1, 1, 1) * (S + 1)
    return torch.where(index >= 0, index, S) + rows


def _walk_caches(p, values, slots, weights, first: list[int], lag: int):
    """Yield (b, C_b) for every block, C_b (N, S, Dv) a view of the one running cache."""
    N, n, _, S = p.shape
    cache = values.new_zeros(N, S + (slots is not None), values.shape[-1])
    for b in range(n):
        if first[b] == b:
            cache.zero_()
        elif b - lag >= first[b]:
            _add_stats(cache, values, slots, weights, b - lag)
        yield b, cache[:, :S]


@torch.library.custom_op("vqattn::segment_cache_read", mutates_args=())
def _cache_read_op(p: torch.Tensor, values: torch.Tensor, index: torch.Tensor | None, weights: torch.Tensor | None,
                   first: torch.Tensor, lag: int) -> torch.Tensor:
    S = p.shape[-1]
    num = values.new_empty(p.shape[1], p.shape[0], p.shape[2], values.shape[-1])  # (n, N, L, Dv)
    for b, cache in _walk_caches(p, values, _cache_slots(index, S), weights, first.tolist(), lag):
        torch.bmm(p[:, b], cache, out=num[b])
    return num.transpose(0, 1).contiguous()


@_cache_read_op.register_fake
def _(p, values, index, weights, first, lag):
    return values.new_empty(*p.shape[:3], values.shape[-1])


@torch.library.custom_op("vqattn::segment_cache_read_backward", mutates_args=())
def _cache_read_backward_op(grad: torch.Tensor, p: torch.Tensor, values: torch.Tensor, index: torch.Tensor | None,
                            weights: torch.Tensor | None, first: torch.Tensor,
                            lag: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dp_b = dnum_b · C_bᵀ (the forward walk again), and G_j = Σ_{b ≥ j + lag in j's sequence} p_bᵀ · dnum_b, the
    gradient of block j's statistics (a reverse walk), handed to its values (hard: gathered at the codes; soft:
    w_j · G_j) and weights (v_j · G_jᵀ). Returns (dp, dvalues, dweights; an empty tensor for hard keys)."""
    N, n, _, S = p.shape
    first_l, slots = first.tolist(), _cache_slots(index, S)
    grad_p = torch.empty_like(p)
    for b, cache in _walk_caches(p, values, slots, weights, first_l, lag):
        torch.bmm(grad[:, b], cache.transpose(-1, -2), out=grad_p[:, b])
    grad_values = torch.empty_like(values)
    grad_weights = torch.empty_like(weights) if weights is not None else values.new_empty(0)
    run = values.new_zeros(N, S + (slots is not None), values.shape[-1])  # G_j, a row for no code kept at 0
    for j in range(n - 1, -1, -1):
        if j + 1 < n and first_l[j + 1] == j + 1:  # j ends its sequence
            run.zero_()
        if j + lag < n and first_l[j + lag] == first_l[j]:
            run[:, :S].baddbmm_(p[:, j + lag].transpose(-1, -2), grad[:, j + lag])
        if slots is not None:
            grad_values[:, j] = run.view(-1, run.shape[-1]).index_select(0, slots[:, j].flatten()).view(
                grad_values[:, j].shape)
        else:
            torch.bmm(weights[:, j], run, out=grad_values[:, j])
            torch.bmm(values[:, j], run.transpose(-1, -2), out=grad_weights[:, j])
    return grad_p, grad_values, grad_weights


@_cache_read_backward_op.register_fake
def _(grad, p, values, index, weights, first, lag):
    return (torch.empty_like(p), torch.empty_like(values),
            torch.empty_like(weights) if weights is not None else values.new_empty(0))


def _cache_read_setup(ctx, inputs, output):
    p, values, index, weights, first, lag = inputs
    ctx.save_for_backward(p, values, index, weights, first)
    ctx.lag = lag


def _cache_read_backward(ctx, grad):
    p, values, index, weights, first = ctx.saved_tensors
    grad_p, grad_values, grad_weights = _cache_read_backward_op(grad.contiguous(), p, values, index, weights, first,
                                                                ctx.lag)
    return grad_p, grad_values, None, grad_weights if weights is not None else None, None, None


torch.library.register_autograd("vqattn::segment_cache_read", _cache_read_backward, setup_context=_cache_read_setup)


def segment_prefix(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Σ_{j = starts_i}^{i} x_j for every slot i along dim 2 of x (B, H, T'): a running sum that restarts at each
    sequence's first slot (``starts`` (T',) long), from float64 prefix sums, in float64."""
    prefix = torch.nn.functional.pad(x.to(torch.float64).cumsum(2), (1, 0))  # (B, H, T' + 1)
    i = torch.arange(x.shape[2], device=x.device)
    return prefix.index_select(2, i + 1) - prefix.index_select(2, starts)


def _zero_at(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.masked_fill(rows.view(-1, *[1] * (x.dim() - 3)), 0)


class _Relayout(torch.autograd.Function):
    """x (B, H, ·, …) gathered along dim 2 at ``index``, zeros where ``zero``; the gradient gathered back at the
    ``inverse`` index (zeros where ``inverse_zero``). Tokens and slots map one to one, so the backward pass is a
    gather too, where index_select's would scatter-add (which compiled CPU code runs element by element)."""

    @staticmethod
    def forward(ctx, x, index, zero, inverse, inverse_zero):
        ctx.save_for_backward(inverse, inverse_zero)
        return _zero_at(x.index_select(2, index), zero)

    @staticmethod
    def backward(ctx, grad):
        inverse, inverse_zero = ctx.saved_tensors
        return _zero_at(grad.index_select(2, inverse), inverse_zero), None, None, None, None


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
                   code_logits: torch.Tensor | None = None, means: torch.Tensor | None = None,
                   read=None) -> torch.Tensor:
    """One softmax per query over its window logits (B, H, n, L, 2L), masked where ``mask`` (n, L, 2L), and the
    codes' logits (B, H, n, L, S) if given: Σ p_j v_j over the window values (B, H, n, 2L, Dv) plus Σ p_s m_s over
    the codes' means (B, H, n, S, Dv), or ``read(p)`` (the codes' (B, H, n, L, Dv) share from their
    unnormalised weights p) in place of p · means."""
    logits = logits.masked_fill(mask, float("-inf"))
    # one normalisation of both parts, without a concatenated (L, 2L + S) copy: every query sees itself, so the
    # shift is finite, and it is detached (the softmax does not depend on it). The exps are floored as the chunk
    # impl's: masked keys and empty codes (−inf) weigh exactly 0 without exp's slow paths on a CPU.
    shift = logits.amax(-1, keepdim=True)
    if code_logits is not None:
        shift = torch.maximum(shift, code_logits.amax(-1, keepdim=True))
    shift = shift.detach()
    window = floored_exp(logits - shift)
    if code_logits is None:
        return (window @ values) / window.sum(-1, keepdim=True)
    codes = floored_exp(code_logits - shift)
    total = window.sum(-1, keepdim=True) + codes.sum(-1, keepdim=True)
    return (window @ values + (codes @ means if read is None else read(codes))) / total


def window_bad_keys(bad: torch.Tensor, L: int, first: torch.Tensor) -> torch.Tensor:
    """bad (B, H, n·L) -> (B, H, n·L, 1) poison: NaN for the queries whose raw window (their block and the
    previous one of the same sequence) holds a non-finite key up to them, else 0."""
    B, H, T = bad.shape
    win = window_blocks(bad.to(torch.float64).unsqueeze(-1), L, first).squeeze(-1)  # (B, H, n, 2L)
    seen = win.cumsum(-1)[..., L:].reshape(B, H, T)  # bad keys up to each query in its window
    return torch.zeros(seen.shape, device=bad.device, dtype=torch.float32).masked_fill(seen > 0, float("nan"))
