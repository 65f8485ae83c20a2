"""Hybrid stacks: a GPT whose layers differ (``GPTConfig.attention`` a list, ``attention_kwargs`` keyed by name). Each
capability of a uniform stack on a hybrid: construction and errors, decoding with each layer's own state (a KV cache
beside O(1) states), state_floats, packed documents (layers whose packing routes differ), bf16 autocast,
torch.compile and compile_step, carried state; the trainer's config, errors, training, resume and report (slow).
The Hugging Face export of a hybrid: tests/model/test_hf.py (its HYBRID cases) and the config.json test here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vqattn.layers import ATTENTIONS, KVCache
from vqattn.model import GPT, GPTConfig, stack_name
from vqattn.ops.varlen import Packing

from model_helpers import NAMES, SMALL_KWARGS, decode_in_chunks, layer_kwargs, scramble_short_conv

ROOT = Path(__file__).resolve().parents[2]
# Four packing routes: ovq's op by length classes, softmax's varlen SDPA, the kernel smoother one sequence at a time
# (a document mask under Segments), linear attention's op; window with a block length of its own (two layouts).
STACK = ["ovq", "softmax", "kernel_rbf", "linear", "window"]


def hybrid(attention, n_layer: int | None = None, pos_emb: str = "rope", kwargs: dict | None = None, seq_len: int = 64,
           **overrides) -> GPT:
    """A float64 model in eval mode (no dropout, no codebook updates) whose layers are ``attention`` (repeated over
    ``n_layer``), each attention with its small test kwargs (``kwargs``: {name: more kwargs})."""
    names = dict.fromkeys(attention)
    keyed = {name: {**layer_kwargs(name, rope=pos_emb == "rope"), **(kwargs or {}).get(name, {})} for name in names}
    config = GPTConfig(vocab_size=17, seq_len=seq_len, n_layer=n_layer or len(attention), n_head=2, n_embd=16,
                       attention=list(attention), attention_kwargs=keyed, pos_emb=pos_emb, **overrides)
    torch.manual_seed(0)
    return GPT(config).double().eval()


def test_each_layer_is_its_own_attention_with_its_own_kwargs():
    config = GPTConfig(n_layer=8, n_embd=16, n_head=2, attention=["ovq", "ovq", "ovq", "softmax"],
                       attention_kwargs={"ovq": {"num_slots": 8, "block_len": 4}})
    model = GPT(config)
    assert config.layer_attentions == ["ovq", "ovq", "ovq", "softmax"] * 2
    assert [type(b.attn) for b in model.blocks] == [ATTENTIONS[n] for n in config.layer_attentions]
    assert all(b.attn.num_slots == 8 and b.attn.block_len == 4 for b in model.blocks if hasattr(b.attn, "num_slots"))
    assert config.stack_name == "(ovq×3+softmax)×2"
    # attention=X stays the uniform stack (flat kwargs); a list of one name is the same model
    torch.manual_seed(0)
    uniform = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, attention="ovq", attention_kwargs={"num_slots": 8}))
    torch.manual_seed(0)
    listed = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, attention=("ovq",), attention_kwargs={"ovq": {"num_slots": 8}}))
    assert listed.config.attention == ["ovq"] and uniform.config.stack_name == listed.config.stack_name == "ovq"
    for (key, a), (_, b) in zip(uniform.state_dict().items(), listed.state_dict().items(), strict=True):
        assert torch.equal(a, b), key


def test_stack_names():
    assert stack_name(["ovq"] * 4) == "ovq"
    assert stack_name(["ovq", "ovq", "ovq", "softmax"]) == "ovq×3+softmax"
    assert stack_name(["ovq", "ovq", "ovq", "softmax"] * 2) == "(ovq×3+softmax)×2"
    assert stack_name(["ovq", "ovq", "ovq", "softmax"] * 2, ascii=True) == "ovqx3+softmax_x2"
    assert stack_name(["softmax", "ovq", "ovq", "softmax"]) == "softmax+ovq×2+softmax"


VALID = ", ".join(sorted(ATTENTIONS))
BAD = [
    (dict(attention=["ovq", "foo"]), f"attention lists an unknown attention 'foo' (entry 1); valid names are: {VALID}"),
    (dict(attention=["ovq"] * 3), "attention lists 3 attentions, which does not divide n_layer=4: list 1, 2 or 4"),
    (dict(attention=[]), "attention must be an attention name or a non-empty list of them"),
    (dict(attention=["ovq", "softmax"], attention_kwargs={"num_slots": 8}),
     "attention_kwargs of a stack of several attentions (ovq, softmax) must be keyed by attention name"),
    (dict(attention=["ovq", "softmax"], attention_kwargs={"window": {}}),
     "attention_kwargs has kwargs for 'window', but no layer is window"),
    (dict(attention=["ovq", "softmax"], attention_kwargs={"ovq": 8}), "attention_kwargs['ovq'] must be a dict"),
    (dict(attention=["ovq", "softmax"], attention_kwargs={"ovq": {"num_slots": 0}}),
     "attention_kwargs.ovq.num_slots must be a positive int, got 0"),  # the layer's own check, named by its key
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[message.split(":")[0][:40] for _, message in BAD])
def test_a_list_that_cannot_work_is_a_one_line_value_error(kwargs, message):
    with pytest.raises(ValueError) as err:
        GPT(GPTConfig(n_layer=4, n_embd=16, n_head=2, **kwargs))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", NAMES)
def test_every_attention_beside_softmax_decodes_and_packs_as_the_whole_sequence(name):
    """Any registered attention in a stack with a softmax layer: prefill then single steps, and a packed call, equal
    the forward pass over the whole sequence (each document alone)."""
    model = hybrid([name, "softmax"])
    idx = torch.randint(0, 17, (1, 13), generator=torch.Generator().manual_seed(0))
    steps, state = decode_in_chunks(model, idx, [6] + [1] * 7)
    torch.testing.assert_close(steps, model(idx).logits, rtol=0, atol=1e-10)
    assert isinstance(state.layers[1].inner, KVCache) and state.layers[1].inner.k.shape[2] == 13
    bounds = [0, 5, 6, 13]
    packed = model(idx, cu_seqlens=torch.tensor(bounds, dtype=torch.int32)).logits
    alone = torch.cat([model(idx[:, a:b]).logits for a, b in zip(bounds, bounds[1:])], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_decoding_keeps_each_layers_own_state(pos_emb):
    """Chunks of every size (with a short convolution) and greedy generate equal the whole forward pass; the softmax
    layer's KV cache grows with the tokens while the other layers' states keep their size."""
    model = scramble_short_conv(hybrid(STACK, pos_emb=pos_emb, short_conv=3))
    idx = torch.randint(0, 17, (2, 28), generator=torch.Generator().manual_seed(1))
    full = model(idx).logits
    chunks, short = decode_in_chunks(model, idx[:, :20], [3, 5, 1, 7, 4])
    torch.testing.assert_close(chunks, full[:, :20], rtol=0, atol=1e-10)
    _, long = decode_in_chunks(model, idx, [20] + [1] * 8)

    def held(layer_state):
        inner = layer_state.inner
        return sum(t.numel() for t in (inner._asdict() if hasattr(inner, "_asdict") else vars(inner)).values()
                   if isinstance(t, torch.Tensor))

    for name, a, b in zip(STACK, short.layers, long.layers):  # 20 and 28 tokens: whole blocks of 4 in the window
        assert held(b) == (held(a) * 28 // 20 if name in ("softmax", "kernel_rbf") else held(a)), name
    prompt = idx[:, :5]
    naive = prompt
    for _ in range(6):
        naive = torch.cat((naive, model(naive).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(model.generate(prompt, 6, temperature=0), naive)


def test_state_floats_are_summed_layer_by_layer():
    """total=True is the layers' sum, each counted as in a uniform stack of its attention; the default, one layer's
    in a uniform stack, is a hybrid's mean over its layers."""
    model = hybrid(["ovq", "ovq", "ovq", "softmax"], n_layer=8)
    ovq, softmax = (hybrid([name], n_layer=1).state_floats(40) for name in ("ovq", "softmax"))
    assert model.layer_state_floats(40) == [ovq, ovq, ovq, softmax] * 2
    assert model.state_floats(40, total=True) == 6 * ovq + 2 * softmax
    assert model.state_floats(40) == round((6 * ovq + 2 * softmax) / 8)
    uniform = hybrid(["ovq"], n_layer=2)
    assert uniform.state_floats(40) == ovq and uniform.state_floats(40, total=True) == 2 * ovq


