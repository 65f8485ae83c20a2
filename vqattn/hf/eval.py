"""``vqattn-eval``: lm-evaluation-harness's command line with vqattn's models and tasks available.

It imports :mod:`vqattn.hf` (registering VQAttnConfig, VQAttnForCausalLM and the byte tokenizer with the Auto
classes, which lm-eval's ``hf`` model loads through), adds ``--include_path`` of vqattn's own tasks
(:mod:`vqattn.hf.tasks`: ``vqattn_heldout``, ``vqattn_kv_recall``) unless the command line gives one, and runs
lm-eval's CLI with the rest of the arguments, e.g.::

    vqattn-eval --model hf --model_args pretrained=OUT_DIR --tasks vqattn_heldout,vqattn_kv_recall --device cpu

It sets its threads as the trainer does (``--threads N|auto``, default auto: the cores other work leaves idle),
taking that option out of what lm-eval reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import vqattn.hf  # noqa: F401  (registers the Auto classes)

from ..utils import threads_arg, use_threads

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def lm_eval_argv(argv: list[str]) -> list[str]:
    """lm-eval's arguments: ``argv`` plus ``--include_path TASKS_DIR`` when it names no include path."""
    if any(arg == "--include_path" or arg.startswith("--include_path=") for arg in argv):
        return list(argv)
    return [*argv, "--include_path", str(TASKS_DIR)]


def split_threads(argv: list[str]) -> tuple[int | str, list[str]]:
    """``--threads N|auto`` (or ``--threads=N``) taken out of ``argv``: (its value, default auto; the rest)."""
    threads, rest, args = "auto", [], iter(argv)
    for arg in args:
        if arg == "--threads" or arg.startswith("--threads="):
            value = arg.partition("=")[2] if "=" in arg else next(args, "")
            try:
                threads = threads_arg(value)
            except argparse.ArgumentTypeError as err:
                raise SystemExit(f"vqattn-eval: error: argument --threads: {err}") from None
        else:
            rest.append(arg)
    return threads, rest


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate  # reads sys.argv

    threads, rest = split_threads(sys.argv[1:] if argv is None else argv)
    if "-h" not in rest and "--help" not in rest:
        use_threads(threads, "evaluating")
    sys.argv = ["lm-eval", *lm_eval_argv(rest)]
    cli_evaluate()


if __name__ == "__main__":
    main()
