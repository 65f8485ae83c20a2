"""``vqattn-eval``: lm-evaluation-harness's command line with vqattn's models and tasks available.

It imports :mod:`vqattn.hf` (registering VQAttnConfig, VQAttnForCausalLM and the byte tokenizer with the Auto
classes, which lm-eval's ``hf`` model loads through), adds ``--include_path`` of vqattn's own tasks
(:mod:`vqattn.hf.tasks`: ``vqattn_heldout``, ``vqattn_kv_recall``, ``vqattn_text``, ``vqattn_copy``) unless the
command line gives one, and runs lm-eval's CLI with the rest of the arguments, e.g.::

    vqattn-eval --model hf --model_args pretrained=OUT_DIR --tasks vqattn_heldout,vqattn_kv_recall --device cpu
    vqattn-eval --model hf --model_args pretrained=OUT_DIR --tasks vqattn_text --metadata path='notes/*.md'

It sets its threads as the trainer does (``--threads N|auto``, default auto: the cores other work leaves idle),
taking that option out of what lm-eval reads. With ``--model hf`` it adds ``backend=causal`` to ``--model_args``
unless they name a backend: lm-eval tells a causal model by transformers' own table of model types, which a
registered model type is not in, and would warn before taking the causal backend anyway. lm-eval's warning that a
task loaded through a function could take ``--metadata`` is dropped for vqattn's tasks: ``vqattn_text``, which
needs it (``path``), says so itself when it is missing, and ``vqattn_copy`` reads its layout from it (``seq_len``,
``passage``, ``gap``, ``streams``; ``seq_len`` by default from the model's config). Their errors (no path, a path
that matches no file or holds no UTF-8 text, a layout that does not fit) are one line on stderr and exit status 2;
a path given on the command line is checked before lm-eval loads the model.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import vqattn.hf  # noqa: F401  (registers the Auto classes)

from ..utils import threads_arg, use_threads
from .tasks.data import TextTaskError, text_files

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def _value(argv: list[str], option: str) -> tuple[int, str] | None:
    """(index, value) of ``option VALUE`` or ``option=VALUE`` in argv, else None."""
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return i + 1, argv[i + 1]
        if arg.startswith(option + "="):
            return i, arg.partition("=")[2]
    return None


def lm_eval_argv(argv: list[str]) -> list[str]:
    """lm-eval's arguments: ``argv`` plus ``--include_path TASKS_DIR`` when it names no include path, and
    ``backend=causal`` in the ``--model_args`` of ``--model hf`` when they name no backend."""
    argv = list(argv)
    model, model_args = _value(argv, "--model"), _value(argv, "--model_args")
    if (model is not None and model[1] == "hf" and model_args is not None and "backend" not in model_args[1]
            and not model_args[1].lstrip().startswith("{")):  # key=value pairs, not JSON
        i, value = model_args
        value = f"{value},backend=causal" if value else "backend=causal"
        argv[i] = value if argv[i] == model_args[1] else f"--model_args={value}"
    if _value(argv, "--include_path") is None:
        argv += ["--include_path", str(TASKS_DIR)]
    return argv


def _not_about_our_functions(record: logging.LogRecord) -> bool:
    """False for lm-eval's warning that a vqattn task's dataset function could take ``--metadata``."""
    message = record.getMessage()
    return not (message.startswith("vqattn_") and "Custom kwargs can be passed" in message)


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


def check_text_path(args: argparse.Namespace) -> None:
    """A ``--metadata path`` that matches no file, with ``vqattn_text`` among ``--tasks``: its error now, before lm-eval
    loads the model (which it does before the tasks). A path given elsewhere (``--config``) is checked by the task."""
    tasks, metadata = getattr(args, "tasks", None), getattr(args, "metadata", None)
    if isinstance(tasks, list) and "vqattn_text" in tasks and isinstance(metadata, dict) and "path" in metadata:
        text_files(metadata["path"])


def main(argv: list[str] | None = None) -> None:
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    threads, rest = split_threads(sys.argv[1:] if argv is None else argv)
    if "-h" not in rest and "--help" not in rest:
        use_threads(threads, "evaluating")
    sys.argv = ["lm-eval", *lm_eval_argv(rest)]
    logging.getLogger("lm_eval.api.task").addFilter(_not_about_our_functions)
    try:  # lm_eval.__main__.cli_evaluate, with the text path checked between parsing and running
        setup_logging()
        parser = HarnessCLI()  # reads sys.argv
        args = parser.parse_args()
        check_text_path(args)
        parser.execute(args)
    except TextTaskError as err:  # the user's --metadata path: a usage error, not a failure of lm-eval's
        print(f"vqattn-eval: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