BOUNDS = [0, 5, 6, 40, 71]  # shorter than a block, one token, crossing blocks of 8 and 16
BLOCKS = {"ovq": {"block_len": 16}, "window": {"block_len": 8}, "linear": {"block_len": 16}}


@pytest.mark.parametrize("given", ["tensor", "Packing", "Segments"])
def test_packed_documents_equal_each_document_alone_loss_and_gradients(given):
    model = hybrid(STACK, kwargs=BLOCKS, short_conv=3, seq_len=80)
    assert model.block_lens() == (8, 16)  # Segments carry a layout for each
    idx, targets = (torch.randint(0, 17, (1, 71), generator=torch.Generator().manual_seed(s)) for s in (2, 3))
    packing = Packing.from_bounds(BOUNDS)
    cu = {"tensor": torch.tensor(BOUNDS, dtype=torch.int32), "Packing": packing,
          "Segments": packing.segments(model.block_lens())}[given]
    out = model(idx, targets, cu_seqlens=cu)
    pieces = [model(idx[:, a:b], targets[:, a:b]) for a, b in zip(BOUNDS, BOUNDS[1:])]
    want = sum(p.loss * (b - a) for p, a, b in zip(pieces, BOUNDS, BOUNDS[1:])) / BOUNDS[-1]
    torch.testing.assert_close(out.logits, torch.cat([p.logits for p in pieces], 1), rtol=1e-10, atol=1e-12)
    params = [p for p in model.parameters() if p.requires_grad]
    for g, w in zip(torch.autograd.grad(out.loss, params, allow_unused=True),
                    torch.autograd.grad(want, params, allow_unused=True), strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_packed_states_are_one_per_document_and_continue_each():
    model = hybrid(STACK, kwargs=BLOCKS, seq_len=80)
    idx = torch.randint(0, 17, (1, 71), generator=torch.Generator().manual_seed(4))
    out = model(idx, cu_seqlens=torch.tensor(BOUNDS, dtype=torch.int32), return_state=True)
    assert [s.pos for s in out.state] == [b - a for a, b in zip(BOUNDS, BOUNDS[1:])]
    step = model(idx[:, :4], state=out.state, cu_seqlens=torch.arange(5, dtype=torch.int32))
    for i, (a, b) in enumerate(zip(BOUNDS, BOUNDS[1:])):
        alone = model(torch.cat([idx[:, a:b], idx[:, i:i + 1]], 1)).logits
        torch.testing.assert_close(step.logits[:, i], alone[:, -1], rtol=1e-10, atol=1e-12)


def test_bf16_autocast_training_step_matches_fp32():
    from test_mixed_precision import LOGIT_ATOL

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=64, seq_len=64, n_layer=4, n_head=2, n_embd=32, attention=STACK[:4],
                             attention_kwargs={n: layer_kwargs(n, rope=True) for n in STACK[:4]})).train()

    idx = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(1))
    reference, mixed = model(), model()
    expected = reference(idx, idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mixed(idx, idx)
    assert got.logits.dtype == torch.bfloat16 and got.loss.dtype == torch.float32 and torch.isfinite(got.loss)
    torch.testing.assert_close(got.logits.float(), expected.logits, rtol=0, atol=LOGIT_ATOL)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0.02, atol=0)
    (got.loss + got.aux_loss).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mixed.parameters() if p.requires_grad)
    assert all(buffer.dtype != torch.bfloat16 for buffer in mixed.buffers())


