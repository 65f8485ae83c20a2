"""Feature pairs (x_m, x_{m+D/2}): RoPE's layout (:mod:`vqattn.modules.rope`), whose pair m turns by base^(−2m/D)
per position, so that the pairs from some m0 on turn slowly. The ops that score far keys keep those pairs alone."""

from __future__ import annotations

import torch


def pair_dims(x: torch.Tensor, first_pair: int) -> torch.Tensor:
    """x (..., D) -> (..., D − 2·first_pair): the dims [first_pair, D/2) and [D/2 + first_pair, D) of the RoPE pairs
    (m, m + D/2) with m ≥ first_pair; x itself for 0. A static slice: no host read, so it compiles into one graph
    and never synchronises a GPU; one slice of the (..., 2, D/2) view, not a cat of two."""
    return x if first_pair == 0 else x.unflatten(-1, (2, x.shape[-1] // 2))[..., first_pair:].flatten(-2)


def check_first_pair(name: str, first_pair, dim: int) -> int:
    """``first_pair`` as an int m with 0 ≤ m < D/2 (at least one pair left) and D even when m > 0, else a ValueError
    naming ``name``."""
    if isinstance(first_pair, bool) or not isinstance(first_pair, int) or first_pair < 0:
        raise ValueError(f"{name} must be an int >= 0, got {first_pair!r}")
    if first_pair and (dim % 2 or first_pair >= dim // 2):
        raise ValueError(f"{name} must leave at least one of the (D/2) feature pairs of an even D: got {first_pair} "
                         f"for D={dim}")
    return first_pair
