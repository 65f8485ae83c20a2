"""Pre-tokenized files (``data=tokens``): nanoGPT's raw train.bin / val.bin and modded-nanogpt's headered shards,
written here; their headers' checks, the memory maps, the windows against the ids written, globs of shards, packed
documents at the end-of-text id, the scan kept between runs, and train.py end to end with a BPE made here."""

from __future__ import annotations

import os
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_tokenizers import WORDS
from test_train import FAST, cfg_for, run_inprocess

from vqattn.tokenizer import load_tokenizer, padded_vocab, train_bpe
from vqattn.train import data as D
from vqattn.train import token_files as TF
from vqattn.train.streams import StreamBatches


def fake_trainer(global_step=0, max_steps=4):
    return SimpleNamespace(global_step=global_step, max_steps=max_steps, global_rank=0, world_size=1,
                           accumulate_grad_batches=1)


def write_raw(path, ids):
    """nanoGPT's prepare.py: the ids as uint16, nothing else."""
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return path


def write_shard(path, ids, magic=TF.MAGIC, version=1, count=None):
    """modded-nanogpt's shard: 256 int32 (magic, version, token count, zeros), then the ids as uint16."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, dtype="<u2").tobytes())
    return path


def module(path, val_path, setup=True, **kwargs) -> TF.TokenFilesDataModule:
    kwargs = {"tokenizer": "bytes", "seq_len": 32, "batch_size": 4, **kwargs}
    dm = TF.TokenFilesDataModule(path=str(path), val_path=str(val_path), **kwargs)
    dm.trainer = fake_trainer()
    if setup:
        dm.setup()
    return dm


def byte_ids(n, seed=0, high=256):
    return np.random.default_rng(seed).integers(0, high, n).astype(np.uint16)


def write_shards(directory, ids, sizes, prefix="fineweb_train"):
    """``ids`` cut into shards of ``sizes`` tokens (the rest in the last), written in reverse order of their names
    (the glob's sorted order, not the files' age, is the sequence's)."""
    cuts = np.cumsum([0, *sizes, len(ids) - sum(sizes)])
    for k in reversed(range(len(cuts) - 1)):
        write_shard(directory / f"{prefix}_{k:06d}.bin", ids[cuts[k]:cuts[k + 1]])
    return str(directory / f"{prefix}_*.bin")


@pytest.fixture
def both_formats(tmp_path):
    """{format: (train path or glob, val path, train ids, val ids)}: a nanoGPT pair and a directory of shards of the
    same ids (an empty shard among them), for the byte tokenizer."""
    train, val = byte_ids(3000, 1), byte_ids(700, 2)
    (tmp_path / "nanogpt").mkdir()
    (tmp_path / "shards").mkdir()
    pair = (write_raw(tmp_path / "nanogpt" / "train.bin", train), write_raw(tmp_path / "nanogpt" / "val.bin", val))
    shards = (write_shards(tmp_path / "shards", train, [1000, 0, 1234]),
              write_shards(tmp_path / "shards", val, [300], prefix="fineweb_val"))
    return {"nanogpt": (*pair, train, val), "shards": (*shards, train, val)}


# ---------------------------------------------------------------- headers


@pytest.mark.parametrize("case,format,message", [
    ("magic", "header", "is not a modded-nanogpt shard: its header's magic is 12345, not 20240520"),
    ("version", "auto", "has header version 2: only version 1"),
    ("short", "auto", "is truncated or corrupt (1224 bytes, its header says 200 tokens of uint16: 1424 bytes)"),
    ("long", "header", "is truncated or corrupt (1226 bytes, its header says 100 tokens of uint16: 1224 bytes)"),
    ("smaller than a header", "header", "is truncated or corrupt (10 bytes, shorter than the 1024-byte header"),
    ("odd raw", "raw", "is truncated or corrupt (201 bytes, not a whole number of uint16 ids)"),
])
def test_a_file_that_does_not_fit_its_format_is_a_one_line_error_naming_it(tmp_path, case, format, message):
    ids, bad = byte_ids(100), tmp_path / "fineweb_train_000000.bin"
    if case == "magic":
        write_shard(bad, ids, magic=12345)
    elif case == "version":
        write_shard(bad, ids, version=2)
    elif case == "short":
        write_shard(bad, ids, count=200)
    elif case == "long":
        write_shard(bad, np.append(ids, 7))
        bad.write_bytes(bad.read_bytes()[:8] + np.int32(100).tobytes() + bad.read_bytes()[12:])
    elif case == "smaller than a header":
        bad.write_bytes(b"0123456789")
    else:
        bad.write_bytes(write_raw(tmp_path / "x", ids).read_bytes() + b"\0")
    val = write_raw(tmp_path / "val.bin", byte_ids(100))
    with pytest.raises(ValueError) as info:
        module(bad, val, format=format)
    line = str(info.value)
    assert line.startswith(f"token file {bad} ") and message in line and "\n" not in line


def test_auto_tells_a_shard_from_a_raw_file_by_its_magic(tmp_path):
    ids = byte_ids(100)
    assert TF.layout(str(write_shard(tmp_path / "s.bin", ids))) == (1024, 100)
    assert TF.layout(str(write_raw(tmp_path / "r.bin", ids))) == (0, 100)
    assert TF.layout(str(write_shard(tmp_path / "s.bin", ids)), "raw") == (0, 100 + 512)  # as told: the header is ids
    # GPT-2's ids cannot start a raw file with the magic: its low uint16 lies past GPT-2's 50257 tokens
    assert np.frombuffer(np.int32(TF.MAGIC).tobytes(), np.uint16)[0] >= 50257


@pytest.mark.parametrize("tokenizer", ["bytes", None])
def test_a_bad_file_or_no_tokenizer_reaches_the_command_line_as_one_line(tmp_path, monkeypatch, tokenizer):
    from vqattn.train import cli, lifecycle

    bad = write_shard(tmp_path / "fineweb_train_000000.bin", byte_ids(100), count=101)
    val = write_shard(tmp_path / "fineweb_val_000000.bin", byte_ids(100))
    monkeypatch.chdir(tmp_path)
    overrides = ["data=tokens", f"data.path={bad}", f"data.val_path={val}"]
    with pytest.raises(Exception) as info:
        cli.train(cfg_for(*FAST, *overrides, *([f"data.tokenizer={tokenizer}"] if tokenizer else [])), tmp_path / "run")
    line = lifecycle.user_error(info.value)
    assert line == (f"ValueError: token file {bad} is truncated or corrupt (1224 bytes, its header says 101 tokens "
                    "of uint16: 1226 bytes)" if tokenizer else "ValueError: data=tokens needs data.tokenizer=, the "
                    "tokenizer the files were made with (a transformers directory such as GPT-2's, a tokenizer.json, "
                    "or bytes for byte ids): it sizes the model's vocabulary and gives bits per byte")
    assert not (tmp_path / "run").exists()


def test_an_id_outside_the_tokenizers_vocabulary_is_a_one_line_error(tmp_path):
    ids = byte_ids(3000)
    ids[1234] = 300
    train, val = write_raw(tmp_path / "train.bin", ids), write_raw(tmp_path / "val.bin", byte_ids(100))
    with pytest.raises(ValueError, match=rf"^token file {train} holds id 300 at token 1234, outside the 256 tokens of "
                                         r"data.tokenizer=bytes: give the tokenizer the files were made with$"):
        module(train, val)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tokenizer=None), "data=tokens needs data.tokenizer=, the tokenizer the files were made with"),
    (dict(val_path=None), "data=tokens needs data.val_path=FILE_OR_GLOB"),
    (dict(format="bin"), "data.format must be one of auto, raw, header, got 'bin'"),
    (dict(separator="\\n"), "data.separator='\\\\n' splits text: token files' documents start at the end-of-text id"),
    (dict(eos_id=256), "data.eos_id must be a token id of data.tokenizer (0 to 255) or null"),
    (dict(pack_documents=True), "data.pack_documents=true starts documents at the end-of-text id, but "
                                "data.tokenizer=bytes has no eos token nor <|endoftext|>: set data.eos_id=ID"),
    (dict(val_path="TRAIN"), "data.path and data.val_path both hold"),
    (dict(val_path="nope.bin"), "data.val_path: no file found at 'nope.bin'"),
])
def test_settings_that_cannot_work_are_one_line_errors(tmp_path, kwargs, message):
    train = write_raw(tmp_path / "train.bin", byte_ids(100))
    kwargs = {"val_path": write_raw(tmp_path / "val.bin", byte_ids(100)), **kwargs}
    kwargs["val_path"] = train if kwargs["val_path"] == "TRAIN" else kwargs["val_path"]
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        dm = TF.TokenFilesDataModule(path=str(train), seq_len=32, **{"tokenizer": "bytes", **kwargs})
        dm.setup()
    assert message in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- maps, windows, globs


