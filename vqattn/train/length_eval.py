"""Length generalisation: bits per byte by absolute position, read past the training length with the carried state.

    python -m vqattn.train.length_eval CKPT                  # 16x the training length, 32 streams: RUN/length_eval/
    python -m vqattn.train.length_eval CKPT --multiple 32 --text notes.txt --out outputs/notes_eval/
    python -m vqattn.train.length_eval CKPT --against window_eval/length_eval.json   # the drift against a baseline
    python -m vqattn.train.length_eval CKPT --memory-decay T      # ovq read with forgetting on a horizon of T keys
    python -m vqattn.train.length_eval a/length_eval.json b/length_eval.json --against window_eval/length_eval.json \
        --plot ab.png                                         # saved results: a row each, plotted together

Each stream is a contiguous stretch of held-out text, ``multiple`` times the checkpoint's ``model.seq_len`` (T)
bytes long. It runs through ``GPT.forward(..., state=, return_state=True)`` in segments of T, each continuing the
state of the one before (a vq or ovq layer's compressed memory and window, a window layer's raw window, softmax's
growing KV cache), as decoding would. The result is the bits per byte of every absolute position, averaged over the
streams and over buckets [0, T), [T, 2T), [2T, 4T), ... that double up to multiple·T, with a plot. A memory that
generalises keeps the later buckets at the first one's level, as the raw window does up to the text's own drift.
The change from the first bucket to the last comes with a 95% bootstrap interval over the streams, and, against
another checkpoint's result on the same streams, as a paired difference (:func:`change_interval`).

Held-out text: the default corpus's validation split (whole files, none of them trained on; see
``StdlibDataModule``), or ``--text`` (a UTF-8 or binary file). Learned absolute positions cannot read past T: such a
checkpoint is a one-line error.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ..files import WriteFailed, failed_write_exit, save_figure, write_text
from ..model import GPT
from ..ops.common.memory_decay import check_memory_decay
from ..utils import add_threads_argument, use_threads


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


def held_out_streams(text: bytes | torch.Tensor, length: int, count: int) -> torch.Tensor:
    """``count`` stretches of length + 1 tokens at evenly spaced offsets of ``text`` (bytes, or a 1-D tensor of token
    ids): (count, length + 1), uint8 for bytes."""
    unit = "bytes" if isinstance(text, bytes) else "tokens"
    room = len(text) - (length + 1)
    if room < 0:
        raise ValueError(f"the held-out text has {len(text)} {unit}; streams of {length} {unit} need at least "
                         f"{length + 1}: lower --multiple or pass a longer --text")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8) if isinstance(text, bytes) else text
    offsets = torch.linspace(0, room, count).round().long() if count > 1 else torch.zeros(1, dtype=torch.long)
    return torch.stack([data[o:o + length + 1] for o in offsets.tolist()])


def streams_overlap(text_len: int, length: int, count: int) -> bool:
    """Whether :func:`held_out_streams`' ``count`` evenly spaced stretches of length + 1 bytes share text."""
    return count * (length + 1) > text_len


def default_held_out() -> bytes:
    """The default corpus's validation split (by file, never trained on)."""
    from .data import StdlibDataModule

    return StdlibDataModule()._load()[1]


