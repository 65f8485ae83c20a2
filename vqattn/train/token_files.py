"""Pre-tokenized corpora (``data=tokens``): nanoGPT's ``train.bin`` / ``val.bin`` and modded-nanogpt's FineWeb shards,
memory-mapped as they are and read as the trainer's own token files are (:mod:`vqattn.train.tokens`).

Formats (``data.format``):

* ``raw``: what nanoGPT's ``prepare.py`` writes: the ids back to back as little-endian uint16, no header.
* ``header``: modded-nanogpt's shards (``fineweb_train_*.bin``, ``fineweb_val_*.bin``): 256 little-endian int32
  (magic 20240520, version 1, the token count, then zeros), followed by the ids as uint16.
* ``auto`` (the default): ``header`` for a file whose first int32 is the magic, else ``raw``. A raw file of GPT-2
  ids cannot begin with the magic (its low half, 54600, lies past GPT-2's 50257 tokens); a shard whose magic is
  damaged reads as raw under ``auto``, so ``data.format=header`` is the way to insist on shards.

A header is checked before anything is read: its magic (``data.format=header``), its version, and its token count
against the file's size; a raw file must hold a whole number of uint16. A file that fails is a one-line error naming
it. ``data.path`` and ``data.val_path`` are each a file or a glob: the files of a glob are one sequence in sorted
order (:class:`Shards`, no copy), and windows run from one file into the next, as documents do (modded-nanogpt cuts
a document that does not fit a shard and continues it in the next). A split of one file is the trainer's own
type: a tensor over the memory map and a :class:`vqattn.train.tokens.TokenFile` (with the header as its offset).

The ids mean what ``data.tokenizer`` says, so it is required: its vocabulary sizes the model and the bytes each of
its tokens stands for give bits per byte, whose guesses from the ids alone would be wrong. Every file is scanned
once for its largest id (an id outside the vocabulary is a one-line error naming the file, the id and where it
is), the bytes of text its tokens stand for (``val_bytes_per_token`` in results.json) and the positions of the
end-of-text id. The scan of a file (about 100M tokens a second on one core) is kept under ``CACHE/token-files/``
(CACHE as for the token files: ``data.cache_dir``, ``$VQATTN_CACHE_DIR``, ``~/.cache/vqattn/tokens``), keyed by the
file's path, size and modification time, the tokenizer's fingerprint and the end-of-text id: a later run reads it.

Packed documents (``data.pack_documents=true``) start at each end-of-text id (``data.eos_id``; null: the eos token
of the tokenizer's transformers files, else its ``<|endoftext|>``, GPT-2's 50256). modded-nanogpt writes it
before each document and nanoGPT's openwebtext ``prepare.py`` after each one: both cut at the same places, and
each document begins with it, the token it predicts its first text token from, while a document's last token is
trained to predict the end-of-text that closes it, from the document itself. An end-of-text id counts as the bytes
the tokenizer gives it (``<|endoftext|>``'s 13 characters), as it does in text that contains it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..files import atomic_file, write_text
from . import tokens
from .data import ByteDataModule, _read_files

MAGIC, VERSION = 20240520, 1
HEADER_BYTES = 256 * 4
DTYPE = np.dtype("<u2")
FORMATS = ("auto", "raw", "header")
SCAN_CHUNK = 1 << 24  # tokens per step of a scan: 32 MiB of ids and their counts in memory at a time
SPECIAL = "<|endoftext|>"
log = logging.getLogger(__name__)


def layout(path: str, format: str = "auto") -> tuple[int, int]:
    """(offset of the first token in bytes, number of tokens) of the token file at ``path`` in ``format`` (module
    docstring), after checking its header; a one-line ValueError naming the file when it does not fit."""
    if format not in FORMATS:
        raise ValueError(f"data.format must be one of {', '.join(FORMATS)}, got {format!r}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4", count=min(size, HEADER_BYTES) // 4)
    if format == "header" or format == "auto" and len(head) and head[0] == MAGIC:
        if size < HEADER_BYTES:
            raise ValueError(f"token file {path} is truncated or corrupt ({size} bytes, shorter than the "
                             f"{HEADER_BYTES}-byte header of a modded-nanogpt shard)")
        if head[0] != MAGIC:
            raise ValueError(f"token file {path} is not a modded-nanogpt shard: its header's magic is {head[0]}, not "
                             f"{MAGIC} (data.format=raw reads headerless uint16 ids, as nanoGPT's prepare.py writes)")
        if head[1] != VERSION:
            raise ValueError(f"token file {path} has header version {head[1]}: only version {VERSION} (uint16 ids) "
                             "is read")
        count = int(head[2])
        if count < 0 or size != HEADER_BYTES + count * DTYPE.itemsize:
            raise ValueError(f"token file {path} is truncated or corrupt ({size} bytes, its header says {count} "
                             f"tokens of uint16: {HEADER_BYTES + count * DTYPE.itemsize} bytes)")
        return HEADER_BYTES, count
    if size % DTYPE.itemsize:
        raise ValueError(f"token file {path} is truncated or corrupt ({size} bytes, not a whole number of uint16 ids)")
    return 0, size // DTYPE.itemsize


def map_tokens(path: str, offset: int, count: int) -> np.ndarray:
    """The ``count`` ids after ``offset`` bytes of ``path``, memory-mapped read-only (an empty array for none)."""
    if count == 0:
        return np.zeros(0, DTYPE)
    return np.memmap(path, dtype=DTYPE, mode="r", offset=offset, shape=(count,))


class Shards:
    """Token files read as one sequence, in order, without a copy, as the trainer reads a split: its length,
    consecutive slices and gathers at index tensors (the tokens: :class:`vqattn.train.streams.StreamBatches`' reads)
    and windows read with ``pread`` (the file: :meth:`vqattn.train.tokens.TokenFile.windows`), which cross from one
    file into the next. ``files``: (path, offset of the first token in bytes, tokens) of each file."""

    dtype = torch.uint16

    def __init__(self, files: list[tuple[str, int, int]]):
        self.layout = [tuple(f) for f in files if f[2] > 0]  # an empty file adds nothing to the sequence
        self.arrays = [map_tokens(*f) for f in self.layout]
        self.files = [tokens.TokenFile(Path(path), DTYPE, offset) for path, offset, _ in self.layout]
        self.bounds = np.cumsum([0, *(count for _, _, count in self.layout)])  # each file's first token

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def _file_of(self, positions) -> np.ndarray:
        return np.searchsorted(self.bounds, positions, side="right") - 1

    def windows(self, offsets, length: int) -> torch.Tensor:
        """(B, length) int64: the ``length`` tokens from each of the B ``offsets``."""
        out = np.empty((len(offsets), length), dtype=np.int64)
        for row, start in enumerate(int(o) for o in offsets):
            if start < 0 or start + length > len(self):
                raise IndexError(f"window [{start}, {start + length}) outside the {len(self)} tokens")
            k, done = int(self._file_of(start)), 0
            while done < length:
                local = start + done - int(self.bounds[k])
                n = min(length - done, self.layout[k][2] - local)
                out[row, done:done + n] = self.files[k].windows([local], n)[0].numpy()
                done, k = done + n, k + 1
        return torch.from_numpy(out)

    def __getitem__(self, index) -> torch.Tensor:
        """A slice (step 1) or an index tensor of positions: their tokens, uint16 (a copy of those alone)."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"Shards take slices of step 1, got {step}")
            pieces = [a[max(start - b, 0):max(min(stop - b, len(a)), 0)] for a, b in zip(self.arrays, self.bounds)]
            return torch.from_numpy(np.concatenate([np.zeros(0, DTYPE), *pieces]))
        positions = index.numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"positions outside the {len(self)} tokens")
        files, out = self._file_of(positions), np.empty(positions.shape, DTYPE)
        for k in np.unique(files):
            at = files == k
            out[at] = self.arrays[k][positions[at] - self.bounds[k]]
        return torch.from_numpy(out)

    def __getstate__(self):  # DataLoader workers map the files again instead of copying the arrays
        return {"layout": self.layout}

    def __setstate__(self, state):
        self.__init__(state["layout"])


