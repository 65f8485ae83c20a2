"""Packed documents in the trainer (``data.pack_documents``): the byte modules' document starts, the training and
validation steps that run a batch as one packed row cut at them (no document sees another), the config conflicts
with the continuous streams, and a packed run of train.py's job on a text corpus cut at a separator."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from vqattn.layers import ATTENTIONS
from vqattn.train import data as D
from vqattn.train.configs import register
from vqattn.train.lit import LitLM, SummedNLL, packed_forward

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "vqattn" / "train" / "conf")
register()
FAST = ["experiment=tiny", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
TINY = dict(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=32)
# blocks of 8 tokens: documents shorter than a block and across blocks
SMALL_KWARGS = {"vq_hard": dict(block_len=8, num_codes=8), "vq_soft": dict(block_len=8, num_codes=8),
                "window": dict(block_len=8), "ovq": dict(block_len=8, num_slots=4), "performer": dict(block_len=8),
                # large steps and a slow decay: one document's state would reach the next (at Mamba-2's own
                # initialisation it moves the loss by 1e-6 of itself, below what the test tells from rounding)
                "mamba2": dict(block_len=8, dt_min=1.0, dt_max=2.0, a_init_range=[0.01, 0.1])}


def cfg_for(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def fake_trainer(global_step=0, max_steps=6, rank=0, world=1, accumulate=1):
    return SimpleNamespace(global_step=global_step, max_steps=max_steps, global_rank=rank, world_size=world,
                           accumulate_grad_batches=accumulate)


# Files whose bytes are all distinct across the corpus: a window's first byte names its offset, and a document
# starts exactly where x holds a file's first byte.
TRAIN_FILES = [bytes(range(0, 40)), bytes(range(40, 90)), bytes(range(90, 150))]
VAL_FILES = [bytes(range(150, 200)), bytes(range(200, 256))]


@pytest.fixture
def distinct_files(tmp_path):
    for i, body in enumerate(TRAIN_FILES):
        (tmp_path / f"train{i}.bin").write_bytes(body)
    for i, body in enumerate(VAL_FILES):
        (tmp_path / f"val{i}.bin").write_bytes(body)
    return dict(path=str(tmp_path / "train*.bin"), val_path=str(tmp_path / "val*.bin"))


def packed_text(files, **kwargs) -> D.TextDataModule:
    dm = D.TextDataModule(**files, seq_len=8, batch_size=4, pack_documents=True, val_windows=1000, **kwargs)
    dm.trainer = fake_trainer()
    dm.setup()
    return dm


def expected_starts(x: torch.Tensor, firsts: list[int]) -> torch.Tensor:
    starts = torch.isin(x, torch.tensor(firsts))
    starts[:, 0] = True
    return starts


# ---------------------------------------------------------------- the data side


def test_document_starts_of_units_and_a_separator(tmp_path):
    from vqattn.tokenizer import load_tokenizer
    from vqattn.train import tokens

    units = [b"ab|cd|", b"", b"ef", b"|g||h"]

    def starts(separator):
        split = tokens.prepare("units", {"all": units}, load_tokenizer("bytes"), separator, str(tmp_path))["all"]
        assert bytes(split.tokens.tolist()) == b"".join(units)
        return split.starts.tolist()

    # files start documents (an empty one none); a separator ends its document, unless it ends the unit anyway
    assert starts(b"|") == [0, 3, 6, 8, 9, 11, 12]
    assert starts(None) == [0, 6, 8]
    assert D.cut_units([b"abc", b"de", b"fgh"], 2, 6) == [b"c", b"de", b"f"]


def test_starts_mark_exactly_the_files_first_bytes(distinct_files):
    dm = packed_text(distinct_files)
    firsts = [body[0] for body in TRAIN_FILES]
    batches = list(dm.train_dataloader())
    assert len(batches) == 6
    seen_inner = 0
    for x, y, starts in batches:
        assert x.shape == y.shape == starts.shape == (4, 8) and starts.dtype == torch.bool
        assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are as unpacked: shifted by one byte
        assert starts[:, 0].all()  # a row's first position always starts a sequence
        assert torch.equal(starts, expected_starts(x, firsts))
        seen_inner += int(starts[:, 1:].sum())
    assert seen_inner > 0  # some window crossed a file boundary
    vals = list(dm.val_dataloader())
    assert sum(len(b[0]) for b in vals) == (sum(map(len, VAL_FILES)) - 1) // 8
    for x, y, starts in vals:
        assert torch.equal(starts, expected_starts(x, [body[0] for body in VAL_FILES]))
    assert any(b[2][:, 1:].any() for b in vals)


def test_a_separator_splits_one_file_and_ends_the_document_it_follows(tmp_path):
    docs = [f"document {i} says {'la' * (i % 7)}\x00" for i in range(60)]
    (tmp_path / "all.txt").write_text("".join(docs))
    dm = D.TextDataModule(path=str(tmp_path / "all.txt"), seq_len=16, batch_size=4, pack_documents=True,
                          separator="\\x00")  # as a command line writes it: data.separator=\x00
    dm.trainer = fake_trainer()
    dm.setup()
    assert dm.separator == b"\x00"
    for x, _, starts in [*dm.train_dataloader(), *dm.val_dataloader()]:
        after_separator = torch.zeros_like(starts)
        after_separator[:, 1:] = x[:, :-1] == 0
        after_separator[:, 0] = True
        assert torch.equal(starts, after_separator)
        assert torch.equal(starts, starts & ((x == ord("d")) | (torch.arange(16) == 0)))  # each begins "document"


def test_packed_batches_are_the_unpacked_windows_and_a_function_of_seed_index_and_rank(distinct_files):
    dm = packed_text(distinct_files)
    plain = D.TextDataModule(**distinct_files, seq_len=8, batch_size=4, val_windows=1000)
    plain.trainer = fake_trainer()
    plain.setup()
    straight = list(dm.train_dataloader())
    for (x, y, _), (px, py) in zip(straight, plain.train_dataloader()):
        assert torch.equal(x, px) and torch.equal(y, py)  # the same windows, the starts beside them
    again = list(dm.train_dataloader())
    assert all(all(torch.equal(a, b) for a, b in zip(p, q)) for p, q in zip(straight, again))
    dm.trainer = fake_trainer(global_step=4)  # resumed at step 4: batches 4 and 5 as the straight run had them
    resumed = list(dm.train_dataloader())
    assert len(resumed) == 2
    assert all(all(torch.equal(a, b) for a, b in zip(p, q)) for p, q in zip(straight[4:], resumed))
    dm.trainer = fake_trainer(rank=1, world=2)
    assert not torch.equal(next(iter(dm.train_dataloader()))[0], straight[0][0])


def test_stdlib_documents_are_its_files():
    dm = D.StdlibDataModule(max_bytes=2_000_000, seq_len=64, pack_documents=True)
    dm.setup()
    train_units, val_units = dm._units()
    for units, starts in ((train_units, dm.train_starts), (val_units, dm.val_set.starts)):
        sizes = torch.tensor([u.stop - u.start for u in units])
        firsts = (torch.cumsum(sizes, 0) - sizes)[sizes > 0]
        assert starts.tolist() == firsts.tolist()
    assert D.StdlibDataModule(max_bytes=2_000_000)._load() == tuple(b"".join(Path(u.path).read_bytes() for u in units)
                                                                   for units in (train_units, val_units))


def test_hub_rows_are_documents(monkeypatch):
    rows = {"train": [f"row {i} {'x' * i}\n" for i in range(30)], "validation": [f"v {i}\n" for i in range(20)]}
    monkeypatch.setattr(D, "load_dataset", lambda path, name=None, split=None, revision=None: {"text": rows[split]})
    dm = D.HubTextDataModule(hub_path="Salesforce/wikitext", seq_len=8, pack_documents=True)
    dm.setup()
    for split, starts in (("train", dm.train_starts), ("validation", dm.val_set.starts)):
        sizes = torch.tensor([len(r.encode()) for r in rows[split]])
        assert starts.tolist() == (torch.cumsum(sizes, 0) - sizes).tolist()
    whole = ["<page>one</page>", "<page>two</page>", "<page>three</page>"]  # rows joined with "\n" between them
    monkeypatch.setattr(D, "load_dataset", lambda path, name=None, split=None, revision=None: {"text": whole})
    monkeypatch.setattr(D.HubTextDataModule, "ENWIK8_SPLIT", (20, 30))
    dm = D.HubTextDataModule(hub_path="LTCB/enwik8", layout="enwik8", seq_len=8, pack_documents=True)
    dm.setup()
    assert bytes(dm.train_data.tolist()) + bytes(dm.val_set.data.tolist()) == "\n".join(whole).encode()[:50]
    assert dm.train_starts.tolist() == [0, 17]
    assert dm.val_set.starts.tolist() == [0, 14]  # 34 - 20: the third row


@pytest.mark.parametrize("kwargs,message", [
    (dict(stream=True), "data.pack_documents=true cuts each window at its documents' starts, but data.stream=true"),
    (dict(val_carried=True), "data.val_carried=true"),
    (dict(pack_documents=False, separator="|"), "data.separator='|' splits the documents of data.pack_documents"),
    (dict(separator=""), "data.separator must not be empty"),
    (dict(pack_documents="yes"), "data.pack_documents must be true or false"),
])
def test_conflicting_data_settings_are_value_errors(tmp_path, kwargs, message):
    kwargs = {"pack_documents": True, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("|", r"\|")):
        D.TextDataModule(path=str(tmp_path / "any.txt"), **kwargs)


# ---------------------------------------------------------------- the trainer side


def packed_batch(b=3, t=32, seed=0):
    """(x, y, starts) with documents of every length: one token, shorter than a block, across blocks, and rows
    whose first position is no document's start."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (b, t + 1), generator=gen)
    starts = torch.zeros(b, t, dtype=torch.bool)
    starts[0, [5, 6, 20]] = True
    starts[1, [0, 31]] = True
    starts[2, [1, 9, 10, 11]] = True  # row 2 begins inside a document: its first position starts one all the same
    return x[:, :-1], x[:, 1:], starts


