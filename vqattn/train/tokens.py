"""Corpora as memory-mapped token files: tokenized once, then read by every run without loading the corpus.

A corpus split (a list of units: :class:`Slice` s of files, or in-memory byte strings such as a Hub dataset's rows)
is tokenized into ``DIR/SPLIT.tokens``, the ids back to back as uint8 (the byte tokenizer), uint16 or uint32 (by
vocabulary size), with ``DIR/SPLIT.starts.npy`` (int64, the token index of each document's first token: each
non-empty unit starts one, and so does the text after each ``separator``) and ``DIR/record.json``: the tokenizer
(its spec and a fingerprint of its content), the separator, and per split its sources (each file's path, slice,
size and mtime; a hash of in-memory text), its token, byte and document counts, and checksums of the token file's
first and last MiB. DIR is ``CACHE/NAME-KEY`` with KEY a hash of the corpus's name, source paths and tokenizer
spec; CACHE is ``data.cache_dir``, else ``$VQATTN_CACHE_DIR``, else ``~/.cache/vqattn/tokens``.

A later run whose record matches (same files, sizes and mtimes, same tokenizer content, same separator) maps the
files as they are; a changed file or tokenizer rebuilds them. A token file whose size or checksums disagree with
its record is a one-line error naming it (delete the directory to rebuild it), never silent garbage.

Tokenizing is parallel over the cores other work leaves idle (worker processes of a fork server, each encoding
~4 MiB chunks cut at a line break or separator, in order), with a progress bar and an estimate of the time left when it takes more
than two seconds. A build writes into a temporary directory renamed into place when complete, so an interrupted
build or two runs building at once leave no half-written file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..files import fsync_directory, fsync_file, write_failed_as
from ..tokenizer import Tokenizer

CHUNK = 4 << 20  # bytes per tokenizing task
CHECK = 1 << 20  # bytes of the token file's start and end that the record's checksums cover
FORMAT = 1


@dataclass(frozen=True)
class Slice:
    """Bytes ``start:stop`` of the file at ``path``."""

    path: str
    start: int
    stop: int

    def read(self, start: int | None = None, stop: int | None = None) -> bytes:
        start, stop = self.start if start is None else start, self.stop if stop is None else stop
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(stop - start)


def unit_len(unit) -> int:
    return unit.stop - unit.start if isinstance(unit, Slice) else len(unit)


def unit_bytes(unit) -> bytes:
    return unit.read() if isinstance(unit, Slice) else bytes(unit)


def cut(units: list, start: int, stop: int) -> list:
    """Bytes start..stop-1 of the units' concatenation, as units (a unit the cut goes through keeps its part)."""
    out, pos = [], 0
    for unit in units:
        n = unit_len(unit)
        lo, hi = max(start - pos, 0), min(stop - pos, n)
        if lo < hi:
            if (lo, hi) == (0, n):
                out.append(unit)
            elif isinstance(unit, Slice):
                out.append(Slice(unit.path, unit.start + lo, unit.start + hi))
            else:
                out.append(unit[lo:hi])
        pos += n
        if pos >= stop:
            break
    return out


def _source(unit) -> list:
    if isinstance(unit, Slice):
        stat = os.stat(unit.path)
        return [os.path.abspath(unit.path), unit.start, unit.stop, stat.st_size, stat.st_mtime_ns]
    return ["text", len(unit), hashlib.blake2b(unit, digest_size=16).hexdigest()]


def sources(units: list) -> list:
    """What a record keeps of a split's units, to tell a changed corpus: each file's path, slice, size and mtime; a
    hash of in-memory text (hashed together, so that a million dataset rows make one entry)."""
    files = [_source(u) for u in units if isinstance(u, Slice)]
    texts = [u for u in units if not isinstance(u, Slice)]
    if texts:
        digest = hashlib.blake2b(digest_size=16)
        for text in texts:
            digest.update(len(text).to_bytes(8, "little"))
            digest.update(text)
        files.append(["texts", len(texts), sum(map(len, texts)), digest.hexdigest()])
    return files


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32)


