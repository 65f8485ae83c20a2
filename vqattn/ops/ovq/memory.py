"""The memory of :func:`~vqattn.ops.ovq.ovq_attention`, shared by its chunk and recurrent impls: the online
assignment of one block of keys to slots, the per-block slot statistics and their lagged prefix sums, and the
memory's logits and values."""

from __future__ import annotations

import torch

from ..common.memory_decay import weigh_blocks
from ..common.statistics import Assignment, code_means, code_statistics, log_counts
from ..graphs import can_graph, replay_graphed


class _LaggedSum(torch.autograd.Function):
    """out_b = (x0 + Σ_{b' ≤ b − lag} x_b') · r_b over dim 2, with r_b = 1 / max(n_b, tiny) (means) or 1 (sums).

    On a CPU, ``torch.cumsum`` over a dim that is not the last walks memory with a stride of a whole block (e.g.
    S·D floats), about 5× slower than adding contiguous blocks at (128, 512, 64); its backward adds two flips,
    and the offset, the lag and the division three more passes. Here a running sum of one block stays in cache
    and each output block is written once. The gradient of x_b' is Σ_{b ≥ b' + lag} r_b·g_b, a suffix sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, x0: torch.Tensor, counts: torch.Tensor | None, lag: int) -> torch.Tensor:
        inverse = None if counts is None else 1 / counts.clamp_min(torch.finfo(counts.dtype).tiny).unsqueeze(-1)
        running, out = x0.clone(), x.new_empty(x.shape)
        for b in range(x.shape[2]):
            if b >= lag:
                running += x[:, :, b - lag]
            if inverse is None:
                out[:, :, b] = running
            else:
                torch.mul(running, inverse[:, :, b], out=out[:, :, b])
        ctx.lag = lag
        ctx.save_for_backward(counts, inverse, out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, inverse, out = ctx.saved_tensors
        lag, nb = ctx.lag, grad.shape[2]
        suffix = grad.new_zeros(grad[:, :, 0].shape)  # Σ_{b'' ≥ b} r_b''·g_b'', one block, kept in cache
        grad_x = grad.new_empty(grad.shape)
        for b in range(nb - 1, -1, -1):
            if inverse is None:
                suffix += grad[:, :, b]
            else:
                suffix.addcmul_(grad[:, :, b], inverse[:, :, b])
            if b >= lag:
                grad_x[:, :, b - lag].copy_(suffix)
        grad_x[:, :, max(nb - lag, 0) :].zero_()  # the last blocks reach no block lag later
        grad_counts = None
        if ctx.needs_input_grad[2]:  # out = sum / n where n ≥ tiny: ∂out/∂n = −out / n
            grad_counts = -(grad * out).sum(-1) * inverse.squeeze(-1) * (counts >= torch.finfo(counts.dtype).tiny)
        return grad_x, suffix, grad_counts, None


def lagged_sum(x: torch.Tensor, x0: torch.Tensor, lag: int, loop: bool, counts: torch.Tensor | None = None):
    """x0 + Σ_{b' ≤ b − lag} x_b' for every block b of x (B, H, nb, ...), x0 (B, H, ...); divided by
    max(counts, tiny) (B, H, nb, S) when given (means, as :func:`code_means`). Block after block when ``loop``
    (:func:`~vqattn.ops.blocks.loops`), else one cumsum."""
    if loop:
        return _LaggedSum.apply(x, x0, counts, lag)
    total = x0.unsqueeze(2) + torch.cumsum(x, 2)
    total = torch.cat([x0.unsqueeze(2).expand(-1, -1, min(x.shape[2], lag), *x0.shape[2:]), total[:, :, :-lag]], 2)
    return total if counts is None else code_means(counts, total)


def _scores(keys: torch.Tensor, centres: torch.Tensor, centre_sq: torch.Tensor) -> torch.Tensor:
    """‖k_i − c_s‖² − ‖k_i‖² = ‖c_s‖² − 2 k_i·c_s, one batched product: keys (B, H, L, D), centres
    (B, H, S, D) and their squared norms (B, H, S) (+inf for a centre that does not count) -> (B, H, L, S)."""
    B, H, L, D = keys.shape
    S = centres.shape[2]
    return torch.baddbmm(centre_sq.reshape(B * H, 1, S), keys.reshape(B * H, L, D),
                         centres.reshape(B * H, S, D).transpose(1, 2), alpha=-2).view(B, H, L, S)


@torch.no_grad()
def assign_block(keys: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor, threshold: float,
                 drop: bool = False) -> torch.Tensor:
    """Online assignment of one block's memory keys (B, H, L, D) to the slots of the memory before the block
    (counts (B, H, S), key sums (B, H, S, D); the slots opened so far are 0..m−1, those with a positive count
    occupied): (B, H, L) slot indices.

    A key is novel when its squared distance to every occupied slot's mean key exceeds ``threshold`` times its
    squared norm (always when m = 0). The novel keys, in position order, open slots m, m+1, ... while slots remain;
    every other key joins the nearest of the occupied slots (at their mean keys) and the slots opened in this block
    (at their opening keys), the lowest slot index on a tie. With ``drop`` (``overflow="drop"``), a novel key that
    finds no slot left is not stored: slot −1. Masks and a cumsum, no host sync; no gradient (the choice is
    discrete). Cost: one (L, S) and one (L, L) score product.
    """
    keys = keys.detach()
    S = counts.shape[-1]
    occupied = counts > 0  # (B, H, S)
    # 1 + the last occupied slot: slots open in order, and one that forgetting took to a zero count stays closed
    m = (occupied * torch.arange(1, S + 1, device=counts.device)).amax(-1, keepdim=True)  # (B, H, 1)
    means = code_means(counts, key_sums)
    old = _scores(keys, means, (means * means).sum(-1).masked_fill(~occupied, float("inf")))
    old_score, old_slot = old.min(-1)  # (B, H, L); min's index is the first (lowest) on a tie
    key_sq = (keys * keys).sum(-1)  # (B, H, L)
    novel = (old_score + key_sq > threshold * key_sq) | (m == 0)
    new_slot = m + novel.cumsum(-1) - novel.long()  # m + (novel keys before)
    opens = novel & (new_slot < S)
    # The slots opened in this block, at their opening keys: scores against the keys that open one.
    new_score, opener = _scores(keys, keys, key_sq.masked_fill(~opens, float("inf"))).min(-1)
    # Opened slots come after every occupied one and in their openers' order: a tie keeps the lower slot.
    nearest = torch.where(new_score < old_score, new_slot.gather(-1, opener), old_slot)
    if drop:
        nearest = torch.where(novel, -1, nearest)
    return torch.where(opens, new_slot, nearest)


@torch.no_grad()
def online_slots(memory_keys: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor, L: int,
                 threshold: float, decay: float | None = None, drop: bool = False,
                 opens: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`assign_block` block after block, absorbing each block before the next (the memory times ``decay`` g
    first, :mod:`~vqattn.ops.common.memory_decay`): memory keys (B, H, nb·L, D) and the memory before them ->
    (B, H, nb·L) slot indices (−1: not stored, with ``drop``). ``opens`` (nb,) bool: the memory empties before
    each block where it is set (a packed sequence's first block, :mod:`~vqattn.ops.common.segments`).

    One opaque operator to ``torch.compile``, which would otherwise unroll the loop over every block into its
    graph. On a GPU the loop is one CUDA graph (:mod:`~vqattn.ops.graphs`): a few dozen tiny kernels per block."""
    return _online_slots_op(memory_keys.detach(), counts.detach(), key_sums.detach(), L, threshold,
                            1.0 if decay is None else decay, drop, opens)


@torch.library.custom_op("vqattn::ovq_online_slots", mutates_args=())
def _online_slots_op(memory_keys: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor, L: int,
                     threshold: float, decay: float, drop: bool, opens: torch.Tensor | None = None) -> torch.Tensor:
    inputs = (memory_keys, counts, key_sums)
    if opens is None and can_graph(*inputs):
        return replay_graphed(_online_slots_loop, inputs, L, threshold, decay, drop)
    return _online_slots_loop(*inputs, L, threshold, decay, drop, opens)


@_online_slots_op.register_fake
def _(memory_keys, counts, key_sums, L, threshold, decay, drop, opens=None):
    return memory_keys.new_empty(memory_keys.shape[:3], dtype=torch.long)


def _online_slots_loop(memory_keys: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor, L: int,
                       threshold: float, decay: float, drop: bool, opens: torch.Tensor | None = None) -> torch.Tensor:
    B, H, S, D = key_sums.shape
    counts, key_sums = counts.clone(), key_sums.clone()
    offsets = torch.arange(B * H, device=counts.device).view(B, H, 1) * S  # rows of the flattened (B·H·S) slots
    out = []
    for b, block in enumerate(memory_keys.split(L, 2)):
        if opens is not None:  # a masked product, not a branch: no host read of the flag
            kept = (~opens[b]).to(counts.dtype)
            counts.mul_(kept)
            key_sums.mul_(kept)
        slots = assign_block(block, counts, key_sums, threshold, drop)
        stored = (slots >= 0).to(counts.dtype)  # a dropped key (−1) adds nothing, to row 0 of its head
        rows = (slots.clamp_min(0) + offsets).flatten()
        if decay != 1:
            counts.mul_(decay)
            key_sums.mul_(decay)
        counts.view(-1).index_add_(0, rows, stored.flatten())
        key_sums.view(-1, D).index_add_(0, rows, (block * stored.unsqueeze(-1)).reshape(-1, D))
        out.append(slots)
    return torch.cat(out, 2)


def statistics(slots: torch.Tensor | None, slot_weights: torch.Tensor | None, memory_keys: torch.Tensor,
               values: torch.Tensor, num_slots: int, block_len: int = 1,
               decay: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots' counts (B, H, S), memory-key sums (B, H, S, D) and value sums (B, H, S, Dv) of the keys
    (B, H, T, ·) assigned by ``slots`` (B, H, T) or weighted by ``slot_weights`` (B, H, T, S); with forgetting
    ``decay`` g, of T / block_len whole blocks, block b' weighing g^(nb−1−b') (the memory after them). The keys (and
    the weights) get gradients: one scatter-add (or product) of the keys and values side by side."""
    D = memory_keys.shape[-1]
    nb = memory_keys.shape[2] // block_len if decay is not None and memory_keys.shape[2] else 1
    counts, sums = code_statistics(Assignment(slot_weights, slots), torch.cat([memory_keys, values], -1),
                                   num_slots, nb)  # (B, H, nb, S), (B, H, nb, S, D + Dv)
    if decay is not None:
        weights = decay ** torch.arange(nb - 1, -1, -1, device=counts.device, dtype=torch.float64)
        counts, sums = weigh_blocks(counts, weights), weigh_blocks(sums, weights)
    return counts.sum(2), *sums.sum(2).split([D, values.shape[-1]], -1)


def memory_logits(q_mem: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor,
                  value_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits σ q̃·k̄_s + log n_s (..., L, S) of the (already scaled) memory queries q_mem (..., L, D) and the
    slots' mean values v̄_s (..., S, Dv), from the memory's counts (..., S) and key and value sums (..., S, ·).
    Empty slots get logit −inf and no NaN, also in the gradients."""
    logits = q_mem @ code_means(counts, key_sums).transpose(-1, -2) + log_counts(counts).unsqueeze(-2)
    return logits, code_means(counts, value_sums)
