"""The data of vqattn's offline lm-evaluation-harness tasks, shipped next to their YAML files.

* ``heldout.jsonl`` (task ``vqattn_heldout``): the first ``DOCS x DOC_BYTES`` = 16 x 4096 bytes of the default
  corpus's held-out split (``data=default``: the held-out standard-library files, concatenated, of the CPython
  that built the file, 3.11), cut into 16 documents of 4096 bytes. 4096 is a multiple of every power-of-two
  ``seq_len`` up to 4096, so lm-eval's rolling windows of ``seq_len`` tokens tile each document exactly as the
  trainer's validation windows tile ``NUL + document`` (the tokenizer's prefix token is NUL).
* ``kv_recall.jsonl`` (task ``vqattn_kv_recall``): key-value recall in Python syntax, ``PAIRS`` assignments
  ``key = value`` then ``assert KEY == `` of one key; the choices are the values assigned, the answer the key's.

``python -m vqattn.hf.tasks.data`` rewrites both files (the held-out one from the running Python's stdlib).
"""

from __future__ import annotations

import json
import random
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
