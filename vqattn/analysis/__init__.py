"""Theory tools: how "focused" attention rows are, and how well finite feature maps approximate exp.

Sparsity of a row a = (a_1, ..., a_n):  S(a) = E|a| / sqrt(E a²)  ∈ (0, 1]  (means over the row).
S = 1 for a flat row, S → 0 when the mass concentrates on a vanishing fraction of positions. It is
scale-invariant, so unnormalised scores can be measured directly.

Closed forms, for scores a = f(q·k) of one query against keys k ~ N(μ, σ² I), so that q·k ~ N(β, γ²)
with β = q·μ and γ = σ‖q‖ (n → ∞ keys):
  * exp        a = exp(q·k):    S = exp(−γ²/2)                          → 0 as γ grows (softmax can focus)
  * identity   a = q·k:         S = (√(2/π) γ e^{−β²/2γ²} + β erf(β/(√2 γ))) / √(β² + γ²)  ≥ √(2/π)
  * relu²      a = relu(q·k)²:  S = E[x²; x>0] / √E[x⁴; x>0] with z = β/γ, Φ(z) = (1 + erf(z/√2))/2,
                                φ(z) = e^{−z²/2}/√(2π):  E[x²; x>0] = (β² + γ²) Φ + β γ φ,
                                E[x⁴; x>0] = (β⁴ + 6β²γ² + 3γ⁴) Φ + (β³γ + 5βγ³) φ
  * linear decay a_j = λ^j, j < n:  S = sqrt((1 − λⁿ)(1 + λ) / (n (1 − λ)(1 + λⁿ)))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torchmetrics import Metric

from ..feature_maps import (
    ExpDefinitionFeatures,
    FeatureMap,
    QKFeatures,
    TaylorFeatures,
    draw_random_features,
    favor_logits,
)
from ..ops.utils import check_positive_int, resolve_scale

# ---------------------------------------------------------------------------------------------- sparsity


def sparsity(x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
    """S = mean|x| / sqrt(mean x²) over the last dim: (..., n) -> (...).

    mask: optional bool tensor broadcastable to x; only True entries belong to the row (e.g. the causal
    mask, so that the structural zeros above the diagonal are not counted). An all-zero row gives 0.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise ValueError("x must be a floating-point tensor of shape (..., n)")
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if mask is None:
        l1, l2 = x.abs().sum(-1), x.pow(2).sum(-1)
        n = torch.full_like(l1, x.shape[-1])
    else:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
        mask = mask.expand_as(x)
        x = x.masked_fill(~mask, 0.0)
        l1, l2, n = x.abs().sum(-1), x.pow(2).sum(-1), mask.sum(-1).to(x.dtype)
    # mean|x| / sqrt(mean x²) = (l1 / n) / sqrt(l2 / n) = l1 / sqrt(n * l2)
    return l1 / (n * l2).sqrt().clamp_min(torch.finfo(x.dtype).tiny)


class AttentionSparsity(Metric):
    """Mean row sparsity S of attention matrices (..., Tq, Tk), accumulated over batches.

    States are sums (S over rows, number of rows) reduced with "sum", so the value is exact under DDP.
    causal=True counts only the entries s ≤ t of row t (square matrices).
    """

    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, *, causal: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.causal = causal
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rows", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, attn: torch.Tensor) -> None:
        if not isinstance(attn, torch.Tensor) or attn.dim() < 2:
            raise ValueError("attn must be a tensor of shape (..., Tq, Tk)")
        mask = None
        if self.causal:
            Tq, Tk = attn.shape[-2:]
            if Tq != Tk:
                raise ValueError(f"causal sparsity needs square attention, got Tq={Tq}, Tk={Tk}")
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=attn.device).tril()
        s = sparsity(attn.detach(), mask=mask)
        self.total += s.sum().to(torch.float64)
        self.rows += s.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.rows


def _as_f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


def _check_gamma(gamma: torch.Tensor) -> None:
    if not bool((gamma > 0).all()):
        raise ValueError("gamma = sigma * |q| must be > 0")


def sparsity_exp(gamma) -> torch.Tensor:
    """S of exp(q·k) rows: exp(−γ²/2) (independent of β)."""
    gamma = _as_f64(gamma)
    _check_gamma(gamma)
    return torch.exp(-0.5 * gamma**2)


def sparsity_identity(beta, gamma) -> torch.Tensor:
    """S of raw-score rows q·k ~ N(β, γ²): (√(2/π) γ e^{−β²/2γ²} + β erf(β/√2γ)) / √(β² + γ²)."""
    beta, gamma = _as_f64(beta), _as_f64(gamma)
    _check_gamma(gamma)
    mean_abs = math.sqrt(2 / math.pi) * gamma * torch.exp(-(beta**2) / (2 * gamma**2)) + beta * torch.erf(
        beta / (math.sqrt(2) * gamma)
    )
    return mean_abs / torch.sqrt(beta**2 + gamma**2)


