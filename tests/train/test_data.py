"""Data modules: MQAR definition, local text, stdlib corpus, Hub loaders on local stand-ins, resumable batches."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vqattn.model import IGNORE_INDEX
from vqattn.train import data as D
from vqattn.train.mqar import MQARDataModule, mqar_example


def fake_trainer(global_step=0, max_steps=10, rank=0, world=1, accumulate=1):
    return SimpleNamespace(global_step=global_step, max_steps=max_steps, global_rank=rank, world_size=world,
                           accumulate_grad_batches=accumulate)


# ---------------------------------------------------------------- MQAR


@pytest.mark.parametrize("seq_len,pairs,filler", [(64, 8, True), (33, 8, False), (128, 4, True)])
def test_mqar_every_answer_is_the_value_bound_to_the_queried_key(seq_len, pairs, filler):
    x, y = mqar_example(np.random.default_rng(1), 16, seq_len, pairs, random_non_queries=filler)
    assert x.shape == y.shape == (16, seq_len) and x.dtype == y.dtype == torch.long
    ctx = 2 * pairs
    for xs, ys in zip(x.tolist(), y.tolist()):
        keys, values = xs[0:ctx:2], xs[1:ctx:2]
        assert len(set(keys)) == pairs and all(1 <= k < 128 for k in keys)
        assert len(set(values)) == pairs and all(128 <= v < 256 for v in values)
        answers = [j for j, t in enumerate(ys) if t != IGNORE_INDEX]
        assert len(answers) == pairs  # every key is queried exactly once
        assert all(j >= ctx for j in answers)  # queries come after all pairs
        binding = dict(zip(keys, values))
        assert sorted(xs[j] for j in answers) == sorted(keys)
        for j in answers:
            assert ys[j] == binding[xs[j]]  # the label at a query key is its value (not shown in the input)
        if not filler:
            query_region = xs[ctx:]
            assert sum(t != 0 for t in query_region) == pairs


@pytest.mark.parametrize("seq_len,pairs,gap", [(128, 16, 0), (1024, 16, 256), (64, 4, 8)])
def test_mqar_random_filler_never_repeats_a_key_of_its_sequence(seq_len, pairs, gap):
    """A key occurs only in its pair and at its query: no nearer fake pair can contradict the real binding, and
    the filler still covers every other token of the vocabulary."""
    x, y = mqar_example(np.random.default_rng(2), 64, seq_len, pairs, min_query_gap=gap)
    ctx = 2 * pairs
    for xs, ys in zip(x, y):
        keys = xs[0:ctx:2]
        filler = torch.ones(seq_len, dtype=torch.bool)
        filler[:ctx] = False
        filler[ys != IGNORE_INDEX] = False  # query positions hold the keys
        assert not torch.isin(xs[filler], keys).any()
    seen = torch.zeros(256, dtype=torch.bool)
    seen[x[:, 2 * pairs + gap:].flatten()] = True
    assert seen.sum() == 256  # across rows every token, 0 and 255 included, appears as filler


def test_mqar_gaps_follow_a_decreasing_power_law():
    # p(g) ∝ g^(a-1) with a=0.01: early query slots are far more likely than late ones.
    x, y = mqar_example(np.random.default_rng(0), 400, 256, 4)
    pos = (y != IGNORE_INDEX).nonzero()[:, 1] - 8
    early, late = (pos < 40).sum().item(), (pos >= 200).sum().item()
    assert early > 3 * late


def test_mqar_rejects_a_sequence_too_short_for_the_pairs():
    with pytest.raises(ValueError, match="seq_len >= 4"):
        MQARDataModule(num_kv_pairs=20, seq_len=64)
    with pytest.raises(ValueError, match="distinct keys"):
        MQARDataModule(num_kv_pairs=200, seq_len=1024)


def test_mqar_module_batches_are_deterministic_and_validation_is_fixed():
    dm = MQARDataModule(num_kv_pairs=4, seq_len=32, batch_size=4, num_val_examples=10)
    dm.trainer = fake_trainer(max_steps=3)
    dm.setup()
    a = [b for b in dm.train_dataloader()]
    b = [b for b in dm.train_dataloader()]
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])
    assert sum(len(xb) for xb, _ in dm.val_dataloader()) == 10


# ---------------------------------------------------------------- text files


@pytest.fixture
def text_file(tmp_path):
    body = "".join(f"line {i}\r\n" if i % 3 else f"línea {i}\n" for i in range(400)).encode()
    path = tmp_path / "notes.txt"
    path.write_bytes(body)
    return path, body


def all_bytes(dm):
    val = dm.val_set
    tiles = bytes(val.data.tolist())
    return bytes(dm.train_data.tolist()), tiles


def test_text_keeps_line_breaks_and_holds_out_the_last_5_percent(text_file):
    path, body = text_file
    dm = D.TextDataModule(path=str(path), seq_len=16, batch_size=2)
    dm.setup()
    train, val = all_bytes(dm)
    cut = len(body) - int(np.ceil(len(body) * 0.05))
    assert train == body[:cut] and val == body[cut:]
    assert b"\r\n" in train and "í".encode() in train


def test_text_glob_and_val_path(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"B" * 100)
    (tmp_path / "a.txt").write_bytes(b"A" * 100)
    (tmp_path / "v.txt").write_bytes(b"V\n" * 40)
    dm = D.TextDataModule(path=str(tmp_path / "[ab].txt"), val_path=str(tmp_path / "v.txt"), seq_len=8)
    dm.setup()
    train, val = all_bytes(dm)
    assert train == b"A" * 100 + b"B" * 100 and val == b"V\n" * 40
    # what results.json records of the run's corpus, so that a report can say what its runs trained on
    assert dm.corpus() == {"name": "text", "source": f"{tmp_path / '[ab].txt'}, validation {tmp_path / 'v.txt'}",
                           "train_bytes": 200, "train_tokens": 200, "val_bytes": 80, "val_tokens": 80}


def test_text_missing_file_names_the_path(tmp_path):
    dm = D.TextDataModule(path=str(tmp_path / "nope.txt"), seq_len=8)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        dm.setup()


def test_text_too_short_for_seq_len_is_explained(text_file):
    path, _ = text_file
    dm = D.TextDataModule(path=str(path), seq_len=4096)
    with pytest.raises(ValueError, match="seq_len=4096"):
        dm.setup()


def test_text_batches_are_shifted_windows_and_validation_tiles_without_overlap(text_file):
    path, _ = text_file
    dm = D.TextDataModule(path=str(path), seq_len=16, batch_size=3, val_windows=1000)
    dm.trainer = fake_trainer(max_steps=2)
    dm.setup()
    data = bytes(dm.train_data.tolist())
    for x, y in dm.train_dataloader():
        assert x.shape == y.shape == (3, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], 1).tolist():
            assert bytes(row) in data
    xv = torch.cat([xb for xb, _ in dm.val_dataloader()])
    assert len(xv) == (len(dm.val_set.data) - 1) // 16
    assert bytes(xv.flatten().tolist()) == bytes(dm.val_set.data[: len(xv) * 16].tolist())


def test_resumed_loader_continues_with_the_next_batch_and_ranks_differ(text_file):
    path, _ = text_file
    dm = D.TextDataModule(path=str(path), seq_len=8, batch_size=2)
    dm.setup()
    dm.trainer = fake_trainer(max_steps=6, accumulate=2)
    straight = list(dm.train_dataloader())
    assert len(straight) == 12
    dm.trainer = fake_trainer(global_step=4, max_steps=6, accumulate=2)
    resumed = list(dm.train_dataloader())
    assert len(resumed) == 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(straight[8:], resumed))
    dm.trainer = fake_trainer(max_steps=6, rank=1, world=2)
    other = list(dm.train_dataloader())
    assert not torch.equal(other[0][0], straight[0][0])


def test_validation_is_sharded_across_ranks(text_file):
    path, _ = text_file
    dm = D.TextDataModule(path=str(path), seq_len=8, batch_size=4, val_windows=1000)
    dm.setup()
    shards = []
    for rank in range(3):
        dm.trainer = fake_trainer(rank=rank, world=3)
        shards.append(torch.cat([x for x, _ in dm.val_dataloader()]))
    dm.trainer = fake_trainer()
    whole = torch.cat([x for x, _ in dm.val_dataloader()])
    assert sum(len(s) for s in shards) == len(whole)
    assert sorted(map(tuple, torch.cat(shards).tolist())) == sorted(map(tuple, whole.tolist()))


# ---------------------------------------------------------------- default corpus


def test_stdlib_corpus_is_deterministic_split_by_file_and_capped():
    root, files = D.stdlib_files(2_000_000)
    assert files and sum(f.stat().st_size for f in files) <= 2_000_000
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in files)
    a, b = D.StdlibDataModule(max_bytes=2_000_000, seq_len=64), D.StdlibDataModule(max_bytes=2_000_000, seq_len=64)
    a.setup(), b.setup()
    assert torch.equal(a.train_data, b.train_data) and torch.equal(a.val_set.data, b.val_set.data)
    total = sum(f.stat().st_size for f in files)
    assert len(a.train_data) + len(a.val_set.data) == total
    assert 0.01 < len(a.val_set.data) / total < 0.15



def test_the_stdlib_corpus_never_lists_site_packages(tmp_path, monkeypatch):
    """A pip install running beside the trainer removes directories of site-packages while the corpus is listed: a
    listing that entered them failed with FileNotFoundError (and took 80 times as long)."""
    import os
    import sysconfig

    for name in ("a.py", "b/c.py", "test/t.py", "site-packages/pkg/p.py", "b/d.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    scandir = os.scandir

    def vanishing(path="."):
        if "site-packages" in str(path):
            raise FileNotFoundError(path)
        return scandir(path)

    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    monkeypatch.setattr(os, "scandir", vanishing)
    root, files = D.stdlib_files(1000)
    assert root == tmp_path and files == [tmp_path / "a.py", tmp_path / "b" / "c.py"]


# ---------------------------------------------------------------- Hub corpora on local stand-ins


def local_hub(tmp_path, monkeypatch, splits: dict[str, str]):
    """Replace the Hub by datasets' own local "text" loader on files holding the given split texts."""
    import datasets

    files = {}
    for split, text in splits.items():
        files[split] = str(tmp_path / f"{split}.txt")
        (tmp_path / f"{split}.txt").write_text(text, encoding="utf-8", newline="")
    calls = []

    def fake(path, name=None, split=None, revision=None):
        calls.append((path, name, split))
        return datasets.load_dataset("text", data_files={split: files[split]}, split=split, keep_linebreaks=True,
                                     cache_dir=str(tmp_path / "cache"))

    monkeypatch.setattr(D, "load_dataset", fake)
    return calls


