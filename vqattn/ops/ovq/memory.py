"""The memory of :func:`~vqattn.ops.ovq.ovq_attention`, shared by its chunked and recurrent forms: the online
assignment of one block of keys to slots, the per-block slot statistics, and the memory's logits and values."""

from __future__ import annotations

import torch

from ..vq.assign import Assignment, code_means, code_statistics, log_counts


def _squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """‖x_i − y_s‖² for x (..., L, D), y (..., S, D): (..., L, S), clamped at 0 against rounding."""
    return ((x * x).sum(-1, keepdim=True) + (y * y).sum(-1).unsqueeze(-2) - 2 * x @ y.transpose(-1, -2)).clamp_min_(0)


@torch.no_grad()
def assign_block(keys: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor, threshold: float) -> torch.Tensor:
    """Online assignment of one block's memory keys (B, H, L, D) to the slots of the memory before the block
    (counts (B, H, S), key sums (B, H, S, D); its m occupied slots are 0..m−1): (B, H, L) slot indices.

    A key is novel when its squared distance to every occupied slot's mean key exceeds ``threshold`` times its
    squared norm (always when m = 0). The novel keys, in position order, open slots m, m+1, ... while slots remain; every other key joins
    the nearest of the occupied slots (at their mean keys) and the slots opened in this block (at their opening
    keys), the lowest slot index on a tie. Masks and a cumsum, no host sync; no gradient (the choice is discrete).
    """
    keys = keys.detach()
    B, H, L, _ = keys.shape
    S = counts.shape[-1]
    occupied = counts > 0  # (B, H, S)
    means = code_means(counts, key_sums)  # 0 for empty slots, which are masked below
    to_means = _squared_distances(keys, means).masked_fill_(~occupied.unsqueeze(-2), float("inf"))  # (B, H, L, S)
    m = occupied.sum(-1, keepdim=True)  # (B, H, 1)
    novel = (to_means.amin(-1) > threshold * (keys * keys).sum(-1)) | (m == 0)  # (B, H, L)
    new_slot = m + novel.cumsum(-1) - novel.long()  # m + (novel keys before)
    opens = novel & (new_slot < S)
    target = torch.where(opens, new_slot, S)  # column S collects the keys that open nothing; dropped
    opener = keys.new_zeros(B, H, S + 1, dtype=torch.long).scatter_(
        -1, target, torch.arange(L, device=keys.device).expand(B, H, L))[..., :S]  # (B, H, S) key of each new slot
    opened = torch.zeros(B, H, S + 1, dtype=torch.bool, device=keys.device).scatter_(-1, target, True)[..., :S]
    to_openers = _squared_distances(keys, keys).gather(-1, opener.unsqueeze(-2).expand(B, H, L, S))
    distances = torch.where(occupied.unsqueeze(-2), to_means,
                            to_openers.masked_fill_(~opened.unsqueeze(-2), float("inf")))
    return torch.where(opens, new_slot, distances.argmin(-1))  # argmin: the first (lowest) index on a tie


@torch.no_grad()
def online_slots(memory_keys: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor, L: int,
                 threshold: float) -> torch.Tensor:
    """:func:`assign_block` block after block, absorbing each block before the next: memory keys
    (B, H, nb·L, D) and the memory before them -> (B, H, nb·L) slot indices."""
    counts, key_sums = counts.detach().clone(), key_sums.detach().clone()
    out = []
    for block in memory_keys.detach().split(L, 2):
        slots = assign_block(block, counts, key_sums, threshold)
        counts.scatter_add_(-1, slots, torch.ones_like(block[..., 0]))
        key_sums.scatter_add_(-2, slots.unsqueeze(-1).expand_as(block), block)
        out.append(slots)
    return torch.cat(out, 2)


def statistics(slots: torch.Tensor | None, slot_weights: torch.Tensor | None, memory_keys: torch.Tensor,
               values: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots' counts (B, H, S), memory-key sums (B, H, S, D) and value sums (B, H, S, Dv) of the keys
    (B, H, T, ·) assigned by ``slots`` (B, H, T) or weighted by ``slot_weights`` (B, H, T, S). The keys (and the
    weights) get gradients: one scatter-add (or product) of the keys and values side by side."""
    D = memory_keys.shape[-1]
    counts, sums = code_statistics(Assignment(slot_weights, slots), torch.cat([memory_keys, values], -1),
                                   num_slots, 1)
    return counts.squeeze(2), *sums.squeeze(2).split([D, values.shape[-1]], -1)


def memory_logits(q_mem: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor,
                  value_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits σ q̃·k̄_s + log n_s (..., L, S) of the (already scaled) memory queries q_mem (..., L, D) and the
    slots' mean values v̄_s (..., S, Dv), from the memory's counts (..., S) and key and value sums (..., S, ·).
    Empty slots get logit −inf and no NaN, also in the gradients."""
    logits = q_mem @ code_means(counts, key_sums).transpose(-1, -2) + log_counts(counts).unsqueeze(-2)
    return logits, code_means(counts, value_sums)
