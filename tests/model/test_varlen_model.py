"""Packed documents (``cu_seqlens``) through the layers and GPT: a packed call equals each document alone, outputs
and gradients of the input and every parameter, for every registered attention, with RoPE, learned positions and
the short convolution; states are one per document."""

from __future__ import annotations

import pytest
import torch

from vqattn.layers import ATTENTIONS, build_attention
from vqattn.model import GPT, GPTConfig
from vqattn.ops.varlen import Packing

F64 = torch.float64
BOUNDS = [0, 5, 6, 40, 71]  # shorter than a block, one token, crossing the blocks of 16
LAYER_KWARGS = {"vq_hard": dict(block_len=16, num_codes=8), "vq_soft": dict(block_len=16, num_codes=8),
                "window": dict(block_len=16), "ovq": dict(block_len=16, num_slots=4), "performer": dict(block_len=16),
                "gated_deltanet": dict(block_len=16, head_dim=16), "deltanet": dict(block_len=16, head_dim=16)}


def _layer(name, **kw):
    torch.manual_seed(0)
    layer = build_attention(name, dim=32, num_heads=2, **LAYER_KWARGS.get(name, {}), **kw).double()
    return layer.eval()  # no dropout, no codebook updates between the calls compared


def _grads(y, leaves):
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    grads = torch.autograd.grad((y * w).sum(), leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


def _segments(module, bounds=BOUNDS):
    """The Segments a compiled model takes, with a block layout for every block length of ``module``."""
    lens = {m.block_len or 64 for m in module.modules() if hasattr(m, "block_len") and hasattr(m, "num_heads")}
    return Packing.from_bounds(bounds).segments(sorted(lens) or [64])


@pytest.mark.parametrize("given", ["tensor", "Segments"])
@pytest.mark.parametrize("extra", [dict(rope=True), dict(short_conv=4, qk_norm=True)], ids=["rope", "conv"])
@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_layer_packed_equals_each_document(name, extra, given):
    layer = _layer(name, **extra)
    x = torch.randn(1, BOUNDS[-1], 32, dtype=F64, requires_grad=True)
    cu = torch.tensor(BOUNDS, dtype=torch.int32) if given == "tensor" else _segments(layer)
    leaves = [x, *(p for p in layer.parameters() if p.requires_grad)]
    got = layer(x, cu_seqlens=cu).output
    want = torch.cat([layer(x[:, a:b]).output for a, b in zip(BOUNDS, BOUNDS[1:])], 1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(_grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_layer_states_one_per_document(name):
    layer = _layer(name, rope=True)
    x = torch.randn(1, BOUNDS[-1], 32, dtype=F64)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    out, _, states = layer(x, cu_seqlens=cu, return_state=True)
    assert isinstance(states, list) and len(states) == len(BOUNDS) - 1
    nxt = torch.randn(1, 4, 32, dtype=F64)  # one more token for each document
    more = layer(nxt, states, cu_seqlens=torch.arange(5, dtype=torch.int32)).output
    for i, (a, b) in enumerate(zip(BOUNDS, BOUNDS[1:])):
        alone = layer(torch.cat([x[:, a:b], nxt[:, i:i + 1]], 1)).output
        torch.testing.assert_close(out[:, a:b], alone[:, :-1], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(more[:, i], alone[:, -1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("given", ["tensor", "Segments"])
@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
@pytest.mark.parametrize("name", ["softmax", "vq_hard", "vq_soft", "ovq", "performer"])
def test_gpt_packed_loss_and_gradients(name, pos_emb, given):
    torch.manual_seed(0)
    config = GPTConfig(attention=name, n_layer=2, n_embd=32, n_head=2, seq_len=BOUNDS[-1], pos_emb=pos_emb,
                       short_conv=3, attention_kwargs=LAYER_KWARGS.get(name, {}))
    model = GPT(config).double().eval()
    idx = torch.randint(0, 256, (1, BOUNDS[-1]), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 256, (1, BOUNDS[-1]), generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    out = model(idx, targets, cu_seqlens=cu if given == "tensor" else Packing.from_bounds(BOUNDS).segments(
        model.block_lens()))
    pieces = [model(idx[:, a:b], targets[:, a:b]) for a, b in zip(BOUNDS, BOUNDS[1:])]
    want = sum(p.loss * (b - a) for p, a, b in zip(pieces, BOUNDS, BOUNDS[1:])) / BOUNDS[-1]
    torch.testing.assert_close(out.loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.logits, torch.cat([p.logits for p in pieces], 1), rtol=1e-10, atol=1e-12)
    for g, w in zip(torch.autograd.grad(out.loss, params, allow_unused=True),
                    torch.autograd.grad(want, params, allow_unused=True)):
        if g is None or w is None:
            assert g is None and w is None or (g if w is None else w).abs().max() == 0
        else:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_gpt_states_one_per_document():
    torch.manual_seed(0)
    model = GPT(GPTConfig(attention="vq_soft", n_layer=2, n_embd=32, n_head=2, seq_len=128,
                          attention_kwargs=LAYER_KWARGS["vq_soft"])).double().eval()
    idx = torch.randint(0, 256, (1, BOUNDS[-1]))
    out = model(idx, cu_seqlens=torch.tensor(BOUNDS, dtype=torch.int32), return_state=True)
    assert [s.pos for s in out.state] == [b - a for a, b in zip(BOUNDS, BOUNDS[1:])]
    step = model(idx[:, :4], state=out.state, cu_seqlens=torch.arange(5, dtype=torch.int32))
    for i, (a, b) in enumerate(zip(BOUNDS, BOUNDS[1:])):
        alone = model(torch.cat([idx[:, a:b], idx[:, i:i + 1]], 1)).logits
        torch.testing.assert_close(step.logits[:, i], alone[:, -1], rtol=1e-10, atol=1e-12)


def test_bad_packed_input():
    model = GPT(GPTConfig(attention="window", n_layer=1, n_embd=32, n_head=2, seq_len=64))
    idx = torch.randint(0, 256, (2, 10))
    with pytest.raises(ValueError, match="cu_seqlens.*B = 2"):
        model(idx, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32"):
        model(idx[:1], cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match="end at T = 10"):
        model(idx[:1], cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="state must be a list of 2 GPTStates"):
        model(idx[:1], cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32), state=model(idx[:1, :3],
              return_state=True).state)
    layer = model.blocks[0].attn
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(2, 10, 32), cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    segments = Packing.from_bounds([0, 4, 10]).segments(model.block_lens())
    with pytest.raises(ValueError, match="Segments runs causal calls without states"):
        model(idx[:1], cu_seqlens=segments, return_state=True)
    with pytest.raises(ValueError, match="Segments of T = 10 tokens.*got 9"):
        model(idx[:1, :9], cu_seqlens=segments)
    with pytest.raises(ValueError, match="B = 2"):
        layer(torch.randn(2, 10, 32), cu_seqlens=segments)


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("packing", [False, True], ids=["tensor", "Packing"])
@pytest.mark.parametrize("name", ["vq_hard", "ovq", "softmax"])
def test_compiled_packed_calls_do_not_recompile_for_new_documents(name, packing):
    """The boundaries are read outside the compiled graph: after the first two calls (automatic dynamic shapes),
    new boundaries and numbers of documents compile nothing new, and the outputs equal eager's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(attention=name, n_layer=1, n_embd=32, n_head=2, seq_len=64, short_conv=3,
                          attention_kwargs=LAYER_KWARGS.get(name, {}))).eval()  # no codebook updates between calls
    compiled = torch.compile(model, backend="eager")
    idx = torch.randint(0, 256, (1, 60))
    torch._dynamo.reset()
    bounds = [[0, 60], [0, 20, 60], [0, 5, 6, 40, 60], [0, 33, 60], [0, 1, 2, 3, 60]]
    for i, b in enumerate(bounds):
        cu = torch.tensor(b, dtype=torch.int32)
        with torch._dynamo.config.patch(error_on_recompile=i >= 2):  # the trainer hands the model a Packing
            out = compiled(idx, idx, cu_seqlens=Packing.from_bounds(b) if packing else cu)
        torch.testing.assert_close(out.logits, model(idx, idx, cu_seqlens=cu).logits)


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("name", sorted(set(ATTENTIONS) - {"taylor"}))
def test_compiled_model_traces_segments_whole(name):
    """Given Segments, a compiled model traces the packed step whole (fullgraph: no graph break, so no per-class
    calls outside the graph) and compiles once: new documents, numbers of documents and of blocks reuse the graph.
    Its logits equal the eager model's with the tensor. (taylor's feature map does not trace whole unpacked
    either.)"""
    torch.manual_seed(0)
    model = GPT(GPTConfig(attention=name, n_layer=2, n_embd=32, n_head=2, seq_len=150, short_conv=3,
                          attention_kwargs=LAYER_KWARGS.get(name, {}))).eval()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    idx = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    for i, b in enumerate([[0, 150], [0, 20, 150], [0, 5, 6, 40, 150], [0, 1, 2, 3, 150], [0, 64, 128, 150]]):
        with torch._dynamo.config.patch(error_on_recompile=i >= 1):
            out = compiled(idx, idx, cu_seqlens=Packing.from_bounds(b).segments(model.block_lens()))
        want = model(idx, idx, cu_seqlens=torch.tensor(b, dtype=torch.int32))
        torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-5)


def _host_reads(model: GPT, idx, cu_seqlens, monkeypatch) -> int:
    """The tensor reads on the host of one packed training step (forward and backward), counted as on a GPU."""
    from vqattn.ops import utils as op_utils
    from vqattn.ops.common import segments

    reads = []
    monkeypatch.setattr(op_utils, "host_read_is_free", lambda x: False)
    monkeypatch.setattr(segments, "cache_walk_runs", lambda first: False)  # a GPU's segmented form
    for method in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            if not torch.compiler.is_compiling():
                reads.append(_method)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, method, counted)
    out = model(idx, idx, cu_seqlens=cu_seqlens)
    (out.loss + out.aux_loss).backward()
    monkeypatch.undo()
    return len(reads)


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_a_packed_step_reads_the_boundaries_once_whatever_the_depth(name, monkeypatch):
    """The model reads ``cu_seqlens`` once and hands a Packing to every layer: the host reads of a packed step
    (forward and backward) do not grow with the number of layers: one read of a tensor, none of a Packing or of
    Segments."""
    idx = torch.randint(0, 256, (1, 71), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    counts = {}
    for n_layer in (2, 4):
        torch.manual_seed(0)
        model = GPT(GPTConfig(attention=name, n_layer=n_layer, n_embd=32, n_head=2, seq_len=80, short_conv=3,
                              attention_kwargs=LAYER_KWARGS.get(name, {}))).train()
        counts[n_layer] = (_host_reads(model, idx, cu, monkeypatch),
                           _host_reads(model, idx, Packing.from_bounds(BOUNDS), monkeypatch),
                           _host_reads(model, idx, Packing.from_bounds(BOUNDS).segments(model.block_lens()),
                                       monkeypatch))
    assert counts[2] == counts[4] == (1, 0, 0), counts
