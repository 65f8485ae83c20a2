"""The model trains and decodes under torch.compile (inductor and aot_eager, CPU here) and matches eager: outputs,
losses, gradients and the codebook's in-place statistics."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from vqattn.layers import build_attention
from vqattn.model import GPT, GPTConfig
from vqattn.ops.varlen import Packing

from model_helpers import decode_in_chunks, layer_kwargs, scramble_short_conv

# The layers with module state updated in the step (codebook statistics, online memory); the window and performer ops
# compile in one graph and match eager in tests/ops/test_ops_compile.py and tests/layers/test_feature_maps.py.
COMPILED = ["vq_hard", "vq_soft", "ovq"]


def _model(name: str, short_conv: int = 0) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, seq_len=64, n_layer=1, n_head=2, n_embd=32, attention=name,
                       attention_kwargs=layer_kwargs(name, rope=True), pos_emb="rope", short_conv=short_conv)
    return scramble_short_conv(GPT(config).train())


def _train_step(model: GPT, idx: torch.Tensor, seed: int, cu_seqlens=None):
    torch.manual_seed(seed)  # the same codebook restart draws in both models
    out = model(idx, idx) if cu_seqlens is None else model(idx, idx, cu_seqlens=cu_seqlens)
    (out.loss + out.aux_loss).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out, grads


@pytest.mark.slow
# Inductor compiles the default attention (vq_soft) with a short convolution, on packed documents: the trainer's
# compiled step. The other layers with module state run on aot_eager: the same graph through dynamo and AOT autograd
# (their in-place codebook and memory updates functionalised) without inductor's code generation, which costs about
# a minute a layer on 2 cores.
@pytest.mark.parametrize("name,short_conv,backend,packed", [("vq_soft", 4, "inductor", True),
                                                             ("vq_hard", 0, "aot_eager", False),
                                                             ("ovq", 0, "aot_eager", False)])
def test_compiled_training_matches_eager(name, short_conv, backend, packed):
    """Two training steps, eager and compiled in lockstep: logits, losses, every gradient and the module state after
    them. Packed: the compiled model is given each batch's Segments (made once per batch, no host reads in the
    step), the eager one its cu_seqlens; the second batch's new documents compile nothing new."""
    # Inductor draws random numbers with its own generator; fallback_random makes the codebook's restart draws
    # (torch.randint) those of eager, so that the two trajectories can be compared step by step.
    with torch._inductor.config.patch(fallback_random=True):
        _compare(name, short_conv, backend, packed)


# documents shorter than a block (4), of one token, and crossing blocks; 45 is not a multiple of block_len
PACKED_BATCHES = [[0, 7, 45], [0, 1, 30, 44, 45]]


def _compare(name: str, short_conv: int, backend: str, packed: bool) -> None:
    eager = _model(name, short_conv)
    compiled = copy.deepcopy(eager)
    compiled.compile(backend=backend, fullgraph=packed)  # in place: parameter names (and checkpoints) stay eager's
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(1)
    for step in range(2):  # step 1 runs on codes initialised from step 0's keys: both must match
        if packed:
            bounds = PACKED_BATCHES[step]
            idx = torch.randint(0, 32, (1, bounds[-1]), generator=generator)
            segments = Packing.from_bounds(bounds).segments(eager.block_lens())
            cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
        else:
            idx = torch.randint(0, 32, (2, 21), generator=generator)  # 21: not a multiple of block_len
            segments = cu_seqlens = None
        expected, expected_grads = _train_step(eager, idx, step, cu_seqlens)
        with torch._dynamo.config.patch(error_on_recompile=packed and step >= 1):
            got, grads = _train_step(compiled, idx, step, segments)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == expected_grads.keys()
        for key in grads:
            torch.testing.assert_close(grads[key], expected_grads[key], rtol=1e-3, atol=1e-5, msg=key)
    for (key, b_eager), (_, b_compiled) in zip(eager.named_buffers(), compiled.named_buffers()):
        torch.testing.assert_close(b_compiled, b_eager, rtol=1e-4, atol=1e-5, msg=key)


