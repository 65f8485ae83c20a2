"""Non-finite keys in codebook attention: NaN in, NaN out, causally, as in softmax attention.

Softmax attention turns a key k_j with a NaN (or infinite) entry into NaN outputs for every query that sees it
(i ≥ j when causal). Codebook attention would not by itself: a hard assignment is an index, which cannot be NaN
(the argmin picks some code), and a key in the compressed cache is only a count. Inside the block kernels a NaN
would instead reach the earlier queries of its block too, through their masked entries (−inf + NaN and 0·NaN are
NaN).

So :func:`~vqattn.ops.vq.vq_attention` zeroes the rows of non-finite keys before the kernels and adds to every
output the poison

    p_i = Σ_{j ≤ i} 0 · [k_j not finite]  (NaN · 0 = NaN)      (all j when not causal)

which is 0, or NaN once a non-finite key is visible. A state carries it in its counts, so decoding after such a key
stays NaN. A given soft assignment's weights of a bad key are NaN too; they are zeroed where a kernel reads them for
queries that cannot see the key: the soft mixture's window (group by group, never a copy of the whole (T, S)
weights, the op's largest input) and the recurrent and non-causal impls. Elsewhere they only enter the cache,
which only the queries that see the key read. :func:`~vqattn.ops.window.window_attention` does the same over each
query's raw window only (:func:`window_poison`): a bad key stops mattering once it has left the window. Everything
is masked tensor arithmetic: no host synchronisation in a training step. Only on a CPU in eager mode, where reading
a flag costs nothing, are the masking and the poison skipped when no key is bad (:func:`may_be_nonfinite`).
"""

from __future__ import annotations

import torch

from . import utils
from .common.statistics import Assignment
from .triton.finite import nonfinite_rows
from .triton.utils import runs_kernels


def _nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, H, T): the row has a NaN or ±inf entry. Its min and max (NaN propagates) are then not
    both finite. Two reductions: on CPU, amax and amin over the last dim take 0.23 ms for a (4, 8192, 64) tensor
    where aminmax takes 1.8 and ~isfinite().all() 2.2 (it writes a (T, D) mask first); a sum would overflow to inf
    for large finite half-precision rows. On a GPU one Triton kernel (:mod:`vqattn.ops.triton.finite`)."""
    if runs_kernels(x):
        return nonfinite_rows(x)
    x = x.detach()
    return ~(x.amax(-1).isfinite() & x.amin(-1).isfinite())


def nonfinite_keys(*keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys (B, H, T, ·) of the same tokens -> (bad (B, H, T): some key of the token has a NaN or ±inf entry,
    poison (B, H, T): NaN where bad, else 0)."""
    bad = _nonfinite_rows(keys[0])
    for k in keys[1:]:
        bad |= _nonfinite_rows(k)
    return bad, keys[0].new_zeros(bad.shape).masked_fill_(bad, float("nan"))


def may_be_nonfinite(bad: torch.Tensor) -> bool:
    """Whether some row of ``bad`` may be set: False only when it is known to be all False. Where a read is free
    (:func:`~vqattn.ops.utils.host_read_is_free`) ``bad`` is read, and a clean input then skips the masked copies
    of the keys and of their gradient and the poison's pass over the output (at T = 32768, 128 MB of fresh memory per step);
    elsewhere the masking always runs (it gives the same result)."""
    return not utils.host_read_is_free(bad) or bool(bad.any())


def zero_rows(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, ...) with the rows where ``bad`` (B, H, T) is set replaced by 0 (no gradient reaches them)."""
    return x.masked_fill(bad.view(*bad.shape, *[1] * (x.dim() - 3)), 0)


def zero_assignment_rows(a: Assignment | None, bad: torch.Tensor | None) -> Assignment | None:
    """The weights of non-finite keys set to 0 (hard indices are kept: a key's code only matters
    to the queries that see it, whose outputs are NaN); None for either leaves ``a`` as it is."""
    if a is None or bad is None:
        return a
    return a._make(zero_rows(x, bad) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in a)


def visible_poison(poison: torch.Tensor, *, causal: bool, state_counts: torch.Tensor | None) -> torch.Tensor:
    """The keys' poison (B, H, Tk) summed over the keys each query sees -> (B, H, Tq, 1), or (B, H, 1, 1) when not
    causal; ``state_counts`` (B, H, S), of the state the keys continue, carries the poison of the keys before."""
    if not causal:
        return poison.sum(2, keepdim=True).unsqueeze(-1)
    poison = poison.cumsum(2)
    if state_counts is not None:
        poison = poison + state_counts.sum(-1, keepdim=True) * 0
    return poison.unsqueeze(-1)


def window_poison(bad: torch.Tensor, block_len: int, dtype: torch.dtype) -> torch.Tensor:
    """bad (B, H, T) -> (B, H, T, 1): NaN for the queries i whose raw window, positions (i // L − 1)·L .. i (from a
    block boundary), holds a bad key, else 0."""
    T = bad.shape[-1]
    before = torch.nn.functional.pad(bad.cumsum(-1), (1, 0))  # (B, H, T + 1): bad keys before each position
    i = torch.arange(T, device=bad.device)
    first = ((i // block_len - 1) * block_len).clamp_min(0)
    seen = before[..., i + 1] - before[..., first]  # bad keys in each query's window
    return torch.zeros(seen.shape, device=bad.device, dtype=dtype).masked_fill_(seen > 0, float("nan")).unsqueeze(-1)
