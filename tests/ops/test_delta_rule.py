"""The delta rule op: every form against the float64 definition (outputs and the gradients of q, k, v, beta,
log_decay and the incoming state), causality, chunks, states, packed sequences, half precision, compile, bad input;
against flash-linear-attention's own naive references (a definition we did not write) and, on a GPU, its kernels."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from vqattn.functional import DeltaRuleState, delta_rule_attention
from vqattn.ops.delta_rule import chunk as chunk_module
from vqattn.ops.delta_rule import (
    chunk_delta_rule_attention,
    naive_delta_rule_attention,
    recurrent_delta_rule_attention,
)
from vqattn.ops.varlen import Packing

F64 = torch.float64
FORMS = {"chunk": chunk_delta_rule_attention, "recurrent": recurrent_delta_rule_attention, "auto": delta_rule_attention}


def _inputs(B=2, H=2, T=37, Dk=8, Dv=6, seed=0, dtype=F64, decay=True, state=False):
    """q, k (unit keys, as the layers give them), v, beta in (0, 1), log_decay in (−1, 0) (or None) and an incoming
    state (or None), all leaves that take gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=F64)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=F64), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=F64)
    beta = torch.rand(B, H, T, generator=g, dtype=F64)
    log_decay = -torch.rand(B, H, T, generator=g, dtype=F64) if decay else None
    S0 = torch.randn(B, H, Dv, Dk, generator=g, dtype=F64) if state else None
    return [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v, beta, log_decay, S0)]


def _call(op, q, k, v, beta, log_decay, S0, **kwargs):
    return op(q, k, v, beta, log_decay, state=None if S0 is None else DeltaRuleState(S0, 0), **kwargs)


def _grads(out, leaves, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out)
    present = [x for x in leaves if x is not None]
    return torch.autograd.grad((out * w).sum(), present)


