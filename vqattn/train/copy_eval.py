"""Copy at a distance: how much of a passage a model recalls when the passage recurs beyond its raw window.

    python -m vqattn.train.copy_eval CKPT                       # passage T/4, T/2 + 1 tokens back: RUN/copy_eval/
    python -m vqattn.train.copy_eval CKPT --passage 32 --gap 160 --text notes.txt
    python -m vqattn.train.copy_eval a/copy_eval.json b/copy_eval.json   # saved results: a row each

Each of ``streams`` evenly spaced stretches of held-out text, one training window of T + 1 tokens, is laid out as

    [lead][passage P][gap G][passage P again]        lead = T + 1 − 2P − G

with the passage's second occurrence written over the stretch's end, and read in one forward pass. Its control is
the same stretch with the first occurrence replaced by another stretch's passage, so that the two differ only in
whether the passage was seen P + G tokens before. The score is over the repeat's tokens after its first (the ones a
copy can predict): ``bpb_repeat`` and ``bpb_control``, and ``copied`` = 1 − bpb_repeat / bpb_control, the share of
the passage's bits that the earlier occurrence saves, with a 95% bootstrap interval over the streams. Softmax
attention can copy the whole passage (``copied`` → 1); a memory that holds nothing from P + G tokens back saves
nothing (``copied`` ≈ 0), and a compressed memory sits between the two. The default, P = T/4 and P + G = T/2 + 1,
puts each token of the repeat one token further back from its source than a raw window of block_len = T/4 reaches
(its current and previous blocks: at most T/2 − 1 keys back); a stack of such windows reaches further in principle
(docs/evaluation.md measures how far it copies). A model learns to copy from data that repeats passages
(``data.repeat_fraction``, :func:`vqattn.train.data.repeat_passages`).

Held-out text as :mod:`vqattn.train.length_eval`'s: the default corpus's validation split, or ``--text``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..files import WriteFailed, failed_write_exit, write_text
from ..model import GPT
from ..utils import add_threads_argument, use_threads
from .length_eval import default_held_out, held_out_streams, stream_bits


def layout(seq_len: int, passage: int | None = None, gap: int | None = None) -> tuple[int, int, int]:
    """(lead, passage, gap) for windows of seq_len + 1 tokens: passage default T // 4, gap default what puts the
    first occurrence T // 2 + 1 tokens before the second (P + G = T // 2 + 1; 0 for a longer passage). A passage
    needs 2 tokens (its first is not scored); everything must fit the window."""
    def checked(name: str, value, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int ≥ {low}, got {value!r}")
        return value

    passage = checked("passage", seq_len // 4 if passage is None else passage, 2)
    gap = checked("gap", max(0, seq_len // 2 + 1 - passage) if gap is None else gap, 0)
    lead = seq_len + 1 - 2 * passage - gap
    if lead < 0:
        raise ValueError(f"two passages of {passage} tokens {gap} apart need {2 * passage + gap} tokens, more than a "
                         f"window of seq_len + 1 = {seq_len + 1}: lower passage or gap")
    return lead, passage, gap


def copy_streams(stretches: torch.Tensor, lead: int, passage: int) -> tuple[torch.Tensor, torch.Tensor]:
    """stretches (N ≥ 2, T + 1) -> (repeat, control), each (N, T + 1): repeat ends with the passage at
    [lead, lead + passage); control is repeat with that first occurrence taken from the next stretch (cyclically)."""
    if stretches.shape[0] < 2:
        raise ValueError(f"streams must be at least 2 (a control borrows another stream's passage), got "
                         f"{stretches.shape[0]}")
    first = slice(lead, lead + passage)
    repeat = stretches.clone()
    repeat[:, -passage:] = stretches[:, first]
    control = repeat.clone()
    control[:, first] = stretches[:, first].roll(-1, 0)
    return repeat, control


def copy_eval(model: GPT, text: bytes, *, passage: int | None = None, gap: int | None = None, streams: int = 64,
              tokenizer=None, resamples: int = 10_000, seed: int = 0) -> dict:
    """The copy score of ``model`` on ``streams`` stretches of ``text`` (see the module docstring); passage and gap
    in tokens (:func:`layout`'s defaults). ``tokenizer`` as :func:`vqattn.train.length_eval.length_eval`'s.
    Returns {"attention", "seq_len", "lead", "passage", "gap", "streams", "bpb_repeat", "bpb_control", "copied",
    "low", "high", "bits_repeat", "bits_control", "bytes"}: the last three per stream, over the scored tokens."""
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 2:
        raise ValueError(f"streams must be an int ≥ 2 (a control borrows another stream's passage), got {streams!r}")
    T = model.config.seq_len
    lead, passage, gap = layout(T, passage, gap)
    if tokenizer is None or tokenizer.spec == "bytes":
        data, table = text, None
    else:
        data, table = torch.from_numpy(tokenizer.encode(text).astype("int64")), torch.from_numpy(tokenizer.token_bytes())
    repeat, control = copy_streams(held_out_streams(data, T, streams), lead, passage)
    scored = slice(T + 1 - passage, T)  # predictions of the repeat's tokens 2 … passage
    targets = repeat[:, T + 2 - passage:].long()
    size = (torch.ones_like(targets) if table is None else table[targets]).double().sum(1)  # (N,) bytes
    bits = {name: stream_bits(model, s, T)[:, scored].sum(1) for name, s in (("repeat", repeat), ("control", control))}
    draws = torch.randint(0, streams, (resamples, streams), generator=torch.Generator().manual_seed(seed))
    resampled = 1 - bits["repeat"][draws].sum(1) / bits["control"][draws].sum(1)
    low, high = torch.quantile(resampled, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"attention": model.config.stack_name, "seq_len": T, "lead": lead, "passage": passage, "gap": gap,
            "streams": streams, "bpb_repeat": (bits["repeat"].sum() / size.sum()).item(),
            "bpb_control": (bits["control"].sum() / size.sum()).item(),
            "copied": (1 - bits["repeat"].sum() / bits["control"].sum()).item(), "low": low, "high": high,
            "bits_repeat": bits["repeat"].tolist(), "bits_control": bits["control"].tolist(), "bytes": size.tolist()}


def table(results: list[dict], labels: list[str] | None = None) -> str:
    """Results as a markdown table, a row each (labelled by ``labels`` or the attention)."""
    labels = labels or [r["attention"] for r in results]
    rows = ["| model | passage / gap | bpb control | bpb repeat | copied (95% interval) |", "|---|---|---:|---:|---|"]
    for label, r in zip(labels, results):
        rows.append(f"| {label} | {r['passage']} / {r['gap']} | {r['bpb_control']:.3f} | {r['bpb_repeat']:.3f} | "
                    f"{r['copied']:.3f} ({r['low']:.3f} to {r['high']:.3f}) |")
    return "\n".join(rows)


def read_result(path: str) -> dict:
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or "copied" not in result:
        raise ValueError(f"{path} is not a copy_eval.json")
    return result


def saved_label(path: str) -> str:
    """A saved result's row label: its run dir's name for the default RUN/copy_eval/, else its directory's."""
    folder = Path(path).resolve().parent
    return folder.parent.name if folder.name == "copy_eval" else folder.name


def default_out(ckpt: str) -> Path:
    """``copy_eval/`` in the checkpoint's run dir (RUN/checkpoints/last.ckpt -> RUN/copy_eval)."""
    path = Path(ckpt).resolve().parent
    return (path.parent if path.name == "checkpoints" else path) / "copy_eval"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vqattn.train.copy_eval", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", nargs="+", help="a trainer checkpoint (OUT/checkpoints/last.ckpt), or saved copy_eval.json "
                                           "files: their table, a row each")
    p.add_argument("--passage", type=int, default=None, help="passage length in tokens (default seq_len // 4)")
    p.add_argument("--gap", type=int, default=None, help="tokens between the two occurrences (default: "
                                                         "seq_len // 2 + 1 - passage)")
    p.add_argument("--streams", type=int, default=64, help="held-out stretches averaged (default 64)")
    p.add_argument("--text", default=None, help="held-out text file (default: the default corpus's validation split)")
    p.add_argument("--out", default=None, help="directory for copy_eval.json (default: copy_eval/ in the "
                                               "checkpoint's run dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_threads_argument(p)
    args = p.parse_args(argv)
    from ..checkpoint import load_model, read_tokenizer

    try:
        if all(path.endswith(".json") for path in args.ckpt):
            print(table([read_result(path) for path in args.ckpt], [saved_label(path) for path in args.ckpt]))
            return 0
        if len(args.ckpt) > 1:
            raise ValueError("one checkpoint at a time, or saved copy_eval.json files only")
        text = Path(args.text).read_bytes() if args.text else default_held_out()
        model = load_model(args.ckpt[0], args.device)
        use_threads(args.threads, "evaluating")
        result = copy_eval(model, text, passage=args.passage, gap=args.gap, streams=args.streams,
                           tokenizer=read_tokenizer(args.ckpt[0]))
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as err:
        p.error(str(err))
    out = Path(args.out) if args.out is not None else default_out(args.ckpt[0])
    try:
        write_text(out / "copy_eval.json", json.dumps(result, indent=1))
    except WriteFailed as err:  # a full disk, a read-only --out: what was there is whole
        return failed_write_exit(p.prog, err)
    print(table([result]))
    print(f"wrote {out / 'copy_eval.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
