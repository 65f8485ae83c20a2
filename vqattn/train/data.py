"""Language-modelling LightningDataModules over token files; the synthetic MQAR task is in :mod:`vqattn.train.mqar`.

Every module yields batches ``(x, y)`` of shape (B, T) long: ``y`` is ``x`` shifted by one token, and
positions that carry no training signal hold ``IGNORE_INDEX`` (only MQAR uses that). With packed documents
(``data.pack_documents=true``, the byte corpora) a batch is ``(x, y, starts)``: ``starts`` (B, T) bool is True where
a document begins in x, and at every row's first position (:class:`ByteDataModule`).

Training batches are a pure function of ``(seed, batch index, rank)``: batch ``i`` on rank ``r`` draws its
random windows from ``numpy.random.default_rng([seed, i, r])``. A run resumed from a checkpoint at global
step ``s`` therefore continues with batch ``s * accumulate_grad_batches`` and sees exactly the batches an
uninterrupted run would have seen, and DDP ranks draw different batches without a DistributedSampler
(the trainer configs set ``use_distributed_sampler: false``). Validation windows are fixed and sharded by rank.

Every corpus is tokenized once by ``data.tokenizer`` (bytes by default, or a subword tokenizer:
:mod:`vqattn.tokenizer`) into memory-mapped token files (:mod:`vqattn.train.tokens`), which training and
validation windows read: a run's memory does not grow with its corpus, and a later run reuses the files.

Corpora:

* ``StdlibDataModule`` (``data=default``): the ``.py`` files of the running Python's standard library.
* ``TextDataModule`` (``data=text``): local files, a path or a glob.
* ``HubTextDataModule`` (``data=enwik8`` / ``data=wikitext103``): Hugging Face Hub datasets via ``datasets``.
* ``vqattn.train.token_files.TokenFilesDataModule`` (``data=tokens``): pre-tokenized files (nanoGPT's ``train.bin``,
  modded-nanogpt's shards), memory-mapped as they are.
* ``vqattn.train.mqar.MQARDataModule`` (``data=mqar``): multi-query associative recall (Zoology).
"""

from __future__ import annotations

import codecs
import glob
import math
import os
import platform
import sysconfig
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..tokenizer import load_tokenizer
from . import tokens
from .streams import CarriedValBatches, StreamBatches

# The loaders below resume from trainer.global_step (see module docstring), which Lightning cannot see.
warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")


class _Batches(Dataset):
    """Map-style dataset whose item ``i`` is a whole training batch ``make(rng_i)`` with rng_i seeded by (seed, i, rank)."""

    def __init__(self, make, num_batches: int, seed: int, rank: int):
        self.make, self.num_batches, self.seed, self.rank = make, num_batches, seed, rank

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, i: int):
        return self.make(np.random.default_rng([self.seed, i, self.rank]))


class _From(Sampler):
    """Indices start(), start() + 1, ..., length - 1 (resuming skips the batches already trained on).

    ``start`` is read whenever an iterator begins: under DDP Lightning re-creates the iterator of a resumed run
    after its first batch, which a start fixed when the loader was built would replay.
    """

    def __init__(self, start, length: int):
        self.start, self.length = start, length

    def __len__(self) -> int:
        return self.length - self.start()

    def __iter__(self):
        return iter(range(self.start(), self.length))


