"""The codes' value-sum cache that every block of a group reads, and the gradients of what reads it.

Block b of a group reads C_b (S, Dv per batch·head), the value sums Σ_j Δ_js v_j of the keys compressed before
it: C_0 is the cache the group starts from and C_{b+1} = C_b + U_b, where U_b enters after block b
(:func:`read_cache`):

* lag 1 (the soft mixture, whose window is the current block): U_b = block b's statistics;
* lag 2 (a window of two blocks): U_b = block b − 1's statistics, U_0 the ``pending`` statistics of the block
  before the group, which the previous group hands on. So no group copies the block before each of its blocks.

Two schedules (:class:`~vqattn.ops.blocks.Schedule`) give the same sums: a loop over the blocks with one running
cache, or every C_b at once by one cumsum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .statistics import code_slots


class CacheUpdates(NamedTuple):
    """The statistics Σ_j Δ_js v_j of each block of a group, which enter the value-sum cache one or two blocks later:
    values (N, n, L, Dv) and either the keys' codes ``index`` (N, n, L) (hard: Δ one-hot) or their weights
    ``weights`` (N, n, L, S) (soft)."""

    values: torch.Tensor
    index: torch.Tensor | None
    weights: torch.Tensor | None


def _flat_slots(index: torch.Tensor, S: int) -> torch.Tensor:
    """(N, n, L) codes -> (n, N·L) rows of the flattened (N·S, Dv) cache."""
    return code_slots(index, S, 0).transpose(0, 1).reshape(index.shape[1], -1)


def _add_block(cache: torch.Tensor, updates: CacheUpdates, slots, b: int, alpha: float) -> None:
    """cache (N, S, Dv) += alpha · (block b's statistics), in place."""
    values = updates.values[:, b]  # (N, L, Dv)
    if slots is not None:
        N, S, Dv = cache.shape
        cache.view(N * S, Dv).index_add_(0, slots[b], values.reshape(-1, Dv), alpha=alpha)
    else:
        cache.baddbmm_(updates.weights[:, b].transpose(-1, -2), values, alpha=alpha)


def _add_entering(cache: torch.Tensor, updates: CacheUpdates, slots, pending, b: int, alpha: float) -> None:
    """cache += alpha · U_b, what enters after block b: block b's statistics (lag 1: ``pending`` None), else block
    b − 1's, or ``pending`` for b = 0 (lag 2)."""
    if pending is None:
        _add_block(cache, updates, slots, b, alpha)
    elif b == 0:
        cache.add_(pending, alpha=alpha)
    else:
        _add_block(cache, updates, slots, b - 1, alpha)


def _block_slots(index: torch.Tensor, S: int) -> torch.Tensor:
    """(N, n, L) codes -> (N, n·L, 1) rows of the (N, n·S, Dv) per-block statistics."""
    return code_slots(index, S, 1).flatten(1).unsqueeze(-1)


def _block_caches(sums: torch.Tensor, updates: CacheUpdates, pending):
    """Every block's cache C_b (N, n, S, Dv) at once, C_n, and (lag 2) the last block's statistics, else None."""
    N, S, Dv = sums.shape
    values = updates.values
    n = values.shape[1]
    if updates.index is not None:
        slots = _block_slots(updates.index, S).expand(-1, -1, Dv)
        stats = values.new_zeros(N, n * S, Dv).scatter_add(1, slots, values.flatten(1, 2)).view(N, n, S, Dv)
    else:
        stats = updates.weights.transpose(-1, -2) @ values
    entering = stats if pending is None else torch.cat([pending.unsqueeze(1), stats[:, :-1]], 1)  # U_b
    ends = sums.unsqueeze(1) + torch.cumsum(entering, 1)  # C_{b+1}
    caches = torch.cat([sums.unsqueeze(1), ends[:, :-1]], 1)
    return caches, ends[:, -1], None if pending is None else stats[:, -1]


def read_cache(p: torch.Tensor, sums: torch.Tensor, updates: CacheUpdates, loop: bool, pending=None):
    """num_b = p_b · C_b for every block b of a group, with p (N, n, L, S) the blocks' code weights and C_0 = ``sums``
    (N, S, Dv). ``pending`` None: lag 1; else lag 2, with ``pending`` (N, S, Dv) the statistics of the block before
    the group (U_0). Returns num (N, n, L, Dv), C_n (N, S, Dv) and, for lag 2, the statistics of the group's last
    block (the next group's ``pending``), else None.

    ``loop``: the blocks run one after another while their (L, S) tiles and one running (S, Dv) cache per
    batch·head stay in cache (CPU): every pass over the (T, S) weights is a pass over memory otherwise, and a
    cache per block is 8× a block's keys at S = 512, L = 64. The weights p are formed for the whole group
    beforehand by the caller: they do not depend on the cache, and a dozen elementwise passes per block
    (tens of microseconds each) cost more in dispatch than in arithmetic.
    """
    if not loop:
        caches, last, pending_out = _block_caches(sums, updates, pending)
        return p @ caches, last, pending_out
    N, n, L, _ = p.shape
    cache = sums.clone()
    slots = None if updates.index is None else _flat_slots(updates.index, sums.shape[1])
    num = p.new_empty(n, N, L, sums.shape[-1])
    for b in range(n):
        torch.bmm(p[:, b], cache, out=num[b])
        _add_entering(cache, updates, slots, pending, b, 1.0)
    pending_out = None
    if pending is not None:
        pending_out = torch.zeros_like(cache)
        _add_block(pending_out, updates, slots, n - 1, 1.0)
    return num.transpose(0, 1), cache, pending_out


class CacheGradients(NamedTuple):
    """Gradients of :func:`read_cache`'s inputs: the first cache ``sums``, the updates' values and weights (None
    when not asked for, or for a code index) and (lag 2) the ``pending`` statistics."""

    sums: torch.Tensor
    values: torch.Tensor | None
    weights: torch.Tensor | None
    pending: torch.Tensor | None = None


def read_cache_backward(p, grad_num, sums, last, grad_last, updates: CacheUpdates, need_updates: bool,
                        logit_factor, use_logit_grad, loop: bool, grad_values=None, grad_weights=None, pending=None,
                        grad_pending=None):
    """Backward of :func:`read_cache` with its first and last caches ``sums`` = C_0 and ``last`` = C_n, its
    ``pending`` input (lag 2) and the gradients ``grad_last`` and ``grad_pending`` of its outputs (or None). With
    G_b = dC_b = G_{b+1} + p_bᵀ · dnum_b (G_n = grad_last), hands every block's logit gradients
    p_b ⊙ logit_factor(b, dp_b), dp_b = dnum_b · C_bᵀ, to ``use_logit_grad(b, ds_b)`` (:class:`LogitGradients`),
    and returns :class:`CacheGradients`: U_b enters C_{b+1}, so its gradient is G_{b+1}. Given ``grad_values`` /
    ``grad_weights`` (N, n, L, ·), the updates' gradients are added to them (when the caller also differentiates
    them otherwise).

    Both callbacks take a block index b and (N, L, S) tiles, or b = ``slice(None)`` and every block's (N, n, L, S).
    With ``loop`` the blocks are walked forwards for the logit gradients, with the running cache C_b, then backwards
    for G_b, and every product is formed while its operands are in cache.
    """
    grad_last = torch.zeros_like(last) if grad_last is None else grad_last
    if pending is not None and grad_pending is None:
        grad_pending = torch.zeros_like(last)
    backward = _backward_loop if loop else _backward_cumsum
    return backward(p, grad_num, sums, last, grad_last, updates, need_updates, logit_factor, use_logit_grad,
                    grad_values, grad_weights, pending, grad_pending)


def _backward_cumsum(p, grad_num, sums, last, grad_last, updates, need_updates, logit_factor, use_logit_grad,
                     grad_values, grad_weights, pending, grad_pending) -> CacheGradients:
    N, n, L, S = p.shape
    Dv = last.shape[-1]
    caches, _, _ = _block_caches(sums, updates, pending)
    use_logit_grad(slice(None), logit_factor(slice(None), grad_num @ caches.transpose(-1, -2)).mul_(p))
    grad_caches = p.transpose(-1, -2) @ grad_num  # (N, n, S, Dv)
    suffix = torch.flip(torch.cumsum(torch.flip(grad_caches, [1]), 1), [1])  # Σ_{b' ≥ b}
    grad_entering = grad_last.unsqueeze(1) + torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], 1)
    grad_stats, grad_pending_in = grad_entering, None
    if pending is not None:  # U_0 is the pending input, block b's statistics are U_{b+1} or the pending output
        grad_pending_in = grad_entering[:, 0]
        grad_stats = torch.cat([grad_entering[:, 1:], grad_pending.unsqueeze(1)], 1)
    if need_updates and updates.index is None:
        grad_values = _plus(grad_values, updates.weights @ grad_stats)
        grad_weights = _plus(grad_weights, updates.values @ grad_stats.transpose(-1, -2))
    elif need_updates:
        slots = _block_slots(updates.index, S).expand(-1, -1, Dv)
        grad_values = grad_stats.flatten(1, 2).gather(1, slots).view(N, n, L, Dv)
    return CacheGradients(grad_last + suffix[:, 0], grad_values, grad_weights, grad_pending_in)