def length_eval(model: GPT, text: bytes, *, multiple: int = 16, streams: int = 32, edit_state=None,
                tokenizer=None) -> dict:
    """Bits per byte by bucket of absolute position (:func:`bucket_edges`, in tokens) when ``model`` reads ``streams``
    stretches of ``text`` to ``multiple`` times its training length. Returns {"attention", "seq_len", "streams",
    "edges", "bpb", "bpb_by_stream"} with one bpb per bucket [edges[i], edges[i + 1]), and every stream's
    (streams, buckets). ``edit_state`` as in :func:`stream_bits`. ``tokenizer`` (vqattn.tokenizer, the
    checkpoint's: :func:`vqattn.checkpoint.read_tokenizer`): the text is encoded with it, and a bucket's bits are
    divided by the bytes its tokens stand for; None: bytes."""
    for name, value in (("multiple", multiple), ("streams", streams)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    T = model.config.seq_len
    if model.config.pos_emb == "learned":
        raise ValueError(f"the model uses learned absolute positions (model.pos_emb=learned): it cannot read past "
                         f"its training length {T}; length generalisation needs pos_emb rope or none")
    edges = bucket_edges(T, multiple)
    if tokenizer is None or tokenizer.spec == "bytes":
        data, table = text, None
    else:
        data, table = torch.from_numpy(tokenizer.encode(text).astype("int64")), torch.from_numpy(tokenizer.token_bytes())
    windows = held_out_streams(data, edges[-1], streams)
    bits = stream_bits(model, windows, T, edit_state)  # (streams, multiple·T)
    if table is None:
        by_stream = torch.stack([bits[:, a:b].mean(1) for a, b in zip(edges[:-1], edges[1:])], 1)  # (streams, buckets)
    else:
        size = table[windows[:, 1:]].double()  # bytes of each target
        by_stream = torch.stack([bits[:, a:b].sum(1) / size[:, a:b].sum(1) for a, b in zip(edges[:-1], edges[1:])], 1)
    return {"attention": model.config.stack_name, "seq_len": T, "streams": streams, "edges": edges,
            "bpb": by_stream.mean(0).tolist(), "bpb_by_stream": by_stream.tolist()}


def read_with_memory_decay(model: GPT, memory_decay: float | str) -> GPT:
    """A copy of ``model`` whose ovq layers forget with ``memory_decay`` γ (the layer option), or with exp(−1/T) for
    ``"T"``: a horizon of the training length, so that far past T a slot averages about as many recent keys as
    training showed it rather than every key since the stream began (docs/evaluation.md measures it)."""
    if not any(hasattr(block.attn, "memory_decay") for block in model.blocks):
        raise ValueError(f"memory_decay applies to ovq layers; this model's attention is {model.config.stack_name}")
    gamma = math.exp(-1 / model.config.seq_len) if memory_decay == "T" else memory_decay
    model = copy.deepcopy(model)
    for block in model.blocks:
        if hasattr(block.attn, "memory_decay"):
            check_memory_decay(gamma, block.attn.block_len)
            block.attn.memory_decay = gamma
    return model


def last_vs_first(by_stream: torch.Tensor) -> torch.Tensor:
    """The change of the last bucket's bpb against the first's, in percent, of the mean over streams: (..., N, buckets)
    -> (...). Every stream has the same positions in a bucket, so the mean of its rows is the bucket's bpb."""
    bpb = by_stream.mean(-2)
    return 100 * (bpb[..., -1] / bpb[..., 0] - 1)


def change_interval(result: dict, baseline: dict | None = None, *, resamples: int = 10_000, seed: int = 0) -> dict:
    """The last-vs-first change (percent) with a 95% bootstrap interval over the streams, {"change", "low", "high"}.

    With ``baseline`` (another checkpoint's result on the same streams), the difference of the two changes in
    percentage points, each resample drawing the same streams for both: the text's own drift, which both models
    read, cancels in the pair, so the interval measures the models' difference, not the text's."""
    if baseline is not None and (baseline["edges"], baseline["streams"]) != (result["edges"], result["streams"]):
        raise ValueError(f"baseline must read the same streams: edges {baseline['edges']} and {baseline['streams']} "
                         f"streams, against {result['edges']} and {result['streams']}")
    draws = torch.randint(0, result["streams"], (resamples, result["streams"]),
                          generator=torch.Generator().manual_seed(seed))  # (resamples, N) stream indices
    pairs = [result] if baseline is None else [result, baseline]
    point, resampled = 0.0, torch.zeros(resamples, dtype=torch.float64)
    for sign, item in zip((1, -1), pairs):
        by_stream = torch.tensor(item["bpb_by_stream"], dtype=torch.float64)  # (N, buckets)
        point += sign * last_vs_first(by_stream).item()
        resampled += sign * last_vs_first(by_stream[draws])
    low, high = torch.quantile(resampled, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"change": point, "low": low, "high": high}


def table(results: list[dict], baseline: dict | None = None, labels: list[str] | None = None) -> str:
    """Results on the same buckets as a markdown table, a row each (labelled by ``labels`` or the attention): one
    column per bucket, the last bucket against the first with its 95% interval over the streams, and, with
    ``baseline``, the difference from the baseline's change."""
    edges, labels = results[0]["edges"], labels or [r["attention"] for r in results]
    kb = lambda n: f"{n // 1024}k" if n % 1024 == 0 and n else str(n)  # noqa: E731
    head = " | ".join(f"{kb(a)}–{kb(b)}" for a, b in zip(edges[:-1], edges[1:]))
    spans = ["last vs first (95%)"] + ([] if baseline is None else [f"against {baseline['attention']} (points)"])
    lines = [f"| attention | {head} | {' | '.join(spans)} |", f"|---|{'---:|' * (len(edges) - 1 + len(spans))}"]
    for label, result in zip(labels, results):
        if result["edges"] != edges:
            raise ValueError(f"{label} has buckets {result['edges']}, the first result {edges}: compare one length")
        changes = [(change_interval(result), 1, "%")]  # a percent to one decimal, a difference in points to two
        if baseline is not None:
            changes.append((change_interval(result, baseline), 2, ""))
        cells = [f"{c['change']:+.{n}f}{unit} ({c['low']:+.{n}f} to {c['high']:+.{n}f})" for c, n, unit in changes]
        lines.append(f"| {label} | {' | '.join(f'{x:.3f}' for x in result['bpb'])} | {' | '.join(cells)} |")
    return "\n".join(lines)


def draw(ax, results: list[dict], labels: list[str] | None = None) -> None:
    """bpb per bucket against the bucket's end position, a line per result, on a log axis labelled in plain
    numbers at the bucket ends (matplotlib's default labels the minor ticks too, "3×10²4×10²", which overlap)."""
    from matplotlib.ticker import NullLocator

    from .report import plain_log_x

    for label, result in zip(labels or [r["attention"] for r in results], results):
        ax.plot(result["edges"][1:], result["bpb"], marker="o", label=label)
    ax.axvline(results[0]["seq_len"], color="gray", linestyle=":", label="training length")
    plain_log_x(ax)
    ax.set_xticks(sorted({edge for r in results for edge in r["edges"][1:]}))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="absolute position (bucket end, bytes)", ylabel="bits per byte")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines, not over them


