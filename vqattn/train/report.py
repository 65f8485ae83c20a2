"""Compare the runs of a sweep: ``python -m vqattn.train.report SWEEP_DIR``.

Reads every ``results.json`` under SWEEP_DIR (one per run dir, as train.py writes them) and the validation
rows of each run's ``metrics.csv``; writes SWEEP_DIR/report.md (a markdown table: val bpb, tokens/s, params,
state floats (one layer's decoding state at the run's seq_len), peak memory, sorted by val bpb; MQAR runs add recall
accuracy and are sorted by it) and SWEEP_DIR/val_bpb.png (val bpb against step, one line per run). Runs with
position buckets add SWEEP_DIR/by_position.png (val bpb, or recall for MQAR, against position in the window, one line
per run). MQAR runs add a recall-against-state table to report.md and SWEEP_DIR/recall_vs_state.png (Zoology's
figure: per attention and state size the best learning rate's recall, mean and spread over seeds, against one
layer's state floats).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def load_runs(sweep_dir: Path) -> list[dict]:
    """One dict per run: its results.json plus ``name`` (its dir relative to sweep_dir) and ``curve`` [(step, bpb)]."""
    runs = []
    for path in sorted(sweep_dir.rglob("results.json")):
        run = json.loads(path.read_text())
        run["name"] = path.parent.relative_to(sweep_dir).as_posix()
        run["curve"] = []
        metrics = path.parent / "metrics.csv"
        if metrics.exists():
            with metrics.open(newline="") as f:
                for row in csv.DictReader(f):
                    if row.get("val_bpb"):
                        run["curve"].append((int(row["step"]), float(row["val_bpb"])))
        runs.append(run)
    return runs


def sort_key(run: dict) -> tuple:
    """Best first: by recall accuracy (descending) for MQAR runs, whose bpb covers only the answers, else by val bpb."""
    if "recall_acc" in run:
        return (0, -run["recall_acc"])
    return (1, run["val_bpb"])


def markdown_table(runs: list[dict]) -> str:
    recall = any("recall_acc" in r for r in runs)
    lines = [
        f"| run | attention |{' recall acc |' if recall else ''} val bpb | tokens/s | params | state floats "
        "| peak memory (MB) | steps |",
        f"|---|---|{'---:|' if recall else ''}---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(runs, key=sort_key):
        acc = (f" {r['recall_acc']:.4f} |" if "recall_acc" in r else " |") if recall else ""
        state = f"{r['state_floats']:,}" if "state_floats" in r else "?"
        lines.append(
            f"| {r['name']} | {r['attention']} |{acc} {r['val_bpb']:.4f} | {r['tokens_per_sec']:,.0f} | {r['params']:,} "
            f"| {state} | {r['peak_memory_mb']:,.0f} | {r['steps']} |"
        )
    kinds = sorted({r.get("peak_memory_kind", "?") for r in runs})
    lines += ["", f"Peak memory: {', '.join(kinds)}. Measured by {provenance(runs)}."]
    if "cpu_max_rss_of_process" in kinds:
        lines.append("cpu_max_rss_of_process: the process's peak over this run and the runs before it in the same "
                     "multirun (a CPU process's peak cannot be reset); run one attention per command for its own.")
    if recall:
        lines.append("MQAR runs are ranked by recall accuracy (the headline; their bpb counts the answers only).")
    return "\n".join(lines) + "\n"


# Runs drawn alike (e.g. two attentions that reach the same recall) stay visible: each has its own line style
# and hollow marker, drawn half-transparent.
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def run_style(i: int) -> dict:
    return {"linestyle": LINESTYLES[i % len(LINESTYLES)], "marker": MARKERS[i % len(MARKERS)], "markersize": 5,
            "fillstyle": "none", "alpha": 0.8}


def draw_curves(ax, runs: list[dict]) -> None:
    """Validation bpb against step, one line per run; the step axis has integer ticks (the steps themselves when
    there are few, as when every run validated only at its end)."""
    from matplotlib.ticker import MaxNLocator

    all_steps = set()
    for i, r in enumerate(runs):
        # a run validated only at its end still shows as a point
        steps, bpb = zip(*sorted(set(r["curve"]))) if r["curve"] else ([r["steps"]], [r["val_bpb"]])
        all_steps.update(steps)
        ax.plot(steps, bpb, label=f"{r['attention']} ({r['name']})", **run_style(i))
    if len(all_steps) <= 8:
        ax.set_xticks(sorted(all_steps))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.set_title(provenance(runs), fontsize=9)


def provenance(runs: list[dict]) -> str:
    """Which code measured the runs and when (results.json's ``code`` and ``date``), for a figure's caption: one
    commit and one date when the runs agree, else each one."""
    def listed(key: str) -> str:
        return ", ".join(sorted({str(r.get(key, "?")) for r in runs}))
    return f"code {listed('code')}, run {listed('date')}; {listed('device')}"


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
    (log axis), one line per run."""
    recall = all("recall_acc" in r for r in runs)
    key = "val_acc_by_position" if recall else "val_bpb_by_position"
    for i, r in enumerate(runs):
        buckets = r.get(key) or {}
        points = sorted((position_midpoint(name), value) for name, value in buckets.items())
        if points:
            ax.plot(*zip(*points), label=f"{r['attention']} ({r['name']})", **run_style(i))
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
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(sweep_dir: Path, runs: list[dict]) -> list[Path]:
    """report.md and the figures the runs have data for; returns the paths written."""
    table = markdown_table(runs)
    cells = recall_cells(runs)
    if cells:
        table += "\nRecall against state (the best learning rate of each cell, mean over its seeds):\n\n"
        table += recall_table(cells)
    written = [sweep_dir / "report.md", sweep_dir / "val_bpb.png"]
    written[0].write_text(table)
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
    written = write_report(args.sweep_dir, runs)
    print(written[0].read_text())
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