@pytest.mark.slow  # about 7 s on 2 idle cores: dynamo traces every layer's packed op twice
def test_compiled_training_step_traces_whole_and_matches_eager():
    """torch.compile of a hybrid's packed training step, given Segments (as the trainer hands them to a compiled
    model), traces it whole (fullgraph: no graph break; the eager backend, no inductor time) and compiles once: new
    documents reuse the graph; loss and gradients are those of the eager model."""
    stack = ["ovq", "softmax", "window"]  # kernel_rbf packs documents outside the graph, one at a time
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=64, n_layer=3, n_head=2, n_embd=16, attention=stack, short_conv=3,
                          attention_kwargs={n: {**SMALL_KWARGS[n], **BLOCKS.get(n, {})} for n in stack})).eval()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    params = list(model.parameters())
    idx = torch.randint(0, 32, (1, 60), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    for i, bounds in enumerate([[0, 60], [0, 7, 33, 60], [0, 1, 2, 59, 60]]):
        with torch._dynamo.config.patch(error_on_recompile=i >= 1):
            out = compiled(idx, idx, cu_seqlens=Packing.from_bounds(bounds).segments(model.block_lens()))
        eager = model(idx, idx, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
        torch.testing.assert_close(out.loss, eager.loss, rtol=1e-5, atol=1e-6)
        for g, w in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(eager.loss, params)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # about 5 s; the softmax cache's own layout: tests/model/test_compile.py, quickly
def test_compile_step_compiles_once_for_every_prompt_length():
    """compile_step on a hybrid: a KV cache that grows beside a raw window and a fixed memory; new prompt lengths
    reuse the graphs (a counting backend that runs them eagerly), without graph breaks, and generate samples what
    the eager model does."""
    from torch._dynamo.utils import counters

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    eager = GPT(GPTConfig(vocab_size=17, seq_len=64, n_layer=2, n_head=2, n_embd=16, attention=["ovq", "softmax"],
                          attention_kwargs={"ovq": layer_kwargs("ovq")})).eval()
    model = GPT(eager.config).eval()
    model.load_state_dict(eager.state_dict())
    model.compile_step(backend=counting)
    torch._dynamo.reset()
    counters.clear()
    prompts = [torch.randint(0, 17, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 2)]
    first = model.generate(prompts[0], 9, temperature=0)  # block_len 4: the steps fold blocks into ovq's state
    compiled = len(graphs)
    later = [model.generate(prompt, 3, temperature=0) for prompt in prompts[1:]]
    assert compiled > 0 and len(graphs) == compiled, "a new prompt length recompiled the step"
    assert not counters["graph_break"], list(counters["graph_break"])
    torch.testing.assert_close(first, eager.generate(prompts[0], 9, temperature=0))
    for prompt, got in zip(prompts[1:], later):
        torch.testing.assert_close(got, eager.generate(prompt, 3, temperature=0))


def test_carried_segments_keep_each_layers_memory_and_survive_a_checkpoint():
    """carry_state's carrier on a hybrid: the O(1) states carry the whole past and the softmax layer the newest
    segment (detached(max_cache=T)), so two segments are the whole sequence; the encoded state survives a weights-only
    checkpoint and continues exactly."""
    import io

    from vqattn.train.carry import CarriedState

    model = hybrid(["ovq", "softmax", "window"])
    x = torch.randint(0, 17, (2, 24), generator=torch.Generator().manual_seed(5))
    carry = CarriedState()
    logits = torch.cat([carry.forward(model, x[:, i:i + 8]).logits for i in (0, 8)], 1)
    torch.testing.assert_close(logits, model(x[:, :16]).logits, rtol=0, atol=1e-10)
    assert carry.state.layers[1].inner.k.shape[2] == 8 and carry.state.layers[0].pos == 16
    buffer = io.BytesIO()
    torch.save({"carry_state": carry.gathered(world_size=1)}, buffer)
    buffer.seek(0)
    resumed = CarriedState()
    resumed.load(torch.load(buffer, weights_only=True)["carry_state"], rank=0, world_size=1)
    torch.testing.assert_close(resumed.forward(model, x[:, 16:]).logits, carry.forward(model, x[:, 16:]).logits,
                               rtol=0, atol=0)


def test_the_hf_config_carries_the_layers_as_transformers_layer_types(tmp_path):
    """config.json holds one attention per layer (a pattern written out over the depth) and transformers'
    layer_types; the Auto classes load a model whose layers are those."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from vqattn.hf import VQAttnConfig, VQAttnForCausalLM

    config = VQAttnConfig(n_layer=4, n_embd=16, n_head=2, attention=["ovq", "window"],
                          attention_kwargs={"ovq": {"num_slots": 8}, "window": {"block_len": 16}})
    VQAttnForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attention"] == ["ovq", "window"] * 2
    assert saved["layer_types"] == ["linear_attention", "sliding_attention"] * 2
    assert AutoConfig.from_pretrained(tmp_path).gpt_config().layer_attentions == ["ovq", "window"] * 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [type(b.attn).__name__ for b in loaded.model.blocks] == ["OnlineVQAttention", "WindowAttention"] * 2
    assert loaded.model.blocks[0].attn.num_slots == 8 and loaded.model.blocks[1].attn.block_len == 16
    assert VQAttnConfig(n_layer=1, attention="softmax").layer_types == ["full_attention"]


# --- the trainer ---------------------------------------------------------------------------------------------------

CONF = str(ROOT / "vqattn" / "train" / "conf")
FAST = ["experiment=tiny", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def cfg_for(*overrides, hydra: bool = False):
    from hydra import compose, initialize_config_dir

    from vqattn.train.configs import register

    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)


def test_the_command_line_builds_a_hybrid_with_each_attentions_kwargs():
    from hydra.utils import instantiate

    cfg = cfg_for(*FAST, "model.attention=[ovq,softmax]", "layer_kwargs.ovq.num_slots=8", hydra=True)
    assert cfg.model.attention_kwargs.ovq.num_slots == 8 and cfg.model.attention_kwargs.ovq.block_len == 16
    assert set(cfg.model.attention_kwargs) == {"ovq", "softmax"}  # the listed attentions only
    assert cfg.hydra.run.dir.endswith("_ovq+softmax")
    model = instantiate(cfg.module, _convert_="all").model
    assert [type(b.attn).__name__ for b in model.blocks] == ["OnlineVQAttention", "SoftmaxAttention"]
    assert model.blocks[0].attn.num_slots == 8 and model.blocks[0].attn.block_len == 16  # experiment=tiny's block_len
    # experiment=hybrid: 3 ovq : 1 softmax, over the default 4 layers or 8
    for n_layer, name in ((4, "ovq×3+softmax"), (8, "(ovq×3+softmax)×2")):
        module = instantiate(cfg_for("experiment=hybrid", f"model.n_layer={n_layer}").module, _convert_="all")
        assert module.model.config.stack_name == name
    # attention=X stays the uniform stack, its kwargs attention.kwargs
    uniform = cfg_for("attention=ovq", "attention.kwargs.num_slots=8")
    assert uniform.model.attention == "ovq" and uniform.model.attention_kwargs == uniform.attention.kwargs


CLI_ERRORS = [
    (["model.attention=[ovq,foo]"], "model.attention lists an unknown attention 'foo' (entry 1); valid names are:"),
    (["model.attention=[ovq,ovq,softmax]"], "model.attention lists 3 attentions, which does not divide n_layer=2"),
    (["model.attention=[ovq,softmax]", "layer_kwargs.ovq.num_slots=0"],
     "layer_kwargs.ovq.num_slots must be a positive int, got 0"),
    (["experiment=hybrid", "model.n_layer=4", "attention=ovq", "attention.kwargs.num_slots=8"],
     "attention.kwargs.num_slots configures the uniform stack of attention=ovq; model.attention is a list, whose ovq "
     "layers take layer_kwargs.ovq.num_slots"),
]


@pytest.mark.parametrize("overrides,message", CLI_ERRORS, ids=[m.split(";")[0][:40] for _, m in CLI_ERRORS])
def test_the_trainer_reports_a_list_that_cannot_work_in_one_line(tmp_path, overrides, message):
    """What train.py prints after "error: " (exit status 2: tests/train/test_train.py runs that path end to end), and
    nothing written."""
    from vqattn.train import cli, lifecycle

    with pytest.raises(Exception) as info:
        cli.train(cfg_for(*FAST, *overrides), tmp_path / "run")
    line = lifecycle.user_error(info.value)
    assert line is not None and message in line and "\n" not in line, repr(info.value)
    assert not (tmp_path / "run").exists()


def test_the_trainers_checks_read_each_layer_of_a_hybrid():
    """The raw-window warning names the hybrid's layer whose window holds the whole sequence, and resuming with
    another stack is one line naming both in the command line's spelling."""
    from types import SimpleNamespace

    from vqattn.train.checks import check_resumable, raw_window_warning

    assert raw_window_warning(cfg_for(*FAST, "model.attention=[softmax,ovq]")) is None  # block_len 16, T = 64
    warning = raw_window_warning(cfg_for(*FAST, "model.attention=[softmax,ovq]", "block_len=32"))
    assert "block_len=32 with seq_len=64" in warning and "so ovq is plain softmax attention" in warning
    module = SimpleNamespace(model=hybrid(["ovq", "softmax"]), optimizer=None, state_dict=dict)
    checkpoint = {"hyper_parameters": {"model": {"attention": "vq_soft"}}, "state_dict": {}}
    with pytest.raises(ValueError, match=r"trained with attention=vq_soft, this run has "
                                         r"model.attention=\[ovq,softmax\]: resume with attention=vq_soft"):
        check_resumable(module, checkpoint, "x.ckpt")


def run_inprocess(tmp_path, name, *overrides):
    from vqattn.train import cli

    run_dir = tmp_path / name
    run_dir.mkdir(exist_ok=True)
    return cli.train(cfg_for(*FAST, *overrides), run_dir), run_dir


@pytest.mark.slow
def test_a_hybrid_trains_with_carried_state_and_resumes_exactly(tmp_path):
    """4 + 4 steps, the checkpoint holding each layer's carried state (a KV cache beside ovq's memory), equal 8
    straight; results.json names the stack and counts its state layer by layer."""
    common = ["model.attention=[ovq,softmax]", "carry_state=true", "optim.total_steps=8",
              "trainer.val_check_interval=4", "checkpoint_every=4"]
    first, a = run_inprocess(tmp_path, "a", *common, "trainer.max_steps=4")
    resumed, _ = run_inprocess(tmp_path, "a", *common, "trainer.max_steps=8", f"ckpt_path={a / 'checkpoints' / 'last.ckpt'}")
    straight, _ = run_inprocess(tmp_path, "c", *common, "trainer.max_steps=8")
    assert resumed["steps"] == straight["steps"] == 8 and straight["carry_state"]
    for key in ("val_loss", "val_loss_carried"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-7), key
    assert straight["val_loss"] != pytest.approx(first["val_loss"], rel=1e-4)  # the test can fail
    assert (straight["attention"], straight["layer_attentions"]) == ("ovq+softmax", ["ovq", "softmax"])
    from vqattn.checkpoint import load_model

    floats = load_model(tmp_path / "c" / "checkpoints" / "last.ckpt").layer_state_floats(64)
    assert floats[1] == 2 * 64 * 32  # the softmax layer's KV cache: 2·T·C at experiment=tiny's width
    assert straight["state_floats_total"] == sum(floats) and straight["state_floats"] == round(sum(floats) / 2)


@pytest.mark.slow
def test_a_multirun_over_stacks_reads_as_one_table(tmp_path):
    """The command line as a user types it (a list, and a sweep of lists): each job's run dir and results.json name
    its stack, and the report puts the stacks in one table with each one's state per layer and in all layers."""
    from vqattn.train import report

    cmd = [sys.executable, str(ROOT / "train.py"), "-m", *FAST, "model.attention=[ovq,softmax],[softmax]",
           "trainer.max_steps=2", "trainer.val_check_interval=2", f"hydra.sweep.dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {run: json.loads((tmp_path / run / "results.json").read_text()) for run in ("0_ovq+softmax", "1_softmax")}
    assert [r["attention"] for r in runs.values()] == ["ovq+softmax", "softmax"]
    for run in runs.values():  # per layer: a hybrid's mean over its two layers
        assert run["state_floats"] == round(run["state_floats_total"] / 2)
    assert report.main([str(tmp_path)]) == 0
    table = (tmp_path / "report.md").read_text().splitlines()
    assert "| state floats | all layers |" in table[0]
    rows = {line.split(" | ")[1]: line for line in table[2:4]}
    assert set(rows) == {"ovq+softmax", "softmax"}
    for run in runs.values():
        assert f"| {run['state_floats']:,} | {run['state_floats_total']:,} |" in rows[run["attention"]]