def test_the_trainer_flag_compiles_the_model_in_place():
    from vqattn.train.lit import LitLM

    model = {"vocab_size": 32, "seq_len": 16, "n_layer": 1, "n_head": 2, "n_embd": 16, "attention": "vq_hard"}
    eager, compiled = LitLM(model), LitLM(model, compile=True)
    assert compiled.model._compiled_call_impl is not None and eager.model._compiled_call_impl is None
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints interchangeable


@pytest.mark.slow
# About ten graphs a name (40 s on aot_eager; inductor's code generation for them took two and a half minutes
# on 2 cores, so inductor compiles the training step alone, above). vq_soft decodes through vq_hard's recurrent and
# block forms (its assignment holds weights instead of an index, which its compiled training covers). The window
# op's decoding forms are checked eagerly in tests/ops/test_window_attention.py, and its block form compiles in one
# graph in tests/ops/test_ops_compile.py; compiled window decoding is not checked here.
@pytest.mark.parametrize("name", ["vq_hard"])
def test_compiled_decoding_matches_eager(name):
    """A compiled model decodes prompts of several lengths, in chunks of every size (the recurrent form, folding a
    block into the cache, the block algorithm re-running a state's window) and by ``generate``, as eager does.
    New lengths make dynamo recompile with symbolic sizes. Falling back to eager at the recompile limit would hide a
    failure, so hitting it fails. Decoding runs without gradients, as ``generate`` does, so the chunks and
    ``generate`` share compiled graphs. (On aot_eager: dynamo's graphs and symbolic sizes, AOT autograd's
    functionalisation, not inductor's code.)"""
    eager = _model(name).eval()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="aot_eager")
    generator = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 32, (1, 30), generator=generator)
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True), torch.no_grad():
        sizes = [5, 1, 1, 9]  # prefill, token steps (recurrent, a block folded), a chunk that continues a state
        expected, _ = decode_in_chunks(eager, idx[:, : sum(sizes)], sizes)
        got, _ = decode_in_chunks(compiled, idx[:, : sum(sizes)], sizes)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        # then another prompt length: the prefill and the steps run the graphs compiled with symbolic sizes
        expected = eager.generate(idx[:, :6], 4, temperature=0)
        torch.testing.assert_close(compiled.generate(idx[:, :6], 4, temperature=0), expected)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif dataclasses.is_dataclass(x):
        for field in dataclasses.fields(x):
            yield from _tensors(getattr(x, field.name))
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from _tensors(item)


@pytest.mark.parametrize("name", ["vq_hard", "vq_soft", "window", "ovq", "softmax"])
def test_decoding_states_hold_tensors_of_their_own(name):
    """A state's raw window is not a view: a view's strides depend on the chunk it came from, and a compiled decoding
    step recompiles for every new layout."""
    torch.manual_seed(0)
    layer = build_attention(name, dim=16, num_heads=2, rope=True, **layer_kwargs(name, rope=True)).eval()
    state = None
    for size in (10, 1, 3, 6):  # the block form, then the recurrent form, each folding blocks (block_len 4)
        _, _, state = layer(torch.randn(1, size, 16), state, return_state=True)
        tensors = list(_tensors(state.inner))
        assert tensors and all(t.is_contiguous() for t in tensors), [t.stride() for t in tensors]


