"""``vqattn-train`` and ``python train.py``: the command line's entry point, which imports nothing heavy itself.

Importing the trainer (torch, Lightning, Hydra) takes seconds, and a Ctrl-C during it would end in a
KeyboardInterrupt traceback of dozens of lines; here it is one line and exit status 130, as for a Ctrl-C anywhere
else before training (:func:`vqattn.train.cli.main` handles them once imported).
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    # Also when SIGINT was ignored: a shell without job control starts background jobs that way, and
    # `kill -INT` should still stop the run from the first line on.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from .cli import main as train_main
    except KeyboardInterrupt:
        print("\ninterrupted while starting: nothing was saved", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    train_main()


if __name__ == "__main__":
    main()
