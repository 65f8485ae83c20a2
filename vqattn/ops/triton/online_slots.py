"""The online slot assignment of :func:`~vqattn.ops.ovq.ovq_attention` as one Triton program per (batch, head).

The assignment is sequential over blocks (block j is assigned against the memory M_{j−1}, then absorbed), so one
program walks the blocks of its sequence and, per block of L keys k̃ (float32 on chip):

    score_is  = ‖k̄_s‖² − 2 k̃_i·k̄_s   (= ‖k̃_i − k̄_s‖² − ‖k̃_i‖²) over the occupied slots, +inf for empty ones
    novel_i   = min_s score_is + ‖k̃_i‖² > threshold·‖k̃_i‖²,  or m = 0  (slots 0..m−1 opened so far)
    new_i     = m + #(novel keys before i);  opens_i = novel_i and new_i < S
    slot_i    = new_i if opens_i; −1 if novel_i with ``drop`` (not stored); else the nearest of the occupied slots
                (at their means k̄_s) and the slots opened in the block (at their opening keys), the lower slot on
                a tie

then multiplies the slots' counts n_s and key sums K_s by the forgetting factor g (1 without ``memory_decay``) and
adds the block's keys to them (k̄_s = K_s / n_s). These are the masks of
:func:`~vqattn.ops.ovq.memory.assign_block`, computed with the same products in the same order, so it chooses the
same slots (on a GPU, up to the products' rounding). The products run in float32: IEEE for float32 keys (TF32 where
PyTorch's float32 matmuls may be, :func:`~vqattn.ops.triton.float32_tensor_cores`) and under the interpreter; for
half keys on a GPU, on tensor cores, in two TF32 products against the slot means (their leading and trailing parts:
about float32's accuracy) and in one where both operands are exact in TF32 (the keys with each other, the one-hot
rows with the keys). IEEE products run on the CUDA cores: about 4 M multiply-adds per block of 64 keys at S = 512,
D = 64, in each program, which walks its blocks in sequence.

The counts (B·H, S) and key sums (B·H, S, D) live in a float32 scratch copy of the memory before the keys, read and
written in tiles of ``BS`` slots (:data:`SLOTS_CONFIGS`; a barrier between a block's writes and the next block's
reads): S·D need not fit in registers.
"""

from __future__ import annotations

import torch

from ..utils import triton
from .tuning import configs, tuned
from .utils import float32_products, register_width, stride_args, unit_last

if triton is not None:
    import triton.language as tl

    from .utils import dot_half_rows, load_rows

# Slots scored per inner step: a (L, SLOT_TILE) score tile and a (SLOT_TILE, D) tile of key sums; a memory of at most
# this many slots (ovq's 64 by default) stays in registers for the whole walk.
SLOT_TILE = 64
# The launch candidates (tuning.py): few programs (one per sequence) each walk a chain of blocks, so what can speed a
# program is its own parallelism, the warps over a block's L × S distances, and the slot tile. The first: 8 warps, as
# a program has its SM to itself when there are fewer sequences than SMs, and at 4 the registers' walk of 64 slots
# spilled 160 bytes on sm_90 (benchmarks/kernel_resources.py); not yet timed (the walk through the scratch memory in
# tiles of 32, at 4 warps, ran at 4% of its floor, docs/triton_kernels.md).
SLOTS_CONFIGS = configs(dict(BS=SLOT_TILE, num_warps=8, num_stages=3), BS=(16, 32, 64, 128), num_warps=(1, 2, 4, 8))

