"""Figures for the kernel-family theory: ``python -m vqattn.analysis.plots OUT_DIR``.

Writes to OUT_DIR:
  sparsity_beta.png          S over β for relu² and identity scores (closed forms, Monte Carlo dots)
  sparsity_gamma.png         exp scores: S = e^{−γ²/2} → 0; identity at β = 0 stays at √(2/π); linear decay
  approximation_error.png    relative RMS error against exp(scale·q·k) over the feature dimension M
  figures.json               the numbers behind them plus the kernel-vs-soft assignment measurement
Everything is seeded, so reruns give the same files.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from ..feature_maps import draw_random_features  # noqa: E402
from ..files import save_figure, write_text  # noqa: E402
from ..ops.linear import linear_attention  # noqa: E402
from ..ops.softmax import softmax_attention  # noqa: E402
from ..ops.vq import vq_attention  # noqa: E402
from . import (  # noqa: E402
    approximation_error_curves,
    codebook_kernel_features,
    kernel_soft_factors,
    sparsity,
    sparsity_exp,
    sparsity_identity,
    sparsity_linear_decay,
    sparsity_relu2,
)

F64 = torch.float64


def _scores(beta: float, gamma: float, n: int, gen: torch.Generator) -> torch.Tensor:
    """Monte Carlo q·k ~ N(β, γ²) (sampled directly: only the 1-d law of q·k matters)."""
    return beta + gamma * torch.randn(n, generator=gen, dtype=F64)


def sparsity_figures(out: Path) -> dict:
    gen = torch.Generator().manual_seed(0)
    betas = torch.linspace(-3, 3, 121, dtype=F64)
    mc_betas = [-2.0, -1.0, 0.0, 1.0, 2.0]
    gammas = [0.5, 1.0, 2.0]
    worst = 0.0
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (name, closed, f) in zip(
        axes,
        [("relu²", sparsity_relu2, lambda x: torch.relu(x) ** 2), ("identity", sparsity_identity, lambda x: x)],
    ):
        for gamma in gammas:
            (line,) = ax.plot(betas, closed(betas, gamma), label=f"γ = {gamma}")
            for beta in mc_betas:
                if name == "relu²" and beta / gamma < -1.5:
                    continue  # too few positive scores for a stable Monte Carlo estimate
                mc = float(sparsity(f(_scores(beta, gamma, 200_000, gen))))
                worst = max(worst, abs(mc / float(closed(beta, gamma)) - 1))
                ax.plot([beta], [mc], "o", color=line.get_color(), ms=4)
        ax.set_title(f"{name} scores")
        ax.set_xlabel("β = q·μ")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("S = E|a| / sqrt(E a²)")
    axes[0].legend()
    fig.suptitle("Row sparsity, closed form (lines) vs Monte Carlo (dots)")
    fig.tight_layout()
    save_figure(fig, out / "sparsity_beta.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    g = torch.linspace(0.05, 4, 100, dtype=F64)
    axes[0].plot(g, sparsity_exp(g), label="exp (softmax): exp(−γ²/2)")
    axes[0].plot(g, sparsity_identity(0.0, g), label="identity, β = 0: √(2/π)")
    axes[0].plot(g, sparsity_relu2(0.0, g), label="relu², β = 0")
    mc_g = [0.25, 0.5, 0.75, 1.0]
    axes[0].plot(mc_g, [float(sparsity(torch.exp(_scores(0.0, x, 400_000, gen)))) for x in mc_g], "o", ms=4,
                 label="exp, Monte Carlo")
    axes[0].set_xlabel("γ = σ‖q‖")
    axes[0].set_ylabel("S")
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=0.3)
    n = torch.arange(1, 513, dtype=F64)
    for lam in (0.5, 0.9, 0.99):
        axes[1].plot(n, sparsity_linear_decay(lam, n), label=f"λ = {lam}")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("row length n")
    axes[1].set_title("linear decay weights λ^j")
    axes[1].legend()
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out / "sparsity_gamma.png", dpi=120)
    plt.close(fig)
    return {"sparsity_monte_carlo_max_relative_deviation": worst}


def approximation_figure(out: Path) -> dict:
    # q, k ~ N(0, 0.5² I): q·k/√D has std 0.25. Larger norms make every relative error explode (the FAVOR+
    # relative variance is exp‖q' + k'‖² − 1, Taylor oscillates for negative q·k), which hides the trends.
    D, std = 8, 0.5
    gen = torch.Generator().manual_seed(1)
    q, k = (std * torch.randn(32, D, generator=gen, dtype=F64) for _ in range(2))
    curves = approximation_error_curves(
        q, k, scale=D**-0.5, performer_features=(8, 32, 128, 512, 2048), taylor_orders=(1, 2, 3, 4),
        exp_definition_ns=(1, 2, 3, 4), num_draws=256,
    )
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, points in curves.items():
        ms, errs = zip(*points)
        ax.plot(ms, errs, "o-", label=name.replace("_", " "))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("feature dimension M")
    ax.set_ylabel("relative RMS error vs exp(q·k/√D)")
    ax.set_title(f"Finite views of the softmax kernel (D = {D}, q, k ~ N(0, {std}² I))")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "approximation_error.png", dpi=120)
    plt.close(fig)
    return {"approximation_error": curves}


def kernel_vs_soft(D: int = 64, T: int = 256, heads: int = 4, features=(64, 256, 1024), stds=(1.0, 0.5)) -> dict:
    """Soft (GMM) vs kernel (= FAVOR+) codebook attention on one random FAVOR+ codebook c = ω/√scale.

    q, k ~ N(0, std² I), v ~ N(0, I), non-causal, float64. Reports relative L2 distances between the outputs and to exact
    softmax attention, and the spread (std of the log) of the per-key and per-code factors that separate the
    two assignments (``kernel_soft_factors``), also for a codebook with all norms equal to √D.
    """
    gen = torch.Generator().manual_seed(2)
    scale, tau = D**-0.5, D**0.5

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    rows = []
    for std, m in [(std, m) for std in stds for m in features]:
        q, k, v = (torch.randn(1, heads, T, D, generator=gen, dtype=F64) * x for x in (std, std, 1.0))
        exact = softmax_attention(q, k, v, causal=False, scale=scale)
        omega = draw_random_features(m, D, orthogonal=True, generator=gen, num_draws=heads)  # (H, m, D)
        for equal_norms in (False, True):
            w = omega / omega.norm(dim=-1, keepdim=True) * math.sqrt(D) if equal_norms else omega
            c = w / math.sqrt(scale)
            phi_q, phi_k, k_log_scale = codebook_kernel_features(q, k, c, temperature=tau, scale=scale)
            out = {"kernel": linear_attention(phi_q, phi_k, v, causal=False, k_log_scale=k_log_scale),
                   "soft": vq_attention(q, k, v, c, causal=False, assign="soft", temperature=tau, scale=scale)}
            per_key, per_code = zip(*(kernel_soft_factors(k[:, h], c[h], tau) for h in range(heads)))
            rows.append({
                "qk_std": std,
                "num_features": m,
                "equal_code_norms": equal_norms,
                "kernel_vs_softmax": rel(out["kernel"], exact),
                "soft_vs_softmax": rel(out["soft"], exact),
                "soft_vs_kernel": rel(out["soft"], out["kernel"]),
                "std_log_per_key_factor": float(torch.stack(per_key).log().std()),
                "std_log_per_code_factor": float(torch.stack(per_code).log().std()),
            })
    return {"kernel_vs_soft": {"D": D, "T": T, "heads": heads, "rows": rows}}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m vqattn.analysis.plots OUT_DIR")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    figures = {**sparsity_figures(out), **approximation_figure(out), **kernel_vs_soft()}
    write_text(out / "figures.json", json.dumps(figures, indent=2))
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")


if __name__ == "__main__":
    main()
