"""The data of vqattn's offline lm-evaluation-harness tasks, shipped next to their YAML files.

* ``heldout.jsonl`` (task ``vqattn_heldout``): the first ``DOCS x DOC_BYTES`` = 16 x 4096 bytes of the default
  corpus's held-out split (``data=default``: the held-out standard-library files, concatenated, of the CPython
  that built the file, 3.11), cut into 16 documents of 4096 bytes. 4096 is a multiple of every power-of-two
  ``seq_len`` up to 4096, so lm-eval's rolling windows of ``seq_len`` tokens tile each document exactly as the
  trainer's validation windows tile ``NUL + document`` (the tokenizer's prefix token is NUL).
* ``kv_recall.jsonl`` (task ``vqattn_kv_recall``): key-value recall in Python syntax, ``PAIRS`` assignments
  ``key = value`` then ``assert KEY == `` of one key; the choices are the values assigned, the answer the key's.
* task ``vqattn_text``: the user's own text, named by lm-eval's task metadata (``--metadata path=FILE_OR_GLOB``),
  one document per file (:func:`text`); no shipped data.
* task ``vqattn_copy``: copy at a distance (:mod:`vqattn.train.copy_eval`) on the text of ``heldout.jsonl``: each
  document is a stretch with a passage repeated at its end, and its control (:func:`copy`).

``python -m vqattn.hf.tasks.data`` rewrites both jsonl files (the held-out one from the running Python's stdlib).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import string
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS, DOC_BYTES = 16, 4096
PAIRS, RECALL_DOCS = 8, 200


def _read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / name).read_text().splitlines()]


def _test_split(name: str, **kwargs):
    """lm-eval's ``custom_dataset``: the jsonl as the test split (kwargs: the task's metadata, unused)."""
    import datasets  # lm-eval's own dependency; imported when a task loads

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_read_jsonl(name))})


def heldout(**kwargs):
    return _test_split("heldout.jsonl", **kwargs)


def kv_recall(**kwargs):
    return _test_split("kv_recall.jsonl", **kwargs)


class TextTaskError(ValueError):
    """``vqattn_text`` was not told which text to score, or cannot read it (``vqattn-eval`` prints it on one line)."""


def text_files(path) -> list[str]:
    """The files ``path`` names, as the trainer's ``data=text`` reads ``data.path``: a file, or every file matching
    a glob (``**`` recursive, ``~`` expanded), in sorted order."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TextTaskError('vqattn_text needs the text to score: pass --metadata path=FILE_OR_GLOB '
                            '(or --metadata \'{"path": "FILE_OR_GLOB"}\'), a file or a glob of files')
    pattern = os.path.expanduser(str(path))
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise TextTaskError(f"vqattn_text: no file found at path={str(path)!r} (give an existing file or a glob that "
                            "matches files)")
    return files


def _read_text(file: str) -> str:
    """The file's bytes as UTF-8, exactly (no newline translation: lm-eval counts the bytes of this string)."""
    data = Path(file).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TextTaskError(f"vqattn_text: {file} is not UTF-8 text (byte {err.start}): lm-eval scores str "
                            "documents") from None


def _token_counter(tokenizer, pretrained, add_bos_token):
    """``len(tokens)`` of a text as lm-eval's ``hf`` model encodes it (its ``tokenizer`` model argument, else
    ``pretrained``; special tokens as its ``add_bos_token`` sets them, else the tokenizer's default), or None when
    neither names a tokenizer (a model object passed in Python, or a TaskManager given no model arguments)."""
    name = tokenizer if isinstance(tokenizer, (str, os.PathLike)) else pretrained
    if not isinstance(name, (str, os.PathLike)):
        return None
    from transformers import AutoTokenizer

    import vqattn.hf  # noqa: F401  (registers the byte tokenizer with AutoTokenizer)

    tok = AutoTokenizer.from_pretrained(str(name))
    special = {} if add_bos_token is None else {"add_special_tokens": bool(add_bos_token)}
    return lambda doc: len(tok.encode(doc, **special))


def text(path=None, tokenizer=None, pretrained=None, add_bos_token=None, **kwargs):
    """lm-eval's ``custom_dataset`` of ``vqattn_text``: one document per non-empty file of ``path`` (a file or a
    glob, :func:`text_files`), {"text", "file", "tokens"} with tokens the count :func:`_token_counter` gives (-1 when
    no tokenizer is named). lm-eval calls it with the task's metadata: ``--metadata`` merged with ``--model_args``
    (which is where ``pretrained`` and ``tokenizer`` come from); the other keys are unused."""
    import datasets  # lm-eval's own dependency; imported when a task loads

    files = text_files(path)
    count = _token_counter(tokenizer, pretrained, add_bos_token)
    rows = []
    for file in files:
        doc = _read_text(file)
        if doc:  # an empty file has no byte to predict
            rows.append({"text": doc, "file": file, "tokens": -1 if count is None else count(doc)})
    if not rows:
        raise TextTaskError(f"vqattn_text: every file at path={str(path)!r} is empty")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def text_results(doc: dict, results: list) -> dict:
    """lm-eval's ``process_results`` of ``vqattn_text``: lm-eval's own three rolling metrics (bytes: of the UTF-8
    text; words: ``re.split(r"\\s+")`` pieces, as lm-eval counts them) and ``token_perplexity`` over the document's
    tokens, when they were counted."""
    (loglikelihood,) = results
    text, n_bytes = doc["text"], len(doc["text"].encode("utf-8"))
    out = {"word_perplexity": (loglikelihood, len(re.split(r"\s+", text))),
           "byte_perplexity": (loglikelihood, n_bytes), "bits_per_byte": (loglikelihood, n_bytes)}
    if doc["tokens"] > 0:
        out["token_perplexity"] = (loglikelihood, doc["tokens"])
    return out