def end_of_text(tokenizer, spec: str | None) -> int | None:
    """The id packed documents start at: the ``eos_token`` of the transformers files beside the tokenizer
    (tokenizer_config.json or special_tokens_map.json), else ``<|endoftext|>`` when the vocabulary holds it; None
    for bytes or a tokenizer with neither. A SentencePiece model's is its ``</s>``."""
    processor = getattr(tokenizer, "processor", None)  # vqattn.tokenizer's SentencePiece model
    if processor is not None:
        return int(processor.eos_id()) if processor.eos_id() >= 0 else None
    rust = getattr(tokenizer, "tokenizer", None)
    if rust is None or not hasattr(rust, "token_to_id"):
        return None
    path = Path(str(spec))
    directory = path if path.is_dir() else path.parent if path.name == "tokenizer.json" else None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            eos = json.loads((directory / name).read_text()).get("eos_token") if directory else None
        except (OSError, ValueError, AttributeError):
            continue
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and rust.token_to_id(eos) is not None:
            return int(rust.token_to_id(eos))
    found = rust.token_to_id(SPECIAL)
    return None if found is None else int(found)


@dataclass
class Scan:
    """What a token file's scan found: its largest id (-1: no token), the bytes of text its tokens stand for and
    the positions of the end-of-text id (None without one)."""

    max_id: int
    n_bytes: int
    starts: np.ndarray | None