def _counted_step_model(name: str, **kwargs) -> tuple[GPT, GPT, list]:
    """A small eager model, its copy with ``compile_step`` on a backend that records each graph it is handed and runs
    it eagerly (no inductor time), and that record. ``kwargs`` go to the attention."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=17, seq_len=64, n_layer=1, n_head=2, n_embd=16, attention=name,
                       attention_kwargs={**layer_kwargs(name, rope=True), **kwargs})
    eager = GPT(config).eval()
    model = copy.deepcopy(eager).compile_step(backend=counting)
    torch._dynamo.reset()
    return eager, model, graphs


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("name", ["softmax", "ovq"])  # a KV cache that grows; a raw window and float settings
def test_compile_step_compiles_once_for_every_prompt_length(name):
    """``compile_step`` compiles the one-token step with dynamic shapes: after the first prompt, new prompt lengths
    and positions reuse its graphs (a counting backend that runs them eagerly: no inductor time), without graph
    breaks, and ``generate`` samples what the eager model does."""
    from torch._dynamo.utils import counters

    eager, model, graphs = _counted_step_model(name)
    counters.clear()
    prompts = [torch.randint(0, 17, (1, length), generator=torch.Generator().manual_seed(length)) for length in (5, 11, 2)]
    first = model.generate(prompts[0], 9, temperature=0)  # block_len 4: the steps fold blocks into the state
    compiled = len(graphs)
    later = [model.generate(prompt, 3, temperature=0) for prompt in prompts[1:]]
    assert compiled > 0 and len(graphs) == compiled, "a new prompt length recompiled the step"
    assert not counters["graph_break"], list(counters["graph_break"])
    torch.testing.assert_close(first, eager.generate(prompts[0], 9, temperature=0))
    for prompt, got in zip(prompts[1:], later):
        torch.testing.assert_close(got, eager.generate(prompt, 3, temperature=0))


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("name,kwargs", [("ovq", {}), ("vq_hard", {}), ("ovq", dict(memory_decay=0.97))])
def test_compiled_decoding_past_the_memory_cap_keeps_its_graphs(name, kwargs):
    """Past ``memory_cap`` the memory's weight M / n changes with every block (n its total count with
    ``memory_decay``); it is a tensor of the graph, not a float that dynamo would specialise (one recompile per
    decoded block, then eager at the recompile limit)."""
    eager, model, graphs = _counted_step_model(name, memory_cap=8, **kwargs)
    prompt = torch.randint(0, 17, (1, 5), generator=torch.Generator().manual_seed(5))
    model.generate(prompt, 9, temperature=0)  # block_len 4: to position 13, whose memory holds 8 keys: no cap yet
    compiled = len(graphs)
    past = model.generate(prompt, 24, temperature=0)  # to position 28: 5 more blocks, each past the cap
    assert len(graphs) == compiled, "decoding past the cap recompiled the step"
    torch.testing.assert_close(past, eager.generate(prompt, 24, temperature=0))


@pytest.mark.slow  # inductor compiles the step's graphs: about a minute a case
@pytest.mark.parametrize("name", ["vq_hard", "vq_soft"])
def test_inductor_compiled_decoding_equals_eager(name):
    """``compile_step()`` with its default backend (inductor, as users decode; the other compile tests use
    recording backends): the one-token steps fold blocks into the value sums (the code statistics' scatters), and a
    compiled step's logits equal the eager model's, as do the greedy tokens of ``generate``."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=17, seq_len=64, n_layer=1, n_head=2, n_embd=16, attention=name,
                       attention_kwargs=layer_kwargs(name, rope=True))
    eager = GPT(config).eval()
    model = copy.deepcopy(eager).compile_step()
    torch._dynamo.reset()
    prompt = torch.randint(0, 17, (1, 5), generator=torch.Generator().manual_seed(5))
    got = model.generate(prompt, 14, temperature=0)  # block_len 4: to position 19, folding 3 blocks
    torch.testing.assert_close(got, eager.generate(prompt, 14, temperature=0))
    with torch.no_grad():
        _, state = model.forward_step(got[:, :-1])
        _, want_state = eager.forward_step(got[:, :-1])
        logits, _ = model.forward_step(got[:, -1:], state)  # a compiled step
        want, _ = eager.forward_step(got[:, -1:], want_state)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5)