def test_the_files_are_memory_mapped_not_copied(both_formats, tmp_path):
    raw_path, _, train, _ = both_formats["nanogpt"]
    raw = module(raw_path, both_formats["nanogpt"][1])
    shards = module(*both_formats["shards"][:2])
    arrays = shards.train_data.arrays
    assert all(isinstance(a, np.memmap) and a.offset == 1024 for a in arrays) and len(arrays) == 3  # the empty one: none
    assert [os.path.basename(a.filename) for a in arrays] == [f"fineweb_train_00000{k}.bin" for k in (0, 2, 3)]
    assert isinstance(raw.train_data, torch.Tensor) and raw.train_file.offset == 0
    # a token rewritten in place shows through the maps and the windows: they read the files, not a copy of them
    with open(raw_path, "r+b") as f:
        f.seek(2 * 1500)
        f.write(np.uint16(999).tobytes())
    with open(tmp_path / "shards" / "fineweb_train_000002.bin", "r+b") as f:
        f.seek(1024 + 2 * 500)
        f.write(np.uint16(999).tobytes())
    assert int(raw.train_data[1500]) == 999 and int(raw.train_file.windows([1499], 2)[0, 1]) == 999
    assert int(shards.train_data[1500:1501][0]) == 999 and int(shards.train_file.windows([1500], 1)[0, 0]) == 999
    assert int(shards.train_data[torch.tensor([1500])][0]) == 999 and int(train[1500]) != 999


