import math

import numpy as np
import pytest
import torch

from vqattn.analysis import exact_exp_kernel, performer_estimates
from vqattn.feature_maps import (
    DEFAULT_REDRAW_INTERVAL,
    EluFeatures,
    ExpDefinitionFeatures,
    IdentityFeatures,
    PerformerFeatures,
    ReluFeatures,
    TaylorFeatures,
    draw_random_features,
    set_feature_step,
)
from vqattn.functional import linear_attention

from model_helpers import tiny_model
from references_kernel import (
    exp_definition_kernel,
    favor_features,
    naive_favor_attention,
    naive_linear_attention,
    taylor_kernel,
)

F64 = torch.float64


def _qk(n=5, d=4, norm=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, d, generator=g, dtype=F64)
    if norm is not None:
        q, k = (norm * x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    return q, k


# ------------------------------------------------------------------------------------- exact expansions


@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_taylor_is_exact_truncated_series(order, scale):
    q, k = _qk(d=3)
    fm = TaylorFeatures(order, scale=scale)
    est = fm(q) @ fm(k).T
    torch.testing.assert_close(est, taylor_kernel(q, k, order, scale), rtol=1e-12, atol=1e-12)
    assert fm(q).shape[-1] == fm.num_features(3) == sum(math.comb(3 + m - 1, m) for m in range(order + 1))


@pytest.mark.parametrize("D", [1, 5, 16])
def test_taylor_order2_is_symmetric_and_exact(D):
    # 1 + D + D(D+1)/2 features (no duplicated x_i x_j, x_j x_i) and the kernel 1 + s q·k + (s q·k)²/2 to 1e-10
    g = torch.Generator().manual_seed(D)
    q, k = 2 * torch.randn(7, D, generator=g, dtype=F64), 2 * torch.randn(9, D, generator=g, dtype=F64)
    fm = TaylorFeatures(2, scale=D**-0.5)
    assert fm(q).shape[-1] == fm.num_features(D) == 1 + D + D * (D + 1) // 2
    x = D**-0.5 * q @ k.T
    assert (fm(q) @ fm(k).T - (1 + x + x**2 / 2)).abs().max() < 1e-10


def test_taylor_order2_layout():
    x = torch.tensor([[2.0, -1.0]], dtype=F64)
    # [1, x0, x1, x0²/√2, x0·x1 (= the two symmetric entries x0x1/√2 of x⊗x/√2 merged: weight √2), x1²/√2]
    expected = torch.tensor([[1.0, 2.0, -1.0, 4 / math.sqrt(2), -2.0, 1 / math.sqrt(2)]], dtype=F64)
    torch.testing.assert_close(TaylorFeatures(2)(x), expected)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_exp_definition_is_exact(n):
    q, k = _qk(d=3, seed=n)
    fm = ExpDefinitionFeatures(n, scale=0.7)
    torch.testing.assert_close(fm(q) @ fm(k).T, exp_definition_kernel(q, k, n, 0.7), rtol=1e-12, atol=1e-12)
    assert fm(q).shape[-1] == 4**n


def test_exp_definition_converges_to_exp():
    q, k = _qk(d=2, norm=0.8)
    errs = [((ExpDefinitionFeatures(n)(q) @ ExpDefinitionFeatures(n)(k).T) / exact_exp_kernel(q, k) - 1).abs().max()
            for n in (1, 2, 4, 8)]
    assert all(b < a for a, b in zip(errs, errs[1:]))


def test_simple_maps():
    x = torch.randn(2, 3, 7, 5, dtype=F64)
    torch.testing.assert_close(EluFeatures()(x), torch.where(x > 0, x + 1, torch.exp(x)))
    torch.testing.assert_close(ReluFeatures()(x), x.clamp_min(0))
    torch.testing.assert_close(IdentityFeatures()(x), x)


@pytest.mark.parametrize(
    "fm", [EluFeatures(), ReluFeatures(), IdentityFeatures(), TaylorFeatures(2), TaylorFeatures(3), ExpDefinitionFeatures(2),
           ExpDefinitionFeatures(3), PerformerFeatures(4, 8)],
    ids=lambda f: f"{type(f).__name__}{getattr(f, 'order', getattr(f, 'n', ''))}",
)
def test_nonnegative_flag(fm):
    q, k = _qk(n=50, d=4, seed=3)
    q, k = 3 * q, 3 * k  # large enough that signed kernels go negative
    kernel = fm(q) @ fm(k).T
    assert bool((kernel >= 0).all()) == fm.nonnegative


def test_half_input_gives_float32_features():
    x = torch.randn(1, 2, 3, 4).half()
    for fm in (EluFeatures(), TaylorFeatures(2), ExpDefinitionFeatures(2), PerformerFeatures(4, 8)):
        assert fm(x).dtype == torch.float32


def test_bad_input():
    with pytest.raises(ValueError, match="order"):
        TaylorFeatures(0)
    with pytest.raises(ValueError, match="n must be a positive int"):
        ExpDefinitionFeatures(-1)
    with pytest.raises(ValueError, match="max_features"):
        ExpDefinitionFeatures(3, max_features=1000)(torch.randn(2, 10))  # 11**3 = 1331
    ExpDefinitionFeatures(3, max_features=1331)(torch.randn(2, 10))
    with pytest.raises(ValueError, match="max_features"):
        TaylorFeatures(3, max_features=100)(torch.randn(2, 10))
    with pytest.raises(ValueError, match="head_dim=4"):
        PerformerFeatures(4, 8)(torch.randn(2, 5))
    with pytest.raises(ValueError, match="num_features"):
        PerformerFeatures(4, 0)
    with pytest.raises(ValueError, match="redraw_interval"):
        PerformerFeatures(4, 8, redraw_interval=0)
    with pytest.raises(ValueError, match="floating-point"):
        EluFeatures()(torch.ones(3, dtype=torch.long))


# ------------------------------------------------------------------------------------------- performer


def test_performer_features_formula_and_query_stabiliser():
    fm = PerformerFeatures(4, 12, scale=0.5).double()
    x = torch.randn(2, 3, 9, 4, dtype=F64)
    ref = favor_features(x, fm.omega.double(), 0.5)
    torch.testing.assert_close(fm(x), ref)
    # the query stabiliser is a per-query constant: rows keep their direction, max entry becomes 1/√m
    phq = fm(x, is_query=True)
    torch.testing.assert_close(phq / phq.sum(-1, keepdim=True), ref / ref.sum(-1, keepdim=True))
    torch.testing.assert_close(phq.amax(-1), torch.full(phq.shape[:-1], 12**-0.5, dtype=F64))


def test_performer_features_are_per_position():
    # no statistic over the sequence: a position's features ignore every other position (no future leak)
    fm = PerformerFeatures(4, 8).double()
    x = torch.randn(1, 1, 10, 4, dtype=F64)
    y = x.clone()
    y[:, :, 6:] *= 10
    for is_query in (True, False):
        torch.testing.assert_close(fm(x, is_query)[:, :, :6], fm(y, is_query)[:, :, :6], rtol=0, atol=0)
    for a, b in zip(fm.map_qk(x, x), fm.map_qk(y, y)):  # the key stabiliser is per key too
        torch.testing.assert_close(a[:, :, :6], b[:, :, :6], rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,m,unit,tol", [(16, 64, 1.0, 1e-5), (16, 64, 10.0, 2e-5), (64, 256, 4.0, 5e-5)])
def test_performer_attention_is_scale_aware(causal, D, m, unit, tol):
    # q, k at `unit` × unit scale (entries N(0, unit²)); float32 against the float64 log-domain reference with
    # the same ω. Before the stabilisers (absolute 1e-6 clamp, unshifted keys) the error at 4× and 10× was the
    # size of the output itself (keys underflowed to 0). tol: float32 rounding of logits of size ~scale·‖k‖².
    fm = PerformerFeatures(D, m, seed=4)
    g = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(2, 2, 37, D, generator=g, dtype=F64) for _ in range(3))
    q, k = unit * q, unit * k
    ref = naive_favor_attention(q, k, v, fm.omega, fm.scale, causal=causal)
    phq, phk, log_scale = fm.map_qk(q.float(), k.float())
    out = linear_attention(phq, phk, v.float(), causal=causal, k_log_scale=log_scale, block_len=8)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
    # gradients, in float64 (the same ω), against the reference's
    fm64 = fm.double()
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    phq, phk, log_scale = fm64.map_qk(*inputs[:2])
    out = linear_attention(phq, phk, inputs[2], causal=causal, k_log_scale=log_scale, block_len=8)
    ref = naive_favor_attention(*inputs, fm64.omega, fm64.scale, causal=causal)
    w = torch.randn(ref.shape, generator=g, dtype=F64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), inputs), torch.autograd.grad((ref * w).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8 * b.abs().max().item())


