"""What every codebook-style op computes from an assignment of keys to codes (or slots): the :class:`Assignment`
itself and the per-code statistics, counts n_s = Σ_j Δ_js and value sums Σ_j Δ_js v_j, over consecutive groups of
keys. Shared by vq (a learned codebook) and ovq (a per-sequence memory of slots)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class Assignment(NamedTuple):
    """Δ of keys (B, H, T) to S codes: hard keeps the code ``index`` (B, H, T) long (the one-hot matrix is never
    built; ``weights`` None; −1: a key of no code, a zero row of Δ), soft the ``weights`` (B, H, T, S) (``index``
    None)."""

    weights: torch.Tensor | None
    index: torch.Tensor | None


def map_time(fn: Callable[[torch.Tensor], torch.Tensor], a: Assignment) -> Assignment:
    """Apply ``fn`` to the per-position tensor of an Assignment (time is dim 2)."""
    return Assignment(*(None if x is None else fn(x) for x in a))


def cat_time(a: Assignment, b: Assignment) -> Assignment:
    return Assignment(*(None if x is None else torch.cat([x, y], 2) for x, y in zip(a, b)))


def log_counts(counts: torch.Tensor) -> torch.Tensor:
    """log n with log 0 = −inf and no NaN gradient for empty codes: the codes' logit offset in the cache."""
    tiny = torch.finfo(counts.dtype).tiny
    return torch.where(counts > 0, counts.clamp_min(tiny).log(), float("-inf"))


def code_means(counts: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    return sums / counts.clamp_min(torch.finfo(counts.dtype).tiny).unsqueeze(-1)


def code_slots(index: torch.Tensor, num_codes: int, dim: int) -> torch.Tensor:
    """index + i·S for the i-th slice of ``index`` along ``dim``: the codes of each slice (a head, a block, a group
    of keys) as rows of a flattened (n·S) axis, for scatter-adds of every slice's statistics at once."""
    shape = [1] * index.dim()
    shape[dim] = index.shape[dim]
    return index + torch.arange(index.shape[dim], device=index.device).view(shape) * num_codes


def one_hot_rows(index: torch.Tensor, num_codes: int, dtype: torch.dtype) -> torch.Tensor:
    """Δ (..., S) of a hard ``index`` (...): one-hot rows, a zero row for −1 (a key of no code)."""
    rows = torch.nn.functional.one_hot(index.clamp_min(0), num_codes).to(dtype)
    return rows * (index >= 0).unsqueeze(-1).to(dtype)


def _group_slots(index: torch.Tensor, num_codes: int, num_groups: int) -> torch.Tensor:
    """(B, H, T) codes -> their slots in a flattened (num_groups·S + 1) axis of consecutive groups of keys, whose
    last row takes the keys of no code (index −1), for the caller to drop."""
    B, H, T = index.shape
    slots = code_slots(index.view(B, H, num_groups, T // num_groups), num_codes, 2).view(B, H, T)
    return torch.where(index >= 0, slots, num_groups * num_codes)


@torch.library.custom_op("vqattn::scatter_rows", mutates_args=())
def scatter_rows(slots: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """out (B, H, rows, Dv) with out[b, h, slots[b, h, t]] += v[b, h, t]: slots (B, H, T) long, v (B, H, T, Dv).
    One operator to the compiler, which cannot then reorder a read of the sums before the scatter that forms them,
    and which runs as one scatter where one-hot (T, S) products stood in for it; its gradient is the gather of the
    output's gradient at the slots."""
    return v.new_zeros(*v.shape[:2], rows, v.shape[-1]).scatter_add_(2, slots.unsqueeze(-1).expand_as(v), v)


@scatter_rows.register_fake
def _(slots, v, rows):
    return v.new_empty(*v.shape[:2], rows, v.shape[-1])


def _scatter_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.v_shape = inputs[1].shape


def _scatter_rows_backward(ctx, grad):
    (slots,) = ctx.saved_tensors
    return None, grad.gather(2, slots.unsqueeze(-1).expand(ctx.v_shape)), None


torch.library.register_autograd("vqattn::scatter_rows", _scatter_rows_backward, setup_context=_scatter_rows_setup)


def code_counts(a: Assignment, num_codes: int, num_groups: int, *, dtype: torch.dtype) -> torch.Tensor:
    """Per-group code counts n_s = Σ_j Δ_js over consecutive groups of keys: (B, H, G, S). Soft weights may come
    as (B, H, T, S) or already grouped, (B, H, G, T/G, S)."""
    if a.index is None:
        return a.weights.view(*a.weights.shape[:2], num_groups, -1, num_codes).sum(3)
    B, H, T = a.index.shape
    slots = _group_slots(a.index, num_codes, num_groups)
    if torch.compiler.is_compiling():  # the scatter as one operator (see scatter_rows)
        ones = torch.ones((), device=a.index.device, dtype=dtype).expand(B, H, T, 1)
        return scatter_rows(slots, ones, num_groups * num_codes + 1)[..., :-1, 0].view(B, H, num_groups, num_codes)
    ones = torch.ones((), device=a.index.device, dtype=dtype).expand(B, H, T)
    counts = ones.new_zeros(B, H, num_groups * num_codes + 1).scatter_add_(2, slots, ones)
    return counts[..., :-1].view(B, H, num_groups, num_codes)


def code_statistics(a: Assignment, v: torch.Tensor, num_codes: int, num_groups: int = 1):
    """Per-group code counts (:func:`code_counts`) and value sums Σ_j Δ_js v_j over consecutive groups.

    v: (B, H, G·L, Dv) -> counts (B, H, G, S), sums (B, H, G, S, Dv). Hard assignments scatter-add (O(T·Dv))
    instead of multiplying by the one-hot matrix (O(T·S·Dv)).
    """
    B, H, T, Dv = v.shape
    S = num_codes
    counts = code_counts(a, S, num_groups, dtype=v.dtype)
    if a.index is None:
        w = a.weights.view(B, H, num_groups, T // num_groups, S)
        return counts, w.transpose(-1, -2) @ v.view(B, H, num_groups, -1, Dv)
    slots = _group_slots(a.index, S, num_groups)
    if torch.compiler.is_compiling():  # the scatter as one operator (see scatter_rows)
        sums = scatter_rows(slots, v, num_groups * S + 1)
    else:
        sums = v.new_zeros(B, H, num_groups * S + 1, Dv).scatter_add_(2, slots.unsqueeze(-1).expand(B, H, T, Dv), v)
    return counts, sums[:, :, :-1].view(B, H, num_groups, S, Dv)