def plot(results: list[dict], path: Path, labels: list[str] | None = None) -> None:
    """:func:`draw` saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    draw(ax, results, labels)
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)


def default_out(ckpt: str) -> Path:
    """Where a checkpoint's results go by default: ``length_eval/`` in its run dir (RUN/checkpoints/last.ckpt ->
    RUN/length_eval), beside the run's other results rather than in the current directory (a checkout's)."""
    path = Path(ckpt).resolve().parent
    return (path.parent if path.name == "checkpoints" else path) / "length_eval"


def read_result(path: str) -> dict:
    """A length_eval.json, checked to hold the per-stream bpb that intervals need."""
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or "bpb_by_stream" not in result:
        raise ValueError(f"{path} is not a length_eval.json with bpb_by_stream (older versions wrote none): "
                         f"run its checkpoint again")
    return result


def memory_decay_arg(text: str) -> float | str:
    """--memory-decay's value: "T" or a number."""
    try:
        return text if text == "T" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number in (0, 1] or T, got {text!r}") from None


def saved_label(path: str) -> str:
    """A saved result's row label: its directory's name, or its run dir's for the default RUN/length_eval/."""
    folder = Path(path).resolve().parent
    return folder.parent.name if folder.name == "length_eval" else folder.name


def compare_saved(paths: list[str], baseline: dict | None, plot_path: str | None) -> str:
    """The table (and, given ``plot_path``, the plot) of saved results, each row labelled by its directory."""
    results, labels = [read_result(path) for path in paths], [saved_label(path) for path in paths]
    summary = table(results, baseline, labels)
    if plot_path is not None:
        plot(results, Path(plot_path), labels)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vqattn.train.length_eval", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", nargs="+", help="a trainer checkpoint (OUT/checkpoints/last.ckpt), or saved length_eval.json "
                                           "files: their table (a row each) without reading the text again")
    p.add_argument("--multiple", type=int, default=16, help="stream length in training lengths (default 16)")
    p.add_argument("--streams", type=int, default=32, help="held-out stretches averaged (default 32)")
    p.add_argument("--text", default=None, help="held-out text file (default: the default corpus's validation split)")
    p.add_argument("--out", default=None, help="directory for length_eval.json and length_eval.png (default: "
                                               "length_eval/ in the checkpoint's run dir)")
    p.add_argument("--against", default=None, metavar="JSON",
                   help="another checkpoint's length_eval.json on the same streams (e.g. the window's): the table adds "
                        "the difference of the two last-vs-first changes, with its interval")
    p.add_argument("--memory-decay", default=None, metavar="GAMMA|T", type=memory_decay_arg,
                   help="read with the ovq layers' memory_decay set to GAMMA, or T for exp(-1/T): a horizon of the "
                        "training length (an ovq model trained without forgetting reads far past T better with it)")
    p.add_argument("--plot", default=None, metavar="PNG", help="with saved length_eval.json files: plot them together")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_threads_argument(p)
    args = p.parse_args(argv)
    from ..checkpoint import load_model, read_tokenizer

    saved = [path.endswith(".json") for path in args.ckpt]
    try:
        baseline = read_result(args.against) if args.against else None
        if any(saved):
            if not all(saved):
                raise ValueError("give one checkpoint, or saved length_eval.json files only")
            print(compare_saved(args.ckpt, baseline, args.plot))
            return 0
        if len(args.ckpt) > 1 or args.plot:
            raise ValueError("one checkpoint at a time (its plot goes to --out); several inputs and --plot compare "
                             "saved length_eval.json files")
        text = Path(args.text).read_bytes() if args.text else default_held_out()
        model = load_model(args.ckpt[0], args.device)
        use_threads(args.threads, "evaluating")
        if args.memory_decay is not None:
            model = read_with_memory_decay(model, args.memory_decay)
        result = length_eval(model, text, multiple=args.multiple, streams=args.streams,
                             tokenizer=read_tokenizer(args.ckpt[0]))
        if args.memory_decay is not None:
            result["memory_decay"] = args.memory_decay  # what the model was read with, not trained with
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as err:
        p.error(str(err))
    except WriteFailed as err:  # --plot on a full disk or a read-only directory
        return failed_write_exit(p.prog, err)
    out = Path(args.out) if args.out is not None else default_out(args.ckpt[0])
    try:  # each file whole or not at all (--against reads the json); the directory made as the first is written
        write_text(out / "length_eval.json", json.dumps(result, indent=1))
        plot([result], out / "length_eval.png")
    except WriteFailed as err:  # a full disk, a read-only --out: what was there is whole
        return failed_write_exit(p.prog, err)
    try:
        print(table([result], baseline))
    except ValueError as err:  # the result is written: only the comparison is refused
        p.error(f"wrote {out / 'length_eval.json'}; {err}")
    print(f"wrote {out / 'length_eval.json'} and {out / 'length_eval.png'}")
    if streams_overlap(len(text), result["edges"][-1], args.streams):
        print(f"note: {args.streams} streams of {result['edges'][-1]} bytes overlap in {len(text)} bytes of held-out "
              f"text, so they are not independent draws and the intervals are approximate (too narrow, if anything); "
              f"a longer --text gives disjoint streams", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