@pytest.mark.parametrize("fmt", ["nanogpt", "shards"])
def test_training_and_validation_windows_are_the_ids_written(both_formats, fmt):
    path, val_path, train, val = both_formats[fmt]
    dm = module(path, val_path, seed=3)
    assert len(dm.train_data) == len(train) and dm.split_sizes == {"train_bytes": 3000, "train_tokens": 3000,
                                                                   "val_bytes": 700, "val_tokens": 700}
    assert torch.equal(dm.train_data[:], torch.from_numpy(train))
    for i, (x, y) in enumerate(dm.train_dataloader()):  # the trainer's own sampler: offsets from (seed, i, rank)
        offsets = np.random.default_rng([3, i, 0]).integers(0, len(train) - 32, size=4)
        expected = torch.from_numpy(np.stack([train[o:o + 33] for o in offsets]).astype(np.int64))
        assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])
    assert torch.equal(dm.val_set.offsets, torch.arange(21) * 32)  # (700 - 1) // 32 windows tiling the split
    for j, o in enumerate(dm.val_set.offsets.tolist()):
        x, y = dm.val_set[j]
        assert x.tolist() == val[o:o + 32].tolist() and y.tolist() == val[o + 1:o + 33].tolist()


def test_shards_are_one_sequence_across_their_files(tmp_path):
    ids = byte_ids(300)
    files = [(str(write_shard(tmp_path / f"s{k}.bin", part)), 1024, len(part))
             for k, part in enumerate(np.split(ids, [100, 100, 170]))]  # the second file is empty
    shards = TF.Shards(files)
    expected = torch.from_numpy(ids.astype(np.int64))
    assert len(shards) == 300 and torch.equal(shards.windows(range(0, 290), 10),
                                              torch.stack([expected[o:o + 10] for o in range(290)]))
    assert torch.equal(shards.windows([0], 300)[0], expected)
    assert torch.equal(shards[95:175].long(), expected[95:175]) and len(shards[290:400]) == 10
    index = torch.tensor([[0, 99, 100, 169], [170, 299, 5, 150]])
    assert torch.equal(shards[index].long(), expected[index])
    again = pickle.loads(pickle.dumps(shards))  # DataLoader workers: the files are mapped again, not copied
    assert len(pickle.dumps(shards)) < 1000 and torch.equal(again.windows([95], 10), shards.windows([95], 10))
    with pytest.raises(IndexError):
        shards.windows([295], 10)
    # carried-state streams read the shards as they read a tensor of the same ids
    streams = [StreamBatches(data, seq_len=16, batch_size=2, rank=0, world_size=1, seed=0, num_batches=12)
               for data in (shards, torch.from_numpy(ids))]
    assert all(torch.equal(a, b) for i in range(12) for a, b in zip(streams[0][i], streams[1][i]))


