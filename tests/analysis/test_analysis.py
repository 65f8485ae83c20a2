import math

import pytest
import torch

from vqattn.analysis import (
    AttentionSparsity,
    approximation_error_curves,
    sparsity,
    sparsity_exp,
    sparsity_identity,
    sparsity_linear_decay,
    sparsity_relu2,
)

from references_kernel import naive_sparsity

F64 = torch.float64


def test_sparsity_matches_naive_rows_and_mask():
    x = torch.randn(3, 4, 7, dtype=F64)
    s = sparsity(x)
    for idx in [(0, 0), (2, 3), (1, 2)]:
        torch.testing.assert_close(s[idx], naive_sparsity(x[idx]))
    mask = torch.rand(3, 4, 7) > 0.4
    mask[..., 0] = True
    sm = sparsity(x, mask=mask)
    torch.testing.assert_close(sm[1, 1], naive_sparsity(x[1, 1][mask[1, 1]]))
    assert sparsity(torch.zeros(5)).item() == 0.0
    torch.testing.assert_close(sparsity(torch.full((9,), 3.0)), torch.tensor(1.0))


def test_attention_sparsity_metric_accumulates_and_merges():
    torch.manual_seed(0)
    batches = [torch.softmax(torch.randn(2, 3, 6, 6) * (i + 1), -1) for i in range(4)]
    whole = AttentionSparsity()
    for b in batches:
        whole.update(b)
    expected = torch.cat([sparsity(b).flatten() for b in batches]).double().mean()
    torch.testing.assert_close(whole.compute(), expected)
    # two "ranks" with unequal numbers of rows: summed states give the global row mean, not a mean of means
    r0, r1 = AttentionSparsity(), AttentionSparsity()
    r0.update(batches[0])
    for b in batches[1:]:
        r1.update(b[:, :1])
    r0.merge_state(r1)
    expected = torch.cat([sparsity(batches[0]).flatten()] + [sparsity(b[:, :1]).flatten() for b in batches[1:]])
    torch.testing.assert_close(r0.compute(), expected.double().mean())


def test_causal_metric_ignores_structural_zeros():
    uniform = torch.tril(torch.ones(5, 5)) / torch.arange(1, 6).unsqueeze(1)  # flat causal rows
    causal = AttentionSparsity(causal=True)
    causal.update(uniform)
    torch.testing.assert_close(causal.compute(), torch.tensor(1.0, dtype=F64))
    full = AttentionSparsity()
    full.update(uniform)
    assert full.compute() < 0.9
    with pytest.raises(ValueError, match="square"):
        causal.update(torch.ones(4, 5))


def _monte_carlo_scores(beta, gamma, n=200_000, d=4, seed=0):
    """q·k for keys k ~ N(μ, σ² I) with β = q·μ, γ = σ‖q‖ (q of norm 2, μ along a random direction)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g, dtype=F64)
    q = 2 * q / q.norm()
    mu = beta * q / q.norm() ** 2
    sigma = gamma / q.norm()
    k = mu + sigma * torch.randn(n, d, generator=g, dtype=F64)
    return k @ q


GRID = [(beta, gamma) for beta in (-0.5, 0.0, 0.5, 2.0) for gamma in (0.5, 1.0, 2.0)]


@pytest.mark.parametrize("beta,gamma", GRID)
def test_closed_forms_match_monte_carlo(beta, gamma):
    x = _monte_carlo_scores(beta, gamma, seed=int(10 * (beta + 1) + gamma * 3))
    assert abs(sparsity(x) / sparsity_identity(beta, gamma) - 1) < 0.02
    assert abs(sparsity(torch.relu(x) ** 2) / sparsity_relu2(beta, gamma) - 1) < 0.02
    if gamma <= 1.0:  # exp(x) is lognormal: its second moment needs γ small to be estimated from samples
        assert abs(sparsity(torch.exp(x)) / sparsity_exp(gamma) - 1) < 0.02


def test_exp_sparsity_vanishes_identity_does_not():
    gammas = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0], dtype=F64)
    s_exp = sparsity_exp(gammas)
    assert bool((s_exp[1:] < s_exp[:-1]).all()) and s_exp[-1] < 1e-3
    assert sparsity(torch.exp(_monte_carlo_scores(0.0, 3.0))) < 0.1 * sparsity(torch.exp(_monte_carlo_scores(0.0, 0.5)))
    betas = torch.linspace(-20, 20, 401, dtype=F64)
    for gamma in (0.1, 1.0, 10.0, 100.0):
        assert sparsity_identity(betas, torch.tensor(gamma, dtype=F64)).min() >= math.sqrt(2 / math.pi) - 1e-12
    assert abs(sparsity(_monte_carlo_scores(0.0, 10.0)) - math.sqrt(2 / math.pi)) < 0.01


@pytest.mark.parametrize("lam", [0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("n", [1, 5, 64, 1000])
def test_linear_decay_closed_form(lam, n):
    row = lam ** torch.arange(n, dtype=F64)
    torch.testing.assert_close(sparsity_linear_decay(lam, n), naive_sparsity(row), rtol=1e-10, atol=1e-12)


def test_closed_form_bad_input():
    with pytest.raises(ValueError, match="gamma"):
        sparsity_identity(0.0, 0.0)
    with pytest.raises(ValueError, match="gamma"):
        sparsity_exp(-1.0)
    with pytest.raises(ValueError, match="lam"):
        sparsity_linear_decay(1.0, 3)
    with pytest.raises(ValueError, match="n must be"):
        sparsity_linear_decay(0.5, 0)
    with pytest.raises(ValueError, match="mask"):
        sparsity(torch.ones(3), mask=torch.ones(3))


def test_approximation_error_curves():
    g = torch.Generator().manual_seed(0)
    q, k = (0.3 * torch.randn(6, 3, generator=g, dtype=F64) for _ in range(2))
    curves = approximation_error_curves(q, k, performer_features=(4, 64), taylor_orders=(1, 2, 3),
                                        exp_definition_ns=(1, 2, 4), num_draws=64)
    assert [m for m, _ in curves["taylor"]] == [4, 10, 20]
    assert [m for m, _ in curves["exp_definition"]] == [4, 16, 256]
    for name in ("taylor", "exp_definition", "performer_iid", "performer_orthogonal"):
        errs = [e for _, e in curves[name]]
        assert all(b < a for a, b in zip(errs, errs[1:])), name
    # Lagrange remainder of order 3: |e^x − T_3(x)| / e^x ≤ e^{2|x|} |x|^4 / 4!  for every pair x = q·k
    x = (q @ k.T).abs().max().item()
    assert curves["taylor"][-1][1] < math.exp(2 * x) * x**4 / 24


@pytest.mark.slow
def test_plots_script_writes_figures(tmp_path):
    import json

    from vqattn.analysis.plots import main

    main([str(tmp_path)])
    for name in ("sparsity_beta.png", "sparsity_gamma.png", "approximation_error.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["sparsity_monte_carlo_max_relative_deviation"] < 0.02
    rows = figures["kernel_vs_soft"]["rows"]
    # with equal code norms the per-key factor is all that separates soft from kernel, and it fades with m
    equal = [r["soft_vs_kernel"] for r in rows if r["equal_code_norms"] and r["qk_std"] == 0.5]
    assert all(b < a for a, b in zip(equal, equal[1:]))