def _rel_rms(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("decay", [False, True], ids=["deltanet", "gated"])
def test_float32_forms_match_the_float64_definition(form, decay):
    """T = 37 in chunks of 8 (not a multiple), with an incoming state: outputs, the final state and every gradient
    (q, k, v, beta, log_decay, the state) to about 1e-5 relative RMS in float32."""
    ref_in = _inputs(decay=decay, state=True)
    ref, ref_state = _call(naive_delta_rule_attention, *ref_in, return_state=True)
    got_in = [None if x is None else x.detach().float().requires_grad_() for x in ref_in]
    out, state = _call(FORMS[form], *got_in, block_len=8, return_state=True)
    assert out.dtype == torch.float32 and state.S.dtype == torch.float32 and state.length == 37
    assert _rel_rms(out, ref) < 1e-5 and _rel_rms(state.S, ref_state.S) < 1e-5
    for g, r in zip(_grads(out, got_in), _grads(ref, ref_in)):
        assert _rel_rms(g, r) < 1e-5


@pytest.mark.parametrize("decay", [False, True], ids=["deltanet", "gated"])
def test_float64_forms_agree_to_rounding_and_the_final_state_has_its_gradient(decay):
    """In float64 the forms agree to 1e-12, gradients through the returned state included (the chunk walk's own
    backward)."""
    inputs = _inputs(T=29, decay=decay, state=True)
    ref, ref_state = _call(naive_delta_rule_attention, *inputs, return_state=True)
    want = _grads(ref_state.S.square().sum() + ref.square().sum(), inputs)
    for form in ("chunk", "recurrent"):
        out, state = _call(FORMS[form], *inputs, block_len=4, return_state=True)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state.S, ref_state.S, rtol=1e-12, atol=1e-12)
        got = _grads(state.S.square().sum() + out.square().sum(), inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("block_len", [1, 3, 16, 64])
def test_the_chunk_length_never_changes_the_result(block_len):
    inputs = _inputs(T=21)
    ref = _call(naive_delta_rule_attention, *inputs)
    torch.testing.assert_close(_call(chunk_delta_rule_attention, *inputs, block_len=block_len), ref, rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("given", ["state", "Segments"])
def test_chunks_in_groups_equal_one_group(monkeypatch, given):
    """On a CPU the chunks run in groups of about GROUP_BYTES of (C, C) matrices, each from the state the last
    leaves: with groups of 2 chunks of 4 tokens (T = 37: the last group a partial chunk), outputs, the final state
    and every gradient equal the definition; packed sequences restart inside the groups (Segments: the keep
    factors split with them)."""
    import vqattn.ops.blocks as blocks

    monkeypatch.setattr(blocks, "GROUP_BYTES", 2 * 2 * 2 * 4 * 4 * 8)  # B·H·C·C float64 per chunk, 2 chunks a group
    seen = []
    group = chunk_module._chunk_group
    monkeypatch.setattr(chunk_module, "_chunk_group", lambda *a: seen.append(a[0].shape[2]) or group(*a))
    if given == "state":
        inputs = _inputs(T=37, state=True)
        out, state = _call(chunk_delta_rule_attention, *inputs, block_len=4, return_state=True)
        ref, ref_state = _call(naive_delta_rule_attention, *inputs, return_state=True)
        torch.testing.assert_close(state.S, ref_state.S, rtol=1e-12, atol=1e-12)
        out_loss, ref_loss = out.square().sum() + state.S.sum(), ref.square().sum() + ref_state.S.sum()
    else:
        inputs = _inputs(B=1, H=2, T=37)[:5]
        monkeypatch.setattr(blocks, "GROUP_BYTES", 1 * 2 * 4 * 4 * 8 * 2)
        out = delta_rule_attention(*inputs, block_len=4, cu_seqlens=Packing.from_bounds(BOUNDS).segments([4]))
        ref = torch.cat([naive_delta_rule_attention(*(None if x is None else x[:, :, a:b] for x in inputs))
                         for a, b in zip(BOUNDS, BOUNDS[1:])], 2)
        out_loss, ref_loss = out.square().sum(), ref.square().sum()
    assert len(seen) > 3 and max(seen) == 8  # several groups of 2 chunks ran
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    present = [x for x in inputs if x is not None]
    for g, w in zip(torch.autograd.grad(out_loss, present), torch.autograd.grad(ref_loss, present)):
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_causal(form):
    q, k, v, beta, g, _ = (None if x is None else x.detach() for x in _inputs(T=19))
    out = FORMS[form](q, k, v, beta, g, block_len=4)
    cut = 9
    changed = [x.clone() for x in (q, k, v, beta)] + [g.clone()]
    for x in changed:
        x[:, :, cut:] = torch.rand_like(x[:, :, cut:])
    changed[-1][:, :, cut:] *= -1  # log_decay stays <= 0
    torch.testing.assert_close(FORMS[form](*changed, block_len=4)[:, :, :cut], out[:, :, :cut], rtol=0, atol=0)


def test_chunked_calls_with_the_state_equal_one_call():
    """Pieces of 5, 1, 13 and 18 tokens carrying the state (the 1-token piece decodes by the recurrent form under
    "auto") give the outputs and the final state of one call."""
    q, k, v, beta, g, _ = _inputs(T=37)
    whole, whole_state = delta_rule_attention(q, k, v, beta, g, block_len=8, return_state=True)
    outs, state, start = [], None, 0
    for size in (5, 1, 13, 18):
        piece = [x[:, :, start:start + size] for x in (q, k, v, beta, g)]
        out, state = delta_rule_attention(*piece, block_len=8, state=state, return_state=True)
        outs.append(out)
        start += size
    assert state.length == 37
    torch.testing.assert_close(torch.cat(outs, 2), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.S, whole_state.S, rtol=1e-12, atol=1e-12)


BOUNDS = [0, 5, 6, 20, 37]  # shorter than a chunk, one token, crossing the chunks of 8


@pytest.mark.parametrize("given", ["tensor", "Segments"])
@pytest.mark.parametrize("decay", [False, True], ids=["deltanet", "gated"])
def test_packed_sequences_equal_separate_calls(given, decay):
    """cu_seqlens (B = 1): each sequence starts from a zero state; outputs and gradients equal one call per
    sequence, by the length classes (a tensor) and by the segmented block form (Segments, what a compiled model
    takes)."""
    inputs = _inputs(B=1, decay=decay)[:5]
    cu = (torch.tensor(BOUNDS, dtype=torch.int32) if given == "tensor"
          else Packing.from_bounds(BOUNDS).segments([8]))
    out = delta_rule_attention(*inputs, block_len=8, cu_seqlens=cu)
    want = torch.cat([naive_delta_rule_attention(*(None if x is None else x[:, :, a:b] for x in inputs))
                      for a, b in zip(BOUNDS, BOUNDS[1:])], 2)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(_grads(out, inputs), _grads(want, inputs)):
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-11)


def test_packed_sequences_take_and_return_one_state_per_sequence():
    q, k, v, beta, g, _ = [None if x is None else x.detach() for x in _inputs(B=1, T=37)]
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    out, states = delta_rule_attention(q, k, v, beta, g, cu_seqlens=cu, return_state=True)
    assert [s.length for s in states] == [5, 1, 14, 17]
    step = [torch.randn(1, 2, 4, x.shape[-1], dtype=F64) for x in (q, k, v)]
    more = delta_rule_attention(*step, torch.rand(1, 2, 4, dtype=F64), -torch.rand(1, 2, 4, dtype=F64),
                                state=states, cu_seqlens=torch.arange(5, dtype=torch.int32))
    for i, (a, b) in enumerate(zip(BOUNDS, BOUNDS[1:])):
        _, alone = delta_rule_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], beta[:, :, a:b], g[:, :, a:b],
                                        return_state=True)
        torch.testing.assert_close(states[i].S, alone.S, rtol=1e-12, atol=1e-12)
    assert more.shape == (1, 2, 4, 6)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_bf16_inputs_compute_in_float32_with_a_float32_state(form):
    inputs = _inputs(dtype=torch.bfloat16)[:5]
    out, state = FORMS[form](*inputs, block_len=8, return_state=True)
    assert out.dtype == torch.bfloat16 and state.S.dtype == torch.float32
    ref = naive_delta_rule_attention(*(x.detach().double() for x in inputs))
    assert _rel_rms(out, ref) < 1e-2  # the output's rounding to bf16 alone
    assert all(torch.isfinite(g).all() for g in _grads(out, inputs))


