"""Compare the runs of a sweep: ``python -m vqattn.train.report SWEEP_DIR``.

Reads every ``results.json`` under SWEEP_DIR (one per run dir, as train.py writes them) and the validation
rows of each run's ``metrics.csv``; writes SWEEP_DIR/report.md (a markdown table: the attention, a hybrid stack by its
short name (``ovq×3+softmax``), val bpb, tokens/s, threads, params, state floats (one layer's decoding state at the
run's seq_len, a hybrid's mean over layers) and those of all layers, peak memory, steps, seed, sorted by val bpb; MQAR runs
add recall accuracy and are sorted by it; then the corpus, tokenizer, threads, device and code of the runs, and a
warning where tokens/s mix threads or devices; runs that differ only in seed pooled in a table of their mean,
standard deviation, min – max and count) and SWEEP_DIR/val_bpb.png (val bpb against step, a line per setup: runs that
differ only in seed as their mean with bars from min to max). Runs with position buckets add
SWEEP_DIR/by_position.png (val bpb, or recall for MQAR, against position in the window, pooled the same way).
MQAR runs add a recall-against-state table to report.md and SWEEP_DIR/recall_vs_state.png (Zoology's figure: per
attention and state size the best learning rate's recall, mean and spread over seeds, against one layer's state
floats).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

from .. import files


def load_runs(sweep_dir: Path) -> list[dict]:
    """One dict per run: its results.json plus ``name`` (its dir relative to sweep_dir), ``curve`` [(step, bpb)],
    ``setup`` (what it ran, less its seed: :func:`run_setup`) and ``overrides`` (its command line's, less the seed)."""
    runs = []
    for path in sorted(sweep_dir.rglob("results.json")):
        run = json.loads(path.read_text())
        run["name"] = path.parent.relative_to(sweep_dir).as_posix()
        run["setup"], run["overrides"] = run_setup(run, path.parent)
        run["curve"] = []
        metrics = path.parent / "metrics.csv"
        if metrics.exists():
            with metrics.open(newline="") as f:
                for row in csv.DictReader(f):
                    if row.get("val_bpb"):
                        run["curve"].append((int(row["step"]), float(row["val_bpb"])))
        runs.append(run)
    return runs


# What a run measured or where it ran, not what it ran: runs that differ only in these (and the seed) are one setup.
MEASURED = {"name", "curve", "setup", "overrides", "seed", "val_loss", "val_bpb", "val_acc", "recall_acc", "tokens_per_sec",
            "peak_memory_mb", "peak_memory_kind", "wall_seconds", "train_tokens", "device", "date", "code",
            "checkpoint", "codebook", "ddp_buffer_divergence", "threads", "corpus", "tokenizer"}
NOT_SETUP = ("seed", "threads", "ckpt_path")  # config keys that do not change what a run trains


def run_setup(run: dict, run_dir: Path) -> tuple[str, list[str]]:
    """What the run trained, less its seed: the settings results.json records and, where the run dir keeps them
    (Hydra's ``.hydra/``), the whole composed config; and its command line's overrides less the seed. Two runs with
    the same setup differ only in seed (and threads, which change speed alone), so the report pools them."""
    import yaml

    fields = {k: v for k, v in run.items() if k not in MEASURED and not k.startswith("val_")}
    fields["corpus"] = {k: v for k, v in (run.get("corpus") or {}).items() if k in ("name", "source")}
    config, overrides = {}, []
    if (run_dir / ".hydra" / "config.yaml").exists():
        config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text()) or {}
        config = {k: v for k, v in config.items() if k not in NOT_SETUP}
    if (run_dir / ".hydra" / "overrides.yaml").exists():
        overrides = [o for o in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
                     if o.split("=", 1)[0].lstrip("+~") not in NOT_SETUP]
    return json.dumps([fields, config], sort_keys=True, default=str), overrides