class _LMDataModule(L.LightningDataModule):
    """Shared loader logic. Subclasses implement ``setup`` and ``_train_batch(rng)``, and fill ``self.val_set``.

    Args:
        seq_len: tokens per training sequence T (the model sees x[:, :T] and predicts y[:, :T]).
        batch_size: sequences per batch and per device.
        seed: seeds the training batches (not the model).
        num_workers: DataLoader workers.
        stream: training batches are consecutive segments, row r of batch i + G continuing row r of batch i
            (carried-state training, see vqattn.train.streams); byte corpora only.
        stream_groups: G, with ``stream``: G groups of batch_size streams read in turn, so that consecutive
            batches come from different text (1: batch i + 1 continues batch i).
        val_carried: validation also runs its windows as consecutive segments with the state carried (a second
            validation loader, reported as val_bpb_carried); byte corpora only.

    The training "epoch" is the whole run, ``trainer.max_steps * accumulate_grad_batches`` batches (so the
    progress bar is exact), which is why the trainer must set ``max_steps``.
    """

    def __init__(self, seq_len: int = 256, batch_size: int = 8, seed: int = 0, num_workers: int = 0,
                 stream: bool = False, stream_groups: int = 1, val_carried: bool = False):
        super().__init__()
        self.stream, self.stream_groups, self.val_carried = stream, stream_groups, val_carried
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("stream_groups", stream_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"data.{name} must be a positive int, got {value!r}")
        if stream_groups > 1 and not stream:
            raise ValueError(f"data.stream_groups={stream_groups} groups the streams of data.stream=true (set by "
                             "carry_state=true); random windows have no streams to group")
        self.seq_len, self.batch_size, self.seed, self.num_workers = seq_len, batch_size, seed, num_workers
        self.val_set: Dataset | None = None

    def corpus(self) -> dict:
        """What the run trained on, for results.json and the reports that compare runs: ``name`` (the data option's
        corpus), ``source`` (where its text came from: a path, a Hub dataset, or None) and, once set up, the bytes of
        each split (byte corpora)."""
        return {"name": self.name, "source": self._source()}

    def _source(self) -> str | None:
        return None

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _train_batch(self, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        rank, _ = self._rank_world()
        trainer = self.trainer
        if trainer is None or trainer.max_steps is None or trainer.max_steps <= 0:
            raise ValueError("the training data is sized by the run: set trainer.max_steps to a positive number")
        length = trainer.max_steps * trainer.accumulate_grad_batches

        def start() -> int:  # read when an iterator begins: a resumed DDP run re-creates its iterator
            return min(trainer.global_step * trainer.accumulate_grad_batches, length)

        batches = self._train_dataset(length)
        return DataLoader(batches, batch_size=None, sampler=_From(start, length), num_workers=self.num_workers)

    def _train_dataset(self, length: int) -> Dataset:
        """Item i = training batch i of this rank."""
        return _Batches(self._train_batch, length, self.seed, self._rank_world()[0])

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """This rank's share of the validation windows; with val_carried also the carried pass (vqattn.train.streams)."""
        rank, world = self._rank_world()
        shard = torch.utils.data.Subset(self.val_set, range(rank, len(self.val_set), world))
        loader = DataLoader(shard, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
        if not self.val_carried:
            return loader

        carried = CarriedValBatches(self.val_set, batch_size=self.batch_size, rank=rank, world_size=world)
        return [loader, DataLoader(carried, batch_size=None, num_workers=self.num_workers)]


def window_starts(starts: np.ndarray, offsets, seq_len: int) -> torch.Tensor:
    """(B, T) bool for the windows of ``seq_len`` tokens at ``offsets`` (B,): True where a document starts (``starts``:
    sorted token indices of documents' first tokens) and at every window's first position (it sees nothing before)."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    out = torch.zeros(len(offsets), seq_len, dtype=torch.bool)
    lo, hi = np.searchsorted(starts, offsets), np.searchsorted(starts, offsets + seq_len)
    for row, (o, a, b) in enumerate(zip(offsets, lo, hi)):
        out[row, torch.from_numpy(starts[a:b] - o)] = True
    out[:, 0] = True
    return out


class _WindowSet(Dataset):
    """Fixed windows of a token tensor: item i = (data[o:o+T], data[o+1:o+T+1]) for the i-th offset; with ``starts``
    (sorted token indices of documents' first tokens) also the window's starts (T,) bool, its first position always
    True."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, seq_len: int, starts: np.ndarray | None = None,
                 file: tokens.TokenFile | None = None):
        self.data, self.offsets, self.seq_len, self.starts, self.file = data, offsets, seq_len, starts, file

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int):
        o = int(self.offsets[i])
        if self.file is not None:  # the token file read without mapping (tokens.TokenFile)
            chunk = self.file.windows([o], self.seq_len + 1)[0]
        else:
            chunk = self.data[o : o + self.seq_len + 1].long()
        if self.starts is None:
            return chunk[:-1], chunk[1:]
        return chunk[:-1], chunk[1:], window_starts(self.starts, [o], self.seq_len)[0]


def separator_bytes(separator: str | bytes | None) -> bytes | None:
    """``data.separator`` as bytes: a str is read with Python's backslash escapes (``"\\n\\n"``, ``"\\x00"``, so
    that a command line can write them) and encoded as UTF-8; None stays None."""
    if separator is None or isinstance(separator, bytes):
        out = separator
    elif isinstance(separator, str):
        try:
            out = codecs.escape_decode(separator.encode("utf-8"))[0]
        except ValueError as err:
            raise ValueError(f"data.separator={separator!r} is not a valid escaped string: {err}") from None
    else:
        raise ValueError(f"data.separator must be a string or null, got {separator!r}")
    if out is not None and not out:
        raise ValueError("data.separator must not be empty (null: documents are the files, or the dataset's rows)")
    return out


def cut_units(units: Sequence, start: int, stop: int) -> list:
    """Bytes start..stop-1 of the units' concatenation (byte strings or file slices) as units: a unit the cut goes
    through keeps its part."""
    return tokens.cut(list(units), start, stop)


class ByteDataModule(_LMDataModule):
    """Next-token prediction on a train and a validation text, tokenized by ``tokenizer`` into token files.

    ``tokenizer``: ``bytes`` (one token per byte), a tokenizers JSON file or a transformers tokenizer directory
    (:mod:`vqattn.tokenizer`); ``cache_dir``: where the token files go (None: ``$VQATTN_CACHE_DIR`` or
    ``~/.cache/vqattn/tokens``; :mod:`vqattn.train.tokens`). ``token_bytes`` (V,) gives the bytes each token id
    stands for, so that validation counts bits per byte of text whatever the tokenizer.
    Training batches are ``batch_size`` windows of ``seq_len + 1`` tokens at uniformly random offsets.
    Validation uses non-overlapping windows tiling the validation tokens, at most ``val_windows`` of them
    (spread evenly over the split when there are more, or the first ``val_windows`` with ``val_carried``, whose
    pass needs consecutive windows), so val bits per byte is over the bytes of those windows.
    Subclasses implement ``_units() -> (train_units, val_units)``: each split as a list of byte strings (dataset
    rows) or file slices (:class:`vqattn.train.tokens.Slice`), whose concatenation is the split's text (``_load``
    returns the two texts, read into memory).

    Packed documents (``pack_documents=True``): the windows are the same (the same random offsets for a given seed,
    batch index and rank), and each batch also carries ``starts`` (B, T) bool, True at the positions of x where a
    document begins, and at every row's first position (the model sees nothing before it); the validation windows
    carry theirs too. The trainer (vqattn.train.lit.LitLM) then runs the rows as one packed row cut at these starts,
    so that no document attends to the one before it. Documents are the units (each non-empty file or row starts
    one) and, with ``separator``, also split inside a unit after each occurrence of the separator, which stays at
    the end of the document it ends. The targets are unchanged: the last byte of a document (its separator, or
    the end of its file) is still trained to predict the next document's first byte, as GPT-2 style packing does.
    ``separator``: a string read with Python's backslash escapes (``"\\n\\n"``, ``"\\x00"``) and encoded as
    UTF-8; it needs ``pack_documents``. Packing cuts windows, so it cannot be combined with ``stream`` or
    ``val_carried``, which read the text as one continuous stream with the state carried across windows.

    Repeated passages (``repeat_fraction`` > 0), the training mix of retrieval data, where a passage recurs later in
    its document: that fraction of the training rows (drawn per row) has a passage of ``repeat_len`` tokens copied
    from a random place of the row to a random later place, at every gap that fits (:func:`repeat_passages`), so
    that copying from far back pays; ``vqattn.train.copy_eval`` scores it. Validation windows are never changed, so
    val bpb stays the corpus's. A copy would cross the documents of ``pack_documents`` and the windows of
    ``stream``, so it combines with neither.
    """

    name = "bytes"

    def __init__(self, *, val_windows: int = 256, pack_documents: bool = False, separator: str | None = None,
                 tokenizer: str = "bytes", cache_dir: str | None = None, repeat_fraction: float = 0.0,
                 repeat_len: int = 32, **kwargs):
        super().__init__(**kwargs)
        check_repeats(repeat_fraction, repeat_len, self.seq_len)
        for key, clash in (("pack_documents", pack_documents), ("stream", self.stream)):
            if repeat_fraction and clash:
                raise ValueError(f"data.repeat_fraction={repeat_fraction} copies passages inside a training window, "
                                 f"across the documents or the carried windows of data.{key}=true: set one of them "
                                 "off (data.repeat_fraction=0)")
        self.repeat_fraction, self.repeat_len = repeat_fraction, repeat_len
        self.tokenizer = load_tokenizer(tokenizer)  # a one-line error for a path that holds no tokenizer
        self.cache_dir = cache_dir
        if not isinstance(pack_documents, bool):
            raise ValueError(f"data.pack_documents must be true or false, got {pack_documents!r}")
        if separator is not None and not pack_documents:
            raise ValueError(f"data.separator={separator!r} splits the documents of data.pack_documents=true: set "
                             "data.pack_documents=true too, or leave data.separator null")
        for key, why, fix in (("stream", "data.stream=true (set by carry_state=true) reads", "carry_state=false"),
                              ("val_carried", "data.val_carried=true (set by carry_state=true and experiment=long) "
                                              "validates on", "data.val_carried=false")):
            if pack_documents and getattr(self, key):
                raise ValueError(f"data.pack_documents=true cuts each window at its documents' starts, but {why} "
                                 f"continuous streams with the state carried across documents: set {fix} or "
                                 "data.pack_documents=false")
        self.val_windows, self.pack_documents = val_windows, pack_documents
        self.separator = separator_bytes(separator)
        self.train_data: torch.Tensor | None = None
        self.train_starts: np.ndarray | None = None  # with pack_documents: each document's first token index
        self.train_file: tokens.TokenFile | None = None  # train_data's file, for random windows
        self.token_bytes = torch.from_numpy(self.tokenizer.token_bytes())  # (V,) bytes per token id
        self.split_sizes: dict | None = None  # each split's bytes and tokens, once set up (results.json's corpus)

    def _units(self) -> tuple[list, list]:
        raise NotImplementedError

    def _load(self) -> tuple[bytes, bytes]:
        """The training and validation texts."""
        return tuple(b"".join(tokens.unit_bytes(u) for u in units) for units in self._units())

    def _advice(self, split: str) -> str:
        """What to change when ``split`` is too short for one window."""
        return "lower model.seq_len"

    def corpus(self) -> dict:
        sizes = {} if self.split_sizes is None else self.split_sizes
        return {**super().corpus(), **sizes}

    @property
    def val_bytes_per_token(self) -> float | None:
        """Bytes per token of the whole validation split, once set up."""
        sizes = self.split_sizes
        return None if sizes is None else sizes["val_bytes"] / sizes["val_tokens"]

    def _splits(self) -> dict[str, tokens.TokenSplit]:
        """The ``train`` and ``val`` token splits: the units tokenized into token files (made once, then reused).
        Pre-tokenized files (:mod:`vqattn.train.token_files`) are another source of the same splits."""
        train_units, val_units = self._units()
        return tokens.prepare(self.name, {"train": train_units, "val": val_units}, self.tokenizer, self.separator,
                              self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        splits = self._splits()
        need, word = self.seq_len + 1, "byte" if self.tokenizer.spec == "bytes" else "token"
        for split, data in (("training", splits["train"].tokens), ("validation", splits["val"].tokens)):
            if len(data) < need:
                n = len(data)
                raise ValueError(
                    f"{self.name}: the {split} split has {n} {word}{'' if n == 1 else 's'} but seq_len={self.seq_len} "
                    f"needs at least {need}; {self._advice(split)}"
                )
        self.train_data, val_data = splits["train"].tokens, splits["val"].tokens
        self.split_sizes = {f"{name}_{unit}": count for name in ("train", "val")
                            for unit, count in (("bytes", splits[name].n_bytes), ("tokens", len(splits[name].tokens)))}
        self.train_file = splits["train"].file
        val_starts = None
        if self.pack_documents:
            self.train_starts, val_starts = splits["train"].starts, splits["val"].starts
        n = (len(val_data) - 1) // self.seq_len
        tiles = torch.arange(n) * self.seq_len
        if n > self.val_windows:
            spread = torch.linspace(0, n - 1, self.val_windows).round().long()
            tiles = tiles[torch.arange(self.val_windows) if self.val_carried else spread]
        self.val_set = _WindowSet(val_data, tiles, self.seq_len, val_starts, splits["val"].file)

    def _train_dataset(self, length: int) -> Dataset:
        if not self.stream:
            return super()._train_dataset(length)

        rank, world = self._rank_world()
        return StreamBatches(self.train_data, seq_len=self.seq_len, batch_size=self.batch_size, rank=rank,
                             world_size=world, seed=self.seed, num_batches=length, groups=self.stream_groups)

    def _train_batch(self, rng):
        offsets = rng.integers(0, len(self.train_data) - self.seq_len, size=self.batch_size)
        chunk = self.train_file.windows(offsets, self.seq_len + 1)  # (B, T+1)
        if self.repeat_fraction:
            chunk = repeat_passages(chunk, rng, self.repeat_fraction, self.repeat_len)
        if self.train_starts is None:
            return chunk[:, :-1], chunk[:, 1:]
        return chunk[:, :-1], chunk[:, 1:], window_starts(self.train_starts, offsets, self.seq_len)


def check_repeats(fraction, length, seq_len: int) -> None:
    """data.repeat_fraction in [0, 1]; with a fraction, data.repeat_len an int with two passages fitting a window."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"data.repeat_fraction must be a number in [0, 1], got {fraction!r}")
    if fraction and (isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= (seq_len + 1) // 2):
        raise ValueError(f"data.repeat_len must be an int in [1, {(seq_len + 1) // 2}] (two passages in a window of "
                         f"seq_len + 1 = {seq_len + 1} tokens), got {length!r}")


def repeat_passages(chunk: torch.Tensor, rng: np.random.Generator, fraction: float, length: int) -> torch.Tensor:
    """Training rows with a repeated passage: chunk (B, T + 1) token ids -> the same rows, each with probability
    ``fraction`` changed so that its ``length`` tokens at a uniform position a recur at a uniform later position
    b ≥ a + length (written over what stood there), every gap from 0 to T + 1 − 2·length possible. Draws from ``rng``
    (three numbers per row), so a batch stays a pure function of its seed."""
    chunk = chunk.clone()
    span = chunk.shape[1] - length  # the last start a passage can have
    for row, (u, va, vb) in enumerate(rng.random((chunk.shape[0], 3))):
        if u < fraction:
            a = int(va * (span - length + 1))  # a in [0, span − length]: room for the repeat after it
            b = a + length + int(vb * (span - a - length + 1))  # b in [a + length, span]
            chunk[row, b:b + length] = chunk[row, a:a + length]
    return chunk


def stdlib_files(max_bytes: int) -> tuple[Path, list[Path]]:
    """The default corpus's files: the stdlib root and its ``.py`` files, in sorted order, up to max_bytes.

    Excluded: site-packages / dist-packages (third-party code) and test suites (directories named test,
    tests, idle_test), which are large, repetitive and vary between builds.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(_python_files(root, skip={"site-packages", "dist-packages", "test", "tests", "idle_test",
                                                 "__pycache__"})):
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return root, files


def _python_files(root: Path, skip: set[str]):
    """The ``.py`` files under root, never entering a directory named in ``skip``: site-packages alone is larger than
    the standard library, and a ``pip install`` running meanwhile removes directories from it mid-walk."""
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in skip]
        yield from (path for path in (Path(directory) / name for name in names if name.endswith(".py"))
                    if path.is_file())


class StdlibDataModule(ByteDataModule):
    """Default corpus: the running Python's standard library source, byte-level, no download.

    Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except site-packages and test suites, in
    sorted path order, concatenated until ``max_bytes``. A file goes to validation when
    ``zlib.crc32(relative_path) % 20 == 0`` (about 5% of files; by file so that no validation text was trained
    on), otherwise to training. Deterministic for a given Python version; it differs between Python versions.
    On CPython 3.11 with the default max_bytes=8_000_000 this is 557 files: 7.64 MB train, 0.36 MB validation.
    Without ``pack_documents`` (the default) the files are read as one continuous stream; with it each file is a
    document (split further at ``separator`` when one is given).
    """

    name = "stdlib"

    def __init__(self, *, max_bytes: int = 8_000_000, **kwargs):
        super().__init__(**kwargs)
        self.max_bytes = max_bytes

    def _source(self) -> str:
        return f"{sysconfig.get_paths()['stdlib']} (Python {platform.python_version()})"

    def _units(self) -> tuple[list[bytes], list[bytes]]:
        root, files = stdlib_files(self.max_bytes)
        if not files:
            raise FileNotFoundError(f"no standard-library .py files found under {root}")
        splits = {True: [], False: []}
        for path in files:
            rel = path.relative_to(root).as_posix()
            splits[zlib.crc32(rel.encode()) % 20 == 0].append(tokens.Slice(str(path), 0, path.stat().st_size))
        return splits[False], splits[True]


def _read_files(pattern: str, what: str) -> list[tokens.Slice]:
    """A file, or each file matching a glob (sorted; their concatenation is the text: line breaks kept), whole."""
    pattern = os.path.expanduser(str(pattern))
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise FileNotFoundError(f"{what}: no file found at {pattern!r} (give an existing file or a glob that matches files)")
    return [tokens.Slice(p, 0, os.path.getsize(p)) for p in paths]


class TextDataModule(ByteDataModule):
    """Local text (``data=text data.path=FILE_OR_GLOB``), read as raw bytes so line breaks and encodings are kept.

    Validation is ``val_path`` when given, otherwise the last ``val_fraction`` (5%) of the training bytes,
    which are then removed from training. With ``pack_documents`` each file is a document (split further at
    ``separator`` when one is given: the way to pack the documents of one file).
    """

    name = "text"

    def __init__(self, *, path: str | None = None, val_path: str | None = None, val_fraction: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        if not path:
            raise ValueError("data=text needs data.path=FILE (a file or a glob)")
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction must lie in (0, 1), got {val_fraction!r}")
        self.path, self.val_path, self.val_fraction = path, val_path, val_fraction

    def _advice(self, split: str) -> str:
        if split == "training":
            return "give more text in data.path or lower model.seq_len"
        if self.val_path:
            return "give more text in data.val_path or lower model.seq_len"
        return (f"give a validation file (data.val_path=FILE), or raise data.val_fraction (now {self.val_fraction}), "
                f"or lower model.seq_len")

    def _source(self) -> str:
        return str(self.path) + (f", validation {self.val_path}" if self.val_path else "")

    def _units(self) -> tuple[list[bytes], list[bytes]]:
        train = _read_files(self.path, "data.path")
        if self.val_path:
            return train, _read_files(self.val_path, "data.val_path")
        total = sum(tokens.unit_len(unit) for unit in train)
        cut = total - math.ceil(total * self.val_fraction)
        return cut_units(train, 0, cut), cut_units(train, cut, total)


class DataUnavailableError(RuntimeError):
    """A corpus cannot be obtained (e.g. a Hub dataset while offline)."""


def load_dataset(*args, **kwargs):
    """``datasets.load_dataset`` (module-level so tests can stand in a local copy)."""
    import datasets

    return datasets.load_dataset(*args, **kwargs)


class HubTextDataModule(ByteDataModule):
    """A text dataset from the Hugging Face Hub, UTF-8 encoded to bytes.

    ``layout="enwik8"``: the standard enwik8 split, the first 90M bytes train, the next 5M validation (the
    last 5M are the test set, unused here). Rows are re-joined into one text: as stored when they end in a
    newline, else with ``\\n`` between them (the "enwik8-raw" config is a single row holding the whole file).
    ``revision``: the Hub revision; LTCB/enwik8 is a loading script, which ``datasets`` >= 4 no longer runs,
    so data/enwik8.yaml reads the Hub's parquet export (``refs/convert/parquet``).
    ``layout="splits"``: the dataset's own ``train`` and ``validation`` splits, rows concatenated as stored
    (wikitext-103-raw rows keep their trailing newline).
    With ``pack_documents`` each row is a document (split further at ``separator`` when one is given): the
    enwik8-raw row is the whole file, so give a separator; wikitext-103-raw's rows are single lines (headings,
    paragraphs, blank lines), not articles.
    """

    ENWIK8_SPLIT = (90_000_000, 5_000_000)

    def __init__(self, *, hub_path: str, hub_name: str | None = None, layout: str = "splits",
                 revision: str | None = None, name: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if layout not in ("enwik8", "splits"):
            raise ValueError(f"data.layout must be 'enwik8' or 'splits', got {layout!r}")
        self.hub_path, self.hub_name, self.layout, self.revision = hub_path, hub_name, layout, revision
        self.name = name or hub_path

    def _source(self) -> str:
        return f"hf://{self.hub_path}" + (f" ({self.hub_name})" if self.hub_name else "")

    def _fetch(self, split: str):
        try:
            return load_dataset(self.hub_path, self.hub_name, split=split, revision=self.revision)
        except Exception as err:  # network, auth and missing-dataset errors all mean: cannot get the data
            raise DataUnavailableError(
                f"could not load {self.name} ({self.hub_path}{', ' + self.hub_name if self.hub_name else ''}, split "
                f"{split!r}) from the Hugging Face Hub: {type(err).__name__}: {err}\nIt needs a network connection "
                f"(or a filled datasets cache); offline, use data=default or data=text data.path=FILE."
            ) from err

    def _units(self) -> tuple[list[bytes], list[bytes]]:
        if self.layout == "enwik8":
            rows = self._fetch("train")["text"]
            if not all(r.endswith("\n") for r in rows):  # joined with "\n" between them
                rows = [*(r + "\n" for r in rows[:-1]), *rows[-1:]]
            units = [r.encode() for r in rows]
            n_train, n_val = self.ENWIK8_SPLIT
            return cut_units(units, 0, n_train), cut_units(units, n_train, n_train + n_val)
        return tuple([r.encode() for r in self._fetch(split)["text"]] for split in ("train", "validation"))
