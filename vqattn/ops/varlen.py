"""Packed variable-length sequences: flash-attn's ``cu_seqlens`` convention, for every attention op.

A packed call has B = 1 and N sequences laid end to end along T; ``cu_seqlens`` (int32, (N+1,)) holds their
boundaries, 0 = cu₀ < cu₁ < … < cu_N = T, so sequence i is tokens cuᵢ … cuᵢ₊₁ − 1. Each sequence is attended
exactly as a call of its own would attend it: the window is cut at its start, the code counts and value sums
start from zero, ovq's memory starts empty, and ``memory_cap`` and ``memory_decay`` count from its first token.

:func:`varlen` adds the argument to an op. Two ways to run a packed call, both exact:

- **Padded batch** (causal calls without state): the sequences become the rows of one (N, H, L_max, …) call,
  right-padded with zeros. Causality makes the pads invisible to the real tokens, so one batched launch (the
  Triton kernels included) computes every sequence; it does L_max·N token-slots of work for T tokens.
- **One call per sequence** (with a ``state``, with ``return_state``, or non-causal): a state belongs to one
  sequence's position, so ``state`` is then a list of N states, one per sequence (None entries start fresh), and
  ``return_state`` returns such a list.

A call with one sequence runs as the op's own call, bit for bit (its state, too, is a list of one).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch

from .common.statistics import Assignment, map_time

__all__ = ["varlen", "check_cu_seqlens", "cu_seqlens_from_starts", "positions", "packed_positions", "check_state_list"]


def check_cu_seqlens(cu_seqlens: torch.Tensor, *, batch: int, length: int) -> list[int]:
    """The boundaries as Python ints, or a ValueError naming ``cu_seqlens`` and what is allowed."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        what = (f"a {cu_seqlens.dtype} tensor of {cu_seqlens.dim()} dims" if isinstance(cu_seqlens, torch.Tensor)
                else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor (flash-attn's convention), got {what}")
    if batch != 1:
        raise ValueError(f"cu_seqlens packs the sequences along T, so the batch must be 1, got B = {batch}")
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {length} with at least one sequence, "
                         f"got {_shown(bounds)}")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (every sequence holds a token), got {_shown(bounds)}")
    return bounds


def _shown(bounds: list[int]) -> str:
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


@torch.compiler.disable
def packed_positions(cu_seqlens: torch.Tensor, *, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """:func:`check_cu_seqlens`, then :func:`positions`: what a packed layer or model call needs, outside
    ``torch.compile``: the boundaries are read on the host, and a compiled graph that saw them as numbers would
    recompile for every new batch of documents."""
    return positions(check_cu_seqlens(cu_seqlens, batch=batch, length=length), device=device)


def _time_map(x, fn):
    """fn over the time axis (dim 2) of a per-token input: a tensor, an Assignment, or None."""
    if x is None:
        return None
    return map_time(fn, x) if isinstance(x, Assignment) else fn(x)


def _padded(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(1, H, T, …) -> (N, H, L_max, …): index (N, L_max) into T, where T itself is a zero pad."""
    x = torch.cat([x, x.new_zeros(x[:, :, :1].shape)], 2)[0]  # (H, T + 1, …)
    return x[:, index].movedim(1, 0)


def check_state_list(state, bounds: list[int], kind: str = "states") -> None:
    """ValueError unless ``state`` is None or a list of one state per sequence of ``bounds`` (None entries start
    fresh): what a packed call with states takes, in the ops, the layers and the model."""
    n = len(bounds) - 1
    if state is not None and (not isinstance(state, (list, tuple)) or len(state) != n):
        size = f" of {len(state)}" if isinstance(state, (list, tuple)) else ""
        raise ValueError(f"with cu_seqlens, state must be a list of {n} {kind} (one per sequence, None to start "
                         f"fresh), got {type(state).__name__}{size}")


def _per_sequence(call, per_token: dict, bounds: list[int], state, return_state: bool):
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


def _padded_batch(call, per_token: dict, bounds: list[int]):
    device = next(x for x in per_token.values() if isinstance(x, torch.Tensor)).device
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    width, total = max(lengths), bounds[-1]
    slot = torch.arange(width, device=device)
    start, length = (torch.tensor(x, device=device)[:, None] for x in (bounds[:-1], lengths))
    index = torch.where(slot < length, start + slot, total)  # (N, L_max) into T; T is the zero pad
    out = call(**{name: _time_map(x, lambda t: _padded(t, index)) for name, x in per_token.items()},
               state=None, return_state=False)  # (N, H, L_max, Dv)
    flat = (slot + torch.arange(len(lengths), device=device)[:, None] * width)[slot < length]  # real slots, in order
    return out.movedim(0, 1).flatten(1, 2)[:, flat].unsqueeze(0)  # (1, H, T, Dv)


def _stateless(op: Callable) -> Callable:
    def call(*args, state=None, return_state=False, **kwargs):
        return op(*args, **kwargs)
    return call


def varlen(per_token: tuple[str, ...]) -> Callable:
    """Decorator: the op takes ``cu_seqlens`` (see the module docstring); ``per_token`` names its arguments with
    a time axis at dim 2 (tensors or Assignments), which are split along it. The op must take ``state`` and
    ``return_state`` (ops without a state take them as None / False)."""

    def wrap(op: Callable) -> Callable:
        signature = inspect.signature(op)
        stateful = "state" in signature.parameters

        @functools.wraps(op)
        def packed(*args, cu_seqlens: torch.Tensor | None = None, **kwargs):
            if cu_seqlens is None:
                return op(*args, **kwargs)
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
            bounds = check_cu_seqlens(cu_seqlens, batch=first.shape[0], length=first.shape[2])
            for name in per_token:
                x = given[name]
                t = x if not isinstance(x, Assignment) else next(y for y in x if y is not None)
                if t is not None and (t.dim() < 3 or t.shape[:1] != (1,) or t.shape[2] != bounds[-1]):
                    raise ValueError(f"with cu_seqlens, {name} must be (1, H, T, …) with T = {bounds[-1]}, "
                                     f"got {tuple(t.shape)}")
            state, return_state = given.pop("state", None), given.pop("return_state", False)
            tokens = {name: given.pop(name) for name in per_token}
            call = functools.partial(op if stateful else _stateless(op), **given)
            if state is None and not return_state and len(bounds) > 2 and given.get("causal", True):
                return _padded_batch(call, tokens, bounds)
            return _per_sequence(call, tokens, bounds, state, return_state)

        packed.__signature__ = signature.replace(parameters=[
            *signature.parameters.values(),
            inspect.Parameter("cu_seqlens", inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation="torch.Tensor | None")])
        return packed

    return wrap
