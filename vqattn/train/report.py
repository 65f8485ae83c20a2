"""Compare the runs of a sweep: ``python -m vqattn.train.report SWEEP_DIR``.

Reads every ``results.json`` under SWEEP_DIR (one per run dir, as train.py writes them) and the validation
rows of each run's ``metrics.csv``; writes SWEEP_DIR/report.md (a markdown table: val bpb, tokens/s, params,
state floats (one layer's decoding state at the run's seq_len), peak memory, sorted by val bpb; MQAR runs add recall
accuracy and are sorted by it) and SWEEP_DIR/val_bpb.png (val bpb against step, one line per run).
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
    devices = sorted({r.get("device", "?") for r in runs})
    lines += ["", f"Peak memory: {', '.join(kinds)}. Device: {'; '.join(devices)}."]
    if recall:
        lines.append("MQAR runs are ranked by recall accuracy (the headline; their bpb counts the answers only).")
    return "\n".join(lines) + "\n"


def plot_curves(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        # a run validated only at its end still shows as a point
        steps, bpb = zip(*sorted(set(r["curve"]))) if r["curve"] else ([r["steps"]], [r["val_bpb"]])
        ax.plot(steps, bpb, marker="o", markersize=3, label=f"{r['attention']} ({r['name']})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vqattn.train.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a Hydra sweep dir (or any dir holding run dirs with results.json)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")
    runs = load_runs(args.sweep_dir)
    if not runs:
        parser.error(f"no results.json found under {args.sweep_dir}; did the runs finish?")
    table = markdown_table(runs)
    (args.sweep_dir / "report.md").write_text(table)
    plot_curves(runs, args.sweep_dir / "val_bpb.png")
    print(table)
    print(f"wrote {args.sweep_dir / 'report.md'} and {args.sweep_dir / 'val_bpb.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
