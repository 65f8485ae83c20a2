"""vqattn.hf: transformers' config/model/tokenizer classes around GPT, generate with the recurrent state as the
cache, save/load through safetensors, vqattn-export and the shipped lm-evaluation-harness tasks."""

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, GPT2Config  # noqa: E402

from vqattn.feature_maps import set_feature_step  # noqa: E402
from vqattn.hf import VQAttnByteTokenizer, VQAttnConfig, VQAttnForCausalLM  # noqa: E402
from vqattn.model import GPT  # noqa: E402

from model_helpers import NAMES, SMALL_KWARGS  # noqa: E402

VOCAB = 256
HYBRID = ["ovq", "softmax"]  # a hybrid stack: an O(1) state beside a KV cache (tests/model/test_hybrid.py)
NAMES_AND_HYBRID = [*NAMES, HYBRID]
IDS = [name if isinstance(name, str) else "+".join(name) for name in NAMES_AND_HYBRID]


def hf_model(name: str | list[str], pos_emb: str = "rope", seq_len: int = 32) -> VQAttnForCausalLM:
    """A tiny model whose buffers left their initial values (codebook EMA, Performer draw 2), in eval mode; ``name``
    a list: a hybrid stack of those layers, its kwargs keyed by name."""
    def layer_kwargs(name):
        return dict(SMALL_KWARGS[name], **({"exact_window": True} if pos_emb == "rope" and name.startswith("vq") else {}))

    kwargs = layer_kwargs(name) if isinstance(name, str) else {n: layer_kwargs(n) for n in dict.fromkeys(name)}
    config = VQAttnConfig(vocab_size=VOCAB, seq_len=seq_len, n_layer=2, n_head=2, n_embd=16, attention=name,
                          attention_kwargs=kwargs, pos_emb=pos_emb)
    torch.manual_seed(0)
    model = VQAttnForCausalLM(config)
    set_feature_step(model.model, 2500)
    model.train()(torch.randint(0, VOCAB, (2, 12)))  # codebook updates
    return model.eval()


def tensors(module: torch.nn.Module) -> dict:
    """Every parameter and buffer, non-persistent ones included."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def reloaded_gpt(model: VQAttnForCausalLM) -> GPT:
    """A fresh GPT given the model's state dict: what torch's own round trip yields (non-persistent buffers, such
    as the last batch's usage statistics, are rebuilt, not saved)."""
    gpt = GPT(model.config.gpt_config())
    gpt.load_state_dict(model.model.state_dict())
    return gpt


@pytest.mark.parametrize("name", NAMES_AND_HYBRID, ids=IDS)
def test_save_and_auto_load_keep_every_tensor_and_the_logits(name, tmp_path):
    model = hf_model(name)
    idx = torch.randint(0, VOCAB, (2, 9))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is VQAttnForCausalLM and not loaded.training
    assert loaded.model.head.weight is loaded.model.tok_emb.weight
    before, after = tensors(reloaded_gpt(model)), tensors(loaded.model)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert torch.equal(loaded(idx).logits, model(idx).logits)


@pytest.mark.parametrize("name", NAMES_AND_HYBRID, ids=IDS)
def test_greedy_generate_equals_gpt_generate_and_full_forwards(name):
    model = hf_model(name)
    prompt = torch.randint(0, VOCAB, (2, 5))
    new = 6
    cached = model.generate(prompt, max_new_tokens=new, do_sample=False)
    uncached = model.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=False)
    assert torch.equal(cached, model.model.generate(prompt, new, temperature=0))
    assert torch.equal(uncached, cached)
    full = prompt
    for _ in range(new):
        full = torch.cat([full, model(full).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(full, cached)


def test_cache_continues_a_sequence_and_counts_its_tokens():
    model = hf_model("vq_soft")
    idx = torch.randint(0, VOCAB, (2, 11))
    first = model(idx[:, :7], use_cache=True)
    second = model(idx[:, 7:], cache=first.cache)
    assert second.cache.get_seq_length() == 11
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), model(idx).logits, rtol=1e-5, atol=1e-5)


def test_tokenizer_is_the_byte_vocabulary_and_auto_loads(tmp_path):
    text = "def f(x):\n    return 'é'\n"
    tokenizer = VQAttnByteTokenizer()
    ids = tokenizer(text).input_ids
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text and tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (0, 0, VOCAB)
    tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "VQAttnByteTokenizer"
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is VQAttnByteTokenizer and loaded(text).input_ids == ids


def test_auto_classes_know_the_config(tmp_path):
    VQAttnConfig(n_layer=1, n_embd=16, n_head=2, attention="softmax").save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is VQAttnConfig
    assert type(AutoModel.from_config(AutoConfig.from_pretrained(tmp_path))) is VQAttnForCausalLM
    config = AutoConfig.from_pretrained(tmp_path)
    assert (config.tie_embeddings, config.max_position_embeddings) == (True, 256)


def test_bad_configs_and_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown attention 'foo'"):
        VQAttnConfig(attention="foo")
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2', not 'vqattn'"):
        VQAttnForCausalLM.from_pretrained(tmp_path)
    learned = hf_model("softmax", pos_emb="learned", seq_len=16)
    with pytest.raises(ValueError, match="seq_len=16") as err:
        learned.generate(torch.zeros(1, 17, dtype=torch.long), max_new_tokens=1, do_sample=False)
    assert "\n" not in str(err.value)
    prompts = torch.ones(2, 4, dtype=torch.long)
    holes = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])  # padded batches work (tests/model/test_hf_padding.py)
    with pytest.raises(ValueError, match="attention_mask row 0 has a pad between real tokens") as err:
        learned.generate(prompts, attention_mask=holes, max_new_tokens=1, do_sample=False)
    assert "\n" not in str(err.value)


