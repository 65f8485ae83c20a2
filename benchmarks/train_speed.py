"""Training throughput as a user sees it: ``python train.py`` end to end, one run per attention, side by side.

Each attention trains the same model for ``--steps`` optimizer steps with the given overrides (by default the GPU
model at a long context: ``model=base trainer=gpu``, bf16 autocast, the progress bar on) and the table gives the
tokens per second of the last ``trainer.log_every_n_steps`` steps, read from the run's metrics.csv: the rate once
compilation and warm-up are behind it. The ratio is the run's rate over softmax's.

    python benchmarks/train_speed.py --attentions softmax vq_hard --seq-len 8192 --batch 8 --steps 40
    python benchmarks/train_speed.py --device cpu --seq-len 256 --batch 2 --steps 12 --model tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def overrides(args: argparse.Namespace, attention: str, run_dir: Path) -> list[str]:
    """train.py's command-line overrides for one run: validation only once, at the end, on one batch."""
    trainer = "gpu" if args.device == "cuda" else "cpu"
    return [f"attention={attention}", f"model={args.model}", f"trainer={trainer}", f"model.seq_len={args.seq_len}",
            f"data.batch_size={args.batch}", f"trainer.max_steps={args.steps}",
            f"trainer.val_check_interval={args.steps}", "trainer.limit_val_batches=1",
            f"checkpoint_every={args.steps}", f"hydra.run.dir={run_dir}", *args.extra]


def last_rate(metrics: Path) -> float:
    """The last logged ``train/items_per_sec`` of a run's metrics.csv: tokens per second over the last window."""
    with metrics.open() as f:
        rates = [float(row["train/items_per_sec"]) for row in csv.DictReader(f) if row.get("train/items_per_sec")]
    if not rates:
        raise ValueError(f"{metrics} has no train/items_per_sec rows: raise --steps above log_every_n_steps")
    return rates[-1]


def run(args: argparse.Namespace, attention: str, root: Path) -> float | str:
    """Tokens per second of one run, or its error: the exception's own line (Hydra's full traceback asked for, whose
    last line is otherwise a hint to set HYDRA_FULL_ERROR)."""
    run_dir = root / attention
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides(args, attention, run_dir)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
        return (errors or lines or [f"exit {done.returncode}"])[-1]
    return last_rate(run_dir / "metrics.csv")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attentions", nargs="+", default=["softmax", "vq_hard"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="base")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("extra", nargs="*", help="more train.py overrides, e.g. compile=true")
    args = parser.parse_args(argv)
    print(f"# train.py model={args.model} seq_len={args.seq_len} batch={args.batch} {args.steps} steps on "
          f"{args.device} {' '.join(args.extra)}: tokens/s over the last logged window")
    print("| attention | tokens/s | x softmax |")
    print("|---|---:|---:|")
    base = None
    with tempfile.TemporaryDirectory() as root:
        for attention in args.attentions:
            rate = run(args, attention, Path(root))
            if isinstance(rate, str):
                print(f"| {attention} | failed: {rate} | |", flush=True)
                continue
            base = rate if attention == "softmax" else base
            ratio = f"{rate / base:.2f}x" if base else ""
            print(f"| {attention} | {rate:,.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
