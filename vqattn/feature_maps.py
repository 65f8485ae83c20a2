"""Feature maps φ for linear attention: κ(q, k) = φ(q)·φ(k), mapping (..., D) -> (..., M).

Three finite views of the softmax kernel exp(scale·q·k) plus the classic linear-attention maps:

* ``PerformerFeatures``: FAVOR+ positive random features, an unbiased estimate of exp(scale·q·k);
* ``TaylorFeatures``: the truncated series Σ_{m≤p} (s·q·k)^m / m!  (exact polynomial, no randomness);
* ``ExpDefinitionFeatures``: (1 + s·q·k/n)^n, the limit definition of exp;
* ``EluFeatures`` (elu+1), ``ReluFeatures``, ``IdentityFeatures`` (the "minimal linear" attention).

All maps are ``nn.Module``s: ``phi(x, is_query=False)`` (same as ``phi.feature_map(x, is_query)``).
Half-precision inputs give float32 features (exp features under/overflow float16); ``linear_attention``
accepts float32 features with half-precision values. Under ``torch.autocast`` the maps still compute in float32
(autocast is disabled inside: FAVOR+ logits of size ~scale·‖x‖² lose whole units in bf16). ``nonnegative`` says
whether every kernel value φ(q)·φ(k) is ≥ 0, i.e. whether the default "kernel" normaliser of ``linear_attention``
is valid.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import torch
from torch import nn

from .ops.utils import autocast_off, check_positive_int, compute_dtype, resolve_scale


class QKFeatures(NamedTuple):
    """phi_q: (..., Tq, M); phi_k: (..., Tk, M); k_log_scale: (..., Tk) or None. The true key features are
    phi_k · exp(k_log_scale) (see ``linear_attention``); phi_q may carry a per-query factor, which the
    default "kernel" normaliser cancels."""

    phi_q: torch.Tensor
    phi_k: torch.Tensor
    k_log_scale: torch.Tensor | None


class FeatureMap(nn.Module):
    """Base class: checks the input, computes in float32 for half precision, calls ``_phi``."""

    nonnegative: bool = True

    def forward(self, x: torch.Tensor, is_query: bool = False) -> torch.Tensor:
        return self.feature_map(x, is_query)

    @autocast_off
    def feature_map(self, x: torch.Tensor, is_query: bool = False) -> torch.Tensor:
        """x: (..., D) -> (..., M). ``is_query`` only matters for maps with a query-side stabiliser."""
        return self._phi(self._prepare(x), is_query)

    @staticmethod
    def _prepare(x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
            raise ValueError(f"x must be a floating-point tensor of shape (..., D), got {x!r:.80}")
        return x.to(compute_dtype(x.dtype))

    def map_qk(self, q: torch.Tensor, k: torch.Tensor) -> QKFeatures:
        """What an attention layer calls once per forward: ``linear_attention(phi_q, phi_k, v,
        k_log_scale=k_log_scale, ...)``. Here φ(q) with the query stabiliser and the exact φ(k) (log scale None);
        maps whose key features exceed float32's range return them divided by a per-key factor instead."""
        return QKFeatures(self.feature_map(q, is_query=True), self.feature_map(k, is_query=False), None)

    def _phi(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        raise NotImplementedError

    def num_features(self, head_dim: int) -> int:
        """M for inputs with D = head_dim."""
        raise NotImplementedError


class EluFeatures(FeatureMap):
    """φ(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020). M = D."""

    def _phi(self, x, is_query):
        return nn.functional.elu(x) + 1.0

    def num_features(self, head_dim):
        return head_dim


class ReluFeatures(FeatureMap):
    """φ(x) = relu(x) ≥ 0. A row of weights can be all zero; the normaliser then gives 0 (see linear_attention)."""

    def _phi(self, x, is_query):
        return torch.relu(x)

    def num_features(self, head_dim):
        return head_dim


class IdentityFeatures(FeatureMap):
    """φ(x) = x: κ(q, k) = q·k, the "minimal linear" attention of the sparsity analysis.

    The scores are signed, so the row sum Σ_s q·k_s can be zero or negative and the "kernel" normaliser is
    meaningless (dividing by a clamped negative sum flips the sign, a sum near 0 blows up). Safe behaviour:
    use ``linear_attention(..., normalizer="count")`` (mean of the raw scores times v, bounded by
    max|q·k|·max|v|) or ``"none"``; ``nonnegative = False`` says so to generic code.
    """

    nonnegative = False

    def _phi(self, x, is_query):
        return x

    def num_features(self, head_dim):
        return head_dim


def _check_expansion(name: str, size: int, max_features: int, hint: str) -> None:
    if size > max_features:
        raise ValueError(f"{name} has {size} features, more than max_features={max_features}; {hint}")


@functools.lru_cache(maxsize=64)
def _monomials(dim: int, degree: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The monomials x^α with |α| = degree, once each, in the order of sorted index tuples (i1 ≤ … ≤ id).

    Returns (index, weight): monomial n is entry index[n] of the flattened (previous degree's monomials) ⊗ x,
    i.e. prev_position(i1..i_{d-1})·dim + i_d; weight[n] = 1/√(α!). n = C(dim + degree − 1, degree).
    Cached per device: copying them from host memory at every call would synchronise a GPU.
    """
    prev = {c: n for n, c in enumerate(itertools.combinations_with_replacement(range(dim), degree - 1))}
    combos = list(itertools.combinations_with_replacement(range(dim), degree))
    index = [prev[c[:-1]] * dim + c[-1] for c in combos]
    weights = [1 / math.sqrt(math.prod(math.factorial(c.count(i)) for i in set(c))) for c in combos]
    return (torch.tensor(index, dtype=torch.long, device=device),
            torch.tensor(weights, dtype=torch.float64, device=device))


class TaylorFeatures(FeatureMap):
    """Truncated Taylor series of exp, one feature per monomial: φ(x) = [x'^α / √(α!)]_{|α|≤order}, x' = √s·x.

    By the multinomial theorem (s·q·k)^m / m! = Σ_{|α|=m} q'^α k'^α / α!, so
    φ(q)·φ(k) = Σ_{m≤order} (s·q·k)^m / m! exactly; order 2 is [1, x', x'_i²/√2, x'_i x'_j (i < j)] -> 1 + s·q·k + (s·q·k)²/2.
    M = Σ_{m≤order} C(D+m−1, m): 1 + D + D(D+1)/2 at order 2 (the symmetric products x_i x_j = x_j x_i are
    kept once, weight √2 relative to the tensor power x⊗x/√2, instead of D² duplicated entries).
    Even orders give a positive kernel (the truncated series of exp has no real root); odd orders do not.
    """

    def __init__(self, order: int = 2, *, scale: float = 1.0, max_features: int = 1 << 16):
        super().__init__()
        check_positive_int("order", order)
        check_positive_int("max_features", max_features)
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")
        self.order, self.scale, self.max_features = order, float(scale), max_features
        self.nonnegative = order % 2 == 0

    def num_features(self, head_dim):
        return sum(math.comb(head_dim + m - 1, m) for m in range(self.order + 1))

    def _phi(self, x, is_query):
        D = x.shape[-1]
        _check_expansion(
            f"TaylorFeatures(order={self.order}) on D={D}", self.num_features(D), self.max_features,
            "lower the order or raise max_features",
        )
        x = x * math.sqrt(self.scale)
        terms, mono = [torch.ones_like(x[..., :1]), x], x  # mono: the degree-m monomials x^α, unweighted
        for m in range(2, self.order + 1):
            index, weight = _monomials(D, m, x.device)
            # extend each degree-(m−1) monomial by the factors whose index is ≥ its last one: no duplicates
            mono = (mono.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)[..., index]
            terms.append(mono * weight.to(x.dtype))  # (..., C(D+m-1, m))
        return torch.cat(terms, dim=-1)


class ExpDefinitionFeatures(FeatureMap):
    """exp as a limit: φ(x) = ⊗^n (1, √s·x/√n), so φ(q)·φ(k) = (1 + s·q·k/n)^n exactly, s = ``scale``.

    M = (D+1)^n grows fast: a ValueError is raised at call time when it exceeds ``max_features``.
    Even n gives a non-negative kernel; odd n does not.
    """

    def __init__(self, n: int, *, scale: float = 1.0, max_features: int = 1 << 16):
        super().__init__()
        check_positive_int("n", n)
        check_positive_int("max_features", max_features)
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")
        self.n, self.scale, self.max_features = n, float(scale), max_features
        self.nonnegative = n % 2 == 0

    def num_features(self, head_dim):
        return (head_dim + 1) ** self.n

    def _phi(self, x, is_query):
        D = x.shape[-1]
        _check_expansion(
            f"ExpDefinitionFeatures(n={self.n}) on D={D}", self.num_features(D), self.max_features,
            "(D+1)^n must fit: lower n or raise max_features",
        )
        base = torch.cat([torch.ones_like(x[..., :1]), x * math.sqrt(self.scale / self.n)], dim=-1)  # (..., D+1)
        out = base
        for _ in range(self.n - 1):
            out = (out.unsqueeze(-1) * base.unsqueeze(-2)).flatten(-2)
        return out


DEFAULT_REDRAW_INTERVAL = 1000


def draw_random_features(
    num_features: int, dim: int, *, orthogonal: bool, generator: torch.Generator | None = None,
    num_draws: int | None = None,
) -> torch.Tensor:
    """ω: (num_features, dim) float64 with rows marginally N(0, I_dim); (num_draws, num_features, dim) when
    ``num_draws`` is given (independent draws, generated in one batch).

    orthogonal=True: blocks of ``dim`` exactly orthogonal directions (QR of a Gaussian matrix, sign-fixed so
    the directions are Haar distributed), each row rescaled by an independent chi(dim) norm so that its
    marginal law stays N(0, I). This keeps the estimator unbiased and lowers its variance (Choromanski et al.).
    """
    check_positive_int("num_features", num_features)
    check_positive_int("dim", dim)
    if num_draws is not None:
        check_positive_int("num_draws", num_draws)
    R = num_draws or 1
    if not orthogonal:
        w = torch.randn(R, num_features, dim, generator=generator, dtype=torch.float64)
    else:
        blocks = -(-num_features // dim)
        q, r = torch.linalg.qr(torch.randn(R, blocks, dim, dim, generator=generator, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # sign fix: Haar directions
        directions = q.transpose(-1, -2).reshape(R, blocks * dim, dim)[:, :num_features]  # orthonormal rows
        norms = torch.randn(R, num_features, dim, generator=generator, dtype=torch.float64).norm(dim=-1, keepdim=True)
        w = directions * norms
    return w if num_draws is not None else w[0]


def favor_logits(x: torch.Tensor, omega: torch.Tensor, scale: float) -> torch.Tensor:
    """ω·x' − ‖x'‖²/2 with x' = √scale·x: x (..., N, D), ω (..., m, D) -> (..., N, m).

    exp of it divided by √m is the FAVOR+ feature vector; ω may carry leading (e.g. per-draw) dims.
    """
    x = x * math.sqrt(scale)
    return x @ omega.transpose(-1, -2) - 0.5 * x.pow(2).sum(-1, keepdim=True)


class PerformerFeatures(FeatureMap):
    """FAVOR+ positive random features (Choromanski et al. 2021).

    φ(x) = exp(ω·x' − ‖x'‖²/2) / √m with x' = √scale·x and ω: (m, D) ~ N(0, I) rows, so that
    E_ω[φ(q)·φ(k)] = exp(scale·q·k) (unbiased; relative variance (exp‖q'+k'‖² − 1)/m for iid ω).
    ``scale`` defaults to D**-0.5 as in softmax attention.

    Stabilisers (``stabilize=True``), both computed in the log domain before exp, both exact:
      * queries (``is_query=True``): each query's logits minus their own max, a per-query factor that the
        "kernel" normaliser of ``linear_attention`` cancels;
      * keys (``map_qk``): each key's logits minus their own max β_s, returned as ``k_log_scale`` = β so that
        ``linear_attention`` multiplies exp(β_s − r_t) back in, against a running max r_t over the keys that
        query t sees (never a future one). Without it, keys of norm ‖k‖ get features ~ exp(−scale‖k‖²/2):
        at 10× unit scale and D = 64 that is e^−400, below float32's range, and the attention collapses.
    ``feature_map(x)`` on keys stays the exact, unshifted φ (it never looks at other positions).

    Redrawing: ω is a pure function of (seed, step // redraw_interval), ``redraw_interval`` defaulting to
    1000 steps (Performer redrew about every 1000; None = never). ``step`` is set from outside, by the trainer:
    ``set_feature_step(model, global_step)`` before each training batch (``LitLM.on_train_batch_start``
    does it), so every DDP rank, a resumed run and an uninterrupted run hold the same ω at the same global
    step without communication, and every micro-batch of an accumulated step shares one ω. Forward passes
    never change it. ``step`` and the draw index are saved in the state dict (extra state) and ω, a non-persistent
    buffer, is re-derived from them on load. Layers use a different ``seed`` each (``PerformerAttention``: seed +
    layer index).
    """

    def __init__(
        self,
        head_dim: int,
        num_features: int,
        *,
        orthogonal: bool = True,
        redraw_interval: int | None = DEFAULT_REDRAW_INTERVAL,
        seed: int = 0,
        scale: float | None = None,
        stabilize: bool = True,
    ):
        super().__init__()
        check_positive_int("head_dim", head_dim)
        check_positive_int("num_features", num_features)
        if redraw_interval is not None:
            check_positive_int("redraw_interval", redraw_interval)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if scale is not None and not scale > 0:
            raise ValueError(f"scale must be > 0 or None, got {scale!r}")
        self.head_dim, self.m = head_dim, num_features
        self.orthogonal, self.redraw_interval, self.seed = orthogonal, redraw_interval, seed
        self.scale = float(resolve_scale(scale, head_dim))
        self.stabilize = stabilize
        self.step = 0
        self.draw_index = 0
        # not persistent: ω is re-derived from (seed, draw index) by set_extra_state
        self.register_buffer("omega", self._draw(0).float(), persistent=False)  # (m, D)

    def num_features(self, head_dim):
        return self.m

    def _draw(self, index: int) -> torch.Tensor:
        # one independent stream per (seed, index); the odd multiplier spreads consecutive seeds apart
        gen = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + index) % (1 << 63))
        return draw_random_features(self.m, self.head_dim, orthogonal=self.orthogonal, generator=gen)

    def _sync_omega(self, index: int | None = None) -> None:
        if index is None:
            index = 0 if self.redraw_interval is None else self.step // self.redraw_interval
        if index != self.draw_index:
            self.omega.copy_(self._draw(index))
            self.draw_index = index

    def set_step(self, step: int) -> None:
        """Follow an external step counter (e.g. the trainer's global step); redraws ω when due."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self.step = step
        self._sync_omega()

    def map_qk(self, q: torch.Tensor, k: torch.Tensor) -> QKFeatures:
        phi_k, beta = self._key_features(k)
        return QKFeatures(self.feature_map(q, is_query=True), phi_k, beta)

    def get_extra_state(self):
        return {"step": self.step, "draw_index": self.draw_index}

    def set_extra_state(self, state):
        # the saved draw, not one recomputed from the step: the loaded weights were trained with exactly this ω,
        # whatever redraw_interval the loading code uses (checkpoints without it predate redraws by default: 0)
        self.step, self.draw_index = state["step"], -1
        self._sync_omega(state.get("draw_index", 0))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have last dim head_dim={self.head_dim}, got {x.shape[-1]}")
        return favor_logits(x, self.omega.to(x.dtype), self.scale)  # (..., m)

    def _phi(self, x, is_query):
        logits = self._logits(x)
        if is_query and self.stabilize:
            # per-query constant: cancels between numerator and normaliser, so detaching it is exact
            logits = logits - logits.amax(dim=-1, keepdim=True).detach()
        return torch.exp(logits) / math.sqrt(self.m)

    @autocast_off
    def _key_features(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(exp(logits − β)/√m, β) with β the per-key max logit (detached: it multiplies back exactly)."""
        if not self.stabilize:
            return self.feature_map(k), None
        logits = self._logits(self._prepare(k))
        beta = logits.amax(dim=-1).detach()
        return torch.exp(logits - beta.unsqueeze(-1)) / math.sqrt(self.m), beta


def set_feature_step(module: nn.Module, step: int) -> None:
    """Set the step of every step-driven feature map in ``module`` (e.g. a GPT) to the trainer's global step;
    each redraws its ω when ``step // redraw_interval`` changed. Call it before every training batch."""
    for m in module.modules():
        if isinstance(m, PerformerFeatures):
            m.set_step(step)


__all__ = [
    "DEFAULT_REDRAW_INTERVAL",
    "set_feature_step",
    "FeatureMap",
    "QKFeatures",
    "EluFeatures",
    "ReluFeatures",
    "IdentityFeatures",
    "TaylorFeatures",
    "ExpDefinitionFeatures",
    "PerformerFeatures",
    "draw_random_features",
    "favor_logits",
]