def test_performer_causal_attention_is_causal_and_matches_naive():
    fm = PerformerFeatures(8, 16, seed=3).double()
    q, k, v = torch.randn(3, 1, 2, 11, 8, dtype=F64)
    pq, pk = fm(q, is_query=True), fm(k)
    out = linear_attention(pq, pk, v, causal=True, block_len=4)
    torch.testing.assert_close(out, naive_linear_attention(pq, pk, v, causal=True))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 7:] += 3.0
    v2[:, :, 7:] -= 1.0
    out2 = linear_attention(fm(q, is_query=True), fm(k2), v2, causal=True, block_len=4)
    torch.testing.assert_close(out2[:, :, :7], out[:, :, :7], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("m,d", [(8, 8), (20, 8), (5, 3)])
def test_orthogonal_draw_structure(m, d):
    w = draw_random_features(m, d, orthogonal=True, generator=torch.Generator().manual_seed(0))
    assert w.shape == (m, d)
    u = w / w.norm(dim=1, keepdim=True)
    for start in range(0, m, d):
        block = u[start : start + d]
        torch.testing.assert_close(block @ block.T, torch.eye(block.shape[0], dtype=F64), atol=1e-12, rtol=0)


def test_orthogonal_rows_have_gaussian_norms():
    # chi(d) norms: E|ω|² = d and Var|ω|² = 2d, as for iid Gaussian rows
    d, g = 6, torch.Generator().manual_seed(1)
    sq = draw_random_features(12, d, orthogonal=True, generator=g, num_draws=1000).pow(2).sum(-1).flatten()
    n = sq.numel()
    assert abs(sq.mean() - d) < 5 * math.sqrt(2 * d / n)
    assert abs(sq.var() / (2 * d) - 1) < 0.1


def _omegas(model):
    return [m.omega.clone() for m in model.modules() if isinstance(m, PerformerFeatures)]


def test_redraw_changes_exactly_at_multiples_of_the_interval():
    fm = PerformerFeatures(4, 8, redraw_interval=3, seed=11)
    draws = []
    for step in range(10):
        fm.set_step(step)
        draws.append(fm.omega.clone())
    for step in range(1, 10):
        assert torch.equal(draws[step], draws[step - 1]) == (step % 3 != 0), step
    # a pure function of (seed, step // interval): going back re-derives the same ω
    fm.set_step(4)
    assert torch.equal(fm.omega, draws[3])
    assert not torch.equal(PerformerFeatures(4, 8, seed=12).omega, PerformerFeatures(4, 8, seed=11).omega)
    assert PerformerFeatures(4, 8).redraw_interval == DEFAULT_REDRAW_INTERVAL == 1000


def test_forward_never_advances_the_draw():
    fm = PerformerFeatures(4, 8, redraw_interval=1).train()
    w, x = fm.omega.clone(), torch.randn(3, 4)
    for _ in range(3):
        fm.map_qk(x, x)
        fm(x)
    assert fm.step == 0 and torch.equal(fm.omega, w)


def test_ranks_and_resumed_runs_draw_the_same_features():
    step = 2 * DEFAULT_REDRAW_INTERVAL + 17
    rank0, rank1 = tiny_model("performer").train(), tiny_model("performer").train()  # built separately
    set_feature_step(rank0, step)
    set_feature_step(rank1, step)
    assert all(torch.equal(a, b) for a, b in zip(_omegas(rank0), _omegas(rank1)))
    assert not any(torch.equal(a, b) for a, b in zip(_omegas(rank0), _omegas(tiny_model("performer"))))
    # resume: a checkpoint from an earlier step, loaded into a fresh model, then the trainer sets the step
    uninterrupted = tiny_model("performer")
    set_feature_step(uninterrupted, DEFAULT_REDRAW_INTERVAL + 5)
    resumed = tiny_model("performer")
    resumed.load_state_dict(uninterrupted.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_omegas(resumed), _omegas(uninterrupted)))  # ω follows the step
    set_feature_step(uninterrupted, step)
    set_feature_step(resumed, step)
    assert all(torch.equal(a, b) for a, b in zip(_omegas(resumed), _omegas(rank0)))
    assert all(torch.equal(a, b) for a, b in zip(_omegas(uninterrupted), _omegas(rank0)))
    with pytest.raises(ValueError, match="step"):
        set_feature_step(resumed, -1)