def _plus(x: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    return y if x is None else x + y


class _StatisticsGradients:
    """Writes the gradient G of block j's statistics into its values' and weights' gradients (soft: added to given
    ones, else written into fresh ones; hard: the values' gradient gathered at their codes)."""

    def __init__(self, p, updates: CacheUpdates, slots, Dv: int, grad_values, grad_weights):
        N, n, L, _ = p.shape
        self.updates, self.slots = updates, slots
        # beta 0 writes, ignoring what empty() left there (NaN included); 1 adds to a given gradient
        self.betas = tuple(0.0 if x is None else 1.0 for x in (grad_values, grad_weights))
        if slots is not None:
            self.values, self.weights = p.new_empty(n, N, L, Dv), None
        else:
            self.values = p.new_empty(N, n, L, Dv) if grad_values is None else grad_values
            self.weights = torch.empty_like(updates.weights) if grad_weights is None else grad_weights

    def __call__(self, j: int, G: torch.Tensor) -> None:
        if self.slots is not None:
            N, S, Dv = G.shape
            torch.index_select(G.view(N * S, Dv), 0, self.slots[j], out=self.values[j].view(-1, Dv))
            return
        self.values[:, j].baddbmm_(self.updates.weights[:, j], G, beta=self.betas[0])
        self.weights[:, j].baddbmm_(self.updates.values[:, j], G.transpose(-1, -2), beta=self.betas[1])

    def result(self):
        return (self.values.transpose(0, 1), None) if self.slots is not None else (self.values, self.weights)


def _backward_loop(p, grad_num, sums, last, grad_last, updates, need_updates, logit_factor, use_logit_grad,
                   grad_values, grad_weights, pending, grad_pending) -> CacheGradients:
    N, n, L, S = p.shape
    slots = None if updates.index is None else _flat_slots(updates.index, S)
    # The logit gradients read C_b, rebuilt forwards as the forward pass built it. Recovering it backwards,
    # C_b = C_{b+1} − U_b, cancels catastrophically for a code that holds almost no mass before block b but much
    # after (soft posteriors): the code's p_b ~ 1/n_s then multiplies that rounding error (up to 1e36 in float64).
    cache = sums.clone()
    for b in range(n):
        use_logit_grad(b, logit_factor(b, torch.bmm(grad_num[:, b], cache.transpose(-1, -2))).mul_(p[:, b]))
        _add_entering(cache, updates, slots, pending, b, 1.0)
    grad_cache = grad_last.clone()
    stats = _StatisticsGradients(p, updates, slots, last.shape[-1], grad_values, grad_weights) if need_updates else None
    if stats is not None and pending is not None:
        stats(n - 1, grad_pending)  # the last block's statistics are the next group's pending ones
    grad_pending_in = None
    for b in range(n - 1, -1, -1):
        entered = b if pending is None else b - 1  # the block whose statistics are U_b (−1: the pending ones)
        if entered < 0:
            grad_pending_in = grad_cache.clone()
        elif stats is not None:
            stats(entered, grad_cache)
        grad_cache.baddbmm_(p[:, b].transpose(-1, -2), grad_num[:, b])
    values, weights = (None, None) if stats is None else stats.result()
    return CacheGradients(grad_cache, values, weights, grad_pending_in)


def code_logits_of(q: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """q·cᵀ for q (N, n, L, D) and c (N, S, D) shared by the blocks, or (N, n, S, D) one per block (the per-sequence
    slot means of online codebook attention): (N, n, L, S). A shared c takes one bmm (a broadcast matmul would copy
    c per block)."""
    if codebook.dim() == 4:
        return torch.matmul(q, codebook.transpose(-1, -2))
    N, n, L, D = q.shape
    return torch.bmm(q.reshape(N, n * L, D), codebook.transpose(-1, -2)).view(N, n, L, -1)


class LogitGradients:
    """Takes a group's code-logit gradients ds (:func:`read_cache_backward`) block by block, adds the window's
    gathered-logit gradients (hard VQ: ``window_codes`` (N, n, L, W) and ``ds_window``), and turns them into the
    gradients ``dq`` of the queries q (N, n, L, D) and ``dc`` of the codebook c of the logits q·cᵀ (c (N, S, D)
    shared by the blocks, or (N, n, S, D) one per block), so no (T, S) gradient is written."""

    def __init__(self, q, codebook, *, need_q: bool, need_codebook: bool, window_codes=None, ds_window=None):
        self.q, self.codebook, self.window_codes, self.ds_window = q, codebook, window_codes, ds_window
        self.per_block = codebook.dim() == 4
        self.dc = torch.zeros_like(codebook) if need_codebook else None
        self.dq = self.codebook_dq = None
        if need_q:
            # ds·c with D output columns, D not a multiple of 8 (RoPE's slow pairs: 30 dims), is slow on CPUs
            # (an (L, S)·(S, 30) block product took 74 µs against 48 for 32, AMD EPYC): a shared c gets zero
            # columns, dq the matching ones, which the gradient leaves out.
            pad = -q.shape[-1] % 8 if not self.per_block else 0
            self.codebook_dq = F.pad(codebook, (0, pad)) if pad else codebook
            self._dq = q.new_empty(*q.shape[:-1], q.shape[-1] + pad)
            self.dq = self._dq[..., :q.shape[-1]]

    def __call__(self, b, ds):
        N, S = ds.shape[0], ds.shape[-1]
        if self.window_codes is not None:
            ds.scatter_add_(-1, self.window_codes[:, b], self.ds_window[:, b])
        if self.per_block:  # ds (N, L, S) of block b, or (N, n, L, S) of every block
            if self.dq is not None:
                self._dq[:, b] = torch.matmul(ds, self.codebook_dq[:, b])
            if self.dc is not None:
                self.dc[:, b] = torch.matmul(ds.transpose(-1, -2), self.q[:, b])
            return
        flat = ds.reshape(N, -1, S)
        if self.dq is not None:
            self._dq[:, b] = torch.bmm(flat, self.codebook_dq).view(self._dq[:, b].shape)
        if self.dc is not None:
            self.dc.baddbmm_(flat.transpose(-1, -2), self.q[:, b].flatten(1, -2))  # no -1: D may be 0