def scan(path: str, array: np.ndarray, offset: int, tokenizer, eos: int | None, cache: Path, bar=None) -> Scan:
    """The scan of the token file at ``path`` (its ids: ``array``), read from ``cache`` when made before for the
    same file and tokenizer (module docstring), else made and kept there; a one-line ValueError for an id outside
    the tokenizer's vocabulary."""
    stat = os.stat(path)
    key = hashlib.sha256(json.dumps([os.path.abspath(path), stat.st_size, stat.st_mtime_ns, offset,
                                     tokenizer.fingerprint, eos]).encode()).hexdigest()[:16]
    record, positions = cache / f"{Path(path).name}-{key}.json", cache / f"{Path(path).name}-{key}.starts.npy"
    try:  # a scan is only a cache: one unreadable is made again
        kept = json.loads(record.read_text())
        if bar is not None:
            bar.update(len(array))
        return Scan(kept["max_id"], kept["bytes"], np.load(positions) if eos is not None else None)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    vocab, table = tokenizer.vocab_size, tokenizer.token_bytes()
    n_bytes, max_id, starts = 0, -1, []
    for i in range(0, len(array), SCAN_CHUNK):
        chunk = np.asarray(array[i:i + SCAN_CHUNK])
        counts = np.bincount(chunk, minlength=vocab)
        if len(counts) > vocab:
            at = int(np.flatnonzero(chunk >= vocab)[0])
            raise ValueError(f"token file {path} holds id {int(chunk[at])} at token {i + at}, outside the {vocab} "
                             f"tokens of data.tokenizer={tokenizer.spec}: give the tokenizer the files were made with")
        n_bytes += int(counts @ table)
        max_id = max(max_id, int(np.flatnonzero(counts)[-1]))
        if eos is not None:
            starts.append(np.flatnonzero(chunk == eos) + i)
        if bar is not None:
            bar.update(len(chunk))
    found = Scan(max_id, n_bytes, np.concatenate([np.zeros(0, np.int64), *starts]) if eos is not None else None)
    try:  # each file renamed into place when whole: a run stopped mid-write, or two runs at once, leave no half file
        if eos is not None:  # the positions first: a record is only ever beside its complete positions
            with atomic_file(positions, "wb") as f:
                np.save(f, found.starts)
        write_text(record, json.dumps({"path": os.path.abspath(path), "tokens": len(array), "max_id": max_id,
                                       "bytes": n_bytes, "eos": eos,
                                       "documents": None if eos is None else len(found.starts)}) + "\n")
    except OSError as err:  # a read-only or full cache costs the next run a scan, not this run its start
        log.warning("could not keep the scan of %s in %s (%s): the next run scans it again", path, cache, err)
    return found