def test_checkpoint_restores_the_draw_it_was_trained_with():
    trained = PerformerFeatures(4, 8, redraw_interval=5, seed=3)
    trained.set_step(12)  # draw 2
    loaded = PerformerFeatures(4, 8, redraw_interval=1000, seed=3)  # another interval in the loading config
    loaded.load_state_dict(trained.state_dict())
    assert loaded.step == 12 and torch.equal(loaded.omega, trained.omega)
    old = PerformerFeatures(4, 8, seed=3)
    old.set_extra_state({"step": 1500})  # a checkpoint from before global-step redraws: never redrawn
    assert torch.equal(old.omega, PerformerFeatures(4, 8, seed=3).omega)


def test_trainer_hook_sets_the_global_step():
    # LitLM.on_train_batch_start is where the trainer hands its global step to the feature maps
    lit_module = pytest.importorskip("vqattn.train.lit")
    from types import SimpleNamespace

    lit = lit_module.LitLM({"vocab_size": 17, "seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 16,
                            "attention": "performer"})
    lit._trainer = SimpleNamespace(global_step=2 * DEFAULT_REDRAW_INTERVAL + 3)  # stands in for the Trainer
    lit.on_train_batch_start((torch.zeros(1, 4, dtype=torch.long),), 0)
    steps = [m.step for m in lit.modules() if isinstance(m, PerformerFeatures)]
    assert steps == [2 * DEFAULT_REDRAW_INTERVAL + 3] * 2


