"""The run's tokenizer (``data.tokenizer``), and a command that trains a BPE or SentencePiece tokenizer offline.

``data.tokenizer`` is one of:

* ``bytes`` (the default): each byte is one token, vocabulary 256 (:class:`ByteTokenizer`);
* a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``);
* a SentencePiece model (a file ending in ``.model``, or a directory holding ``tokenizer.model`` and no
  ``tokenizer.json``): :class:`SentencePieceTokenizer`, through the ``sentencepiece`` package;
* a transformers tokenizer directory (one ``AutoTokenizer.from_pretrained`` reads offline, with a fast tokenizer).

A ``tokenizers`` tokenizer reads text, so a corpus's bytes are decoded as UTF-8 (invalid sequences replaced) before
they are encoded. A SentencePiece model encodes the bytes exactly, invalid UTF-8 included (its class says how). The
model's vocabulary is the tokenizer's, padded up to a multiple of 64 (:func:`padded_vocab`, as nanoGPT pads GPT-2's
50257 to 50304): the padding ids are never targets. Bits per byte divide the NLL by the bytes each target token
stands for (:meth:`Tokenizer.token_bytes`), so runs with different tokenizers compare.

Train a byte-level BPE on local files (no network)::

    python -m vqattn.tokenizer train --files 'corpus/*.txt' --vocab-size 8000 --out my_tokenizer

writes ``my_tokenizer/tokenizer.json`` and (with transformers installed) the transformers files beside it:
``data.tokenizer=my_tokenizer`` (the directory) or ``data.tokenizer=my_tokenizer/tokenizer.json`` both name it.
``--kind sentencepiece`` (``--model-type unigram`` or ``bpe``) trains a SentencePiece model instead
(:func:`train_sentencepiece`) and writes ``my_tokenizer/tokenizer.model`` (and the readable ``tokenizer.vocab``).
"""

from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

from .files import WriteFailed, atomic_files, failed_write_exit

BYTES = "bytes"
PAD_MULTIPLE = 64
SPECIAL = "<|endoftext|>"  # the BPE trainer's one special token (id 0), GPT-2's end-of-text marker
SENTENCEPIECE_FILE = "tokenizer.model"  # what the SentencePiece trainer writes, and a directory's model
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")  # a byte fallback piece: the byte it names
SENTENCEPIECE_KEY = "sentencepiece_model"  # a checkpoint's SentencePiece model: {KEY: base64 of the proto}


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
        """Byte-level BPE (GPT-2's alphabet, one character per byte): a token's length in characters; a byte
        fallback token (``<0x41>``, in a model with byte fallback): 1; other tokens: the UTF-8 length of the token
        decoded alone (a piece marker such as SentencePiece's "▁" counts as the space it stands for)."""
        from tokenizers.pre_tokenizers import ByteLevel

        spec = json.loads(self.to_json())
        # by what the tokenizer does, not by the look of its tokens: "é" is a byte in GPT-2's alphabet, 2 in UTF-8
        byte_level = '"ByteLevel"' in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        alphabet = set(ByteLevel.alphabet())
        added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        out = np.ones(self.vocab_size, dtype=np.int64)
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if byte_level and token not in added and set(token) <= alphabet:
                out[i] = len(token)
            elif byte_fallback and token not in added and BYTE_PIECE.fullmatch(token):
                out[i] = 1
            else:  # an added token stands for its text
                out[i] = max(len(token.replace("▁", " ").encode("utf-8")), 1)
        return out

    def to_json(self) -> str:
        return self.tokenizer.to_str()