def segments(starts_row: torch.Tensor) -> list[tuple[int, int]]:
    cuts = sorted({0, *starts_row.nonzero().flatten().tolist(), len(starts_row)})
    return list(zip(cuts, cuts[1:]))


def module_for(attention, **kwargs):
    torch.manual_seed(0)
    model = {**TINY, "attention": attention, "attention_kwargs": SMALL_KWARGS.get(attention, {})}
    module = LitLM(model=model, aux_weight=0.0, **kwargs)
    module.model.double().eval()  # float64; eval: no codebook update between the calls compared
    return module


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_the_training_loss_is_each_document_run_alone(attention):
    module = module_for(attention)
    x, y, starts = packed_batch()
    loss = module.training_step((x, y, starts), 0)
    total, logits = 0.0, []
    with torch.no_grad():
        for r in range(x.shape[0]):
            for a, b in segments(starts[r]):
                alone = module.model(x[r:r + 1, a:b]).logits[0]  # B = 1, no cu_seqlens
                logits.append(alone)
                total = total + F.cross_entropy(alone, y[r, a:b], reduction="sum")
    reference = total / x.numel()
    torch.testing.assert_close(loss.detach(), reference, rtol=1e-6, atol=1e-7)  # the step's NLL is in float32
    with torch.no_grad():
        packed, positions = packed_forward(module.model, x, starts)
    torch.testing.assert_close(packed.logits.flatten(0, 1), torch.cat(logits), rtol=1e-10, atol=1e-12)
    assert positions.tolist()[2][:3] == [0, 0, 1]  # row 2: its start, then a document from position 1
    unpacked = module.training_step((x, y), 0)  # without starts, the rows are whole sequences as before
    assert not torch.isclose(unpacked.detach(), reference, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
# The trainer's path from document starts to Segments, on softmax (its trace takes seconds, the codebook attentions'
# tens): every attention's packed step traces whole in tests/model/test_varlen_model.py, and vq_soft's compiles by
# inductor and trains as eager does in tests/model/test_compile.py.
@pytest.mark.parametrize("attention", ["softmax"])
def test_a_compiled_model_runs_every_packed_batch_in_one_graph(attention):
    """With ``compile``, the packed batches reach the model as Segments: the whole step is one graph (fullgraph),
    new documents compile nothing new, and the loss is each document's alone. (The trainer's inductor is replaced by
    the eager backend, which traces the same graph without generating code.)"""
    module = module_for(attention, compile=True)
    module.model.compile(backend="eager", fullgraph=True)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    for i in range(2):  # the compiling batch, then one with other documents (each checked against every document alone)
        x, y, _ = packed_batch(seed=i)
        starts = torch.rand(x.shape, generator=gen) < 0.15 * (i + 1)
        starts[:, 0] = True
        with torch._dynamo.config.patch(error_on_recompile=i >= 1):
            loss = module.training_step((x, y, starts), 0)
        with torch.no_grad():
            total = sum(F.cross_entropy(module.model.forward(x[r:r + 1, a:b]).logits[0], y[r, a:b], reduction="sum")
                        for r in range(x.shape[0]) for a, b in segments(starts[r]))
        torch.testing.assert_close(loss.detach(), total / x.numel(), rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_validation_runs_one_flattened_call_and_buckets_positions_within_documents():
    module = module_for("vq_soft", position_edges=[0, 4, 12])
    batches = [packed_batch(seed=s) for s in (1, 2)]
    calls = []
    forward = module.model.forward

    def recorded(idx, *args, **kwargs):
        calls.append((tuple(idx.shape), kwargs.get("cu_seqlens")))
        return forward(idx, *args, **kwargs)

    module.model.forward = recorded
    for i, batch in enumerate(batches):
        module.validation_step(batch, i)
    assert [shape for shape, _ in calls] == [(1, 3 * 32)] * 2  # one packed row per batch
    assert list(calls[0][1].bounds) == [0, 5, 6, 20, 32, 63, 64, 65, 73, 74, 75, 96]  # read once, handed on
    got = module.val_nll.compute()
    module.model.forward = forward
    reference = SummedNLL([0, 4, 12])  # each document alone, its positions counted from its first token
    with torch.no_grad():
        for x, y, starts in batches:
            for r in range(x.shape[0]):
                for a, b in segments(starts[r]):
                    reference.update(module.model(x[r:r + 1, a:b]).logits, y[r:r + 1, a:b])
    want = reference.compute()
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-10, atol=1e-12)
    assert list(got["by_position"]) == list(want["by_position"]) == ["0_3", "4_11", "12_30"]
    for name, bucket in want["by_position"].items():
        assert got["by_position"][name] == pytest.approx(bucket, rel=1e-10)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_a_batch_from_the_data_module_trains_as_its_documents(tmp_path):
    docs = [f"doc {i}: {'ab' * (i % 9)}\n\n" for i in range(80)]
    (tmp_path / "docs.txt").write_text("".join(docs))
    dm = D.TextDataModule(path=str(tmp_path / "docs.txt"), seq_len=32, batch_size=3, pack_documents=True,
                          separator="\\n\\n")
    dm.trainer = fake_trainer()
    dm.setup()
    x, y, starts = next(iter(dm.train_dataloader()))
    assert starts[:, 1:].any()
    module = module_for("window")
    loss = module.training_step((x, y, starts), 0)
    with torch.no_grad():
        total = sum(F.cross_entropy(module.model(x[r:r + 1, a:b]).logits[0], y[r, a:b], reduction="sum")
                    for r in range(3) for a, b in segments(starts[r]))
    torch.testing.assert_close(loss.detach(), total / x.numel(), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- configs and train.py


def test_the_configs_have_the_keys_and_the_default_does_not_pack():
    for option in ("default", "text", "enwik8", "wikitext103"):
        data = cfg_for(f"data={option}").data
        assert data.pack_documents is False and data.separator is None, option
    assert "pack_documents" not in cfg_for("data=mqar").data  # MQAR is not affected
    data = instantiate(cfg_for("data.pack_documents=true", "data.separator='\\n\\n'").data)
    assert data.pack_documents and data.separator == b"\n\n"


@pytest.mark.parametrize("overrides,key", [(["carry_state=true"], "data.stream=true (set by carry_state=true)"),
                                           (["data.stream=true"], "data.stream=true"),
                                           (["experiment=long"], "data.val_carried=true")])
def test_packing_with_a_continuous_stream_is_a_one_line_error(tmp_path, monkeypatch, overrides, key):
    from vqattn.train import cli, lifecycle

    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as info:
        cli.train(cfg_for(*FAST, "data.pack_documents=true", *overrides), tmp_path / "run")
    line = lifecycle.user_error(info.value)  # what the command line prints after "error: "
    assert line is not None and "\n" not in line, repr(info.value)
    assert line.startswith("ValueError: data.pack_documents=true cuts each window") and key in line
    assert not (tmp_path / "run").exists()


@pytest.mark.filterwarnings("ignore:The number of training batches")
def test_a_packed_run_trains_and_validates(tmp_path):
    """A text corpus packed at a separator given as a command line writes it (data.separator=\\x00), trained and
    validated by train.py's job (in this process: its start-up is test_train.py's; the refusal of a continuous
    stream is test_packing_with_a_continuous_stream_is_a_one_line_error, its exit status test_train.py's)."""
    from vqattn.train import cli

    (tmp_path / "docs.txt").write_text("".join(f"doc {i}: {'ab' * (i % 9)}\x00" for i in range(400)))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = cfg_for(*FAST, "data=text", f"data.path={tmp_path / 'docs.txt'}", "data.pack_documents=true",
                  "data.separator=\\x00", "attention=vq_soft", "trainer.max_steps=4", "trainer.val_check_interval=2",
                  "optim.warmup_steps=1", "threads=1")
    assert instantiate(cfg.data).separator == b"\x00"
    results = cli.train(cfg, run_dir)
    assert results["steps"] == 4 and results["train_tokens"] == 4 * 8 * 64 and results["data"] == "TextDataModule"
    assert math.isfinite(results["val_bpb"]) and 0 < results["val_bpb"] < 9
    tokens = results["val_tokens_by_position"]
    recombined = sum(results["val_bpb_by_position"][k] * n for k, n in tokens.items()) / sum(tokens.values())
    assert recombined == pytest.approx(results["val_bpb"], rel=1e-9)
    assert (run_dir / "results.json").exists()