def test_no_redraw_without_interval():
    a = PerformerFeatures(4, 8, redraw_interval=None)
    w = a.omega.clone()
    a.set_step(10**6)
    assert torch.equal(a.omega, w)


# ------------------------------------------------------------------------------------- FAVOR+ statistics
# q, k of norm 0.4 each keep the relative variance exp|q+k|² − 1 below 1.6, so moments are well estimated.


@pytest.mark.parametrize("orthogonal", [False, True])
def test_performer_unbiased(orthogonal):
    q, k = _qk(n=4, d=4, norm=0.4, seed=5)
    est = performer_estimates(q, k, 8, orthogonal=orthogonal, num_draws=4000, seed=7)  # (R, 4, 4)
    exact = exact_exp_kernel(q, k)
    stderr = est.std(0) / math.sqrt(est.shape[0])
    z = (est.mean(0) - exact) / stderr
    assert z.abs().max() < 4.5  # 16 pairs, 4.5 sigma: false alarm probability ~1e-4 (and the seed is fixed)


def test_performer_iid_error_matches_theory_and_falls_as_inverse_sqrt_m():
    q, k = _qk(n=6, d=4, norm=0.4, seed=6)
    exact = exact_exp_kernel(q, k)
    ms = [4, 16, 64, 256]
    errs = []
    for m in ms:
        est = performer_estimates(q, k, m, orthogonal=False, num_draws=400, seed=m)
        errs.append(((est / exact - 1) ** 2).mean().sqrt().item())
        # iid positive features: E(est/exact − 1)² = (exp|q+k|² − 1) / m exactly
        theory = math.sqrt(((torch.exp(((q[:, None] + k[None]) ** 2).sum(-1)) - 1) / m).mean())
        assert 0.85 < errs[-1] / theory < 1.15
    slope = np.polyfit(np.log(ms), np.log(errs), 1)[0]
    assert -0.6 < slope < -0.4


