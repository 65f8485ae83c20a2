"""Subword tokenizers and token files: a BPE trained here on a corpus made here, bits per byte by hand, the token
file's reuse, rebuilds and corruption, and the run's tokenizer through sampling and the export."""

import json
import math
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_train import FAST, cfg_for, run_inprocess

from vqattn.checkpoint import load_model, read_tokenizer
from vqattn.model import IGNORE_INDEX
from vqattn.tokenizer import load_tokenizer, padded_vocab, train_bpe
from vqattn.train import tokens
from vqattn.train.lit import LN2, SummedNLL

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "naïve", "café", "данные", "über"]


def write_corpus(path, lines=2500, seed=0):
    rng = random.Random(seed)
    path.write_text("".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "\n"
                            for _ in range(lines)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(corpus file, BPE tokenizer directory) made for this module."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = write_corpus(root / "corpus.txt")
    return corpus, train_bpe([str(corpus)], 300, root / "tok")


def test_a_trained_bpe_encodes_losslessly_and_counts_the_bytes_of_each_token(bpe):
    corpus, directory = bpe
    tokenizer = load_tokenizer(str(directory))
    assert load_tokenizer(str(directory / "tokenizer.json")).fingerprint == tokenizer.fingerprint
    text = corpus.read_bytes()
    ids = tokenizer.encode(text)
    assert 256 < tokenizer.vocab_size <= 300 and len(ids) < len(text) / 2  # merges learned
    assert tokenizer.decode(ids).encode() == text
    assert tokenizer.token_bytes()[ids].sum() == len(text)  # every byte counted once
    assert padded_vocab(tokenizer.vocab_size) == 320 and padded_vocab(256) == 256 and padded_vocab(50257) == 50304


@pytest.mark.parametrize("spec,message", [
    ("nope/tokenizer.json", "data.tokenizer='.*nope/tokenizer.json' does not exist"),
    ("corpus.txt", "data.tokenizer='.*corpus.txt' holds no tokenizer"),
])
def test_a_bad_tokenizer_is_a_one_line_error_naming_the_key(bpe, monkeypatch, spec, message):
    monkeypatch.chdir(bpe[0].parent)
    with pytest.raises(ValueError, match=message) as info:
        load_tokenizer(spec)
    assert "\n" not in str(info.value)


def test_the_model_vocabulary_follows_the_tokenizer_and_a_disagreeing_one_is_an_error(bpe, tmp_path):
    from vqattn.train.checks import check_config

    assert cfg_for().model.vocab_size == 256
    assert cfg_for("data=text", "data.path=x", f"data.tokenizer={bpe[1]}").model.vocab_size == 320
    assert cfg_for("data=mqar").model.vocab_size == 256
    with pytest.raises(ValueError, match=r"^model.vocab_size=50257 does not fit data.tokenizer=bytes \(256 tokens, "
                                         r"padded to 256\): leave model.vocab_size unset"):
        check_config(cfg_for("model.vocab_size=50257"))


def test_bits_per_byte_divide_the_summed_nll_by_the_bytes_of_the_targets():
    token_bytes = torch.tensor([1, 3, 2, 5])
    logits = torch.randn(2, 3, 4)
    targets = torch.tensor([[0, 1, 2], [3, 3, IGNORE_INDEX]])
    metric = SummedNLL(position_edges=[0, 2])
    metric.token_bytes = token_bytes
    metric.update(logits, targets)
    out = metric.compute()
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    n_bytes = 1 + 3 + 2 + 5 + 5
    assert float(out["bpb"]) == pytest.approx(float(nll) / (LN2 * n_bytes), rel=1e-6)
    assert float(out["loss"]) == pytest.approx(float(nll) / 5, rel=1e-6)  # per token
    assert float(out["bytes_per_token"]) == pytest.approx(n_bytes / 5)
    first = F.cross_entropy(logits[:, :2].flatten(0, 1), targets[:, :2].flatten(), reduction="sum")
    assert out["by_position"]["0_1"]["bpb"] == pytest.approx(float(first) / (LN2 * (1 + 3 + 5 + 5)), rel=1e-6)


def token_text(tokenizer, i: int) -> bytes:
    """The bytes token ``i`` stands for: itself for bytes, else its characters read through byte-level BPE's
    byte-to-character table (GPT-2's)."""
    if tokenizer.spec == "bytes":
        return bytes([i])
    # GPT-2's table: printable bytes are their own character, the others 256, 257, ... in order
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}
    return bytes(byte_of[c] for c in tokenizer.tokenizer.id_to_token(i))


