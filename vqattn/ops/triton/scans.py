"""The short scan of chunked prefixes (fla's ``chunk_h_split`` pattern): n pieces' sums of codes' counts (S,) and
value sums (S, Dv), formed in parallel, become every piece's running sum in one short sequential pass per tile of
codes and sequence. The superblock caches (:mod:`.superblock`) and the soft caches (:mod:`.soft_caches`) scan with
it.
"""

from __future__ import annotations

import torch

from ..utils import triton

if triton is not None:
    import triton.language as tl

    from .utils import code_tile_layout, load_cache, store_cache

    @triton.jit
    def exclusive_scan_kernel(TN, TC, N0, C0, NT, CT, S, DV, nseg, BS: tl.constexpr, BDV: tl.constexpr,
                            REVERSE: tl.constexpr, HAS_BASE: tl.constexpr, HAS_TOTAL: tl.constexpr):
        """The pieces' sums TN (B·H, nseg, S), TC (B·H, nseg, S, DV) float32 replaced in place by their exclusive
        prefix sums from the base N0 (B·H, S), C0 (B·H, S, DV) (with HAS_BASE, else 0), or with REVERSE by their
        exclusive suffix sums; with HAS_TOTAL the base plus every piece's sum stored at NT (B·H, S), CT
        (B·H, S, DV). One program per (tile of codes, batch·head)."""
        bh = tl.program_id(1)
        codes, present, tile_mask, offsets = code_tile_layout(S, DV, BS, BDV)
        n = tl.zeros([BS], tl.float32)
        sums = tl.zeros([BS, BDV], tl.float32)
        if HAS_BASE:
            n, sums = load_cache(N0, C0, bh, S, DV, codes, offsets, present, tile_mask)
        for i in range(0, nseg):
            seg = i
            if REVERSE:
                seg = nseg - 1 - i
            t_n, t_sums = load_cache(TN, TC, bh * nseg + seg, S, DV, codes, offsets, present, tile_mask)
            store_cache(TN, TC, bh * nseg + seg, S, DV, codes, offsets, n, sums, present, tile_mask)
            n += t_n
            sums += t_sums
        if HAS_TOTAL:
            store_cache(NT, CT, bh, S, DV, codes, offsets, n, sums, present, tile_mask)


def exclusive_scan(tn: torch.Tensor, tc: torch.Tensor, *, code_tile: int, base=None, reverse: bool = False,
                   total: bool = False):
    """tn (B·H, n, S), tc (B·H, n, S, Dv) float32 contiguous, the n pieces' sums, replaced in place by their
    exclusive prefix sums from ``base`` (a pair (B·H, S), (B·H, S, Dv) float32, or None: 0), or by their exclusive
    suffix sums with ``reverse``. Returns the base plus all n pieces, (B·H, S) and (B·H, S, Dv), with ``total``
    (else None)."""
    BH, n, S = tn.shape
    DV = tc.shape[-1]
    BDV = max(16, triton.next_power_of_2(DV))
    totals = (torch.empty(BH, S, device=tn.device, dtype=torch.float32),
              torch.empty(BH, S, DV, device=tn.device, dtype=torch.float32)) if total else (tn, tc)
    n0, c0 = base if base is not None else (tn, tc)
    exclusive_scan_kernel[(triton.cdiv(S, code_tile), BH)](
        TN=tn, TC=tc, N0=n0, C0=c0, NT=totals[0], CT=totals[1], S=S, DV=DV, nseg=n, BS=code_tile, BDV=BDV,
        REVERSE=reverse, HAS_BASE=base is not None, HAS_TOTAL=total)
    return totals if total else None