def cache_root(cache_dir: str | None) -> Path:
    return Path(os.path.expanduser(cache_dir or os.environ.get("VQATTN_CACHE_DIR") or "~/.cache/vqattn/tokens"))


class TokenFile:
    """Windows of a token file read with ``os.pread``: (B, length) int64 for B offsets.

    Random windows read this way copy only their own tokens. Through the memory map each would map the page-cache
    folio it falls in (up to a couple of MiB on current kernels, whatever madvise says), and the resident set of a
    long run would grow towards the corpus's size. ``offset``: the bytes before the first token (a header, as in
    modded-nanogpt's shards: :mod:`vqattn.train.token_files`)."""

    def __init__(self, path: Path, dtype: np.dtype, offset: int = 0):
        self.path, self.dtype, self.offset, self._fd, self._pid = path, np.dtype(dtype), offset, None, None

    def _descriptor(self) -> int:
        if self._pid != os.getpid():  # opened per process (DataLoader workers)
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def windows(self, offsets, length: int) -> torch.Tensor:
        fd, size = self._descriptor(), self.dtype.itemsize
        rows = [np.frombuffer(os.pread(fd, length * size, self.offset + int(o) * size), dtype=self.dtype)
                for o in offsets]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def __getstate__(self):
        return {"path": self.path, "dtype": self.dtype, "offset": self.offset}

    def __setstate__(self, state):
        self.__init__(state["path"], state["dtype"], state.get("offset", 0))


@dataclass
class TokenSplit:
    """A split's tokens (a 1-D tensor over the memory-mapped file, for consecutive reads), the same file for random
    windows (:class:`TokenFile`), its document starts (int64 token indices, sorted) and the bytes of text they
    encode."""

    tokens: torch.Tensor
    file: TokenFile
    starts: np.ndarray
    n_bytes: int
    path: Path


def prepare(name: str, splits: dict[str, list], tokenizer: Tokenizer, separator: bytes | None = None,
            cache_dir: str | None = None, workers: int | None = None) -> dict[str, TokenSplit]:
    """The token files of ``splits`` ({split: units}), made when missing or stale (module docstring), mapped."""
    units_sources = {split: sources(units) for split, units in splits.items()}
    paths = sorted({s[0] for srcs in units_sources.values() for s in srcs})
    key = hashlib.sha256(json.dumps([name, tokenizer.spec, paths]).encode()).hexdigest()[:16]
    directory = cache_root(cache_dir) / f"{''.join(c if c.isalnum() or c in '-_.' else '_' for c in name)}-{key}"
    wanted = {"format": FORMAT, "tokenizer": tokenizer.spec, "tokenizer_fingerprint": tokenizer.fingerprint,
              "vocab_size": tokenizer.vocab_size, "dtype": token_dtype(tokenizer.vocab_size).name,
              "separator": separator.hex() if separator else None, "sources": units_sources}
    record = _read_record(directory)
    if record is None or any(record.get(k) != v for k, v in wanted.items()):
        record = _build(directory, wanted, splits, tokenizer, separator, workers)
    return {split: _map(directory, split, record) for split in splits}


def _read_record(directory: Path) -> dict | None:
    path = directory / "record.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise ValueError(f"token record {path} is corrupt (not JSON): delete {directory} to tokenize the corpus "
                         "again") from None


def _checksums(path: Path) -> list[int]:
    with open(path, "rb") as f:
        head = f.read(CHECK)
        f.seek(max(0, os.path.getsize(path) - CHECK))
        return [zlib.crc32(head), zlib.crc32(f.read(CHECK))]