def test_wikitext_layout_uses_the_train_and_validation_splits(tmp_path, monkeypatch):
    train = "".join(f" = Heading {i} = \n text ü {i} \n" for i in range(50))
    val = "".join(f" valid {i} \n" for i in range(30))
    calls = local_hub(tmp_path, monkeypatch, {"train": train, "validation": val})
    dm = D.HubTextDataModule(hub_path="Salesforce/wikitext", hub_name="wikitext-103-raw-v1", seq_len=16)
    dm.setup()
    got_train, got_val = all_bytes(dm)
    assert got_train == train.encode() and got_val == val.encode()
    assert calls == [("Salesforce/wikitext", "wikitext-103-raw-v1", "train"),
                     ("Salesforce/wikitext", "wikitext-103-raw-v1", "validation")]


def test_enwik8_layout_splits_90_5_5_by_bytes(tmp_path, monkeypatch):
    whole = "".join(f"<page>{i} ß</page>\n" for i in range(200))
    local_hub(tmp_path, monkeypatch, {"train": whole})
    monkeypatch.setattr(D.HubTextDataModule, "ENWIK8_SPLIT", (900, 50))
    dm = D.HubTextDataModule(hub_path="LTCB/enwik8", hub_name="enwik8-raw", layout="enwik8", seq_len=16)
    dm.setup()
    whole = whole.encode()
    got_train, got_val = all_bytes(dm)
    assert got_train == whole[:900] and got_val == whole[900:950]


