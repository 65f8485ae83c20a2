"""Performer ↔ codebook bridge: FAVOR+ is codebook attention with the kernel assignment and the random codebook
c = ω/√scale (``codebook_kernel_features``), checked against the naive T×T codebook attention too."""

import math

import pytest
import torch

from vqattn.analysis import codebook_kernel_features, kernel_soft_factors
from vqattn.feature_maps import PerformerFeatures, draw_random_features
from vqattn.functional import linear_attention, vq_attention

from references import ref_vq_attention
from references_kernel import favor_features, naive_linear_attention

F64 = torch.float64


def _qkv(T, D=8, Dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, T, d, generator=g, dtype=F64).requires_grad_() for d in (D, D, Dv)]


def _kernel_vq(q, k, v, codebook, *, causal, temperature, scale=None, block_len=None):
    """Codebook attention with the kernel assignment, in its linear-attention form."""
    phi_q, phi_k, k_log_scale = codebook_kernel_features(q, k, codebook, temperature=temperature, scale=scale)
    return linear_attention(phi_q, phi_k, v, causal=causal, block_len=block_len, k_log_scale=k_log_scale)


def _grads(out, inputs):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,block_len,scale", [(37, 8, None), (16, 4, 0.3), (5, 8, 1.0)])
def test_kernel_assignment_equals_favor(causal, T, block_len, scale):
    D, m = 8, 24
    fm = PerformerFeatures(D, m, seed=T, scale=scale).double()
    s = fm.scale
    q, k, v = _qkv(T, D)
    phq, phk, k_log_scale = fm.map_qk(q, k)
    favor = linear_attention(phq, phk, v, causal=causal, block_len=block_len, k_log_scale=k_log_scale)
    vq = _kernel_vq(q, k, v, fm.omega.double() / math.sqrt(s), causal=causal, temperature=1 / s, scale=s,
                    block_len=block_len)
    assert (vq - favor).abs().max() <= 1e-8
    for g_vq, g_favor in zip(_grads(vq, (q, k, v)), _grads(favor, (q, k, v))):
        assert (g_vq - g_favor).abs().max() <= 1e-8


@pytest.mark.parametrize("causal", [False, True])
def test_per_head_random_codebooks(causal):
    # one ω per head: codebook (H, S, D), checked against the element-wise FAVOR+ reference
    D, m, s, T = 6, 10, 0.5, 13
    omega = draw_random_features(m, D, orthogonal=True, generator=torch.Generator().manual_seed(3), num_draws=2)
    q, k, v = (x.detach() for x in _qkv(T, D))
    phq = torch.stack([favor_features(q[:, h], omega[h], s) for h in range(2)], dim=1)
    phk = torch.stack([favor_features(k[:, h], omega[h], s) for h in range(2)], dim=1)
    ref = naive_linear_attention(phq, phk, v, causal=causal)
    vq = _kernel_vq(q, k, v, omega / math.sqrt(s), causal=causal, temperature=1 / s, scale=s, block_len=4)
    assert (vq - ref).abs().max() <= 1e-8


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("equal_norms", [False, True])
def test_soft_assignment_is_kernel_with_per_key_and_per_code_factors(causal, equal_norms):
    # Δ^kernel_js = Δ^soft_js · a(k_j) · b_s: the soft (GMM) attention is FAVOR+ with key features divided by
    # a(k_j) and query features divided by b_s; with codes of equal norm b is constant and drops out.
    D, m, s, T = 8, 16, 0.35, 21
    fm = PerformerFeatures(D, m, seed=5, scale=s).double()
    if equal_norms:
        fm.omega.copy_(fm.omega / fm.omega.norm(dim=1, keepdim=True) * math.sqrt(D))
    c, tau = fm.omega.double() / math.sqrt(s), 1 / s
    q, k, v = (x.detach() for x in _qkv(T, D))
    phq, phk = fm(q, is_query=True), fm(k)
    per_key, per_code = kernel_soft_factors(k, c, tau)
    soft = vq_attention(q, k, v, c, causal=causal, assign="soft", temperature=tau, block_len=8, scale=s)
    kernel = _kernel_vq(q, k, v, c, causal=causal, temperature=tau, scale=s)
    full = linear_attention(phq / per_code, phk / per_key.unsqueeze(-1), v, causal=causal)
    key_only = linear_attention(phq, phk / per_key.unsqueeze(-1), v, causal=causal)
    assert (soft - full).abs().max() <= 1e-8
    if equal_norms:
        assert (soft - key_only).abs().max() <= 1e-8
    else:
        assert (soft - key_only).abs().max() > 1e-3  # the per-code prior matters when norms differ
    assert (soft - kernel).abs().max() > 1e-3  # and the per-key factor is never constant


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,block_len", [(1, 4), (37, 8), (100, 16)])
def test_kernel_features_match_naive_codebook_attention_outputs_and_grads(causal, T, block_len):
    """The linear form against the T×T codebook attention with the kernel Δ (window and cache alike), including
    the codebook's gradient."""
    q, k, v = _qkv(T)
    c = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(2), dtype=F64).requires_grad_()
    kw = dict(causal=causal, temperature=0.7, scale=0.4)
    out = _kernel_vq(q, k, v, c, block_len=block_len, **kw)
    ref = ref_vq_attention(q, k, v, c, assign="kernel", block_len=block_len, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for name, a, b in zip("qkvc", _grads(out, (q, k, v, c)), _grads(ref, (q, k, v, c))):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=f"grad of {name}")


def test_kernel_features_with_large_keys_and_small_temperature_do_not_underflow():
    """τ = 0.05, ‖k‖ ≈ 17: every raw kernel weight is below e^{-2000}; the per-key scale keeps float32 exact."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=g, dtype=F64) for _ in range(3))
    c = torch.randn(2, 32, 16, generator=g, dtype=F64)
    k = k / k.norm(dim=-1, keepdim=True) * 17 * (1 + 0.05 * torch.rand(1, 2, 70, 1, generator=g, dtype=F64))
    c = c / c.norm(dim=-1, keepdim=True)
    ref = ref_vq_attention(q, k, v, c, causal=True, assign="kernel", temperature=0.05, block_len=8)
    out = _kernel_vq(*(x.float() for x in (q, k, v, c)), causal=True, temperature=0.05, block_len=8)
    assert (ref - v.mean(2, keepdim=True)).abs().max() > 0.5  # far from the window-mean collapse
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-3)
