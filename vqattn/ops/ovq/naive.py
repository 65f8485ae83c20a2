"""The definition of :func:`~vqattn.ops.ovq.ovq_attention`: a token-by-token loop, written for clarity (per-key
Python loops for the assignment, direct distances ‖k − c‖², the memory recomputed from its definition).
O(T·(L + S)·D) tensor work plus O(T·S) Python steps per batch·head: for tests in float64, not for training."""

from __future__ import annotations

import math

import torch

from ..common.memory_cap import memory_scale
from ..common.memory_decay import block_factor, total_count
from ..common.statistics import one_hot_rows
from .state import prepare


def _nearest(key: torch.Tensor, centres: dict[int, torch.Tensor]) -> int:
    """The slot whose centre is nearest to key, the lowest slot on a tie."""
    best, best_distance = -1, float("inf")
    for s in sorted(centres):
        distance = float(((key - centres[s]) ** 2).sum())
        if distance < best_distance:
            best, best_distance = s, distance
    return best


def _assign_online(keys: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor, threshold: float,
                   drop: bool = False) -> list[int]:
    """One batch·head: keys (L, D) of a block, the memory before it (S,), (S, D) -> the slot of each key (−1: a novel
    key that found no free slot, with ``drop``)."""
    S = counts.shape[0]
    means = {s: key_sums[s] / counts[s] for s in range(S) if counts[s] > 0}
    novel = [all(float(((key - c) ** 2).sum()) > threshold * float((key**2).sum()) for c in means.values())
             for key in keys]
    # slots open in order; one that forgetting took to a zero count stays closed
    slots, centres, free = [None] * len(keys), dict(means), 1 + max(means, default=-1)
    for j, key in enumerate(keys):  # novel keys open slots in position order while slots remain
        if novel[j] and free < S:
            slots[j], centres[free], free = free, key, free + 1
    return [s if s is not None else -1 if drop and is_novel else _nearest(key, centres)
            for s, key, is_novel in zip(slots, keys, novel)]


def _block_weights(block: slice, x, counts, key_sums) -> torch.Tensor:
    """(B, H, L, S) weights of a block's keys: the given weights, one-hot given slots, or the online assignment."""
    if x.slot_weights is not None:
        return x.slot_weights[:, :, block]
    if x.slots is not None:
        slots = x.slots[:, :, block]
    else:
        B, H = counts.shape[:2]
        keys = x.k_mem[:, :, block].detach()
        slots = torch.tensor([[_assign_online(keys[b, h], counts[b, h].detach(), key_sums[b, h].detach(), x.threshold,
                                              x.drop) for h in range(H)] for b in range(B)], device=keys.device)
    return one_hot_rows(slots, x.num_slots, x.k.dtype)


def naive_ovq_attention(q, k, v, *, num_slots: int, block_len: int | None = None, scale: float | None = None,
                        threshold: float | None = None, slots=None, slot_weights=None, q_mem=None, k_mem=None,
                        memory_cap: int | None = None, memory_decay: float | None = None, overflow: str = "nearest",
                        memory_first_pair: int = 0):
    """The semantics of :func:`~vqattn.ops.ovq.ovq_attention` (same arguments, no state) as a loop over tokens."""
    x = prepare(q, k, v, num_slots=num_slots, block_len=block_len, scale=scale, threshold=threshold, slots=slots,
                slot_weights=slot_weights, q_mem=q_mem, k_mem=k_mem, state=None, memory_cap=memory_cap,
                memory_decay=memory_decay, overflow=overflow, memory_first_pair=memory_first_pair)
    (B, H, T, _), L, S = x.q.shape, x.block_len, num_slots
    g = 1.0 if x.decay is None else x.decay  # the memory's factor per block that joins it
    counts, key_sums = x.q.new_zeros(B, H, S), x.q.new_zeros(B, H, S, x.memory_dim)
    value_sums = x.q.new_zeros(B, H, S, x.v.shape[-1])
    outs = []
    for i in range(T):
        b = i // L
        if i % L == 0 and b >= 2:  # block b − 2 joins the memory, assigned against the memory before it
            block = slice((b - 2) * L, (b - 1) * L)
            w = _block_weights(block, x, counts, key_sums)  # (B, H, L, S)
            counts = g * counts + w.sum(2)
            key_sums = g * key_sums + w.transpose(-1, -2) @ x.k_mem[:, :, block]
            value_sums = g * value_sums + w.transpose(-1, -2) @ x.v[:, :, block]
        window = slice(max(0, (b - 1) * L), i + 1)
        window_logits = x.scale * (x.k[:, :, window] @ x.q[:, :, i].unsqueeze(-1)).squeeze(-1)  # (B, H, W)
        occupied = counts > 0
        safe = torch.where(occupied, counts, torch.ones_like(counts)).unsqueeze(-1)
        key_means = torch.where(occupied.unsqueeze(-1), key_sums / safe, 0.0)
        value_means = torch.where(occupied.unsqueeze(-1), value_sums / safe, 0.0)
        memory_logits = torch.where(occupied, x.scale * (key_means @ x.q_mem[:, :, i].unsqueeze(-1)).squeeze(-1)
                                    + torch.where(occupied, safe.squeeze(-1), 1.0).log()
                                    + math.log(memory_scale(total_count(max(0, b - 1), L, x.decay), memory_cap)),
                                    float("-inf"))
        p = torch.softmax(torch.cat([window_logits, memory_logits], -1), -1)
        W = window_logits.shape[-1]
        outs.append((p[..., :W].unsqueeze(-2) @ x.v[:, :, window]).squeeze(-2)
                    + (p[..., W:].unsqueeze(-2) @ value_means).squeeze(-2))
    return torch.stack(outs, 2).to(q.dtype)


def naive_online_slots(memory_keys: torch.Tensor, num_slots: int, block_len: int, threshold: float,
                       memory_decay: float | None = None, drop: bool = False) -> torch.Tensor:
    """The slots that the definition's online assignment gives memory keys (B, H, T, D) from an empty memory: block
    after block, each against the memory of the blocks before it (each weighing γ^L less per block after it, with
    ``memory_decay`` γ) -> (B, H, T) long (−1: not stored, with ``drop``). For checking the fast impls."""
    g = block_factor(memory_decay, block_len) or 1.0
    B, H, T, D = memory_keys.shape
    counts = memory_keys.new_zeros(B, H, num_slots)
    key_sums = memory_keys.new_zeros(B, H, num_slots, D)
    out = torch.empty(B, H, T, dtype=torch.long)
    for start in range(0, T, block_len):
        for b in range(B):
            for h in range(H):
                keys = memory_keys[b, h, start : start + block_len]
                slots = _assign_online(keys, counts[b, h], key_sums[b, h], threshold, drop)
                out[b, h, start : start + block_len] = torch.tensor(slots)
                counts[b, h] *= g
                key_sums[b, h] *= g
                for key, slot in zip(keys, slots):
                    if slot < 0:
                        continue
                    counts[b, h, slot] += 1
                    key_sums[b, h, slot] += key
    return out.to(memory_keys.device)