def copy(seq_len=None, passage=None, gap=None, streams=64, pretrained=None, **kwargs):
    """lm-eval's ``custom_dataset`` of ``vqattn_copy``: ``streams`` stretches of the ``vqattn_heldout`` text, laid
    out as :func:`vqattn.train.copy_eval.layout` lays them out for windows of ``seq_len`` tokens (default: the
    ``max_position_embeddings`` of ``pretrained``'s config) and read as bytes. Each document holds the two contexts,
    the stretch up to the repeat's first byte with the passage's first occurrence (``repeat``) and with another
    stretch's passage instead (``control``), and the ``continuation``: the rest of the repeat, the bytes a copy can
    predict. The documents are :func:`vqattn.train.copy_eval.copy_eval`'s streams of ``text=`` this text; lm-eval
    also scores the whitespace that ends a context (it moves it into the continuation), where copy_eval scores the
    repeat's bytes after its first alone."""
    import datasets  # lm-eval's own dependency; imported when a task loads

    from ...train.copy_eval import copy_streams, layout
    from ...train.length_eval import held_out_streams

    if seq_len is None and isinstance(pretrained, (str, os.PathLike)):
        from transformers import AutoConfig

        import vqattn.hf  # noqa: F401  (registers vqattn's config with AutoConfig)

        seq_len = getattr(AutoConfig.from_pretrained(str(pretrained)), "max_position_embeddings", None)
    if seq_len is None:
        raise TextTaskError("vqattn_copy needs the model's window: pass --metadata seq_len=T (it is read from "
                            "pretrained's config.json when --model_args names one)")
    try:
        seq_len, streams = int(seq_len), int(streams)
        lead, passage, gap = layout(seq_len, None if passage is None else int(passage), None if gap is None else int(gap))
        repeat, control = copy_streams(held_out_streams("".join(heldout_docs_shipped()).encode(), seq_len, streams),
                                       lead, passage)
    except ValueError as err:
        raise TextTaskError(f"vqattn_copy: {err}") from None
    cut = seq_len + 2 - passage  # the repeat's first byte ends the contexts
    rows = [{"contexts": [bytes(r[:cut].tolist()).decode("ascii"), bytes(c[:cut].tolist()).decode("ascii")],
             "gold": 0, "continuation": bytes(r[cut:].tolist()).decode("ascii")} for r, c in zip(repeat, control)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def copy_results(doc: dict, results: list) -> dict:
    """lm-eval's ``process_results`` of ``vqattn_copy``: the continuation's log-likelihood after the repeat's context
    and after the control's, as bits per byte each, and the pair for :func:`copied`."""
    (repeat, _), (control, _) = results

    def scored_bytes(context: str) -> int:  # lm-eval moves a context's trailing whitespace into the continuation
        return len((context[len(context.rstrip()):] + doc["continuation"]).encode("utf-8"))

    return {"bits_per_byte_repeat": (repeat, scored_bytes(doc["contexts"][0])),
            "bits_per_byte_control": (control, scored_bytes(doc["contexts"][1])), "copied": (repeat, control)}


def copied(items: list) -> float:
    """``vqattn_copy``'s aggregation: 1 − (bits of the repeats) / (bits of their controls), summed over documents,
    as :func:`vqattn.train.copy_eval.copy_eval`'s ``copied``."""
    return 1 - sum(r for r, _ in items) / sum(c for _, c in items)


def heldout_docs_shipped() -> list[str]:
    """The documents of ``heldout.jsonl``, as ``vqattn_heldout`` reads them."""
    return [row["text"] for row in _read_jsonl("heldout.jsonl")]


def heldout_docs() -> list[str]:
    """DOCS documents of DOC_BYTES bytes from the start of the default corpus's held-out split."""
    from ...train.data import StdlibDataModule  # the train extra: the corpus's split rule lives there

    _, val = StdlibDataModule()._load()
    chunks = [val[i * DOC_BYTES:(i + 1) * DOC_BYTES] for i in range(DOCS)]
    return [chunk.decode("utf-8") for chunk in chunks]  # strict: a cut inside a character would be an error


def recall_docs(seed: int = 0) -> list[dict]:
    """RECALL_DOCS key-value recall questions: {"context", "choices", "answer" (index into choices)}."""
    rng = random.Random(seed)
    docs = []
    for _ in range(RECALL_DOCS):
        keys = rng.sample([a + b for a in string.ascii_lowercase for b in string.digits], PAIRS)
        values = [str(v) for v in rng.sample(range(10, 100), PAIRS)]
        asked = rng.randrange(PAIRS)
        lines = "".join(f"{k} = {v}\n" for k, v in zip(keys, values))
        docs.append({"context": f"{lines}assert {keys[asked]} == ", "choices": values, "answer": asked})
    return docs


def _write_jsonl(name: str, rows: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    _write_jsonl("heldout.jsonl", [{"text": doc} for doc in heldout_docs()])
    _write_jsonl("kv_recall.jsonl", recall_docs())
