"""The run's tokenizer (``data.tokenizer``), and a command that trains a BPE tokenizer offline.

``data.tokenizer`` is one of:

* ``bytes`` (the default): each byte is one token, vocabulary 256 (:class:`ByteTokenizer`);
* a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``);
* a transformers tokenizer directory (one ``AutoTokenizer.from_pretrained`` reads offline, with a fast tokenizer).

A subword tokenizer reads text, so a corpus's bytes are decoded as UTF-8 (invalid sequences replaced) before they
are encoded. The model's vocabulary is the tokenizer's, padded up to a multiple of 64 (:func:`padded_vocab`, as
nanoGPT pads GPT-2's 50257 to 50304): the padding ids are never targets. Bits per byte divide the NLL by the bytes
each target token stands for (:meth:`Tokenizer.token_bytes`), so runs with different tokenizers compare.

Train a byte-level BPE on local files (no network)::

    python -m vqattn.train.tokenizer train --files 'corpus/*.txt' --vocab-size 8000 --out my_tokenizer

writes ``my_tokenizer/tokenizer.json`` and (with transformers installed) the transformers files beside it:
``data.tokenizer=my_tokenizer`` (the directory) or ``data.tokenizer=my_tokenizer/tokenizer.json`` both name it.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

BYTES = "bytes"
PAD_MULTIPLE = 64
SPECIAL = "<|endoftext|>"  # the BPE trainer's one special token (id 0), GPT-2's end-of-text marker


def padded_vocab(size: int) -> int:
    """The model's vocabulary for a tokenizer of ``size`` tokens: the next multiple of 64 (matmuls of such sizes run
    faster; 256 stays 256, GPT-2's 50257 becomes 50304)."""
    return -(-size // PAD_MULTIPLE) * PAD_MULTIPLE


class Tokenizer:
    """What the trainer needs of a tokenizer: its ``spec`` (data.tokenizer as given), ``vocab_size``, encoding of a
    corpus's bytes to ids, decoding of ids to text, the bytes each id stands for, a ``fingerprint`` of its content
    (a token file made with another tokenizer is not reused) and its JSON (kept in checkpoints, None for bytes)."""

    spec: str
    vocab_size: int
    fingerprint: str

    def encode(self, data: bytes) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def token_bytes(self) -> np.ndarray:
        """(vocab_size,) int64: the bytes each token stands for."""
        raise NotImplementedError

    def to_json(self) -> str | None:
        return None


class ByteTokenizer(Tokenizer):
    """One token per byte, id = byte value."""

    spec, vocab_size, fingerprint = BYTES, 256, BYTES

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (from a tokenizer.json, a transformers directory, or a checkpoint's
    copy of its JSON)."""

    def __init__(self, tokenizer, spec: str):
        self.tokenizer, self.spec = tokenizer, spec
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def encode(self, data: bytes) -> np.ndarray:
        ids = self.tokenizer.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size],
                                     skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """Byte-level BPE (GPT-2's alphabet, one character per byte): a token's length in characters; other
        tokenizers: the UTF-8 length of the token decoded alone (a piece marker such as SentencePiece's "▁" counts
        as the space it stands for)."""
        from tokenizers.pre_tokenizers import ByteLevel

        alphabet = set(ByteLevel.alphabet())
        added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        out = np.ones(self.vocab_size, dtype=np.int64)
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if token not in added and set(token) <= alphabet:
                out[i] = len(token)
            else:  # an added token stands for its text
                out[i] = max(len(token.replace("▁", " ").encode("utf-8")), 1)
        return out

    def to_json(self) -> str:
        return self.tokenizer.to_str()


def load_tokenizer(spec: str | None) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names (module docstring); a one-line ValueError naming data.tokenizer for a
    path that does not exist or holds no tokenizer."""
    if spec in (None, BYTES):
        return _load(BYTES, 0)
    path = os.path.abspath(os.path.expanduser(str(spec)))
    inner = os.path.join(path, "tokenizer.json")
    stamp = os.stat(inner if os.path.isfile(inner) else path).st_mtime_ns if os.path.exists(path) else 0
    return _load(path, stamp)


@lru_cache(maxsize=8)
def _load(spec: str, stamp: int) -> Tokenizer:
    """The tokenizer at ``spec`` as it was at modification time ``stamp`` (a rewritten file is read again)."""
    if spec == BYTES:
        return ByteTokenizer()
    from tokenizers import Tokenizer as RustTokenizer

    path = Path(spec)
    if not path.exists():
        raise ValueError(f"data.tokenizer={spec!r} does not exist: give bytes, a tokenizer.json file or a "
                         "transformers tokenizer directory (python -m vqattn.train.tokenizer train makes one)")
    try:
        if path.is_file():
            return HFTokenizer(RustTokenizer.from_file(str(path)), spec)
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(RustTokenizer.from_file(str(path / "tokenizer.json")), spec)
        from ..hf.tokenizer import backend_tokenizer  # a directory without tokenizer.json: transformers converts it

        return HFTokenizer(backend_tokenizer(path), spec)
    except Exception as err:  # not JSON, not a tokenizer, a slow-only tokenizer
        raise ValueError(f"data.tokenizer={spec!r} holds no tokenizer the tokenizers library reads "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None


def from_json(text: str | None, spec: str = "checkpoint") -> Tokenizer:
    """The tokenizer a checkpoint keeps (its JSON; None: bytes)."""
    if text is None:
        return ByteTokenizer()
    from tokenizers import Tokenizer as RustTokenizer

    return HFTokenizer(RustTokenizer.from_str(text), spec)


def train_bpe(files: list[str], vocab_size: int, out: str | Path, min_frequency: int = 2) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenization and alphabet, so any text encodes, losslessly) of ``vocab_size``
    tokens trained on ``files``, written to ``out/tokenizer.json`` with the transformers files beside it; returns
    ``out``."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"--vocab-size must be at least 257 (the 256 bytes and {SPECIAL}), got {vocab_size}")
    paths = sorted({p for pattern in files for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                    if os.path.isfile(p)})
    if not paths:
        raise ValueError(f"--files: no file found at {files!r}")
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(paths, trainer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    try:  # the transformers files beside it, for AutoTokenizer (vqattn[hf])
        from ..hf.tokenizer import transformers_tokenizer
    except ImportError:
        return out
    transformers_tokenizer(HFTokenizer(tokenizer, str(out))).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vqattn.train.tokenizer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a byte-level BPE tokenizer on local files")
    train.add_argument("--files", nargs="+", required=True, help="text files or globs")
    train.add_argument("--vocab-size", type=int, required=True, help="tokens, special token included")
    train.add_argument("--min-frequency", type=int, default=2, help="merge pairs seen at least this often")
    train.add_argument("--out", required=True, help="directory to write")
    args = parser.parse_args(argv)
    try:
        out = train_bpe(args.files, args.vocab_size, args.out, args.min_frequency)
    except ValueError as err:
        parser.error(str(err))
    tokenizer = load_tokenizer(str(out))
    print(f"wrote {out / 'tokenizer.json'} ({tokenizer.vocab_size} tokens): train with data.tokenizer={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

