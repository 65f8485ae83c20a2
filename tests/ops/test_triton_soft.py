"""Soft keys in the fused impl without a (T, S) tensor (vqattn/ops/triton/soft.py): every block's cache and
its gradients against a float64 definition, the op and a layer against the formed path, the codebook's statistics
kernel, and what the backward allocates. Under TRITON_INTERPRET=1 on a CPU, or on a GPU."""

from __future__ import annotations

import pytest
import torch

from vqattn.functional import Assignment, SoftMixture, naive_vq_attention, vq_assign, vq_attention
from vqattn.ops.triton.soft import soft_block_caches, soft_statistics

from triton_helpers import DEVICE, Allocations, compare, leaves, nan_empty, needs_triton, rel_rms  # noqa: F401 (a fixture)

pytestmark = [needs_triton, pytest.mark.usefixtures("nan_empty")]
# One sequence: the interpreter's time grows with the programs, one per (sequence, head) and block; soft keys run
# through these kernels with two sequences in test_triton.py's tests of the definition
B, H, D, DV, S, L = 1, 2, 16, 8, 24, 16


def ref_block_caches(k, codes, tau, v, counts0, sums0, block_len, fold):
    """Every block's cache n_b = n_0 + Σ_{j ≤ b−2} Δ_jᵀ1, C_b = C_0 + Σ_{j ≤ b−2} Δ_jᵀV_j and the state after
    ``fold`` blocks, from the GMM posterior formed whole, block by block. τ is (H,), or (H, T): one per key."""
    T = k.shape[2]
    p = torch.softmax(-((k.unsqueeze(-2) - codes[None, :, None]) ** 2).sum(-1) / (2 * tau.view(1, k.shape[1], -1, 1)),
                      -1)
    nb = -(-T // block_len)
    blocks = [slice(j * block_len, min((j + 1) * block_len, T)) for j in range(nb)]
    inc_n = [p[:, :, rows].sum(2) for rows in blocks]
    inc_c = [p[:, :, rows].transpose(-1, -2) @ v[:, :, rows] for rows in blocks]
    before = lambda incs, base, j: base + sum(incs[:j], torch.zeros_like(base))  # noqa: E731
    caches_n = torch.stack([before(inc_n, counts0, max(b - 1, 0)) for b in range(nb)], 2)
    caches_c = torch.stack([before(inc_c, sums0, max(b - 1, 0)) for b in range(nb)], 2)
    return caches_n, caches_c, before(inc_n, counts0, fold), before(inc_c, sums0, fold)


def soft_inputs(T, scale=1.0, generator=None):
    k, codes, v, sums0 = leaves((B, H, T, D), (H, S, D), (B, H, T, DV), (B, H, S, DV), scale=scale,
                                generator=generator)
    tau = (torch.rand(H, dtype=torch.float64, generator=generator) + 0.5).requires_grad_()
    counts0 = torch.rand(B, H, S, dtype=torch.float64, generator=generator).requires_grad_()
    return [k, codes, tau, v, counts0, sums0]


@pytest.mark.parametrize("T,fold", [(1, 0), (1, 1), (20, 1), (33, 2), (64, 3), (70, 4), (70, 5)])
def test_block_caches_against_the_definition(T, fold):
    """Outputs and every input's gradient (keys, codes, per-head τ, values, initial cache) for one random gradient
    of each output; T = 1, under two blocks, not a multiple of L, and every kept state up to all blocks."""
    inputs = soft_inputs(T, generator=torch.Generator().manual_seed(T + fold))
    ref = ref_block_caches(*inputs, L, fold)
    grads = [torch.randn_like(r) for r in ref]
    ref_grads = [torch.zeros_like(x) if g is None else g  # T = 1, fold = 0: the keys reach no cache
                 for x, g in zip(inputs, torch.autograd.grad(ref, inputs, grads, allow_unused=True))]
    fast = [x.detach().to(DEVICE, torch.float32).requires_grad_() for x in inputs]
    out = soft_block_caches(*fast, block_len=L, fold=fold)
    fast_grads = torch.autograd.grad(out, fast, [g.to(DEVICE, torch.float32) for g in grads])
    for o, r in zip(out, ref):
        assert rel_rms(o, r) < 1e-5
    for i, (g, r) in enumerate(zip(fast_grads, ref_grads)):
        assert rel_rms(g, r) < 1e-4, f"gradient of input {i}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_caches_of_half_keys_and_values(dtype):
    """Half keys and values (the codes and τ float32): within the halves' rounding of the definition on the rounded
    inputs. τ's gradient is a sum over the keys whose terms cancel (relative to the sum it can be off by 5% at
    bfloat16): it is held to 1% of the sum of its terms' sizes, the definition's gradient to a per-key τ."""
    inputs = soft_inputs(70, generator=torch.Generator().manual_seed(1))
    rounded = [x.detach().to(dtype).double().requires_grad_() if i in (0, 3) else x for i, x in enumerate(inputs)]
    ref = ref_block_caches(*rounded, L, 2)
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(r.shape, dtype=r.dtype, generator=generator) for r in ref]
    ref_grads = torch.autograd.grad(ref, rounded, grads)
    per_key = inputs[2].detach()[:, None].expand(H, 70).clone().requires_grad_()
    tau_terms, = torch.autograd.grad(ref_block_caches(*rounded[:2], per_key, *rounded[3:], L, 2), per_key, grads)
    fast = [x.detach().to(DEVICE, dtype if i in (0, 3) else torch.float32).requires_grad_()
            for i, x in enumerate(rounded)]
    out = soft_block_caches(*fast, block_len=L, fold=2)
    fast_grads = torch.autograd.grad(out, fast, [g.to(DEVICE, torch.float32) for g in grads])
    assert fast_grads[0].dtype == dtype and fast_grads[3].dtype == dtype
    for o, r in zip(out, ref):
        assert rel_rms(o, r) < 1e-2
    for i, (g, r) in enumerate(zip(fast_grads, ref_grads)):
        if i == 2:
            assert torch.allclose(tau_terms.sum(1), r)
            assert ((g.double().cpu() - r).abs() <= 1e-2 * tau_terms.abs().sum(1)).all()
        else:
            assert rel_rms(g, r) < 2e-2, f"gradient of input {i}"