if triton is not None:

    @triton.jit
    def _occupied(CNT, S, BS: tl.constexpr):
        """m, 1 + the last slot with a positive count: the slots opened so far are 0..m−1 (one that forgetting took
        to a zero count stays closed)."""
        m = 0
        for s0 in range(0, S, BS):
            slots = s0 + tl.arange(0, BS)
            hit = tl.load(CNT + slots, mask=slots < S, other=0.0) > 0
            m = tl.maximum(m, tl.max(tl.where(hit, slots + 1, 0), 0))
        return m

    @triton.jit
    def _nearest_of(keys, n, sums, PREC: tl.constexpr, EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr):
        """min_s ‖k̄_s‖² − 2 k̃·k̄_s over the occupied slots of one tile (counts n (BS,), key sums (BS, BD), on chip;
        +inf when none) and its index in the tile, the lowest on a tie (L,)."""
        means = sums / tl.where(n > 0, n, 1.0)[:, None]
        centre_sq = tl.where(n > 0, tl.sum(means * means, 1), float("inf"))
        score = centre_sq[None, :] - 2 * dot_half_rows(keys, means, HALF_ROWS, PREC, EXACT_PREC)
        return tl.min(score, 1), tl.argmin(score, 1, tie_break_left=True).to(tl.int32)

    @triton.jit
    def _nearest_slot(keys, CNT, SUM, S, D, L: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
                      PREC: tl.constexpr, EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr):
        """min_s ‖k̄_s‖² − 2 k̃·k̄_s over the occupied slots (+inf when none) and its slot, the lowest on a tie
        (L,)."""
        best = tl.full([L], float("inf"), tl.float32)
        best_slot = tl.zeros([L], tl.int32)
        dims = tl.arange(0, BD)
        for s0 in range(0, S, BS):
            slots = s0 + tl.arange(0, BS)
            n = tl.load(CNT + slots, mask=slots < S, other=0.0)
            sums = tl.load(SUM + slots[:, None] * D + dims[None, :], mask=(slots[:, None] < S) & (dims[None, :] < D),
                           other=0.0)
            tile_best, tile_slot = _nearest_of(keys, n, sums, PREC, EXACT_PREC, HALF_ROWS)
            tile_slot += s0
            better = tile_best < best  # strictly: an earlier tile keeps a tie
            best, best_slot = tl.where(better, tile_best, best), tl.where(better, tile_slot, best_slot)
        return best, best_slot

    @triton.jit
    def _absorb(keys, slot, valid, CNT, SUM, S, D, decay, BD: tl.constexpr, BS: tl.constexpr,
                EXACT_PREC: tl.constexpr):
        """n_s ← g·n_s + #keys of slot s, K_s ← g·K_s + Σ their keys, over the block's ``valid`` keys."""
        dims = tl.arange(0, BD)
        for s0 in range(0, S, BS):
            slots = s0 + tl.arange(0, BS)
            hit = ((slot[:, None] == slots[None, :]) & valid[:, None]).to(tl.float32)  # (L, BS) one-hot
            n = tl.load(CNT + slots, mask=slots < S, other=0.0)
            tl.store(CNT + slots, n * decay + tl.sum(hit, 0), mask=slots < S)
            mask = (slots[:, None] < S) & (dims[None, :] < D)
            sums = tl.load(SUM + slots[:, None] * D + dims[None, :], mask=mask, other=0.0)
            sums = tl.dot(tl.trans(hit), keys, sums * decay, input_precision=EXACT_PREC)
            tl.store(SUM + slots[:, None] * D + dims[None, :], sums, mask=mask)

    @triton.jit
    def _choose(keys, key_sq, old_score, old_slot, m, valid, threshold, S, L: tl.constexpr, EXACT_PREC: tl.constexpr,
                DROP: tl.constexpr):
        """The block's slots from its keys' nearest occupied slot (``old_score``, ``old_slot``): novel keys open slots
        m, m + 1, … in position order while slots remain (with DROP, those left over get −1, not stored); the others
        take the nearest of the occupied slots and the block's opened ones (at their opening keys). Returns the slots
        and which keys opened one."""
        local = tl.arange(0, L)
        # keys after T (a partial last block) open no slot: they would be centres for the keys before them
        novel = (((old_score + key_sq) > threshold * key_sq) | (m == 0)) & valid
        novel_i = novel.to(tl.int32)
        new_slot = m + tl.cumsum(novel_i, 0) - novel_i
        opens = novel & (new_slot < S)
        # the slots opened in this block, at their opening keys
        new_scores = key_sq[None, :] - 2 * tl.dot(keys, tl.trans(keys), input_precision=EXACT_PREC)
        new_scores = tl.where(opens[None, :], new_scores, float("inf"))
        new_score = tl.min(new_scores, 1)
        opener = tl.argmin(new_scores, 1, tie_break_left=True)
        opener_slot = tl.sum(tl.where(local[None, :] == opener[:, None], new_slot[None, :], 0), 1)
        # an opened slot comes after every occupied one: a tie keeps the occupied slot
        nearest = tl.where(new_score < old_score, opener_slot, old_slot)
        if DROP:
            nearest = tl.where(novel, -1, nearest)
        return tl.where(opens, new_slot, nearest), opens

    @tuned(SLOTS_CONFIGS, key=("S", "D", "L"), restore_value=["CNT", "SUM"])  # the scratch memory, rewritten
    @triton.heuristics({"RESIDENT": lambda args: args["S"] <= args["BS"]})  # one walk compiled, not both
    @triton.jit
    def _online_slots_kernel(K, CNT, SUM, OUT, sk_b, sk_h, sk_t, H, T, S, D, threshold, decay,
                             L: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr,
                             EXACT_PREC: tl.constexpr, HALF_ROWS: tl.constexpr, RESIDENT: tl.constexpr,
                             DROP: tl.constexpr):
        """One sequence's slots. RESIDENT, when all S slots fit one tile (S ≤ BS: ovq's 64 slots at BS = 64): their
        counts and key sums stay in registers from the first block to the last, no scratch memory read and written
        per block, no barrier between blocks. Otherwise tile by tile through the scratch copy."""
        bh = tl.program_id(0)
        b, h = bh // H, bh % H
        CNT += bh * S
        SUM += bh * S * D
        local = tl.arange(0, L)
        if RESIDENT:
            slots = tl.arange(0, BS)
            dims = tl.arange(0, BD)
            n = tl.load(CNT + slots, mask=slots < S, other=0.0)
            sums = tl.load(SUM + slots[:, None] * D + dims[None, :], mask=(slots[:, None] < S) & (dims[None, :] < D),
                           other=0.0)
            m = tl.max(tl.where(n > 0, slots + 1, 0), 0)
            for blk in range(0, tl.cdiv(T, L)):
                rows = blk * L + local
                keys = load_rows(K, sk_b, sk_h, sk_t, b, h, rows, T, D, BD, tl.float32)
                valid = rows < T
                old_score, old_slot = _nearest_of(keys, n, sums, PREC, EXACT_PREC, HALF_ROWS)
                slot, opens = _choose(keys, tl.sum(keys * keys, 1), old_score, old_slot, m, valid, threshold, S, L,
                                      EXACT_PREC, DROP)
                tl.store(OUT + bh * T + rows, slot.to(tl.int64), mask=valid)
                hit = ((slot[:, None] == slots[None, :]) & valid[:, None]).to(tl.float32)  # (L, BS) one-hot
                n = n * decay + tl.sum(hit, 0)
                sums = tl.dot(tl.trans(hit), keys, sums * decay, input_precision=EXACT_PREC)
                m += tl.sum(opens.to(tl.int32), 0)
        else:
            m = _occupied(CNT, S, BS)
            for blk in range(0, tl.cdiv(T, L)):
                rows = blk * L + local
                keys = load_rows(K, sk_b, sk_h, sk_t, b, h, rows, T, D, BD, tl.float32)
                valid = rows < T
                old_score, old_slot = _nearest_slot(keys, CNT, SUM, S, D, L, BD, BS, PREC, EXACT_PREC, HALF_ROWS)
                slot, opens = _choose(keys, tl.sum(keys * keys, 1), old_score, old_slot, m, valid, threshold, S, L,
                                      EXACT_PREC, DROP)
                tl.store(OUT + bh * T + rows, slot.to(tl.int64), mask=valid)
                _absorb(keys, slot, valid, CNT, SUM, S, D, decay, BD, BS, EXACT_PREC)
                m += tl.sum(opens.to(tl.int32), 0)
                tl.debug_barrier()  # the next block reads the slots' statistics that this one wrote