def sparsity_relu2(beta, gamma) -> torch.Tensor:
    """S of relu(q·k)² rows, q·k ~ N(β, γ²): truncated Gaussian moments (see module docstring)."""
    beta, gamma = _as_f64(beta), _as_f64(gamma)
    _check_gamma(gamma)
    z = beta / gamma
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    pdf = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    m2 = (beta**2 + gamma**2) * cdf + beta * gamma * pdf
    m4 = (beta**4 + 6 * beta**2 * gamma**2 + 3 * gamma**4) * cdf + (beta**3 * gamma + 5 * beta * gamma**3) * pdf
    return m2 / torch.sqrt(m4)


def sparsity_linear_decay(lam, n) -> torch.Tensor:
    """S of the row (1, λ, ..., λ^{n−1}), 0 < λ < 1: sqrt((1−λⁿ)(1+λ) / (n(1−λ)(1+λⁿ)))."""
    lam, n = _as_f64(lam), _as_f64(n)
    if not bool(((lam > 0) & (lam < 1)).all()):
        raise ValueError("lam must be in (0, 1)")
    if not bool((n >= 1).all()):
        raise ValueError("n must be >= 1")
    ln = lam**n
    return torch.sqrt((1 - ln) * (1 + lam) / (n * (1 - lam) * (1 + ln)))


# ---------------------------------------------------------------------------------- approximation error