class TokenFilesDataModule(ByteDataModule):
    """Pre-tokenized files (``data=tokens``, module docstring): ``path`` the training files, ``val_path`` the
    validation files (each a file or a glob), ``format`` auto / raw / header, ``tokenizer`` the tokenizer they were
    made with (required), ``eos_id`` the end-of-text id documents start at with ``pack_documents`` (None: the
    tokenizer's). Training windows, streams, validation windows and packing are those of every other corpus
    (:class:`vqattn.train.data.ByteDataModule`), over the files as they are."""

    name = "tokens"

    def __init__(self, *, path: str | None = None, val_path: str | None = None, format: str = "auto",
                 eos_id: int | None = None, tokenizer: str | None = None, separator: str | None = None, **kwargs):
        if not path:
            raise ValueError("data=tokens needs data.path=FILE_OR_GLOB, the training token files (a train.bin, or "
                             "'fineweb_train_*.bin')")
        if not val_path:
            raise ValueError("data=tokens needs data.val_path=FILE_OR_GLOB, the validation token files (a val.bin, "
                             "or 'fineweb_val_*.bin')")
        if format not in FORMATS:
            raise ValueError(f"data.format must be one of {', '.join(FORMATS)}, got {format!r}")
        if tokenizer is None:
            raise ValueError("data=tokens needs data.tokenizer=, the tokenizer the files were made with (a "
                             "transformers directory such as GPT-2's, a tokenizer.json, or bytes for byte ids): it "
                             "sizes the model's vocabulary and gives bits per byte")
        if separator is not None:
            raise ValueError(f"data.separator={separator!r} splits text: token files' documents start at the "
                             "end-of-text id (data.eos_id)")
        super().__init__(tokenizer=tokenizer, **kwargs)
        self.path, self.val_path, self.format = path, val_path, format
        if eos_id is None:
            eos_id = end_of_text(self.tokenizer, tokenizer)
        elif isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < self.tokenizer.vocab_size:
            raise ValueError(f"data.eos_id must be a token id of data.tokenizer (0 to "
                             f"{self.tokenizer.vocab_size - 1}) or null (the tokenizer's own), got {eos_id!r}")
        if self.pack_documents and eos_id is None:
            raise ValueError(f"data.pack_documents=true starts documents at the end-of-text id, but "
                             f"data.tokenizer={tokenizer} has no eos token nor {SPECIAL}: set data.eos_id=ID")
        self.eos_id = eos_id

    def _source(self) -> str:
        return f"{self.path}, validation {self.val_path}"

    def _advice(self, split: str) -> str:
        return f"give more tokens in {'data.path' if split == 'training' else 'data.val_path'} or lower model.seq_len"

    def _splits(self) -> dict[str, tokens.TokenSplit]:
        from tqdm.auto import tqdm

        paths = {split: [unit.path for unit in _read_files(pattern, key)]
                 for split, pattern, key in (("train", self.path, "data.path"), ("val", self.val_path, "data.val_path"))}
        shared = sorted(set(map(os.path.abspath, paths["train"])) & set(map(os.path.abspath, paths["val"])))
        if shared:
            raise ValueError(f"data.path and data.val_path both hold {shared[0]}: validation would score tokens the "
                             "model trained on")
        files = {split: [(p, *layout(p, self.format)) for p in split_paths] for split, split_paths in paths.items()}
        total = sum(count for split_files in files.values() for _, _, count in split_files)
        cache = tokens.cache_root(self.cache_dir) / "token-files"
        with tqdm(total=total, unit="tok", unit_scale=True, delay=2, desc="scanning token files") as bar:
            return {split: self._split(split_files, cache, bar) for split, split_files in files.items()}

    def _split(self, files: list[tuple[str, int, int]], cache: Path, bar) -> tokens.TokenSplit:
        """One split's files as the trainer's token split: ids, windows, document starts and bytes of text."""
        arrays = [map_tokens(*f) for f in files]
        scans = [scan(p, a, offset, self.tokenizer, self.eos_id, cache, bar) for (p, offset, _), a in zip(files, arrays)]
        first = np.cumsum([0, *map(len, arrays)])
        starts = np.concatenate([np.zeros(0, np.int64), *(s.starts + b for s, b in zip(scans, first)
                                                          if s.starts is not None)])
        n_bytes = sum(s.n_bytes for s in scans)
        if len(files) > 1:
            shards = Shards(files)
            return tokens.TokenSplit(shards, shards, starts, n_bytes, Path(files[0][0]))
        (path, offset, _), array = files[0], arrays[0]
        with warnings.catch_warnings():  # a read-only map: torch warns that it could not write to it (nothing does)
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(array)
        return tokens.TokenSplit(data, tokens.TokenFile(Path(path), DTYPE, offset), starts, n_bytes, Path(path))