def write_trainer_checkpoint(path, model: VQAttnForCausalLM) -> None:
    """A checkpoint as LitLM saves one: the GPT under "model.", its GPTConfig in hyper_parameters["model"]."""
    gpt = model.model
    torch.save({"global_step": 3, "hyper_parameters": {"model": dataclasses.asdict(gpt.config)},
                "state_dict": {f"model.{key}": value for key, value in gpt.state_dict().items()}}, path)


@pytest.mark.parametrize("name", ["performer", "vq_hard", HYBRID], ids=["performer", "vq_hard", "hybrid"])
def test_export_writes_a_directory_the_auto_classes_load(name, tmp_path):
    pytest.importorskip("lightning")
    from vqattn.hf.export import main

    model = hf_model(name)
    write_trainer_checkpoint(tmp_path / "last.ckpt", model)
    assert main([str(tmp_path / "last.ckpt"), str(tmp_path / "out")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(AutoTokenizer.from_pretrained(tmp_path / "out")) is VQAttnByteTokenizer
    idx = torch.randint(0, VOCAB, (1, 10))
    assert torch.equal(loaded(idx).logits, model(idx).logits)


def test_export_refuses_a_file_that_is_not_a_vqattn_checkpoint(tmp_path, capsys):
    pytest.importorskip("lightning")
    from vqattn.hf.export import main

    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    torch.save({"global_step": 0, "state_dict": {"w": torch.zeros(1)}}, tmp_path / "other.ckpt")
    for name in ("text.ckpt", "other.ckpt"):
        assert main([str(tmp_path / name), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vqattn-export: error:") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_lm_eval_heldout_bits_per_byte_equal_the_trainers_validation(tmp_path):
    """The shipped tasks end to end in lm-eval, in this process: one held-out document's bits per byte equals the
    trainer's validation metric over NUL + that document (the same windows of seq_len), and the recall task runs. The
    model is a hybrid stack (the default attention, vq_soft, beside a softmax layer): lm-eval runs it as any other."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("lightning")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from vqattn.hf.eval import TASKS_DIR
    from vqattn.hf.tasks.data import heldout
    from vqattn.train.data import _WindowSet
    from vqattn.train.lit import SummedNLL

    model = hf_model(["vq_soft", "softmax"], seq_len=64)
    model.save_pretrained(tmp_path)
    VQAttnByteTokenizer().save_pretrained(tmp_path)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # lm-eval's own tasks: seconds to index
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path}", device="cpu", limit=1,
                                      tasks=["vqattn_heldout", "vqattn_kv_recall"], task_manager=manager)["results"]
    assert 0 <= results["vqattn_kv_recall"]["acc,none"] <= 1

    doc = heldout()["test"][0]["text"].encode()
    data = torch.tensor([0, *doc], dtype=torch.uint8)
    windows = _WindowSet(data, torch.arange(0, len(doc), 64), 64)
    metric = SummedNLL()
    with torch.no_grad():
        for x, y in windows:
            metric.update(model.model(x[None]).logits, y[None])
    trainer_bpb = float(metric.compute()["bpb"])
    assert results["vqattn_heldout"]["bits_per_byte,none"] == pytest.approx(trainer_bpb, rel=1e-5)


def test_vqattn_eval_adds_our_tasks_and_the_causal_backend_unless_given():
    pytest.importorskip("lm_eval")
    from vqattn.hf.eval import TASKS_DIR, lm_eval_argv

    tasks = ["--include_path", str(TASKS_DIR)]
    assert lm_eval_argv(["--model", "hf", "--model_args", "pretrained=m", "--tasks", "t"]) == [
        "--model", "hf", "--model_args", "pretrained=m,backend=causal", "--tasks", "t", *tasks]
    assert lm_eval_argv(["--model=hf", "--model_args=pretrained=m"]) == [
        "--model=hf", "--model_args=pretrained=m,backend=causal", *tasks]
    kept = [["--model", "hf", "--model_args", "pretrained=m,backend=seq2seq"],  # the user's backend
            ["--model", "vllm", "--model_args", "pretrained=m"],  # another model type
            ["--model", "hf", "--model_args", '{"pretrained": "m"}']]  # JSON
    for argv in kept:
        assert lm_eval_argv(argv) == [*argv, *tasks]
    assert lm_eval_argv(["--include_path=x"]) == ["--include_path=x"]


@pytest.mark.slow
def test_our_lm_eval_tasks_load_without_warnings(caplog):
    """Every metric of the shipped tasks names its aggregation and direction (lm-eval warned about each default it
    filled in), and vqattn-eval drops lm-eval's note that their dataset functions could take --metadata."""
    pytest.importorskip("lm_eval")
    import logging

    from lm_eval.tasks import TaskManager

    from vqattn.hf.eval import TASKS_DIR, _not_about_our_functions

    task_log = logging.getLogger("lm_eval.api.task")
    task_log.addFilter(_not_about_our_functions)  # as vqattn-eval's main installs it
    try:
        with caplog.at_level("WARNING"):
            # lm-eval's own tasks left out: seconds to index, and none of them is ours
            manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
            tasks = manager.load(["vqattn_heldout", "vqattn_kv_recall"])["tasks"]
    finally:
        task_log.removeFilter(_not_about_our_functions)
    assert set(tasks) == {"vqattn_heldout", "vqattn_kv_recall"}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert tasks["vqattn_heldout"].higher_is_better() == {"word_perplexity": False, "byte_perplexity": False,
                                                          "bits_per_byte": False}