def exact_exp_kernel(q: torch.Tensor, k: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """exp(scale·q·k) for all pairs: q (Nq, D), k (Nk, D) -> (Nq, Nk)."""
    return torch.exp(scale * q @ k.T)


def kernel_estimate(feature_map: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """φ(q)·φ(k) for all pairs, without the query stabiliser: (Nq, D), (Nk, D) -> (Nq, Nk)."""
    return feature_map(q, is_query=False) @ feature_map(k, is_query=False).T


def relative_rmse(estimate: torch.Tensor, exact: torch.Tensor) -> float:
    """sqrt(mean over pairs of (estimate / exact − 1)²), averaged over any leading (draw) dims.

    estimate: (..., Nq, Nk), exact: (Nq, Nk). Taking the root per draw before averaging keeps the value
    stable: the squared FAVOR+ error is heavy-tailed (rare draws dominate its mean for large ‖q + k‖).
    """
    return float(((estimate / exact - 1) ** 2).mean((-2, -1)).sqrt().mean())


def performer_estimates(
    q: torch.Tensor, k: torch.Tensor, num_features: int, *, orthogonal: bool, num_draws: int, scale: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    """FAVOR+ estimates of exp(scale·q·k) for ``num_draws`` independent ω draws: (num_draws, Nq, Nk), float64.

    Draws are batched (ω of shape (num_draws, m, D)) so statistics over many draws stay cheap.
    """
    check_positive_int("num_draws", num_draws)
    gen = torch.Generator().manual_seed(seed)
    omega = draw_random_features(num_features, q.shape[-1], orthogonal=orthogonal, generator=gen,
                                 num_draws=num_draws)  # (R, m, D)

    def phi(x):  # (N, D) -> (R, N, m)
        return torch.exp(favor_logits(x.double(), omega, scale)) / math.sqrt(num_features)

    return phi(q) @ phi(k).transpose(1, 2)


def approximation_error_curves(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float = 1.0,
    performer_features: Iterable[int] = (8, 16, 32, 64, 128, 256),
    taylor_orders: Iterable[int] = (1, 2, 3, 4),
    exp_definition_ns: Iterable[int] = (1, 2, 3, 4),
    num_draws: int = 32,
    seed: int = 0,
) -> dict[str, list[tuple[int, float]]]:
    """Relative RMS error against exp(scale·q·k) as a function of the feature dimension M.

    Returns {"performer_iid" | "performer_orthogonal" | "taylor" | "exp_definition": [(M, error), ...]};
    performer errors are averaged over ``num_draws`` draws (see ``relative_rmse``). q, k: (N, D) float.
    """
    exact = exact_exp_kernel(q.double(), k.double(), scale=scale)
    curves: dict[str, list[tuple[int, float]]] = {}
    for name, orthogonal in (("performer_iid", False), ("performer_orthogonal", True)):
        curves[name] = [
            (m, relative_rmse(performer_estimates(q, k, m, orthogonal=orthogonal, num_draws=num_draws, scale=scale,
                                                  seed=seed), exact))
            for m in performer_features
        ]
    makers: dict[str, tuple[Iterable[int], Callable[[int], FeatureMap]]] = {
        "taylor": (taylor_orders, lambda p: TaylorFeatures(p, scale=scale, max_features=1 << 22)),
        "exp_definition": (exp_definition_ns, lambda n: ExpDefinitionFeatures(n, scale=scale, max_features=1 << 22)),
    }
    for name, (params, make) in makers.items():
        maps = [make(p) for p in params]
        curves[name] = [
            (fm.num_features(q.shape[-1]), relative_rmse(kernel_estimate(fm, q.double(), k.double()), exact))
            for fm in maps
        ]
    return curves


# ------------------------------------------------------------------------------------------- the bridge


def codebook_kernel_features(q: torch.Tensor, k: torch.Tensor, codebook: torch.Tensor, *, temperature: float,
                             scale: float | None = None) -> QKFeatures:
    """Codebook attention with the unnormalised Gaussian-kernel assignment, as linear-attention features.

    Spreading key k_j over codes c_s by Δ_js = exp(−‖k_j − c_s‖²/2τ + ‖c_s‖²/2τ) and reading it through the
    query weights e^{σ q_i·c_s} gives the weights κ_ij = Σ_s e^{σ q_i·c_s} Δ_js = φ(q_i)·φ(k_j): codebook attention
    with this assignment is linear attention, in window and cache alike. For the random codebook c = ω/√σ and
    τ = 1/σ it is exactly FAVOR+ (Performer): Δ_js = exp(ω_s·k'_j − ‖k'_j‖²/2) with k' = √σ k, the Performer key
    feature, and e^{σ q·c_s} = e^{ω_s·q'} its query feature up to a per-query factor.

    q, k: (B, H, T, D), codebook: (H, S, D) or (S, D) -> ``QKFeatures`` for ``linear_attention(phi_q, phi_k, v,
    k_log_scale=k_log_scale, ...)``. Query features are shifted by their row max (a per-query factor the "kernel"
    normaliser cancels); key features are exp(log Δ_js − r_j) with r_j = max_s log Δ_js returned as
    ``k_log_scale``: a key of norm 17 at τ = 0.05 has every Δ_js below e^{−2000}, far outside float32. The
    temperature is a positive number (this is an analysis tool, not a layer: τ is not learned here).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    c = codebook if codebook.dim() == 3 else codebook.expand(k.shape[1], -1, -1)  # (H, S, D)
    scale = resolve_scale(scale, q.shape[-1])
    q_logits = scale * q @ c.transpose(-1, -2)  # (B, H, T, S)
    phi_q = torch.exp(q_logits - q_logits.detach().amax(-1, keepdim=True))
    kc = k @ c.transpose(-1, -2)
    # log Δ = (k·c − ‖k‖²/2)/τ, split as (k·c − max_s k·c)/τ + r: the large ‖k‖²/2τ never rounds the features.
    # r is handed over detached (it multiplies back exactly); r − sg(r) adds nothing but routes r's gradient to k.
    kc_max = kc.detach().amax(-1, keepdim=True)
    r = (kc_max - (k * k).sum(-1, keepdim=True) / 2) / temperature  # (B, H, T, 1)
    phi_k = torch.exp((kc - kc_max) / temperature + (r - r.detach()))
    return QKFeatures(phi_q, phi_k, r.detach().squeeze(-1))


def kernel_soft_factors(
    k: torch.Tensor, codebook: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factorise the kernel assignment through the soft (GMM) one: Δ^kernel_js = Δ^soft_js · a(k_j) · b_s.

    k: (..., T, D), codebook: (S, D) -> per_key a: (..., T), per_code b: (S,), with
    a(k) = Σ_s exp(−‖k − c_s‖²/2τ)  (the soft normaliser)  and  b_s = exp(‖c_s‖²/2τ).

    In attention the per-key factor a reweights key j; the per-code factor b multiplies the query-side
    weight e^{scale·q·c_s}, i.e. it is a GMM mixing prior π_s ∝ e^{‖c_s‖²/2τ}. So soft and kernel codebook
    attention differ by a per-key factor alone exactly when all codes have the same norm; for a FAVOR+
    codebook (c = ω/√scale, τ = 1/scale) b_s = e^{‖ω_s‖²/2}, which varies a lot with the chi-distributed
    norms of ω.
    """
    d2 = (k.unsqueeze(-2) - codebook).pow(2).sum(-1)  # (..., T, S)
    return torch.exp(-d2 / (2 * temperature)).sum(-1), torch.exp(codebook.pow(2).sum(-1) / (2 * temperature))


__all__ = [
    "sparsity",
    "AttentionSparsity",
    "sparsity_exp",
    "sparsity_identity",
    "sparsity_relu2",
    "sparsity_linear_decay",
    "exact_exp_kernel",
    "kernel_estimate",
    "relative_rmse",
    "performer_estimates",
    "approximation_error_curves",
    "codebook_kernel_features",
    "kernel_soft_factors",
]