@pytest.mark.parametrize("scale", [4.0, 12.0])
def test_block_caches_at_large_logits(scale):
    """Keys and codes at 4 and 12 times unit scale: scores in the hundreds or thousands, weights nearly one-hot. The
    logsumexp keeps them finite, and every output and gradient is within 3× the error of the definition run in
    float32 by PyTorch (whose softmax is exact to float32's rounding) against float64, or 1e-5 (at scale 12 the
    temperature's gradient, a sum of terms that cancel, is off by ~3e-3 in both)."""
    torch.manual_seed(0)
    inputs = soft_inputs(50, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        inputs[0].mul_(scale)
        inputs[1].mul_(scale)
    flat = lambda outs: torch.cat([t.flatten() for t in outs])  # noqa: E731
    ref = flat(ref_block_caches(*inputs, L, 1))
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, inputs, grad)

    def errors(fn, device):
        x = [t.detach().to(device, torch.float32).requires_grad_() for t in inputs]
        out = flat(fn(*x))
        return [rel_rms(out, ref)] + [rel_rms(g, r) for g, r in zip(torch.autograd.grad(out, x, grad.to(out)),
                                                                          ref_grads)]

    pytorch = errors(lambda *x: ref_block_caches(*x, L, 1), "cpu")
    kernels = errors(lambda *x: soft_block_caches(*x, block_len=L, fold=1), DEVICE)
    assert all(k <= max(3 * p, 1e-5) for k, p in zip(kernels, pytorch)), (kernels, pytorch)


def test_no_tensor_of_keys_by_codes_is_allocated():
    """A fwd+bwd of the op on soft keys it assigns itself allocates nothing of (T, S) or (T, S)-per-head shape: the
    weights, their gradient and the scores' are recomputed in the kernels."""
    T = 40  # 3 blocks: every kernel reads a cache
    q, k, v, c = (x.detach().to(DEVICE, torch.float32).requires_grad_()
                  for x in leaves((B, H, T, D), (B, H, T, D), (B, H, T, DV), (H, S, D)))
    with Allocations() as allocated:
        out = vq_attention(q, k, v, c, causal=True, assign="soft", block_len=L, exact_window=True, impl="triton")
        out.square().sum().backward()
    assert not {(B, H, T, S), (B * H, T, S)} & set(allocated.shapes), allocated.shapes
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, c))


