"""decay_attention (linear attention with a per-head scalar decay: Mamba-2's SSD, fla's simple_gla): every form against
the float64 references (ours and flash-linear-attention's), outputs and gradients; causality, uneven chunks, state
continuation, packed sequences, half precision, fla's kernels on a GPU, and the argument errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from vqattn.functional import DecayState, decay_attention, linear_attention
from vqattn.ops.decay import chunk_decay_attention, naive_decay_attention, recurrent_decay_attention
from vqattn.ops.varlen import Packing

from references import ref_decay_attention

F64 = torch.float64
FORMS = {"chunk": chunk_decay_attention, "recurrent": recurrent_decay_attention}


def inputs(B=2, H=2, T=37, Dk=8, Dv=6, dtype=F64, seed=0):
    """q, k (B, H, T, Dk), v (B, H, T, Dv) and log decays in [−1, 0): after ~5 tokens a key weighs e^{−2.5}."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, Dk, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    log_decay = -torch.rand(B, H, T, generator=g, dtype=dtype)
    return q, k, v, log_decay


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).square().mean().sqrt() / want.square().mean().sqrt())


def outputs_and_grads(fn, tensors, grad_out_seed=1):
    """fn's output over copies of ``tensors`` that require grad, and the gradients of ⟨out, r⟩ for a fixed random r."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_out_seed), dtype=F64).to(out)
    return out, torch.autograd.grad((out * r).sum(), leaves)


def test_the_reference_is_the_one_matrix_definition_and_linear_attention_without_decay():
    q, k, v, g = inputs()
    S0 = torch.randn(2, 2, 6, 8, dtype=F64)
    out, state = naive_decay_attention(q, k, v, g, state=DecayState(S0, 5), return_state=True)
    want, want_S = ref_decay_attention(q, k, v, g, S0=S0)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.S, want_S, rtol=1e-10, atol=1e-12)
    assert state.length == 5 + 37
    # no decay: causal linear attention on identity features, no normaliser
    plain = linear_attention(q * 8**-0.5, k, v, causal=True, normalizer="none")
    torch.testing.assert_close(decay_attention(q, k, v, torch.zeros_like(g)), plain, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("block_len", [8, 64])  # T = 37: five chunks, the last partial; one chunk longer than T
def test_float32_forms_match_the_float64_reference_outputs_and_grads(form, block_len):
    tensors = inputs(dtype=torch.float32)
    scale = 0.7
    want, want_grads = outputs_and_grads(lambda *x: naive_decay_attention(*(t.double() for t in x), scale=scale),
                                         tensors)
    got, grads = outputs_and_grads(lambda *x: FORMS[form](*x, scale=scale, block_len=block_len), tensors)
    assert got.dtype == torch.float32
    assert rel_rms(got, want) < 1e-5
    for name, g, w in zip(("q", "k", "v", "log_decay"), grads, want_grads):
        assert rel_rms(g, w) < 1e-5, name


@pytest.mark.parametrize("form", FORMS)
def test_strong_decays_stay_finite(form):
    """Log decays of −30 per token (a state forgotten at once) and 0 (kept whole), in float32: the chunk form takes
    only differences within a chunk, masked before the exp, so nothing overflows; the gradients stay finite."""
    q, k, v, _ = inputs(dtype=torch.float32)
    g = torch.where(torch.rand(q.shape[:3], generator=torch.Generator().manual_seed(3)) < 0.5, -30.0, 0.0)
    want, want_grads = outputs_and_grads(lambda *x: naive_decay_attention(*(t.double() for t in x)), (q, k, v, g))
    got, grads = outputs_and_grads(lambda *x: FORMS[form](*x, block_len=16), (q, k, v, g))
    assert rel_rms(got, want) < 1e-5
    for g_, w in zip(grads, want_grads):
        assert torch.isfinite(g_).all() and rel_rms(g_, w) < 1e-5


@pytest.mark.parametrize("form", FORMS)
def test_causal(form):
    q, k, v, g = inputs(T=19)
    out = FORMS[form](q, k, v, g, block_len=4)
    for cut in (1, 6, 13):
        changed = [x.clone() for x in (q, k, v, g)]
        for x in changed:
            x[:, :, cut:] = -torch.rand_like(x[:, :, cut:])
        torch.testing.assert_close(FORMS[form](*changed, block_len=4)[:, :, :cut], out[:, :, :cut], rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["auto", "chunk", "recurrent", "naive"])
def test_pieces_with_the_state_equal_one_call(impl):
    """Pieces of 1, 7, 3, 17 and 9 tokens (with "auto", the short ones run the recurrent step, the others the chunks
    of 4) give one call's outputs and final state."""
    q, k, v, g = inputs()
    whole, final = decay_attention(q, k, v, g, block_len=4, return_state=True)
    outs, state, start = [], None, 0
    for size in (1, 7, 3, 17, 9):
        part = [x[:, :, start:start + size] for x in (q, k, v, g)]
        out, state = decay_attention(*part, block_len=4, state=state, return_state=True, impl=impl)
        outs.append(out)
        start += size
    torch.testing.assert_close(torch.cat(outs, 2), whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.S, final.S, rtol=1e-10, atol=1e-12)
    assert state.length == final.length == 37