def _map(directory: Path, split: str, record: dict) -> TokenSplit:
    """The split's token file mapped, after checking it against its record (a one-line error naming it)."""
    info, dtype = record["splits"][split], np.dtype(record["dtype"])
    path = directory / f"{split}.tokens"
    advice = f"delete {directory} to tokenize the corpus again"
    size = path.stat().st_size if path.exists() else -1
    if size != info["tokens"] * dtype.itemsize:
        raise ValueError(f"token file {path} is truncated or corrupt ({size} bytes, its record says "
                         f"{info['tokens']} tokens of {dtype.name}): {advice}")
    if _checksums(path) != info["checksums"]:
        raise ValueError(f"token file {path} is corrupt (its checksums differ from its record's): {advice}")
    try:
        starts = np.load(directory / f"{split}.starts.npy")
    except (OSError, ValueError):
        raise ValueError(f"document starts {directory / f'{split}.starts.npy'} are missing or corrupt: "
                         f"{advice}") from None
    file = TokenFile(path, dtype)
    if not info["tokens"]:
        return TokenSplit(torch.zeros(0, dtype=torch.uint8), file, starts, info["bytes"], path)
    with warnings.catch_warnings():  # read-only map: torch warns that it could not write to it (nothing does)
        warnings.simplefilter("ignore", UserWarning)
        return TokenSplit(torch.from_numpy(np.memmap(path, dtype=dtype, mode="r")), file, starts, info["bytes"], path)


# --- building ---------------------------------------------------------------------------------------------------

_WORKER: dict = {}  # the tokenizer and separator of a build, in this process and in each of its workers


def _start_worker(tokenizer: Tokenizer, separator: bytes | None) -> None:
    _WORKER.update(tokenizer=tokenizer, separator=separator)