@torch.compiler.disable  # a graph break: torch.compile runs the kernel as it is
def fused_online_slots(memory_keys: torch.Tensor, counts: torch.Tensor, key_sums: torch.Tensor, L: int,
                       threshold: float, decay: float | None = None, drop: bool = False) -> torch.Tensor:
    """:func:`~vqattn.ops.ovq.memory.online_slots` as one kernel: memory keys (B, H, T, D) (any supported dtype,
    scored in float32) and the memory before them, counts (B, H, S) and key sums (B, H, S, D) with occupied
    slots 0..m−1 -> (B, H, T) long slot indices (−1: not stored, with ``drop``); ``decay``: the forgetting factor g
    per block. T need not be a
    multiple of L (the last block is partial). No gradient (the choice is discrete)."""
    B, H, T, D = memory_keys.shape
    S = counts.shape[-1]
    keys = unit_last(memory_keys.detach())
    # scratch copies that the kernel updates block after block
    cnt = counts.detach().to(torch.float32, copy=True).contiguous()
    sums = key_sums.detach().to(torch.float32, copy=True).contiguous()
    out = torch.empty(B, H, T, device=keys.device, dtype=torch.long)
    _online_slots_kernel[(B * H,)](K=keys, CNT=cnt, SUM=sums, OUT=out, **stride_args("k", keys), H=H, T=T, S=S, D=D,
                                   threshold=float(threshold), decay=1.0 if decay is None else float(decay), L=L,
                                   BD=register_width(D), **float32_products(keys.dtype), DROP=drop)
    return out