def test_autocast_does_not_lower_the_precision():
    inputs = [x.detach().float() for x in _inputs()[:5]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = delta_rule_attention(*inputs, block_len=8)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, delta_rule_attention(*inputs, block_len=8), rtol=0, atol=0)


@pytest.mark.slow  # about 10 s of tracing (AOT autograd over the walk's own forward and backward operators)
def test_compiled_chunk_form_traces_whole():
    """One graph (fullgraph) for the chunk form and for packed Segments: the walk over the chunks is one operator,
    so new lengths and new documents do not recompile; outputs and gradients are eager's."""
    q, k, v, beta, g, _ = [None if x is None else x.detach().float() for x in _inputs(B=1, T=37)]
    fn = torch.compile(chunk_delta_rule_attention, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    for i, b in enumerate([[0, 5, 6, 20, 37], [0, 30, 37]]):
        with torch._dynamo.config.patch(error_on_recompile=i >= 1):
            leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g)]
            out = fn(*leaves, block_len=8, cu_seqlens=Packing.from_bounds(b).segments([8]))
        eager = [x.clone().requires_grad_() for x in (q, k, v, beta, g)]
        want = chunk_delta_rule_attention(*eager, block_len=8, cu_seqlens=torch.tensor(b, dtype=torch.int32))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        for got, ref in zip(_grads(out, leaves), _grads(want, eager)):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def _bad(q, k, v, beta, g):
    return [
        (dict(beta=beta[:, :, :-1]), r"beta must have shape \(B, H, T\)"),
        (dict(beta=beta.long()), "beta must be a floating-point tensor"),
        (dict(log_decay=g[..., None]), r"log_decay must have shape \(B, H, T\)"),
        (dict(log_decay=-g), "log_decay must be finite and <= 0"),
        (dict(log_decay=g.masked_fill(torch.zeros_like(g, dtype=torch.bool).index_fill(2, torch.tensor([3]), True),
                                      float("nan"))), "log_decay must be finite and <= 0"),
        (dict(k=k[..., :-1]), "q and k must share the feature dim"),
        (dict(v=v[:, :, :-1]), "k and v must have the same length"),
        (dict(scale="big"), "scale must be a number"),
        (dict(block_len=0), "block_len must be a positive int"),
        (dict(impl="fast"), "impl must be one of"),
        (dict(impl="triton"), "impl='triton' runs flash-linear-attention's Triton kernels, which need CUDA"),
        (dict(state=torch.zeros(2, 2, 6, 8)), "state must be a DeltaRuleState or None"),
        (dict(state=DeltaRuleState(torch.zeros(2, 2, 8, 6), 0)), r"state.S must have shape \(B, H, Dv, Dk\)"),
        (dict(cu_seqlens=torch.tensor([0, 5, 9])), "cu_seqlens must be a 1-D int32"),
        (dict(cu_seqlens=torch.tensor([0, 5, 9], dtype=torch.int32)), "the batch must be 1"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_bad_input_names_the_argument(case):
    q, k, v, beta, g, _ = [None if x is None else x.detach() for x in _inputs(T=9)]
    change, match = _bad(q, k, v, beta, g)[case]
    args = dict(q=q, k=k, v=v, beta=beta, log_decay=g, **{})
    args.update({n: change[n] for n in change if n in args})
    kwargs = {n: x for n, x in change.items() if n not in args}
    with pytest.raises(ValueError, match=match):
        delta_rule_attention(args["q"], args["k"], args["v"], args["beta"], args["log_decay"], **kwargs)


def _fla_naive(relative: str):
    """A module of flash-linear-attention's package, loaded from its file alone: its naive references import torch
    and einops only, where ``import fla`` imports every kernel (seconds)."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / relative
    module_spec = importlib.util.spec_from_file_location(f"fla_reference_{path.parent.name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_matches_fla_naive_gated_delta_rule(form):
    """fla's naive_recurrent_gated_delta_rule: (B, T, H, ·) tensors, its state (Dk × Dv) the transpose of ours,
    ``scale`` multiplying q as ours does; float32 throughout."""
    naive = _fla_naive("ops/gated_delta_rule/naive.py").naive_recurrent_gated_delta_rule
    q, k, v, beta, g, S0 = (x.detach().float() for x in _inputs(T=21, state=True))
    out, state = FORMS[form](q, k, v, beta, g, scale=0.3, state=DeltaRuleState(S0, 0), block_len=8,
                             return_state=True)
    o, h = naive(*(x.transpose(1, 2) for x in (q, k, v, beta, g)), scale=0.3, initial_state=S0.transpose(-1, -2),
                 output_final_state=True)
    torch.testing.assert_close(out, o.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.S, h.transpose(-1, -2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_matches_fla_delta_rule_recurrence(form):
    """fla's delta_rule_recurrence (DeltaNet): (B, H, T, ·) tensors like ours, its scale fixed at Dk^−½ (our
    default), its state (Dk × Dv)."""
    recurrence = _fla_naive("ops/delta_rule/naive.py").delta_rule_recurrence
    q, k, v, beta, _, S0 = (None if x is None else x.detach().float() for x in _inputs(T=21, state=True))
    out, state = FORMS[form](q, k, v, beta, state=DeltaRuleState(S0, 0), block_len=8, return_state=True)
    o, h = recurrence(q, k, v, beta, initial_state=S0.transpose(-1, -2).clone())
    torch.testing.assert_close(out, o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.S, h.transpose(-1, -2), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decay", [False, True], ids=["deltanet", "gated"])
def test_fla_kernels_on_a_gpu_match_the_definition(dtype, decay):
    """impl="triton" (and "auto" on CUDA) against the float64 definition: a prefill from a state with gradients, then
    a decoding step without them (fla's fused recurrent kernel)."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    ref_in = [None if x is None else x.detach().cuda().requires_grad_()
              for x in _inputs(B=2, H=4, T=100, Dk=64, Dv=32, decay=decay, state=True)]
    ref, ref_state = _call(naive_delta_rule_attention, *ref_in, return_state=True)
    got_in = [None if x is None else x.detach().to(dtype if i < 3 else torch.float32).requires_grad_()
              for i, x in enumerate(ref_in)]
    out, state = _call(delta_rule_attention, *got_in, impl="triton", return_state=True)
    tol = 2e-3 if dtype == torch.float32 else 3e-2  # fla's float32 products may run in TF32 (10 mantissa bits)
    assert out.dtype == dtype and state.S.dtype == torch.float32
    assert _rel_rms(out, ref) < tol and _rel_rms(state.S, ref_state.S) < tol
    for g, r in zip(_grads(out, got_in), _grads(ref, ref_in)):
        assert _rel_rms(g, r) < 5 * tol
    step = [x.detach()[:, :, :1] for x in ref_in[:5] if x is not None]
    with torch.no_grad():
        want = naive_delta_rule_attention(*step[:4], step[4] if decay else None, state=ref_state)
        got = delta_rule_attention(*(x.to(dtype) if i < 3 else x.float() for i, x in enumerate(step[:4])),
                                   step[4].float() if decay else None, state=state)
    assert _rel_rms(got, want) < tol