def group_runs(runs: list[dict]) -> list[list[dict]]:
    """The runs pooled by setup (:func:`run_setup`): those that differ only in seed form one group, in the order
    their first run comes."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["setup"], []).append(run)
    return list(groups.values())


def group_label(group: list[dict], groups: list[list[dict]]) -> str:
    """A group's name in tables and legends: its attention, with the overrides that tell it from another group of
    the same attention (or its first run's dir, where the runs have none)."""
    attention = group[0]["attention"]
    if sum(g[0]["attention"] == attention for g in groups) == 1:
        return attention
    others = {o for g in groups if g is not group and g[0]["attention"] == attention for o in g[0]["overrides"]}
    own = [o for o in group[0]["overrides"] if o not in others and not o.startswith("attention=")]
    return f"{attention} ({' '.join(own) if own else group[0]['name']})"


def headline(run: dict) -> float:
    """The metric that ranks runs: recall accuracy for MQAR runs (their bpb covers only the answers), else val bpb."""
    return run["recall_acc"] if "recall_acc" in run else run["val_bpb"]


def seed_stats(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min, max and count of one metric over a group's seeds."""
    mean = sum(values) / len(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": len(values)}


def seeds_table(groups: list[list[dict]]) -> str:
    """One row per group of runs that differ only in seed: the headline metric's mean, standard deviation, min–max
    and the seeds, and the mean tokens/s; best first."""
    recall = all("recall_acc" in g[0] for g in groups)
    metric = "recall acc" if recall else "val bpb"
    rows = sorted(((group_label(g, groups), seed_stats([headline(r) for r in g]), g) for g in groups),
                  key=lambda row: -row[1]["mean"] if recall else row[1]["mean"])
    lines = [f"| setup | runs | seeds | {metric} mean | std | min – max | tokens/s mean |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for label, stats, g in rows:
        speed = sum(r["tokens_per_sec"] for r in g) / len(g)
        seeds = ", ".join(str(r.get("seed", "?")) for r in g)
        lines.append(f"| {label} | {stats['n']} | {seeds} | {stats['mean']:.4f} | {stats['std']:.4f} "
                     f"| {stats['min']:.4f} – {stats['max']:.4f} | {speed:,.0f} |")
    return "\n".join(lines) + "\n"


def sort_key(run: dict) -> tuple:
    """Best first: by recall accuracy (descending) for MQAR runs, whose bpb covers only the answers, else by val bpb."""
    if "recall_acc" in run:
        return (0, -run["recall_acc"])
    return (1, run["val_bpb"])


def markdown_table(runs: list[dict]) -> str:
    """A row per run, best first, then what the runs ran on (:func:`provenance_lines`) and how to read the columns."""
    recall = any("recall_acc" in r for r in runs)
    total = any("state_floats_total" in r for r in runs)  # older results.json files lack it
    lines = [
        f"| run | attention |{' recall acc |' if recall else ''} val bpb | tokens/s | threads | params "
        f"| state floats |{' all layers |' if total else ''} peak memory (MB) | steps | seed |",
        f"|---|---|{'---:|' if recall else ''}---:|---:|---:|---:|---:|{'---:|' if total else ''}---:|---:|---:|",
    ]
    for r in sorted(runs, key=sort_key):
        acc = (f" {r['recall_acc']:.4f} |" if "recall_acc" in r else " |") if recall else ""
        state = f"{r['state_floats']:,}" if "state_floats" in r else "?"
        state += (f" | {r['state_floats_total']:,}" if "state_floats_total" in r else " | ?") if total else ""
        lines.append(
            f"| {r['name']} | {r['attention']} |{acc} {r['val_bpb']:.4f} | {r['tokens_per_sec']:,.0f} "
            f"| {r.get('threads', '?')} | {r['params']:,} | {state} | {r['peak_memory_mb']:,.0f} | {r['steps']} "
            f"| {r.get('seed', '?')} |"
        )
    kinds = sorted({r.get("peak_memory_kind", "?") for r in runs})
    lines += ["", *provenance_lines(runs), "", f"Peak memory: {', '.join(kinds)}."]
    speed = speed_note(runs)
    if speed:
        lines.append(speed)
    if "cpu_max_rss_of_process" in kinds:
        lines.append("cpu_max_rss_of_process: the process's peak over this run and the runs before it in the same "
                     "multirun (a CPU process's peak cannot be reset); run one attention per command for its own.")
    if recall:
        lines.append("MQAR runs are ranked by recall accuracy (the headline; their bpb counts the answers only).")
    return "\n".join(lines) + "\n"


def listed(runs: list[dict], value) -> str:
    """The distinct values of ``value(run)`` over the runs, sorted, joined by "; " (one value when they agree)."""
    return "; ".join(sorted({str(value(r)) for r in runs}))


def corpus_text(run: dict) -> str:
    """The run's corpus in words: its name, source and split sizes (results.json's ``corpus``; older runs recorded
    only the data module)."""
    corpus = run.get("corpus")
    if not corpus:
        return f"{run.get('data', '?')} (not recorded)"
    sizes = (f", {corpus['train_bytes']:,} train / {corpus['val_bytes']:,} validation bytes"
             if "train_bytes" in corpus else "")
    source = f" from {corpus['source']}" if corpus.get("source") else ""
    return f"{corpus['name']}{source}{sizes}"


def provenance_lines(runs: list[dict]) -> list[str]:
    """What every report states about its runs: corpus, tokenizer, threads, device and code version (and date)."""
    return [f"- corpus: {listed(runs, corpus_text)}",
            f"- tokenizer: {listed(runs, lambda r: r.get('tokenizer', 'bytes (not recorded)'))}",
            f"- threads: {listed(runs, lambda r: r.get('threads', '?'))}",
            f"- device: {listed(runs, lambda r: r.get('device', '?'))}",
            f"- code: {listed(runs, lambda r: r.get('code', '?'))}; run {listed(runs, lambda r: r.get('date', '?'))}"]


def speed_note(runs: list[dict]) -> str | None:
    """Where the runs' threads or devices differ, a line saying tokens/s cannot rank them across those: threads=auto
    chooses per run, and a run with two threads can be twice as fast as one with one, or several times slower."""
    def where(run: dict) -> str:
        return f"{run.get('threads', '?')} threads on {run.get('device', '?')}"

    if len({where(r) for r in runs}) < 2:
        return None
    return (f"tokens/s are not comparable across these runs: they ran with different threads or devices "
            f"({listed(runs, where)}); compare speed only between runs with the same threads and device.")


# Runs drawn alike (e.g. two attentions that reach the same recall) stay visible: each has its own line style
# and hollow marker, drawn half-transparent.
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def run_style(i: int) -> dict:
    return {"linestyle": LINESTYLES[i % len(LINESTYLES)], "marker": MARKERS[i % len(MARKERS)], "markersize": 5,
            "fillstyle": "none", "alpha": 0.8}


def pooled(group: list[dict], points) -> tuple[list, list, list, list]:
    """x, mean, min and max over a group's runs of ``points(run)`` -> {x: y}, at the x every run has."""
    tables = [points(r) for r in group]
    xs = sorted(set(tables[0]).intersection(*tables[1:]))
    ys = [[t[x] for t in tables] for x in xs]
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def draw_groups(ax, runs: list[dict], points) -> set:
    """A line per group of runs that differ only in seed (:func:`group_runs`): its one run, or its runs' mean with
    bars spanning their min to max, labelled with the group's attention (and the seed count); returns the x drawn."""
    groups, drawn = group_runs(runs), set()
    for i, group in enumerate(groups):
        xs, mean, low, high = pooled(group, points)
        if not xs:
            continue
        drawn.update(xs)
        label = group_label(group, groups)
        if len(group) == 1:
            ax.plot(xs, mean, label=label, **run_style(i))
        else:
            spread = [[m - lo for m, lo in zip(mean, low)], [hi - m for m, hi in zip(mean, high)]]
            ax.errorbar(xs, mean, yerr=spread, capsize=3, label=f"{label}, mean of {len(group)} seeds (bars: min–max)",
                        **run_style(i))
    return drawn


def curve_points(run: dict) -> dict:
    """{step: val bpb} of a run's validations; a run validated only at its end still shows as a point."""
    return dict(sorted(set(run["curve"]))) if run["curve"] else {run["steps"]: run["val_bpb"]}


def draw_curves(ax, runs: list[dict]) -> None:
    """Validation bpb against step, a line per setup (runs that differ only in seed pooled, with bars); the step axis
    has integer ticks (the steps themselves when there are few, as when every run validated only at its end)."""
    from matplotlib.ticker import MaxNLocator

    all_steps = draw_groups(ax, runs, curve_points)
    if len(all_steps) <= 8:
        ax.set_xticks(sorted(all_steps))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.set_title(provenance(runs), fontsize=8)


def provenance(runs: list[dict]) -> str:
    """What measured the runs, for a figure's caption: code, date, device and threads, and corpus (each value once
    when the runs agree, else each one)."""
    corpus = listed(runs, lambda r: (r.get("corpus") or {}).get("name", r.get("data", "?")))
    return (f"code {listed(runs, lambda r: r.get('code', '?'))}, run {listed(runs, lambda r: r.get('date', '?'))}; "
            f"{listed(runs, lambda r: r.get('device', '?'))}; corpus {corpus}")


def plain_log_x(ax) -> None:
    """A log x axis labelled in plain numbers at 1, 2 and 5 per decade (20,000 rather than 2×10⁴): matplotlib's
    default labels every minor tick in scientific notation when the data span less than a decade, and they overlap."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log")
    plain = FuncFormatter(lambda x, _: f"{x:,.0f}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_locator(LogLocator(subs=(2, 5)))
    ax.xaxis.set_minor_formatter(plain)


def position_midpoint(name: str) -> float:
    """The middle of the bucket "A_B" (positions A..B)."""
    lo, hi = map(int, name.split("_"))
    return (lo + hi) / 2


def draw_positions(ax, runs: list[dict]) -> None:
    """Validation bpb (recall accuracy for MQAR sweeps) against position in the window, at the bucket midpoints
    (log axis), a line per setup (runs that differ only in seed pooled, with bars)."""
    recall = all("recall_acc" in r for r in runs)
    key = "val_acc_by_position" if recall else "val_bpb_by_position"
    draw_groups(ax, runs, lambda r: {position_midpoint(name): v for name, v in (r.get(key) or {}).items()})
    plain_log_x(ax)
    ax.set_xlabel("position in the validation window (bucket midpoint)")
    ax.set_ylabel("recall accuracy" if recall else "validation bits per byte")


def recall_cells(runs: list[dict]) -> list[dict]:
    """Zoology's reading of an MQAR sweep: per (attention, state_floats) cell the learning rate with the best mean
    recall over its seeds, with that mean, the seeds' min and max, the seed count and how many rates were tried."""
    by_rate: dict[tuple, list[float]] = {}
    for r in runs:
        if "recall_acc" in r and "state_floats" in r:
            by_rate.setdefault((r["attention"], r["state_floats"], r.get("lr")), []).append(r["recall_acc"])
    cells: dict[tuple, dict] = {}
    for (attention, state, lr), recalls in sorted(by_rate.items(), key=str):
        mean = sum(recalls) / len(recalls)
        cell = cells.get((attention, state))
        rates = (cell["rates"] + 1) if cell else 1
        if cell is None or mean > cell["recall"]:
            cell = {"attention": attention, "state_floats": state, "lr": lr, "recall": mean, "min": min(recalls),
                    "max": max(recalls), "seeds": len(recalls)}
        cells[(attention, state)] = {**cell, "rates": rates}
    return sorted(cells.values(), key=lambda c: (c["attention"], c["state_floats"]))


def recall_table(cells: list[dict]) -> str:
    lines = ["| attention | state floats | best lr | recall (mean over seeds) | min | max | seeds | rates tried |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {c['attention']} | {c['state_floats']:,} | {c['lr']} | {c['recall']:.4f} | {c['min']:.4f} "
              f"| {c['max']:.4f} | {c['seeds']} | {c['rates']} |" for c in cells]
    return "\n".join(lines) + "\n"


def draw_recall_vs_state(ax, cells: list[dict]) -> None:
    """The Zoology figure: recall (best rate, mean over seeds; bars span the seeds) against one layer's state
    floats (log axis), one line per attention."""
    attentions = sorted({c["attention"] for c in cells})
    for i, attention in enumerate(attentions):
        mine = [c for c in cells if c["attention"] == attention]
        x, y = [c["state_floats"] for c in mine], [c["recall"] for c in mine]
        spread = [[c["recall"] - c["min"] for c in mine], [c["max"] - c["recall"] for c in mine]]
        ax.errorbar(x, y, yerr=spread, label=attention, capsize=3, **run_style(i))
    plain_log_x(ax)
    ax.set_xlabel("state floats per layer")
    ax.set_ylabel("recall accuracy (best lr, mean over seeds)")


def save_figure(draw, data, path: Path) -> None:
    """draw(ax, data) on a fresh figure, saved as a PNG at path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, data)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        files.save_figure(fig, path, dpi=120)
    finally:
        plt.close(fig)


def write_report(sweep_dir: Path, runs: list[dict]) -> list[Path]:
    """report.md and the figures the runs have data for; returns the paths written."""
    table = markdown_table(runs)
    groups = group_runs(runs)
    if any(len(g) > 1 for g in groups):
        table += ("\nOver seeds (runs that differ only in seed pooled: mean, sample standard deviation, min – max):"
                  "\n\n" + seeds_table(groups))
    cells = recall_cells(runs)
    if cells:
        table += "\nRecall against state (the best learning rate of each cell, mean over its seeds):\n\n"
        table += recall_table(cells)
    written = [sweep_dir / "report.md", sweep_dir / "val_bpb.png"]
    files.write_text(written[0], table)
    save_figure(draw_curves, runs, written[1])
    if any(r.get("val_bpb_by_position") for r in runs):
        written.append(sweep_dir / "by_position.png")
        save_figure(draw_positions, runs, written[-1])
    if cells:
        written.append(sweep_dir / "recall_vs_state.png")
        save_figure(draw_recall_vs_state, cells, written[-1])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vqattn.train.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a Hydra sweep dir (or any dir holding run dirs with results.json)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")
    runs = load_runs(args.sweep_dir)
    if not runs:
        parser.error(f"no results.json found under {args.sweep_dir}; did the runs finish?")
    try:
        written = write_report(args.sweep_dir, runs)
    except files.WriteFailed as err:  # a full disk, a read-only sweep dir: what was there is whole
        return files.failed_write_exit(parser.prog, err)
    print(written[0].read_text())
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