def _rotated_call(attention, mixture: bool, **kwargs):
    """The layers' call: q and the codebook on the first D/2 dims, the window on its own rotated pair, the keys
    assigned on the full keys against full codes, formed or as a SoftMixture."""

    def call(q, k, v, codes, q_rot, k_rot, tau):
        a = vq_assign(k, codes, assign="soft", temperature=tau, formed=not mixture)
        return attention(q, k, v, codes[..., :D // 2], causal=True, assign="soft", block_len=L, exact_window=True,
                         q_rot=q_rot, k_rot=k_rot, assignment=a, **kwargs)

    return call


@pytest.mark.parametrize("T", [1, 20, 70])
def test_a_soft_mixture_assignment_on_narrow_codes(T):
    """A SoftMixture handed to the op, as a layer's codebook hands it on a GPU (keys and codes of D dims, the query
    codes narrower, a learned τ), gives the definition's outputs and gradients (τ's included), with a memory
    bound."""
    g = torch.Generator().manual_seed(T)
    q, k, v, codes, q_rot, k_rot = leaves((B, H, T, D // 2), (B, H, T, D), (B, H, T, DV), (H, S, D), (B, H, T, D),
                                          (B, H, T, D), generator=g)
    tau = (torch.rand(H, dtype=torch.float64, generator=g) + 0.5).requires_grad_()
    compare(_rotated_call(naive_vq_attention, False, memory_cap=24),
            _rotated_call(vq_attention, True, impl="triton", memory_cap=24), [q, k, v, codes, q_rot, k_rot, tau])


def test_a_soft_mixture_continues_a_state_and_runs_the_chunk_impl():
    """With a SoftMixture the chunked calls (return_state, then state) equal one call, and the chunk impl forms it
    and gives the same output."""
    g = torch.Generator().manual_seed(5)
    q, k, v, codes, q_rot, k_rot = (x.detach().to(DEVICE, torch.float32) for x in leaves(
        (B, H, 90, D // 2), (B, H, 90, D), (B, H, 90, DV), (H, S, D), (B, H, 90, D), (B, H, 90, D), generator=g))
    tau = torch.tensor([0.7, 1.3], device=DEVICE)
    whole = _rotated_call(vq_attention, True, impl="triton")(q, k, v, codes, q_rot, k_rot, tau)
    chunk = _rotated_call(vq_attention, True, impl="chunk")(q, k, v, codes, q_rot, k_rot, tau)
    first, state = _rotated_call(vq_attention, True, impl="triton", return_state=True)(
        *(x[:, :, :50] for x in (q, k, v)), codes, *(x[:, :, :50] for x in (q_rot, k_rot)), tau)
    rest = _rotated_call(vq_attention, True, impl="triton", state=state)(
        *(x[:, :, 50:] for x in (q, k, v)), codes, *(x[:, :, 50:] for x in (q_rot, k_rot)), tau)
    assert rel_rms(torch.cat([first, rest], 2), whole) < 1e-6
    assert rel_rms(chunk, whole) < 1e-6


def test_bad_soft_mixtures():
    k, codes = torch.randn(B, H, 10, D), torch.randn(H, S, D)
    q, v = torch.randn(B, H, 10, D), torch.randn(B, H, 10, DV)
    with pytest.raises(ValueError, match="formed=False is for assign='soft'"):
        vq_assign(k, codes, assign="hard", formed=False)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vq_assign(k, codes, assign="soft", temperature=0.0, formed=False)
    mixture = vq_assign(k, codes, assign="soft", formed=False)
    with pytest.raises(ValueError, match="SoftMixture assignment needs assign='soft'"):
        vq_attention(q, k, v, codes, causal=True, assign="hard", assignment=mixture)
    with pytest.raises(ValueError, match=rf"SoftMixture.*keys \({B}, {H}, 5, {D}\)"):
        vq_attention(q, k, v, codes, causal=True, assign="soft", assignment=SoftMixture(k[:, :, :5], codes, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_statistics(dtype):
    """The codebook's statistics kernel: soft counts Σ_j p(s | k_j) over batch and keys, and every key's most
    probable code, against the posterior formed in float64 (the keys rounded to dtype first)."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B, H, 150, D, generator=g).to(dtype)
    codes, tau = torch.randn(H, S, D, generator=g), torch.tensor([0.5, 2.0])
    scores = -((k.double().unsqueeze(-2) - codes.double()[None, :, None]) ** 2).sum(-1) / (2 * tau.double()[:, None, None])
    counts, index = soft_statistics(k.to(DEVICE), codes.to(DEVICE), tau.to(DEVICE))
    assert rel_rms(counts, torch.softmax(scores, -1).sum((0, 2))) < 1e-5
    assert torch.equal(index.cpu(), scores.argmax(-1))


def test_a_layer_hands_its_soft_keys_unformed_where_the_kernels_run(monkeypatch):
    """Where the assignment kernels run (a GPU; here the interpreter, told so), the soft layer's codebook hands the
    op a SoftMixture: its output, every parameter's gradient (the codes and a learned τ included) and the codebook's
    statistics equal those of the formed path."""
    import vqattn.codebook as codebook_module
    import vqattn.layers.vq as vq_module
    from vqattn.layers.vq import VQSoftAttention

    torch.manual_seed(0)
    layer = VQSoftAttention(32, 2, num_codes=S, block_len=L, impl="triton",
                            codebook=dict(learn_temperature=True)).to(DEVICE)
    x = torch.randn(B, 70, 32, device=DEVICE)
    runs, seen = [], []
    op = vq_module.vq_attention
    monkeypatch.setattr(vq_module, "vq_attention", lambda *a, **kw: seen.append(type(kw["assignment"])) or op(*a, **kw))
    for kernels in (False, True):
        monkeypatch.setattr(codebook_module, "runs_kernels", lambda k, on=kernels: on)
        layer.zero_grad()
        state = {name: buf.clone() for name, buf in layer.codebook.named_buffers()}
        torch.manual_seed(1)  # the same restart candidates drawn
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.square().mean().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None},
                     {name: buf.clone() for name, buf in layer.codebook.named_buffers()}))
        for name, buf in layer.codebook.named_buffers():  # the same statistics before both runs
            buf.copy_(state[name])
    (out0, grads0, stats0), (out1, grads1, stats1) = runs
    assert seen == [Assignment, SoftMixture]
    assert rel_rms(out1, out0) < 1e-6
    assert grads0.keys() == grads1.keys() and "codebook.log_temperature" in grads0
    for name in grads0:
        assert rel_rms(grads1[name], grads0[name]) < 1e-5, name
    for name in stats0:
        if stats0[name].is_floating_point():
            assert rel_rms(stats1[name], stats0[name]) < 1e-5, name


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_op_on_half_inputs(dtype):
    """bf16 and float16 q, k, v and codebook, the soft keys assigned by the op (their weights recomputed in the
    kernels): within the halves' rounding of the float64 definition on the rounded inputs, every gradient
    included; one head (the rounding is a head's own)."""
    q, k, v, c = leaves((B, 1, 100, D), (B, 1, 100, D), (B, 1, 100, DV), (1, S, D),
                        generator=torch.Generator().manual_seed(3))
    rounded = [x.detach().to(dtype).double().requires_grad_() for x in (q, k, v, c)]

    def call(attention, **kwargs):
        return lambda q, k, v, c: attention(q, k, v, c, causal=True, assign="soft", temperature=0.7, block_len=L,
                                            exact_window=True, memory_cap=40, **kwargs)

    compare(call(naive_vq_attention), call(vq_attention, impl="triton"), rounded, dtype=dtype, tol=2e-2)


@pytest.mark.parametrize("tile", [32, 128])
def test_every_code_tile_candidate(tile, monkeypatch):
    """The three kernels' launch candidates (soft.*_CONFIGS) differ in their code tile, which splits the
    codes differently, never what they sum: 24 codes in tiles of 32 and 128 (one partial tile each), every output
    and gradient against the definition."""
    from vqattn.ops.triton import soft

    for kernel in (soft._soft_block_sums_kernel, soft._soft_block_grads_kernel,
                   soft._soft_code_grads_kernel):
        monkeypatch.setattr(kernel, "configs", [next(c for c in kernel.candidates if c.kwargs["BS"] == tile)])
        monkeypatch.setattr(kernel, "cache", {})
    compare(lambda *x: torch.cat([t.flatten() for t in ref_block_caches(*x, L, 2)]),
            lambda *x: torch.cat([t.flatten() for t in soft_block_caches(*x, block_len=L, fold=2)]),
            soft_inputs(70, generator=torch.Generator().manual_seed(tile)))