def test_hub_offline_gives_a_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'LTCB/enwik8' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(D, "load_dataset", offline)
    dm = D.HubTextDataModule(hub_path="LTCB/enwik8", hub_name="enwik8", layout="enwik8", name="enwik8", seq_len=16)
    with pytest.raises(D.DataUnavailableError, match="(?s)could not load enwik8.*offline, use data=default"):
        dm.setup()


def test_a_too_short_split_names_the_settings_that_fix_it(tmp_path):
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 300)
    dm = D.TextDataModule(path=str(small), seq_len=64)  # validation: the last 5% = 15 bytes
    with pytest.raises(ValueError, match=r"validation split has 15 bytes") as info:
        dm.setup()
    assert "data.val_path" in str(info.value) and "data.val_fraction" in str(info.value)
    one = tmp_path / "one.txt"
    one.write_bytes(b"y")
    dm = D.TextDataModule(path=str(small), val_path=str(one), seq_len=8)
    with pytest.raises(ValueError, match=r"has 1 byte but .*data\.val_path"):
        dm.setup()


def test_the_training_data_is_sized_by_max_steps():
    dm = MQARDataModule(num_kv_pairs=2, seq_len=16, batch_size=2)
    dm.trainer = fake_trainer(max_steps=-1)
    with pytest.raises(ValueError, match="trainer.max_steps"):
        dm.train_dataloader()