def _pool(workers: int, tokenizer: Tokenizer, separator: bytes | None):
    """Worker processes started by a fork server, not forked from this process: a fork beside the trainer's threads
    (torch's, tqdm's, Lightning's) can copy a lock one of them holds, and a DDP run's tokenizing once hung there
    until killed. The server imports this module once; each worker gets the tokenizer pickled."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context.Pool(workers, initializer=_start_worker, initargs=(tokenizer, separator))


def _split_documents(data: bytes, separator: bytes | None) -> list[bytes]:
    """``data`` cut after each separator (which ends the document it follows)."""
    if not separator:
        return [data]
    pieces, pos = [], 0
    while True:
        found = data.find(separator, pos)
        if found < 0 or found + len(separator) >= len(data):
            pieces.append(data[pos:])
            return pieces
        pieces.append(data[pos:found + len(separator)])
        pos = found + len(separator)


def _encode(task: list) -> tuple[np.ndarray, np.ndarray, int]:
    """One chunk: [(unit or file slice, starts a document)] -> (ids, document starts in them, bytes)."""
    tokenizer, separator = _WORKER["tokenizer"], _WORKER["separator"]
    ids, starts, n, total = [], [], 0, 0
    for unit, first in task:
        data = unit_bytes(unit)
        total += len(data)
        for i, piece in enumerate(_split_documents(data, separator)):
            if not piece:
                continue
            if first or i > 0:
                starts.append(n)
            encoded = tokenizer.encode(piece)
            ids.append(encoded)
            n += len(encoded)
    dtype = token_dtype(tokenizer.vocab_size)
    out = np.concatenate(ids).astype(dtype, copy=False) if ids else np.zeros(0, dtype)
    return out, np.asarray(starts, dtype=np.int64), total


def _cut_point(unit: Slice, at: int, separator: bytes | None) -> tuple[int, bool]:
    """Where a chunk of ``unit`` ending near ``at`` ends: after the first separator (else line break, else UTF-8
    character boundary) at or after it; and whether the next chunk starts a document (it follows a separator)."""
    window = unit.read(at, min(at + (64 << 10), unit.stop))  # a line break is rarely further
    if separator and separator not in window or b"\n" not in window:
        window = unit.read(at, min(at + CHUNK, unit.stop))
    if separator:
        found = window.find(separator)
        if found >= 0:
            return at + found + len(separator), True
    found = window.find(b"\n")
    if found >= 0:
        return at + found + 1, False
    step = next((i for i, b in enumerate(window[:4]) if b & 0xC0 != 0x80), 0)
    return at + step, False


def _tasks(units: list, separator: bytes | None) -> list[list]:
    """The units grouped and cut into chunks of about CHUNK bytes: [[(unit part, starts a document), ...], ...]."""
    tasks, current, size = [], [], 0
    for unit in units:
        n = unit_len(unit)
        if n == 0:
            continue
        if not isinstance(unit, Slice) or n <= CHUNK:
            current.append((unit, True))
            size += n
        else:
            pos, first = unit.start, True
            while pos < unit.stop:
                end, next_first = (_cut_point(unit, pos + CHUNK, separator) if pos + CHUNK < unit.stop
                                   else (unit.stop, False))
                end = min(max(end, pos + 1), unit.stop)
                tasks.append([(Slice(unit.path, pos, end), first)])
                pos, first = end, next_first
        if size >= CHUNK:
            tasks.append(current)
            current, size = [], 0
    if current:
        tasks.append(current)
    return tasks


def _build(directory: Path, wanted: dict, splits: dict[str, list], tokenizer: Tokenizer, separator: bytes | None,
           workers: int | None) -> dict:
    from tqdm.auto import tqdm

    from ..utils import available_cores

    temporary = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    with write_failed_as(directory):  # a read-only cache: one line naming it
        directory.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    record = {**wanted, "splits": {}}
    workers = workers or max(1, available_cores())
    total = sum(unit_len(u) for units in splits.values() for u in units)
    _WORKER.update(tokenizer=tokenizer, separator=separator)
    bar = tqdm(total=total, unit="B", unit_scale=True, delay=2, desc=f"tokenizing {wanted['tokenizer']}")
    pool = None
    try:
        tasks = {split: _tasks(units, separator) for split, units in splits.items()}
        # a pool only for more than one chunk of bytes: starting one for a small corpus costs more than it saves
        if workers > 1 and sum(map(len, tasks.values())) > 1 and total > CHUNK:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker process
            pool = _pool(workers, tokenizer, separator)
        for split, split_tasks in tasks.items():
            with write_failed_as(temporary):  # a full disk: one line naming the build's directory
                record["splits"][split] = _write_split(temporary, split, split_tasks, pool, bar)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)  # nothing half-written left beside the cache
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
        _WORKER.clear()
    with write_failed_as(directory):  # the files durable before the rename that publishes them
        (temporary / "record.json").write_text(json.dumps(record, indent=1) + "\n")
        for path in temporary.iterdir():
            fsync_file(path)
        fsync_directory(temporary)
    current = _read_record(directory) if directory.exists() else None
    if current is not None and all(current.get(k) == v for k, v in wanted.items()):  # another run built it meanwhile
        shutil.rmtree(temporary, ignore_errors=True)
        return current
    shutil.rmtree(directory, ignore_errors=True)  # stale: files or tokenizer changed
    try:
        os.rename(temporary, directory)
    except OSError:  # another run renamed its own build first: use that one
        shutil.rmtree(temporary, ignore_errors=True)
        return _read_record(directory)
    fsync_directory(directory.parent)
    return record


def _write_split(directory: Path, split: str, tasks: list, pool, bar) -> dict:
    encoded = pool.imap(_encode, tasks) if pool is not None else map(_encode, tasks)
    n_tokens, n_bytes, starts = 0, 0, []
    path = directory / f"{split}.tokens"
    with open(path, "wb") as f:
        for ids, task_starts, size in encoded:
            f.write(ids.tobytes())
            starts.append(task_starts + n_tokens)
            n_tokens += len(ids)
            n_bytes += size
            bar.update(size)
    starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    np.save(directory / f"{split}.starts.npy", starts)
    return {"tokens": n_tokens, "bytes": n_bytes, "documents": len(starts), "checksums": _checksums(path)}