def by_hand_bpb(run_dir, datamodule) -> float:
    """The summed NLL of the run's validation windows over ln 2 x the bytes their targets stand for."""
    model = load_model(run_dir / "checkpoints" / "last.ckpt")
    tokenizer = read_tokenizer(run_dir / "checkpoints" / "last.ckpt")
    nll, n_bytes = 0.0, 0
    with torch.no_grad():
        for x, y in datamodule.val_set:
            nll += float(F.cross_entropy(model(x[None]).logits[0].double(), y, reduction="sum"))
            n_bytes += sum(len(token_text(tokenizer, i)) for i in y.tolist())
    return nll / (LN2 * n_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_val_bpb_is_the_bits_per_byte_of_the_validation_text(bpe, tmp_path, tokenizer):
    from hydra.utils import instantiate

    corpus, directory = bpe
    spec = "bytes" if tokenizer == "bytes" else str(directory)
    overrides = ["attention=softmax", "data=text", f"data.path={corpus}", f"data.tokenizer={spec}",
                 f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=8", "trainer.limit_val_batches=null"]
    results, run_dir = run_inprocess(tmp_path, "run", *overrides)
    datamodule = instantiate(cfg_for(*FAST, *overrides).data)
    datamodule.setup()
    assert results["val_bpb"] == pytest.approx(by_hand_bpb(run_dir, datamodule), rel=1e-4)
    assert results["tokenizer"] == spec and results["val_loss"] == pytest.approx(
        results["val_bpb"] * LN2 * results["val_window_bytes_per_token"], rel=1e-6)  # per token
    expected = 1.0 if tokenizer == "bytes" else corpus.stat().st_size / len(load_tokenizer(spec).encode(corpus.read_bytes()))
    assert results["val_bytes_per_token"] == pytest.approx(expected, rel=0.05)
    if tokenizer == "bpe":
        assert results["val_bytes_per_token"] > 2 and load_model(run_dir / "checkpoints" / "last.ckpt").config.vocab_size == 320


def test_the_token_file_is_reused_rebuilt_when_a_file_or_the_tokenizer_changes(bpe, tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "a.txt", lines=300)
    builds = []
    build = tokens._build
    monkeypatch.setattr(tokens, "_build", lambda *a, **k: builds.append(1) or build(*a, **k))

    def prepare(spec):
        units = [tokens.Slice(str(corpus), 0, corpus.stat().st_size)]
        return tokens.prepare("text", {"train": units}, load_tokenizer(spec), None, str(tmp_path / "cache"))["train"]

    first = prepare(str(bpe[1]))
    assert len(builds) == 1 and first.tokens.dtype == torch.uint16 and first.n_bytes == corpus.stat().st_size
    assert torch.equal(prepare(str(bpe[1])).tokens, first.tokens) and len(builds) == 1  # reused
    assert prepare("bytes").tokens.dtype == torch.uint8 and len(builds) == 2  # another tokenizer: its own file
    with corpus.open("a") as f:
        f.write("the end\n")
    assert len(prepare(str(bpe[1])).tokens) > len(first.tokens) and len(builds) == 3  # a changed file: rebuilt
    retrained = train_bpe([str(corpus)], 280, tmp_path / "tok")
    before = prepare(str(retrained))
    train_bpe([str(corpus)], 290, retrained)  # the same path, another tokenizer in it
    after = prepare(str(retrained))
    assert len(builds) == 5 and not torch.equal(before.tokens[:len(after.tokens)], after.tokens[:len(before.tokens)])


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_truncated_or_corrupt_token_file_is_a_one_line_error_naming_it(tmp_path, damage):
    corpus = write_corpus(tmp_path / "a.txt", lines=100)
    units = {"train": [tokens.Slice(str(corpus), 0, corpus.stat().st_size)]}
    split = tokens.prepare("text", units, load_tokenizer("bytes"), None, str(tmp_path / "cache"))["train"]
    data = bytearray(split.path.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    else:
        data[len(data) // 2] ^= 0xFF
    del split
    split_path = next((tmp_path / "cache").glob("*/train.tokens"))
    split_path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as info:
        tokens.prepare("text", units, load_tokenizer("bytes"), None, str(tmp_path / "cache"))
    line = str(info.value)
    assert "\n" not in line and f"token file {split_path} is" in line and "delete" in line


def test_tokenizing_in_parallel_equals_one_process(bpe, tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "CHUNK", 2048)  # many chunks, cut at line breaks
    corpus = write_corpus(tmp_path / "a.txt", lines=1500)
    units = {"train": [tokens.Slice(str(corpus), 0, corpus.stat().st_size), b"a row of text\n"]}
    tokenizer = load_tokenizer(str(bpe[1]))
    one, two = (tokens.prepare("text", units, tokenizer, None, str(tmp_path / f"cache{n}"), workers=n)["train"]
                for n in (1, 2))
    assert torch.equal(one.tokens, two.tokens) and one.starts.tolist() == two.starts.tolist()
    assert len(one.starts) == 2 and one.n_bytes == corpus.stat().st_size + 14  # the file and the row start documents
    assert tokenizer.decode(one.tokens.tolist()).encode() == corpus.read_bytes() + b"a row of text\n"


def test_a_corpus_smaller_than_one_window_is_a_one_line_error(bpe, tmp_path):
    from vqattn.train import cli

    small = tmp_path / "small.txt"
    small.write_text("the quick brown fox " * 20)
    with pytest.raises(ValueError, match=r"text: the validation split has \d+ tokens but seq_len=64 needs at least 65"):
        cli.train(cfg_for(*FAST, "data=text", f"data.path={small}", f"data.tokenizer={bpe[1]}",
                          f"data.cache_dir={tmp_path}"), tmp_path / "run")


@pytest.mark.slow
def test_a_bpe_run_resumes_exactly_samples_and_exports_for_auto_tokenizer(bpe, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vqattn.hf  # noqa: F401
    from vqattn.hf.export import export
    from vqattn.train.sample import sample

    corpus, directory = bpe
    common = ["attention=vq_soft", "data=text", f"data.path={corpus}", f"data.tokenizer={directory}",
              f"data.cache_dir={tmp_path / 'cache'}", "optim.total_steps=12", "checkpoint_every=6"]
    run_inprocess(tmp_path, "a", *common, "trainer.max_steps=6")
    resumed, a = run_inprocess(tmp_path, "a", *common, "trainer.max_steps=12",
                               f"ckpt_path={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}")
    straight, b = run_inprocess(tmp_path, "b", *common, "trainer.max_steps=12")
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-5)
    weights, expected = (torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for d in (a, b))
    assert all(torch.equal(weights[k], expected[k]) for k in expected)

    checkpoint = b / "checkpoints" / "last.ckpt"
    text = sample(checkpoint, "the quick", 20, seed=0)[0]
    assert text.startswith("the quick") and len(text) > len("the quick") + 20  # subword tokens: more than a byte each
    out = export(checkpoint, tmp_path / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    bpe_tokenizer = load_tokenizer(str(directory))
    assert hf_tokenizer.encode("the lazy dog") == bpe_tokenizer.encode(b"the lazy dog").tolist()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = hf_tokenizer("the quick", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    assert hf_tokenizer.decode(generated[0]).startswith("the quick")
    # bits per byte through transformers, on the validation text, as results.json has them
    val = corpus.read_bytes()[-math.ceil(corpus.stat().st_size * 0.05):]
    ids = torch.tensor(hf_tokenizer.encode(val.decode(errors="ignore")))
    T = 64
    nll, n_bytes = 0.0, 0
    with torch.no_grad():
        for start in range(0, (len(ids) - 1) // T * T, T):
            x, y = ids[start:start + T], ids[start + 1:start + T + 1]
            nll += float(F.cross_entropy(model(x[None]).logits[0].double(), y, reduction="sum"))
            n_bytes += sum(len(token_text(bpe_tokenizer, i)) for i in y.tolist())
    assert nll / (LN2 * n_bytes) == pytest.approx(straight["val_bpb"], rel=0.03)
    assert json.loads((b / "results.json").read_text())["tokenizer"] == str(directory)
    # vqattn-eval's tasks through lm-eval read the export with its own tokenizer: bits per byte of held-out text
    import lm_eval
    from lm_eval.tasks import TaskManager

    from vqattn.hf.eval import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # lm-eval's own tasks: seconds to index
    heldout = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},backend=causal", device="cpu", limit=1,
                                      tasks=["vqattn_heldout"], task_manager=manager)
    assert 0 < heldout["results"]["vqattn_heldout"]["bits_per_byte,none"] < 20


def test_results_record_the_tokenizer_and_bytes_per_token(tmp_path):
    corpus = write_corpus(tmp_path / "a.txt", lines=400)
    results, _ = run_inprocess(tmp_path, "run", "attention=softmax", "trainer.max_steps=2", "data=text",
                               f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}")
    assert results["tokenizer"] == "bytes" and results["val_bytes_per_token"] == 1.0
    assert results["val_window_bytes_per_token"] == 1.0 and results["tokenizer_vocab_size"] == 256
    assert re.match(r"^\d", str(results["val_loss"])) and np.isfinite(results["val_bpb"])


# A BPE run under DDP on two CPU processes (rank 1 reuses rank 0's token files): the DDP runs of
# tests/train/test_train.py train on a BPE tokenizer (test_ddp_two_cpu_processes_share_one_run_dir_and_stay_in_sync).