BOUNDS = [0, 5, 6, 8, 20, 37]  # sequences of 5, 1, 2, 12 and 17 tokens: several in one chunk of 8, one across three


def _separate(q, k, v, g, bounds, **kwargs):
    return torch.cat([naive_decay_attention(*(x[:, :, a:b] for x in (q, k, v, g)), **kwargs)
                      for a, b in zip(bounds, bounds[1:])], 2)


@pytest.mark.parametrize("impl", ["chunk", "recurrent", "naive"])
@pytest.mark.parametrize("given", ["tensor", "packing", "segments"])
def test_packed_sequences_equal_separate_calls(impl, given):
    tensors = inputs(B=1)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    packing = Packing.from_bounds(BOUNDS)
    cu_seqlens = {"tensor": cu, "packing": packing, "segments": packing.segments((8,))}[given]
    want, want_grads = outputs_and_grads(lambda *x: _separate(*x, BOUNDS), tensors)
    got, grads = outputs_and_grads(lambda *x: decay_attention(*x, cu_seqlens=cu_seqlens, block_len=8, impl=impl),
                                   tensors)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_packed_sequences_with_states_continue_each_sequence():
    q, k, v, g = inputs(B=1)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    first, states = decay_attention(q, k, v, g, cu_seqlens=cu, state=[None] * 5, return_state=True, block_len=8)
    torch.testing.assert_close(first, _separate(q, k, v, g, BOUNDS), rtol=1e-10, atol=1e-12)
    assert [s.length for s in states] == [5, 1, 2, 12, 17]
    q2, k2, v2, g2 = inputs(B=1, T=5, seed=1)
    nxt = decay_attention(q2, k2, v2, g2, cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32),
                          state=[states[1], None], block_len=8)
    whole = naive_decay_attention(*(torch.cat([x[:, :, 5:6], y[:, :, :2]], 2) for x, y in
                                    zip((q, k, v, g), (q2, k2, v2, g2))))
    torch.testing.assert_close(nxt[:, :, :2], whole[:, :, 1:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(nxt[:, :, 2:], naive_decay_attention(*(x[:, :, 2:] for x in (q2, k2, v2, g2))),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_bf16_inputs_compute_in_float32_with_a_float32_state(impl):
    q, k, v, g = (x.to(torch.bfloat16) for x in inputs(dtype=torch.float32))
    out, state = decay_attention(q, k, v, g, block_len=8, impl=impl, return_state=True)
    assert out.dtype == torch.bfloat16 and state.S.dtype == torch.float32
    want, want_S = ref_decay_attention(*(x.double() for x in (q, k, v, g)))
    assert rel_rms(out, want) < 4e-3  # the output's own bf16 rounding (2^-9 relative)
    assert rel_rms(state.S, want_S) < 1e-5  # the state is not rounded
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast does not lower the op's own products
        autocast_out = decay_attention(q, k, v, g, block_len=8, impl=impl)
    torch.testing.assert_close(autocast_out, out, rtol=0, atol=0)


def _fla_naive():
    """flash-linear-attention's naive simple_gla module (fla-core, in the dev extra): a definition we did not write.
    Loaded from its file, since ``import fla`` imports every kernel module (seconds) and the naive one needs torch
    and einops alone."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    pytest.importorskip("einops")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "simple_gla" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_simple_gla_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_matches_flash_linear_attentions_naive_references():
    """fla's naive recurrent and chunked simple_gla, in their (B, T, H, D) layout and (Dk × Dv) state, from a given
    state: our float32 chunk form equals them to float32 rounding."""
    fla = _fla_naive()
    q, k, v, g = inputs(dtype=torch.float32)
    S0 = torch.randn(2, 2, 6, 8)
    scale = 0.5
    out, state = decay_attention(q, k, v, g, scale=scale, block_len=8, state=DecayState(S0, 0), return_state=True)
    bthd = [x.transpose(1, 2).contiguous() for x in (q, k, v, g)]
    fla_out, fla_S = fla.naive_recurrent_simple_gla(*bthd, scale=scale, initial_state=S0.transpose(-1, -2).clone(),
                                                    output_final_state=True)
    assert rel_rms(out, fla_out.transpose(1, 2)) < 1e-5
    assert rel_rms(state.S, fla_S.transpose(-1, -2)) < 1e-5
    chunk_out, chunk_S = fla.naive_chunk_simple_gla(*bthd, initial_state=S0.transpose(-1, -2).clone(),
                                                    output_final_state=True, chunk_size=16, scale=scale)
    assert rel_rms(out, chunk_out.transpose(1, 2)) < 1e-5
    assert rel_rms(state.S, chunk_S.transpose(-1, -2)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_fla_kernels_match_the_chunk_form_on_a_gpu(dtype, tol):
    pytest.importorskip("fla")
    tensors = [x.cuda() for x in inputs(B=2, H=4, T=300, Dk=64, Dv=32, dtype=torch.float32)]
    tensors = [*(x.to(dtype) for x in tensors[:3]), tensors[3]]
    S0 = torch.randn(2, 4, 32, 64, device="cuda")

    def run(impl):
        def fn(q, k, v, g):
            out, state = decay_attention(q, k, v, g, impl=impl, state=DecayState(S0, 0), return_state=True)
            return out.float() + 0 * state.S.sum()
        return outputs_and_grads(fn, tensors)

    (want, want_grads), (got, grads) = run("chunk"), run("triton")
    assert decay_attention(*tensors).dtype == dtype  # "auto" runs fla's kernels here
    assert rel_rms(got, want) < tol
    for g, w in zip(grads, want_grads):
        assert rel_rms(g, w) < tol
    q, k, v, g = (x[:1] for x in tensors)
    cu = torch.tensor([0, 7, 100, 300], dtype=torch.int32, device="cuda")
    packed = decay_attention(q, k, v, g, cu_seqlens=cu, impl="triton")
    assert rel_rms(packed, decay_attention(q, k, v, g, cu_seqlens=cu, impl="chunk")) < tol


def _bad(**changes):
    q, k, v, g = inputs(T=5)
    return {**dict(q=q, k=k, v=v, log_decay=g), **changes}


@pytest.mark.parametrize("changes,match", [
    (dict(log_decay=torch.zeros(2, 2, 4, dtype=F64)), r"log_decay must have shape \(B, H, T\) = \(2, 2, 5\)"),
    (dict(log_decay=torch.zeros(2, 2, 5, dtype=torch.long)), "log_decay must be a floating-point tensor"),
    (dict(log_decay=torch.full((2, 2, 5), 0.1, dtype=F64)), "log_decay must be <= 0"),
    (dict(q=torch.zeros(2, 5, 8, dtype=F64)), r"q must have shape \(B, H, T, D\)"),
    (dict(k=torch.zeros(2, 2, 5, 7, dtype=F64)), "q and k must share the feature dim"),
    (dict(v=torch.zeros(2, 2, 5, 6)), "v has dtype torch.float32 but q has torch.float64"),
    (dict(scale="big"), "scale must be a number or None"),
    (dict(block_len=0), "block_len must be a positive int"),
    (dict(impl="fast"), "impl must be one of 'auto', 'chunk', 'recurrent', 'naive', 'triton'"),
    (dict(impl="triton"), "impl='triton' needs"),
    (dict(state=torch.zeros(2, 2, 6, 8)), "state must be a DecayState or None, got Tensor"),
    (dict(state=DecayState(torch.zeros(2, 2, 8, 6, dtype=F64), 0)), r"state.S must have shape \(B, H, Dv, Dk\)"),
    (dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), "the batch must be 1"),
])
def test_bad_arguments_are_named(changes, match):
    if changes.get("impl") == "triton" and torch.cuda.is_available():
        pytest.skip("impl='triton' runs here")
    with pytest.raises(ValueError, match=match):
        decay_attention(**_bad(**changes))


def test_bad_packed_states_are_named():
    q, k, v, g = inputs(B=1, T=5)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="state must be a list of 2 DecayStates"):
        decay_attention(q, k, v, g, cu_seqlens=cu, state=DecayState(torch.zeros(1, 2, 6, 8, dtype=F64), 0))
    with pytest.raises(ValueError, match="runs causal calls without states"):
        decay_attention(q, k, v, g, cu_seqlens=Packing.from_bounds([0, 2, 5]).segments(), return_state=True)
