"""Packed variable-length sequences: flash-attn's ``cu_seqlens`` convention, for every attention op.

A packed call has B = 1 and N sequences laid end to end along T; ``cu_seqlens`` (int32, (N+1,)) holds their
boundaries, 0 = cu₀ < cu₁ < … < cu_N = T, so sequence i is tokens cuᵢ … cuᵢ₊₁ − 1. Each sequence is attended
exactly as a call of its own would attend it: the window is cut at its start, the code counts and value sums
start from zero, ovq's memory starts empty, and ``memory_cap`` and ``memory_decay`` count from its first token.

:func:`varlen` adds the argument to an op. ``cu_seqlens`` may also be a :class:`Packing`, the boundaries already
read on the host (a model reads them once per batch and hands the same Packing to every layer and op). Two ways
to run a packed call, both exact:

- **Length classes** (causal calls without state): the sequences are grouped by their number of blocks of L
  (the op's ``block_len``, else :data:`~vqattn.ops.blocks.DEFAULT_BLOCK_LEN`); a class of one sequence runs as
  the op's own call on its tokens, a class of several as one batch (n, H, L_class, …), right-padded with zeros.
  Causality makes the pads invisible to the real tokens, and a sequence is padded by less than one block, so a
  packed row costs its tokens plus one call per class, never N × the longest (the Triton kernels included).
  On a GPU neighbouring classes merge where a call's launches cost more than the padding saved
  (:data:`CALL_TOKENS`).
- **One call per sequence** (with a ``state``, with ``return_state``, or non-causal): a state belongs to one
  sequence's position, so ``state`` is then a list of N states, one per sequence (None entries start fresh), and
  ``return_state`` returns such a list.

A call with one sequence runs as the op's own call, bit for bit (its state, too, is a list of one).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .blocks import DEFAULT_BLOCK_LEN
from .common.segments import BlockLayout
from .common.statistics import Assignment, map_time

__all__ = ["varlen", "Packing", "Segments", "as_packing", "check_cu_seqlens", "cu_seqlens_from_starts", "positions",
           "read_packing", "resolve_call", "PackedCall", "check_state_list"]


def check_cu_seqlens(cu_seqlens: torch.Tensor, *, batch: int, length: int) -> list[int]:
    """The boundaries as Python ints, or a ValueError naming ``cu_seqlens`` and what is allowed."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        what = (f"a {cu_seqlens.dtype} tensor of {cu_seqlens.dim()} dims" if isinstance(cu_seqlens, torch.Tensor)
                else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor (flash-attn's convention), got {what}")
    _check_batch(batch)
    bounds = cu_seqlens.tolist()
    _check_bounds(bounds, length)
    return bounds


def _check_batch(batch: int) -> None:
    if batch != 1:
        raise ValueError(f"cu_seqlens packs the sequences along T, so the batch must be 1, got B = {batch}")


def _check_bounds(bounds: Sequence[int], length: int) -> None:
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {length} with at least one sequence, "
                         f"got {_shown(bounds)}")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (every sequence holds a token), got {_shown(bounds)}")


def _shown(bounds: Sequence[int]) -> str:
    bounds = list(bounds)
    return str(bounds) if len(bounds) <= 12 else f"[{', '.join(map(str, bounds[:10]))}, …, {bounds[-1]}]"


def cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` of a packed row from a bool mask (T,) that is True at each sequence's first token (the first
    token always starts one)."""
    starts = starts.clone()
    starts[0] = True
    bounds = torch.cat([starts.nonzero().flatten(), starts.new_tensor([starts.numel()], dtype=torch.long)])
    return bounds.to(torch.int32)


def positions(cu_seqlens: torch.Tensor | Sequence[int], offsets: Sequence[int] | None = None,
              device: torch.device | None = None) -> torch.Tensor:
    """(T,) long: each token's position in its own sequence (plus ``offsets[i]`` for sequence i, the length a
    state already holds), the per-token positions of RoPE in a packed call. ``cu_seqlens`` may be the boundaries
    as Python ints (what :func:`check_cu_seqlens` returns: no host read of a device tensor)."""
    if isinstance(cu_seqlens, torch.Tensor):
        device = cu_seqlens.device if device is None else device
        cu_seqlens = cu_seqlens.tolist()
    starts = [a - (0 if offsets is None else offsets[i]) for i, a in enumerate(cu_seqlens[:-1])]
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    first = torch.repeat_interleave(torch.tensor(starts, device=device), torch.tensor(lengths, device=device),
                                    output_size=cu_seqlens[-1])
    return torch.arange(cu_seqlens[-1], device=device) - first


class LengthClass(NamedTuple):
    """The sequences of a packed row that hold the same number of blocks (or neighbouring numbers, merged where a
    call costs more than the padding: :meth:`Packing.classes`), run as one call.

    span: (a, b), the tokens of the class's one sequence, or None for several. For several, n rows of ``width``
    slots (the longest sequence's length): ``slots`` (n·width,) long, the token in each slot (a pad repeats its
    row's first token, and is zeroed: ``pads`` (n·width,) bool); ``real`` (Σ lengths,) long, the real slots in
    order, and ``tokens`` (Σ lengths,) long, their tokens.
    """

    span: tuple[int, int] | None
    rows: int = 1
    width: int = 0
    slots: torch.Tensor | None = None
    pads: torch.Tensor | None = None
    real: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


class Packing:
    """The boundaries of a packed row, read on the host once, and what is derived from them: the tokens' positions
    and the length classes that :func:`varlen` runs. A model builds one per batch (:meth:`of`) and hands it to
    every layer and op as their ``cu_seqlens``: none of them reads the boundaries back from the device again.

    ``cu_seqlens`` the (N+1,) int32 tensor (on the inputs' device), ``bounds`` the same as Python ints.
    """

    __slots__ = ("cu_seqlens", "bounds", "_positions", "_classes")

    def __init__(self, cu_seqlens: torch.Tensor, bounds: Sequence[int]):
        self.cu_seqlens, self.bounds = cu_seqlens, tuple(bounds)
        self._positions: torch.Tensor | None = None
        self._classes: dict[tuple[int, int], tuple[LengthClass, ...]] = {}

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor | Packing, *, batch: int, length: int) -> Packing:
        """``cu_seqlens`` checked (a ValueError names it) and read once: a Packing, or the given one checked
        against the batch and length of the call, with no read."""
        if isinstance(cu_seqlens, Packing):
            _check_batch(batch)
            _check_bounds(cu_seqlens.bounds, length)
            return cu_seqlens
        return cls(cu_seqlens, check_cu_seqlens(cu_seqlens, batch=batch, length=length))

    @classmethod
    def from_bounds(cls, bounds: Sequence[int], device: torch.device | str | None = None) -> Packing:
        """A Packing of boundaries known on the host (a data loader's, a tokenizer's lengths): no read."""
        bounds = [int(b) for b in bounds]
        _check_bounds(bounds, bounds[-1] if bounds else 0)
        return cls(torch.tensor(bounds, dtype=torch.int32, device=device), bounds)

    @classmethod
    def from_starts(cls, starts: torch.Tensor, device: torch.device | str | None = None) -> Packing:
        """The Packing of a packed row from a bool mask (T,), True at each sequence's first token (the first token
        always starts one): one read of the mask, wherever it lives; ``cu_seqlens`` on ``device`` (default: the
        mask's)."""
        host = starts.detach().to("cpu", torch.bool).clone()
        host[0] = True
        bounds = [*host.nonzero().flatten().tolist(), host.numel()]
        return cls(torch.tensor(bounds, dtype=torch.int32).to(starts.device if device is None else device), bounds)

    @property
    def length(self) -> int:
        return self.bounds[-1]

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """(T,) long: each token's position in its own sequence (:func:`positions`), formed once."""
        device = self.cu_seqlens.device if device is None else torch.device(device)
        if self._positions is None or self._positions.device != device:
            self._positions = positions(self.bounds, device=device)
        return self._positions

    def segments(self, block_lens: Sequence[int] = (DEFAULT_BLOCK_LEN,), device: torch.device | None = None) -> Segments:
        """The boundaries as tensors alone (:class:`Segments`), with a block layout for each of ``block_lens``: what
        a compiled model takes, formed here on the host."""
        device = self.cu_seqlens.device if device is None else torch.device(device)
        cu_seqlens = self.cu_seqlens.to(device)
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        layouts = tuple(BlockLayout.build(self.bounds, L, device) for L in sorted(set(block_lens)))
        return Segments(cu_seqlens, self.positions(device), layouts)

    def classes(self, block_len: int, call_tokens: int | None = None) -> tuple[LengthClass, ...]:
        """The sequences grouped into length classes (formed once per block length): by their number of blocks of
        ``block_len``, so each is padded by less than one block, then neighbouring groups merged where a call
        costs more than the padding it saves. ``call_tokens``: a call's fixed cost in token slots, default
        :data:`CALL_TOKENS` of the boundaries' device (0: never merge)."""
        if call_tokens is None:
            call_tokens = CALL_TOKENS.get(self.cu_seqlens.device.type, CALL_TOKENS["cuda"])
        key = (block_len, call_tokens)
        if key not in self._classes:
            self._classes[key] = self._group(block_len, call_tokens)
        return self._classes[key]

    def _group(self, block_len: int, call_tokens: int) -> tuple[LengthClass, ...]:
        bounds = self.bounds
        by_blocks: dict[int, list[int]] = {}
        for i, n in enumerate(self.lengths):
            by_blocks.setdefault(-(-n // block_len), []).append(i)
        groups = [seqs for _, seqs in sorted(by_blocks.items())]
        return tuple(self._class([i for g in groups[a:b] for i in g]) for a, b in
                     merged_groups([[bounds[i + 1] - bounds[i] for i in g] for g in groups], call_tokens))

    def _class(self, seqs: list[int]) -> LengthClass:
        """The class of sequences ``seqs`` (in the row's order)."""
        bounds, seqs = self.bounds, sorted(seqs)
        if len(seqs) == 1:
            return LengthClass((bounds[seqs[0]], bounds[seqs[0] + 1]))
        width = max(bounds[i + 1] - bounds[i] for i in seqs)
        slots, pads, real, tokens = [], [], [], []
        for row, i in enumerate(seqs):
            a, b = bounds[i], bounds[i + 1]
            slots += [*range(a, b), *[a] * (width - (b - a))]
            pads += [False] * (b - a) + [True] * (width - (b - a))
            real += range(row * width, row * width + b - a)
            tokens += range(a, b)
        device = self.cu_seqlens.device
        slots, pads, real, tokens = (torch.tensor(x, device=device) for x in (slots, pads, real, tokens))
        return LengthClass(None, len(seqs), width, slots, pads, real, tokens)


class Segments(NamedTuple):
    """A packed row's boundaries as tensors only, for ``torch.compile`` (:meth:`Packing.segments`): ``cu_seqlens``
    (N+1,) int32, ``positions`` (T,) long (each token's position in its sequence) and a
    :class:`~vqattn.ops.common.segments.BlockLayout` per block length. Passed as ``cu_seqlens`` to a model, layer or
    op, it runs the packed call in its segmented block form (:mod:`vqattn.ops.common.segments`), which a compiled
    graph traces whole: no host read, and no recompile for new documents (the sizes that change are marked
    dynamic). Options a segmented form does not cover (ovq's ``memory_decay``) read ``cu_seqlens`` and run the length
    classes outside the graph."""

    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    layouts: tuple[BlockLayout, ...]

    @property
    def length(self) -> int:
        return self.positions.shape[0]

    def check(self, *, batch: int, length: int, state=None, return_state: bool = False, causal: bool = True) -> None:
        """ValueError unless a call given these Segments is causal, without states, with B = 1 and their T tokens."""
        if state is not None or return_state or not causal:
            raise ValueError("cu_seqlens given as Segments runs causal calls without states; pass the cu_seqlens "
                             "tensor or a Packing for a call with state, return_state or causal=False")
        _check_batch(batch)
        if length != self.length:
            raise ValueError(f"with cu_seqlens (Segments of T = {self.length} tokens), the input's T must be "
                             f"{self.length}, got {length}")

    def document_mask(self) -> torch.Tensor:
        """(T, T) bool: key j is visible to query i, in i's own sequence and not after it (quadratic attention)."""
        i = torch.arange(self.length, device=self.positions.device)
        first = (i - self.positions)[:, None]  # each query's sequence's first token
        return (i[None, :] <= i[:, None]) & (i[None, :] >= first)

    def layout(self, block_len: int) -> BlockLayout:
        for layout in self.layouts:
            if layout.block_len == block_len:
                return layout
        have = [layout.block_len for layout in self.layouts]
        raise ValueError(f"these Segments hold block layouts for block_len {have}, not {block_len}: build them with "
                         f"Packing.segments(block_lens=[..., {block_len}])")


# A call's fixed cost, in token slots of work, by device type: what merging two length classes into one padded batch
# may spend in padding to save a call. On a CPU, never: a call's dispatch (about a millisecond, forward and
# backward) costs less than the copies a merged class makes of its inputs, its soft weights included (measured in the
# default vq_soft model at 2048 tokens, four sequences: four calls on views 10% over one unpacked call, two merged
# calls 18%). On a GPU a vq call launches about 40 kernels, worth a couple of thousand tokens of a (16 heads of 64)
# step on an H200 (4.1 ms for 8192 tokens, vq_hard, fwd+bwd, bf16).
CALL_TOKENS = {"cpu": 0, "cuda": 2048}


def merged_groups(groups: list[list[int]], call_tokens: int, reach: int = 64) -> list[tuple[int, int]]:
    """Ranges [a, b) of ``groups`` (the sequences' lengths, grouped by number of blocks, in increasing order) that
    minimise Σ (slots + ``call_tokens``) over the ranges, a range's slots being its sequences' count times its
    longest (its tokens alone, for one sequence): one call per range. Dynamic programming over the range ends, each
    range spanning at most ``reach`` groups; with ``call_tokens`` 0 every group is its own range."""
    if call_tokens <= 0:
        return [(a, a + 1) for a in range(len(groups))]
    best, cut = [0] + [None] * len(groups), [0] * (len(groups) + 1)
    for b in range(1, len(groups) + 1):
        rows, width = 0, max(groups[b - 1])
        for a in range(b - 1, max(b - reach, 0) - 1, -1):
            rows += len(groups[a])
            cost = best[a] + (width if rows == 1 else rows * width) + call_tokens
            if best[b] is None or cost < best[b]:
                best[b], cut[b] = cost, a
    ranges, b = [], len(groups)
    while b:
        ranges.append((cut[b], b))
        b = cut[b]
    return ranges[::-1]


class _SplitClasses(torch.autograd.Function):
    """x (1, H, T, …) -> every length class's input: its sequence's tokens (a view), or (n, H, width, …) rows with
    zero pads. The backward pass writes x's gradient once, each token from its class (pads have none)."""

    @staticmethod
    def forward(ctx, x, classes: tuple[LengthClass, ...]):
        ctx.classes, ctx.shape, ctx.dtype, ctx.device = classes, x.shape, x.dtype, x.device
        return tuple(_class_input(x, c) for c in classes)

    @staticmethod
    def backward(ctx, *grads):
        if all(g is None for g in grads):
            return None, None
        # every token belongs to one class, which writes its gradient; a class not differentiated leaves zeros
        make = torch.empty if all(g is not None for g in grads) else torch.zeros
        grad = make(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        for c, g in zip(ctx.classes, grads):
            if g is not None:
                _write_class(grad, c, g)
        return grad, None


def _class_input(x: torch.Tensor, c: LengthClass) -> torch.Tensor:
    """Class c's tokens of x (1, H, T, …): a view of its one sequence, or (n, H, width, …) rows, zeros at pads."""
    if c.span is not None:
        return x[:, :, c.span[0]:c.span[1]]
    rows = x[0].index_select(1, c.slots)  # (H, n·width, …)
    rows.masked_fill_(c.pads.view(-1, *[1] * (rows.dim() - 2)), 0)
    return rows.view(rows.shape[0], c.rows, c.width, *rows.shape[2:]).movedim(1, 0)


def _write_class(x: torch.Tensor, c: LengthClass, piece: torch.Tensor) -> None:
    """The inverse of :func:`_class_input`: class c's ``piece`` written into x (1, H, T, …) at its tokens (pads
    dropped), in place."""
    if c.span is not None:
        x[:, :, c.span[0]:c.span[1]] = piece
    else:  # (n, H, width, …) -> (H, n·width, …): the real slots go to their tokens
        x[0].index_copy_(1, c.tokens, piece.movedim(0, 1).flatten(1, 2).index_select(1, c.real))


class _MergeClasses(torch.autograd.Function):
    """The classes' outputs (:class:`_SplitClasses`'s order) -> (1, H, T, Dv) in token order, written once; the
    backward pass hands each class its tokens' gradient (zeros at pads)."""

    @staticmethod
    def forward(ctx, classes: tuple[LengthClass, ...], length: int, *outs):
        ctx.classes = classes
        first = outs[0]
        H, Dv = first.shape[1], first.shape[-1]
        out = first.new_empty(1, length, H, Dv).transpose(1, 2)  # a layer's merge of the heads is then a view
        for c, o in zip(classes, outs):
            _write_class(out, c, o)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, *(_class_input(grad, c) for c in ctx.classes)


def as_packing(cu_seqlens: torch.Tensor | Packing, *, batch: int, length: int) -> Packing:
    """:meth:`Packing.of`: what a layer or op does with its ``cu_seqlens`` argument."""
    return Packing.of(cu_seqlens, batch=batch, length=length)


@torch.compiler.disable
def read_packing(cu_seqlens: torch.Tensor | Packing, *, batch: int, length: int,
                 device: torch.device) -> tuple[Packing, torch.Tensor]:
    """:func:`as_packing` and its (T,) positions on ``device``: what a packed layer or model call needs, outside
    ``torch.compile``: the boundaries are read on the host (unless given as a Packing), and a compiled graph that
    saw them as numbers would recompile for every new batch of documents."""
    packing = as_packing(cu_seqlens, batch=batch, length=length)
    return packing, packing.positions(device)


class PackedCall(NamedTuple):
    """What a model or layer call does with its ``cu_seqlens`` (:func:`resolve_call`): ``each`` the boundaries as
    Python ints when the sequences run one by one (a call with states), else None; ``boundaries`` what its layers and
    ops take (a Packing, Segments, or None for an unpacked call); ``positions`` (T,) each packed token's position in
    its sequence, or None."""

    each: tuple[int, ...] | None
    boundaries: Packing | Segments | None
    positions: torch.Tensor | None


def resolve_call(cu_seqlens: torch.Tensor | Packing | Segments | None, *, batch: int, length: int, state,
                 return_state: bool, device: torch.device) -> PackedCall:
    """The one dispatch of a packed model or layer call: Segments pass as they are (tensors only, no states: a
    compiled graph traces them whole); with a state or ``return_state`` each sequence runs alone (its state is its
    own); otherwise the boundaries are read on the host once (:func:`read_packing`) and handed on as a Packing, so no
    layer or op below reads them again. A ValueError names ``cu_seqlens`` when they do not fit the call."""
    if cu_seqlens is None:
        return PackedCall(None, None, None)
    if isinstance(cu_seqlens, Segments):
        cu_seqlens.check(batch=batch, length=length, state=state, return_state=return_state)
        return PackedCall(None, cu_seqlens, cu_seqlens.positions)
    if state is not None or return_state:
        return PackedCall(as_packing(cu_seqlens, batch=batch, length=length).bounds, None, None)
    packing, positions = read_packing(cu_seqlens, batch=batch, length=length, device=device)
    return PackedCall(None, packing, positions)


def _time_map(x, fn):
    """fn over the time axis (dim 2) of a per-token input: a tensor, an Assignment, or None."""
    if x is None:
        return None
    return map_time(fn, x) if isinstance(x, Assignment) else fn(x)


def check_state_list(state, bounds: Sequence[int], kind: str = "states") -> None:
    """ValueError unless ``state`` is None or a list of one state per sequence of ``bounds`` (None entries start
    fresh): what a packed call with states takes, in the ops, the layers and the model."""
    n = len(bounds) - 1
    if state is not None and (not isinstance(state, (list, tuple)) or len(state) != n):
        size = f" of {len(state)}" if isinstance(state, (list, tuple)) else ""
        raise ValueError(f"with cu_seqlens, state must be a list of {n} {kind} (one per sequence, None to start "
                         f"fresh), got {type(state).__name__}{size}")


def _per_sequence(call, per_token: dict, bounds: Sequence[int], state, return_state: bool):
    check_state_list(state, bounds)
    outs, states = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        args = {name: _time_map(x, lambda t: t[:, :, a:b]) for name, x in per_token.items()}
        r = call(**args, state=None if state is None else state[i], return_state=return_state)
        out, new = r if return_state else (r, None)
        outs.append(out)
        states.append(new)
    out = torch.cat(outs, 2)
    return (out, states) if return_state else out


def _by_class(call, per_token: dict, packing: Packing, block_len: int):
    """Every length class of ``packing`` as one call (see the module docstring), the outputs back in token order:
    (1, H, T, Dv). Each input is split, and the output merged, by one autograd function, so that the gradients of
    the inputs and the output are written once, not zero-filled and added once per class."""
    classes = packing.classes(block_len)
    split = {name: _time_map(x, lambda t: _SplitClasses.apply(t, classes)) for name, x in per_token.items()}
    outs = []
    for i in range(len(classes)):
        args = {name: None if x is None else (map_time(lambda parts: parts[i], x) if isinstance(x, Assignment)
                                              else x[i]) for name, x in split.items()}
        outs.append(call(**args, state=None, return_state=False))
    return _MergeClasses.apply(classes, packing.length, *outs)


def _stateless(op: Callable) -> Callable:
    def call(*args, state=None, return_state=False, **kwargs):
        return op(*args, **kwargs)
    return call


def _check_per_token(given: dict, per_token: tuple[str, ...], length: int) -> None:
    """ValueError unless every per-token input of a packed call is (1, H, T, …) with T = ``length``."""
    for name in per_token:
        x = given[name]
        t = x if not isinstance(x, Assignment) else next((y for y in x if y is not None), None)
        if t is not None and (t.dim() < 3 or t.shape[0] != 1 or t.shape[2] != length):
            raise ValueError(f"with cu_seqlens, {name} must be (1, H, T, …) with T = {length}, got {tuple(t.shape)}")


def varlen(per_token: tuple[str, ...], segmented: Callable | None = None) -> Callable:
    """Decorator: the op takes ``cu_seqlens`` (see the module docstring); ``per_token`` names its arguments with
    a time axis at dim 2 (tensors or Assignments), which are split along it. The op must take ``state`` and
    ``return_state`` (ops without a state take them as None / False). ``segmented(arguments, segments)``: the
    op's segmented block form (:mod:`vqattn.ops.common.segments`), which runs a call given :class:`Segments`, or
    returns None for options it does not cover (the call then runs its length classes outside the graph)."""

    def wrap(op: Callable) -> Callable:
        signature = inspect.signature(op)
        stateful = "state" in signature.parameters

        @functools.wraps(op)
        def packed(*args, cu_seqlens: torch.Tensor | Packing | Segments | None = None, **kwargs):
            if cu_seqlens is None:
                return op(*args, **kwargs)
            if isinstance(cu_seqlens, Segments):
                given = signature.bind(*args, **kwargs)
                given.apply_defaults()
                given = dict(given.arguments)
                first = given[per_token[0]]
                if segmented is not None and isinstance(first, torch.Tensor) and first.dim() >= 3:
                    cu_seqlens.check(batch=first.shape[0], length=cu_seqlens.length, state=given.get("state"),
                                     return_state=given.get("return_state"), causal=given.get("causal", True))
                    _check_per_token(given, per_token, cu_seqlens.length)
                    out = segmented(given, cu_seqlens)
                    if out is not None:
                        return out
                cu_seqlens = cu_seqlens.cu_seqlens  # read outside the graph, as a tensor
            return run_packed(args, kwargs, cu_seqlens)

        # Outside torch.compile: the boundaries are read on the host, and a graph that saw them as numbers would
        # recompile for every new batch of documents; the op itself runs as in eager mode.
        @torch.compiler.disable
        def run_packed(args, kwargs, cu_seqlens):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments)
            first = given[per_token[0]]
            if not isinstance(first, torch.Tensor) or first.dim() < 3:
                return op(*args, **kwargs)  # the op's own checks name the bad argument
            packing = as_packing(cu_seqlens, batch=first.shape[0], length=first.shape[2])
            bounds = packing.bounds
            _check_per_token(given, per_token, bounds[-1])
            state, return_state = given.pop("state", None), given.pop("return_state", False)
            tokens = {name: given.pop(name) for name in per_token}
            call = functools.partial(op if stateful else _stateless(op), **given)
            if state is None and not return_state and len(bounds) > 2 and given.get("causal", True):
                return _by_class(call, tokens, packing, given.get("block_len") or DEFAULT_BLOCK_LEN)
            return _per_sequence(call, tokens, bounds, state, return_state)

        packed.__signature__ = signature.replace(parameters=[
            *signature.parameters.values(),
            inspect.Parameter("cu_seqlens", inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation="torch.Tensor | Packing | Segments | None")])
        return packed

    return wrap
