"""Length generalisation: bits per byte by absolute position, read past the training length with the carried state.

    python -m vqattn.train.length_eval CKPT                  # 16x the training length, 32 streams, plot + json
    python -m vqattn.train.length_eval CKPT --multiple 32 --text notes.txt --out length_eval/

Each stream is a contiguous stretch of held-out text, ``multiple`` times the checkpoint's ``model.seq_len`` (T)
bytes long. It runs through ``GPT.forward(..., state=, return_state=True)`` in segments of T, each continuing the
state of the one before (a vq or ovq layer's compressed memory and window, a window layer's raw window, softmax's
growing KV cache), as decoding would. The result is the bits per byte of every absolute position, averaged over the
streams and over buckets [0, T), [T, 2T), [2T, 4T), ... that double up to multiple·T, with a plot. A memory that
generalises keeps the later buckets at the first one's level, as the raw window does up to the text's own drift.

Held-out text: the default corpus's validation split (whole files, none of them trained on; see
``StdlibDataModule``), or ``--text`` (a UTF-8 or binary file). Learned absolute positions cannot read past T: such a
checkpoint is a one-line error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model import GPT


def bucket_edges(seq_len: int, multiple: int) -> list[int]:
    """[0, T, 2T, 4T, ..., multiple·T]: buckets that double, the last one cut at the stream's end."""
    edges, end = [0, seq_len], multiple * seq_len
    while edges[-1] < end:
        edges.append(min(2 * edges[-1], end))
    return edges


def stream_bits(model: GPT, streams: torch.Tensor, segment: int, edit_state=None) -> torch.Tensor:
    """The NLL in bits of every next byte of ``streams`` (N, length + 1) uint8 or long, read in segments of
    ``segment`` tokens with the carried state: (N, length), float64. ``edit_state`` (GPTState -> GPTState), when
    given, changes the carried state between segments (benchmarks/length_ablations.py)."""
    idx = streams.long()
    state, bits = None, []
    with torch.inference_mode():
        for start in range(0, idx.shape[1] - 1, segment):
            x, y = idx[:, start:start + segment], idx[:, start + 1:start + segment + 1]
            x = x[:, :y.shape[1]]
            out = model(x, state=state, return_state=True)
            nll = F.cross_entropy(out.logits.double().transpose(1, 2), y, reduction="none")  # (N, segment)
            bits.append(nll / math.log(2))
            state = out.state if edit_state is None else edit_state(out.state)
    return torch.cat(bits, 1)


def held_out_streams(text: bytes, length: int, count: int) -> torch.Tensor:
    """``count`` stretches of length + 1 bytes at evenly spaced offsets of ``text``: (count, length + 1) uint8."""
    room = len(text) - (length + 1)
    if room < 0:
        raise ValueError(f"the held-out text has {len(text)} bytes; streams of {length} bytes need at least "
                         f"{length + 1}: lower --multiple or pass a longer --text")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    offsets = torch.linspace(0, room, count).round().long() if count > 1 else torch.zeros(1, dtype=torch.long)
    return torch.stack([data[o:o + length + 1] for o in offsets.tolist()])


def default_held_out() -> bytes:
    """The default corpus's validation split (by file, never trained on)."""
    from .data import StdlibDataModule

    return StdlibDataModule()._load()[1]


def length_eval(model: GPT, text: bytes, *, multiple: int = 16, streams: int = 32) -> dict:
    """Bits per byte by bucket of absolute position (:func:`bucket_edges`) when ``model`` reads ``streams``
    stretches of ``text`` to ``multiple`` times its training length. Returns {"attention", "seq_len", "streams",
    "edges", "bpb"} with one bpb per bucket [edges[i], edges[i + 1])."""
    for name, value in (("multiple", multiple), ("streams", streams)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    T = model.config.seq_len
    if model.config.pos_emb == "learned":
        raise ValueError(f"the model uses learned absolute positions (model.pos_emb=learned): it cannot read past "
                         f"its training length {T}; length generalisation needs pos_emb rope or none")
    edges = bucket_edges(T, multiple)
    bits = stream_bits(model, held_out_streams(text, edges[-1], streams), T).mean(0)  # (multiple·T,)
    bpb = [bits[a:b].mean().item() for a, b in zip(edges[:-1], edges[1:])]
    return {"attention": model.config.attention, "seq_len": T, "streams": streams, "edges": edges, "bpb": bpb}


def table(result: dict) -> str:
    """The result as a markdown table: one column per bucket, and the last bucket against the first."""
    edges, bpb = result["edges"], result["bpb"]
    kb = lambda n: f"{n // 1024}k" if n % 1024 == 0 and n else str(n)  # noqa: E731
    head = " | ".join(f"{kb(a)}–{kb(b)}" for a, b in zip(edges[:-1], edges[1:]))
    change = f"{100 * (bpb[-1] / bpb[0] - 1):+.1f}%"
    return (f"| attention | {head} | last vs first |\n|---|{'---:|' * (len(bpb) + 1)}\n"
            f"| {result['attention']} | {' | '.join(f'{x:.3f}' for x in bpb)} | {change} |")


def plot(result: dict, path: Path) -> None:
    """bpb per bucket against the bucket's end position (log scale), saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(result["edges"][1:], result["bpb"], marker="o", label=result["attention"])
    ax.axvline(result["seq_len"], color="gray", linestyle=":", label="training length")
    ax.set(xscale="log", xlabel="absolute position (bucket end, bytes)", ylabel="bits per byte")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vqattn.train.length_eval", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", help="a trainer checkpoint (OUT/checkpoints/last.ckpt)")
    p.add_argument("--multiple", type=int, default=16, help="stream length in training lengths (default 16)")
    p.add_argument("--streams", type=int, default=32, help="held-out stretches averaged (default 32)")
    p.add_argument("--text", default=None, help="held-out text file (default: the default corpus's validation split)")
    p.add_argument("--out", default="length_eval", help="directory for length_eval.json and length_eval.png")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    from .lit import load_model

    try:
        text = Path(args.text).read_bytes() if args.text else default_held_out()
        result = length_eval(load_model(args.ckpt, args.device), text, multiple=args.multiple, streams=args.streams)
    except (ValueError, FileNotFoundError) as err:
        p.error(str(err))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "length_eval.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "length_eval.png")
    print(table(result))
    print(f"wrote {out / 'length_eval.json'} and {out / 'length_eval.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
