"""The far-recall sweep, run as Zoology does: ``python benchmarks/far_recall.py OUT``.

Trains ``experiment=mqar_far`` (every validation query beyond the raw windows of both layers) for each attention,
state size, learning rate and seed, one run dir per run under OUT (a finished run, one with results.json, is
skipped: rerun the command to continue an interrupted sweep), then writes OUT/report.md and the figures with
``vqattn.train.report``: recall against one layer's state floats (``recall_vs_state.png``), each point the best
learning rate of its cell, averaged over the seeds.

The state size is the layer's own knob, found in its signature: ``num_codes`` (vq_hard, vq_soft), ``num_slots`` or
``num_features`` (a layer that takes it directly), ``head_dim`` (gated_deltanet, deltanet), ``d_state`` (mamba2) or
the feature map's ``num_features`` (performer). Attentions
without one (softmax, window, linear) run at their single size. Attentions not registered are left out with a note.

    python benchmarks/far_recall.py OUT --dry-run            # list the runs (and their count) without running
    python benchmarks/far_recall.py OUT --jobs 4 --threads 2  # 4 runs side by side, 2 threads each
    python benchmarks/far_recall.py OUT --attentions softmax,window --sizes 64 --lrs 2e-3 --seeds 0 -- trainer.max_steps=400

Arguments after ``--`` are Hydra overrides added to every run. At ~10 min a run on 2 cores, the default grid (15
cells x 3 rates x 3 seeds) is about a day of one 2-core machine; --jobs spreads it over more cores.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ATTENTIONS = ("softmax", "window", "vq_hard", "vq_soft", "ovq", "performer", "linear", "gated_deltanet", "deltanet",
              "mamba2")
# the layer's own state-size argument, first found: the delta rule's state grows as head_dim² (Dv = expand_v · Dk),
# Mamba-2's as d_state
SIZE_KNOBS = ("num_codes", "num_slots", "num_features", "head_dim", "d_state")


def size_override(attention: str, size: int) -> str | None:
    """The Hydra override that sets ``attention``'s state size, or None when it has no such knob."""
    from vqattn.layers import ATTENTIONS as REGISTERED
    from vqattn.layers import Attention
    from vqattn.train.configs import signature_defaults

    cls = REGISTERED[attention]
    kwargs = signature_defaults(cls, stop=Attention)
    for knob in SIZE_KNOBS:
        if knob in kwargs:
            return f"attention.kwargs.{knob}={size}"
    make_features = getattr(cls, "_make_features", None)  # the kernel family: the feature map's size
    if make_features is not None and "num_features" in inspect.signature(make_features).parameters:
        return f"+attention.kwargs.features.num_features={size}"
    return None


def plan(attentions: list[str], sizes: list[int], lrs: list[float], seeds: list[int]) -> list[tuple[str, list[str]]]:
    """(run name, overrides) for every run of the grid."""
    runs = []
    for attention in attentions:
        knobs = [(size, size_override(attention, size)) for size in sizes]
        if knobs and knobs[0][1] is None:
            knobs = [(None, None)]  # one state size only
        for size, knob in knobs:
            for lr in lrs:
                for seed in seeds:
                    name = f"{attention}{'' if size is None else f'_s{size}'}_lr{lr:g}_seed{seed}"
                    overrides = [f"attention={attention}", *([knob] if knob else []), f"optim.lr={lr}", f"seed={seed}"]
                    runs.append((name, overrides))
    return runs


def run_one(out: Path, name: str, overrides: list[str], extra: list[str], threads: int) -> tuple[str, int]:
    """Train one run into out/name (its console output in out/logs/name.log); returns (name, exit code)."""
    run_dir = out / name
    if (run_dir / "results.json").exists():
        return name, 0
    (out / "logs").mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "vqattn.train.cli", "experiment=mqar_far", *overrides, *extra,
               "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(out / "logs" / f"{name}.log", "w") as log:
        return name, subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def parse_list(kind):
    return lambda text: [kind(item) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    from vqattn.layers import ATTENTIONS as REGISTERED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Hydra overrides may follow --")
    parser.add_argument("out", type=Path, help="the sweep dir (one run dir per run, then report.md and figures)")
    parser.add_argument("--attentions", type=parse_list(str), default=list(ATTENTIONS))
    parser.add_argument("--sizes", type=parse_list(int), default=[16, 64, 256], help="state sizes (num_codes, ...)")
    parser.add_argument("--lrs", type=parse_list(float), default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--seeds", type=parse_list(int), default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--dry-run", action="store_true", help="print the runs, run nothing")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    missing = [a for a in args.attentions if a not in REGISTERED]
    if missing:
        print(f"not registered, left out: {', '.join(missing)}", file=sys.stderr)
    if args.jobs < 1 or args.threads < 1:
        parser.error("--jobs and --threads must be >= 1")
    runs = plan([a for a in args.attentions if a in REGISTERED], args.sizes, args.lrs, args.seeds)
    if args.dry_run:
        for name, overrides in runs:
            print(name, " ".join(overrides + extra))
        print(f"{len(runs)} runs")
        return 0
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda run: run_one(args.out, *run, extra, args.threads), runs))
    failed = [name for name, code in results if code != 0]
    if failed:
        print(f"failed (see {args.out / 'logs'}): {', '.join(failed)}", file=sys.stderr)
    from vqattn.train.report import main as report

    report([str(args.out)])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