# Text a SentencePiece model cannot carry: invalid UTF-8 (held as lone surrogates by "surrogateescape") and "▁",
# which SentencePiece writes for a space and so would decode as one. Their bytes become byte pieces.
_RAW = re.compile("([\udc80-\udcff\u2581]+)")
# Text that a model which normalizes, adds a dummy prefix or removes spaces does not give back as it was.
_PROBE = "  a  b\t\n\u3000ｱ ﬁ ①é e\u0301 x ".encode()


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (its serialized proto: a ``.model`` file's bytes), encoding a corpus's bytes exactly.

    Every id stands for fixed bytes (:meth:`decode_bytes`): a byte fallback piece ``<0xNN>`` for the byte 0xNN, any
    other piece for its text with "▁" read as a space, control pieces (``<s>``, ``</s>``) and ``<unk>`` for none,
    so :meth:`token_bytes` summed over the ids of a text is its length in bytes. That needs a model that keeps the
    text as it is, which the constructor checks on a probe text (a ValueError otherwise): byte fallback (every
    character has pieces), identity normalization (NFKC would change characters), no dummy prefix (an added "▁"
    would count a space that is not there) and spaces kept (remove_extra_whitespaces off). :func:`train_sentencepiece`
    trains such models.

    SentencePiece encodes text (str), so :meth:`encode` reads the bytes as UTF-8 and hands it the valid text; the
    bytes it cannot carry go in as byte pieces, each byte its own: an invalid UTF-8 byte (SentencePiece would make it
    U+FFFD) and the bytes of a "▁" in the text (which SentencePiece would decode as a space). So ``decode_bytes(
    encode(data)) == data`` for any bytes; :meth:`decode` makes text of those bytes, replacing invalid UTF-8 as the
    byte tokenizer does. The checkpoint keeps the proto (base64 in :meth:`to_json`), so it is self-contained.
    """

    def __init__(self, proto: bytes, spec: str):
        try:
            import sentencepiece
        except ImportError:
            raise ValueError("is a SentencePiece model, which needs the sentencepiece package (pip install "
                             "sentencepiece; the train extra has it)") from None
        self.proto, self.spec = bytes(proto), spec
        self.processor = sentencepiece.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(self.proto)
        except (RuntimeError, OSError, TypeError):  # sentencepiece's message is a multi-line C++ status
            raise ValueError("is not a SentencePiece model (sentencepiece could not parse it)") from None
        sp = self.processor
        self.model_type = _sentencepiece_model_type(self.proto)
        if self.model_type not in ("unigram", "bpe"):
            raise ValueError(f"is a SentencePiece {self.model_type} model: unigram and bpe models are supported")
        self.vocab_size = sp.get_piece_size()
        self.fingerprint = hashlib.sha256(self.proto).hexdigest()[:16]
        self._byte_ids = np.array([sp.piece_to_id(f"<0x{b:02X}>") for b in range(256)], dtype=np.uint32)
        if not all(sp.is_byte(int(i)) for i in self._byte_ids):
            raise ValueError("is a SentencePiece model without byte fallback: a character outside its vocabulary "
                             "would be <unk>, whose bytes bits per byte cannot count (train one with byte_fallback, "
                             "as python -m vqattn.tokenizer train --kind sentencepiece does)")
        self._pieces = [self._piece_bytes(i) for i in range(self.vocab_size)]
        if self.decode_bytes(self.encode(_PROBE)) != _PROBE:
            raise ValueError("is a SentencePiece model that changes the text it encodes (a normalization other than "
                             "identity, a dummy prefix, or removing extra whitespace), so its pieces do not spell "
                             "the text; python -m vqattn.tokenizer train --kind sentencepiece trains one that "
                             "keeps it")

    def _piece_bytes(self, i: int) -> bytes:
        sp = self.processor
        if sp.is_byte(i):
            return bytes([int(sp.id_to_piece(i)[3:5], 16)])
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            return b""  # never in an encoded text: with byte fallback every character has pieces
        return sp.id_to_piece(i).replace("▁", " ").encode("utf-8")

    def encode(self, data: bytes) -> np.ndarray:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and "▁" not in text:
            return np.asarray(self.processor.encode(text), dtype=np.uint32)
        ids = []
        for n, part in enumerate(_RAW.split(data.decode("utf-8", errors="surrogateescape"))):
            if n % 2:  # the bytes SentencePiece cannot carry: one byte piece each
                ids.extend(self._byte_ids[list(part.encode("utf-8", errors="surrogateescape"))].tolist())
            elif part:
                ids.extend(self.processor.encode(part))
        return np.asarray(ids, dtype=np.uint32)

    def decode_bytes(self, ids) -> bytes:
        """The bytes ``ids`` stand for (ids outside the vocabulary, such as the model's padding, are skipped)."""
        return b"".join(self._pieces[int(i)] for i in ids if 0 <= int(i) < self.vocab_size)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([len(p) for p in self._pieces], dtype=np.int64)

    def to_json(self) -> str:
        return json.dumps({SENTENCEPIECE_KEY: base64.b64encode(self.proto).decode("ascii")})

    def __getstate__(self):  # tokenizing workers get it pickled: the proto, not the C++ processor
        return {"proto": self.proto, "spec": self.spec}

    def __setstate__(self, state):
        self.__init__(state["proto"], state["spec"])

    def special_tokens(self) -> dict:
        """transformers' special tokens of the export: eos ``</s>``, bos ``<s>`` and unk ``<unk>`` as the model
        has them, pad its pad piece else eos (what the trainer never saw; lm-eval puts bos before a document)."""
        sp = self.processor

        def piece(i: int):
            return sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

        eos = piece(sp.eos_id())
        return {"eos_token": eos, "bos_token": piece(sp.bos_id()) or eos, "unk_token": piece(sp.unk_id()),
                "pad_token": piece(sp.pad_id()) or eos}

    def fast_tokenizer(self):
        """The model as a ``tokenizers.Tokenizer`` (for the export's ``tokenizer.json``, which ``AutoTokenizer``
        reads without sentencepiece): the same pieces and ids, a Unigram model with the pieces' scores or a BPE
        whose merges follow the pieces' order, byte fallback, spaces as "▁", no pre-tokenizer (SentencePiece
        segments the whole text). It encodes valid UTF-8 text without "▁" as :meth:`encode` does, except where a
        Unigram's segmentations score the same, which tokenizers breaks its own way (on the default corpus's held-out
        split: no token differs with the 2048-piece unigram model the command trains, 6 in 111,901 with a
        4096-piece one, cut into documents of 4096 characters; none with a 4096-piece BPE)."""
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, normalizers

        sp = self.processor
        pieces = [sp.id_to_piece(i) for i in range(self.vocab_size)]
        special = [sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
                   for i in range(self.vocab_size)]
        if self.model_type == "bpe":
            ids = {p: i for i, p in enumerate(pieces)}
            merges = sorted((i, ids[p[:k]], ids[p[k:]]) for i, p in enumerate(pieces) if not special[i]
                            for k in range(1, len(p)) if p[:k] in ids and p[k:] in ids)
            model = models.BPE(ids, [(pieces[a], pieces[b]) for _, a, b in merges], unk_token=pieces[sp.unk_id()],
                               byte_fallback=True, fuse_unk=True)
        else:
            scores = [sp.get_score(i) for i in range(self.vocab_size)]
            lowest = min((s for s, x in zip(scores, special) if not x), default=0.0)
            # SentencePiece never matches a byte or control piece in text; tokenizers' Unigram would, so they
            # score below any spelling of their text in single pieces ("<s>": "<", "s", ">")
            floor = min(lowest, 0.0) * (max(len(p) for p in pieces) + 1) - 10.0
            model = models.Unigram([(p, floor if x else s) for p, s, x in zip(pieces, scores, special)],
                                   unk_id=sp.unk_id(), byte_fallback=True)
        fast = RustTokenizer(model)
        fast.normalizer = normalizers.Replace(" ", "▁")
        fast.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        return fast


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        value, shift, i = value | (byte & 0x7F) << shift, shift + 7, i + 1
        if byte < 0x80:
            return value, i


def _proto_fields(buf: bytes):
    """(field number, value) of each field of a serialized protobuf message (its wire format): an int for a varint,
    bytes otherwise."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire}")
        yield key >> 3, value


def _sentencepiece_model_type(proto: bytes) -> str:
    """The model type of a serialized SentencePiece ModelProto: its trainer_spec (field 2)'s model_type (field 3;
    1 unigram, the default, 2 bpe, 3 word, 4 char). Read from the wire format: the protobuf package is not needed."""
    kind = 1
    for number, value in _proto_fields(proto):
        if number == 2 and isinstance(value, bytes):
            kind = next((v for n, v in _proto_fields(value) if n == 3 and isinstance(v, int)), kind)
    return {1: "unigram", 2: "bpe", 3: "word", 4: "char"}.get(kind, f"type-{kind}")


def load_tokenizer(spec: str | None) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names (module docstring); a one-line ValueError naming data.tokenizer for a
    path that does not exist or holds no tokenizer."""
    if spec in (None, BYTES):
        return _load(BYTES, 0)
    path = os.path.abspath(os.path.expanduser(str(spec)))
    # a directory's tokenizer file: rewriting it need not touch the directory
    inner = next((p for p in (os.path.join(path, name) for name in ("tokenizer.json", SENTENCEPIECE_FILE))
                  if os.path.isfile(p)), path)
    stamp = os.stat(inner).st_mtime_ns if os.path.exists(path) else 0
    return _load(path, stamp)


@lru_cache(maxsize=8)
def _load(spec: str, stamp: int) -> Tokenizer:
    """The tokenizer at ``spec`` as it was at modification time ``stamp`` (a rewritten file is read again)."""
    if spec == BYTES:
        return ByteTokenizer()
    from tokenizers import Tokenizer as RustTokenizer

    path = Path(spec)
    if not path.exists():
        raise ValueError(f"data.tokenizer={spec!r} does not exist: give bytes, a tokenizer.json file, a "
                         "SentencePiece .model file or a transformers tokenizer directory (python -m "
                         "vqattn.tokenizer train makes one)")
    model = path if path.is_file() and path.suffix == ".model" else path / SENTENCEPIECE_FILE
    if model.is_file() and not (path / "tokenizer.json").is_file():
        try:
            return SentencePieceTokenizer(model.read_bytes(), spec)
        except ValueError as err:  # not a model, or one whose pieces do not spell the text
            raise ValueError(f"data.tokenizer={spec!r} {err}") from None
    try:
        if path.is_file():
            return HFTokenizer(RustTokenizer.from_file(str(path)), spec)
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(RustTokenizer.from_file(str(path / "tokenizer.json")), spec)
        return HFTokenizer(backend_tokenizer(path), spec)  # no tokenizer.json: transformers converts it
    except Exception as err:  # not JSON, not a tokenizer, a slow-only tokenizer
        raise ValueError(f"data.tokenizer={spec!r} holds no tokenizer the tokenizers library reads "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None


def from_json(text: str | None, spec: str = "checkpoint") -> Tokenizer:
    """The tokenizer a checkpoint keeps (its JSON; None: bytes)."""
    if text is None:
        return ByteTokenizer()
    if text.startswith(f'{{"{SENTENCEPIECE_KEY}"'):  # SentencePieceTokenizer.to_json
        try:
            return SentencePieceTokenizer(base64.b64decode(json.loads(text)[SENTENCEPIECE_KEY]), spec)
        except ValueError as err:  # no sentencepiece installed where the checkpoint is read
            raise ValueError(f"the checkpoint's tokenizer ({spec}) {err}") from None
    from tokenizers import Tokenizer as RustTokenizer

    return HFTokenizer(RustTokenizer.from_str(text), spec)


def backend_tokenizer(path):
    """The ``tokenizers.Tokenizer`` of a transformers tokenizer directory without a tokenizer.json (transformers
    converts a slow tokenizer to a fast one where it can), read offline: what ``data.tokenizer=DIR`` trains with."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True).backend_tokenizer


def transformers_tokenizer(tokenizer: Tokenizer):
    """A subword tokenizer as transformers' own ``PreTrainedTokenizerFast``, for a directory ``AutoTokenizer`` loads:
    around its JSON, whose end-of-text token (``<|endoftext|>``, when it has one) is eos, bos and pad. A
    SentencePiece model becomes its ``tokenizers`` equivalent (``SentencePieceTokenizer.fast_tokenizer``: a
    ``tokenizer.json`` needing no sentencepiece) with its own ``</s>``, ``<s>`` and ``<unk>``, which text never
    encodes to (split_special_tokens, as the trainer encodes "</s>" in text as its characters). Bytes have no
    such form: their transformers tokenizer is ``vqattn.hf.VQAttnByteTokenizer``. Raises ImportError without
    transformers."""
    if tokenizer.to_json() is None:
        raise ValueError("the byte tokenizer's transformers form is vqattn.hf.VQAttnByteTokenizer")
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    if hasattr(tokenizer, "fast_tokenizer"):  # a SentencePiece model
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer.fast_tokenizer(), split_special_tokens=True,
                                       **tokenizer.special_tokens())
    rust = RustTokenizer.from_str(tokenizer.to_json())
    eos = SPECIAL if rust.token_to_id(SPECIAL) is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=eos, bos_token=eos, pad_token=eos)


def train_bpe(files: list[str], vocab_size: int, out: str | Path, min_frequency: int = 2) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenization and alphabet, so any text encodes, losslessly) of ``vocab_size``
    tokens trained on ``files``, written to ``out/tokenizer.json`` with the transformers files beside it; returns
    ``out``."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"--vocab-size must be at least 257 (the 256 bytes and {SPECIAL}), got {vocab_size}")
    paths = _paths(files)
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(paths, trainer)
    out = Path(out)
    with atomic_files(out) as temporary:  # each file whole or not at all: runs read them
        tokenizer.save(str(temporary / "tokenizer.json"))
        try:  # the transformers files beside it, for AutoTokenizer (vqattn[hf])
            files = transformers_tokenizer(HFTokenizer(tokenizer, str(out)))
        except ImportError:
            return out
        files.save_pretrained(str(temporary))
    return out


def _paths(files: list[str]) -> list[str]:
    """The files that ``files`` (paths or globs) name, sorted; a ValueError naming --files when there are none."""
    paths = sorted({p for pattern in files for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                    if os.path.isfile(p)})
    if not paths:
        raise ValueError(f"--files: no file found at {files!r}")
    return paths


def _lines(paths: list[str]):
    """The lines of ``paths`` without their line breaks, for SentencePiece's trainer (which learns from lines: a
    line break is a byte piece). Invalid UTF-8 is replaced here: it only shapes the vocabulary, and encoding keeps
    such bytes as byte pieces."""
    for path in paths:
        with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
            for line in f:
                yield line.rstrip("\n")


def train_sentencepiece(files: list[str], vocab_size: int, out: str | Path, model_type: str = "unigram",
                        max_lines: int = 0) -> Path:
    """A SentencePiece ``model_type`` ("unigram" or "bpe") model of ``vocab_size`` pieces trained on ``files``,
    written to ``out/tokenizer.model`` (and ``out/tokenizer.vocab``, its pieces and scores as text); returns ``out``.
    ``max_lines``: train on that many lines drawn at random (SentencePiece's input_sentence_size; 0: every line).

    The model keeps the text as it is, which :class:`SentencePieceTokenizer` needs for exact bits per byte: byte
    fallback (a character outside the vocabulary is its UTF-8 bytes, never <unk>), identity normalization (no
    NFKC), no dummy prefix, spaces kept; pieces may be runs of spaces only (indentation). Ids 0-2 are <unk>, <s>
    and </s>, then the 256 byte pieces."""
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"--model-type must be unigram or bpe, got {model_type!r}")
    if vocab_size < 260:
        raise ValueError(f"--vocab-size must be at least 260 for --kind sentencepiece (<unk>, <s>, </s>, the 256 "
                         f"byte pieces and one more), got {vocab_size}")
    if max_lines < 0:
        raise ValueError(f"--max-lines must be 0 (every line) or positive, got {max_lines}")
    paths = _paths(files)
    out = Path(out)
    if (out / "tokenizer.json").is_file():  # load_tokenizer(out) would read it, not the model
        raise ValueError(f"--out {str(out)!r} holds a tokenizer.json, which data.tokenizer={out} would read first: "
                         "give another directory")
    try:
        import sentencepiece
    except ImportError:
        raise ValueError("--kind sentencepiece needs the sentencepiece package (pip install sentencepiece; the "
                         "train extra has it)") from None
    options = dict(model_type=model_type, vocab_size=vocab_size, byte_fallback=True, normalization_rule_name="identity",
                   add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
                   input_sentence_size=max_lines, shuffle_input_sentence=True,
                   num_threads=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                   minloglevel=1)  # warnings and errors, not its progress
    with atomic_files(out) as temporary:  # each file whole or not at all: runs read the model
        try:
            sentencepiece.SentencePieceTrainer.train(sentence_iterator=_lines(paths),
                                                     model_prefix=str(temporary / Path(SENTENCEPIECE_FILE).stem),
                                                     **options)
        except RuntimeError as err:  # e.g. a vocabulary larger than the text allows; its message names the limit
            reason = str(err).strip().splitlines()[-1]  # "INTERNAL: FILE(LINE) [CHECK] what is wrong": what is wrong
            raise ValueError(f"SentencePiece could not train: {reason.rpartition('] ')[2] or reason}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vqattn.tokenizer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a byte-level BPE or a SentencePiece tokenizer on local files")
    train.add_argument("--files", nargs="+", required=True, help="text files or globs")
    train.add_argument("--vocab-size", type=int, required=True, help="tokens, special tokens included")
    train.add_argument("--kind", choices=["bpe", "sentencepiece"], default="bpe",
                       help="bpe: a byte-level BPE (tokenizers; the default); sentencepiece: a SentencePiece model")
    train.add_argument("--min-frequency", type=int, default=None, help="bpe: merge pairs seen at least this often "
                       "(default 2)")
    train.add_argument("--model-type", choices=["unigram", "bpe"], default=None,
                       help="sentencepiece: its model (default unigram)")
    train.add_argument("--max-lines", type=int, default=None,
                       help="sentencepiece: train on this many lines drawn at random (default: every line)")
    train.add_argument("--out", required=True, help="directory to write")
    args = parser.parse_args(argv)
    wrong = [f"--{name.replace('_', '-')}" for name in (("model_type", "max_lines") if args.kind == "bpe"
                                                         else ("min_frequency",)) if getattr(args, name) is not None]
    if wrong:
        parser.error(f"{wrong[0]} is not an option of --kind {args.kind}")
    try:
        if args.kind == "bpe":
            min_frequency = 2 if args.min_frequency is None else args.min_frequency
            out = train_bpe(args.files, args.vocab_size, args.out, min_frequency)
        else:
            out = train_sentencepiece(args.files, args.vocab_size, args.out, args.model_type or "unigram",
                                      args.max_lines or 0)
        tokenizer = load_tokenizer(str(out))
    except ValueError as err:
        parser.error(str(err))
    except WriteFailed as err:  # a full disk or a read-only --out: what was there is whole
        return failed_write_exit(parser.prog, err)
    written = out / ("tokenizer.json" if args.kind == "bpe" else SENTENCEPIECE_FILE)
    print(f"wrote {written} ({tokenizer.vocab_size} tokens): train with data.tokenizer={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