@pytest.mark.parametrize("m", [4, 8])
def test_orthogonal_beats_iid(m):
    q, k = _qk(n=6, d=4, norm=0.5, seed=8)
    exact = exact_exp_kernel(q, k)
    R = 20000
    per_draw = {o: ((performer_estimates(q, k, m, orthogonal=o, num_draws=R, seed=9 + o) / exact - 1) ** 2).mean((1, 2))
                for o in (False, True)}
    gain = per_draw[False].mean() - per_draw[True].mean()
    stderr = math.sqrt(per_draw[False].var() / R + per_draw[True].var() / R)
    assert gain > 4 * stderr  # the MSE reduction is ~10% here, 7+ standard errors at this R


# ------------------------------------------------------------------------------------------ autocast


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_performer_under_autocast_matches_float64(causal, amp):
    fm = PerformerFeatures(16, 64, seed=2)
    g = torch.Generator().manual_seed(3)
    q, k, v = (2 * torch.randn(2, 2, 21, 16, generator=g, dtype=F64) for _ in range(3))
    ref = naive_favor_attention(q, k, v, fm.omega, fm.scale, causal=causal)
    with torch.autocast("cpu", dtype=amp):
        phq, phk, log_scale = fm.map_qk(q.float(), k.float())
        out = linear_attention(phq, phk, v.float(), causal=causal, k_log_scale=log_scale, block_len=8)
    assert phq.dtype == phk.dtype == log_scale.dtype == out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 inputs: finite and close
        phq, phk, log_scale = fm.map_qk(q.bfloat16(), k.bfloat16())
        out = linear_attention(phq, phk, v.bfloat16(), causal=causal, k_log_scale=log_scale, block_len=8)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = naive_favor_attention(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), fm.omega,
                                fm.scale, causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)


@pytest.mark.parametrize("is_query", [False, True])
def test_performer_feature_map_under_autocast_computes_in_float32(is_query):
    fm = PerformerFeatures(16, 32, seed=1)
    x = 2 * torch.randn(3, 5, 16, dtype=F64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fm(x.float(), is_query=is_query)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), fm.double()(x, is_query=is_query), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
def test_performer_linear_attention_compiles_in_one_graph_and_matches_eager():
    """Traced and differentiated as inductor sees it (dynamo and AOT autograd, the aot_eager backend); inductor's
    code generation itself, a minute of C++ compilation on 2 cores, is checked on the codebook layers'
    compiled models (tests/model/test_compile.py)."""
    fm = PerformerFeatures(16, 32, seed=1)

    def attend(q, k, v):
        phq, phk, log_scale = fm.map_qk(q, k)
        return linear_attention(phq, phk, v, causal=True, k_log_scale=log_scale, block_len=8)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, 16, generator=g).requires_grad_() for _ in range(3))  # 37: a partial chunk
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break fails
    out, ref = compiled(q, k, v), attend(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn(ref.shape, generator=g)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