def test_the_windows_are_those_of_the_same_ids_tokenized_by_the_trainer(tmp_path):
    text = bytes(byte_ids(3000, 4))
    (tmp_path / "train.txt").write_bytes(text)
    (tmp_path / "val.txt").write_bytes(text[:500])
    write_raw(tmp_path / "train.bin", np.frombuffer(text, np.uint8))
    write_raw(tmp_path / "val.bin", np.frombuffer(text[:500], np.uint8))
    kwargs = dict(tokenizer="bytes", seq_len=32, batch_size=4, seed=5, cache_dir=str(tmp_path / "cache"))
    own = D.TextDataModule(path=str(tmp_path / "train.txt"), val_path=str(tmp_path / "val.txt"), **kwargs)
    own.trainer = fake_trainer()
    own.setup()
    files = module(tmp_path / "train.bin", tmp_path / "val.bin", **kwargs)
    for a, b in zip([*own.train_dataloader(), *own.val_dataloader()], [*files.train_dataloader(),
                                                                       *files.val_dataloader()], strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert files.split_sizes == own.split_sizes and torch.equal(files.token_bytes, own.token_bytes)


# ---------------------------------------------------------------- packed documents, the scan


@pytest.mark.parametrize("fmt", ["nanogpt", "shards"])
def test_packed_documents_start_at_the_end_of_text_id(both_formats, fmt):
    path, val_path, train, val = both_formats[fmt]
    dm = module(path, val_path, pack_documents=True, eos_id=7, seed=1)
    assert dm.train_starts.tolist() == np.flatnonzero(train == 7).tolist() and len(dm.train_starts) > 5
    assert dm.val_set.starts.tolist() == np.flatnonzero(val == 7).tolist()
    for i, (x, y, starts) in enumerate(dm.train_dataloader()):
        offsets = np.random.default_rng([1, i, 0]).integers(0, len(train) - 32, size=4)
        expected = torch.from_numpy(np.stack([train[o:o + 32] for o in offsets]) == 7)
        expected[:, 0] = True  # a row's first position sees nothing before it
        assert torch.equal(starts, expected) and bool((x[:, 1:][starts[:, 1:]] == 7).all())
    x, _, starts = dm.val_set[3]
    assert starts.tolist() == [t == 0 or v == 7 for t, v in enumerate(val[96:128].tolist())]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE of 300 tokens (``<|endoftext|>`` is id 0) made offline, as a transformers directory, and
    documents of its corpus: (directory, tokenizer, [document bytes])."""
    root = tmp_path_factory.mktemp("bpe")
    rng = random.Random(0)
    documents = ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                           for _ in range(rng.randint(2, 30))).encode() for _ in range(400)]
    (root / "corpus.txt").write_bytes(b"\n".join(documents))
    directory = train_bpe([str(root / "corpus.txt")], 300, root / "tok")
    return directory, load_tokenizer(str(directory)), documents


def test_the_end_of_text_id_is_the_tokenizers_eos(bpe, tmp_path):
    directory, tokenizer, _ = bpe
    assert (directory / "tokenizer_config.json").exists() and TF.end_of_text(tokenizer, str(directory)) == 0
    assert TF.end_of_text(load_tokenizer(str(directory / "tokenizer.json")), str(directory / "tokenizer.json")) == 0
    other = tmp_path / "other"  # another eos_token in the transformers files: that one
    other.mkdir()
    (other / "tokenizer.json").write_text((directory / "tokenizer.json").read_text())
    (other / "tokenizer_config.json").write_text('{"eos_token": {"content": "%s"}}' % tokenizer.tokenizer.id_to_token(5))
    assert TF.end_of_text(load_tokenizer(str(other)), str(other)) == 5
    assert TF.end_of_text(load_tokenizer("bytes"), "bytes") is None


def test_a_files_scan_is_kept_and_made_again_when_the_file_changes(tmp_path):
    ids = byte_ids(3000)
    train, val = write_raw(tmp_path / "train.bin", ids), write_raw(tmp_path / "val.bin", byte_ids(100))
    kwargs = dict(pack_documents=True, eos_id=7, cache_dir=str(tmp_path / "cache"))
    first = module(train, val, **kwargs)
    kept = sorted((tmp_path / "cache" / "token-files").glob("train.bin-*.json"))
    assert len(kept) == 1 and kept[0].with_name(kept[0].stem + ".starts.npy").exists()
    kept[0].write_text(kept[0].read_text().replace('"bytes": 3000', '"bytes": 12345'))  # read, not scanned again
    assert module(train, val, **kwargs).split_sizes["train_bytes"] == 12345
    ids[:10] = 7
    write_raw(train, ids)
    os.utime(train, ns=(os.stat(train).st_atime_ns, os.stat(train).st_mtime_ns + 10**9))
    again = module(train, val, **kwargs)
    assert again.split_sizes["train_bytes"] == 3000 and len(again.train_starts) == len(first.train_starts) + 10


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_run(tmp_path, caplog):
    train, val = write_raw(tmp_path / "train.bin", byte_ids(300)), write_raw(tmp_path / "val.bin", byte_ids(100))
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    dm = module(train, val, cache_dir=str(tmp_path / "cache"))
    assert dm.split_sizes["train_tokens"] == 300
    assert f"could not keep the scan of {train} in {tmp_path / 'cache' / 'token-files'}" in caplog.text


# ---------------------------------------------------------------- train.py end to end


def encoded(tokenizer, documents, eos_before: bool) -> np.ndarray:
    """The documents' ids joined as nanoGPT's openwebtext prepare.py (eos after each) or modded-nanogpt's fineweb.py
    (eos before each) join them; the BPE's eos is id 0."""
    parts = [[0, *tokenizer.encode(d).tolist()] if eos_before else [*tokenizer.encode(d).tolist(), 0]
             for d in documents]
    return np.concatenate(parts).astype(np.uint16)


@pytest.mark.slow
def test_a_nanogpt_pair_trains_as_the_text_it_was_made_from(bpe, tmp_path):
    directory, tokenizer, documents = bpe
    # the text with each document ended by <|endoftext|>, and its ids as openwebtext's prepare.py writes them
    train_text, val_text = (b"".join(d + b"<|endoftext|>" for d in part) for part in (documents[:360], documents[360:]))
    train, val = encoded(tokenizer, documents[:360], False), encoded(tokenizer, documents[360:], False)
    assert tokenizer.encode(train_text).tolist() == train.tolist() and (train == 0).sum() == 360
    (tmp_path / "train.txt").write_bytes(train_text)
    (tmp_path / "val.txt").write_bytes(val_text)
    write_raw(tmp_path / "train.bin", train)
    write_raw(tmp_path / "val.bin", val)
    common = ["attention=softmax", f"data.tokenizer={directory}", f"data.cache_dir={tmp_path / 'cache'}",
              "trainer.max_steps=4"]
    text, _ = run_inprocess(tmp_path, "text", *common, "data=text", f"data.path={tmp_path / 'train.txt'}",
                            f"data.val_path={tmp_path / 'val.txt'}")
    files, run_dir = run_inprocess(tmp_path, "tokens", *common, "data=tokens", f"data.path={tmp_path / 'train.bin'}",
                                   f"data.val_path={tmp_path / 'val.bin'}")
    assert files["steps"] == 4 and files["data"] == "TokenFilesDataModule"
    assert files["val_bpb"] == text["val_bpb"] and files["val_loss"] == text["val_loss"]  # the same windows and steps
    assert files["val_bytes_per_token"] == text["val_bytes_per_token"] == len(val_text) / len(val)
    assert files["tokenizer_vocab_size"] == tokenizer.vocab_size and cfg_for(
        *FAST, "data=tokens", f"data.tokenizer={directory}").model.vocab_size == padded_vocab(tokenizer.vocab_size)


@pytest.mark.slow
def test_a_directory_of_modded_nanogpt_shards_trains_with_packed_documents(bpe, tmp_path):
    from hydra.utils import instantiate

    directory, tokenizer, documents = bpe
    train, val = encoded(tokenizer, documents[:360], True), encoded(tokenizer, documents[360:], True)
    shards = tmp_path / "fineweb10B"
    shards.mkdir()
    write_shards(shards, train, [len(train) // 3, len(train) // 3])  # documents cut across shards, as fineweb.py does
    write_shard(shards / "fineweb_val_000000.bin", val)
    overrides = ["attention=vq_soft", "data=tokens", f"data.path={shards / 'fineweb_train_*.bin'}",
                 f"data.val_path={shards / 'fineweb_val_*.bin'}", f"data.tokenizer={directory}",
                 "data.pack_documents=true", f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=4"]
    results, _ = run_inprocess(tmp_path, "run", *overrides)
    assert results["steps"] == 4 and np.isfinite(results["val_bpb"]) and results["corpus"]["train_tokens"] == len(train)
    table = tokenizer.token_bytes()
    assert results["val_bytes_per_token"] == pytest.approx(table[val].sum() / len(val))
    dm = instantiate(cfg_for(*FAST, *overrides).data)
    dm.setup()
    assert dm.eos_id == 0 and dm.train_starts.tolist() == np.flatnonzero(train == 0).tolist()
    assert len(dm.train_starts) == 360 and isinstance(dm.train_data, TF.Shards)

