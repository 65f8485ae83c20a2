"""Command lines of the processes Lightning's DDP launcher starts for local ranks > 0.

Lightning re-runs ``sys.argv`` for every extra local rank. In a Hydra sweep that argv still holds ``-m`` and the
comma lists, and a fresh run dir would get a new timestamp; so rank 0 publishes its resolved overrides and run dir
in ``VQATTN_DDP_ARGV`` and the children compose exactly rank 0's job from it.
"""

from __future__ import annotations

import json

DDP_ARGV = "VQATTN_DDP_ARGV"


def ddp_child_argv(argv: list[str], environ) -> list[str]:
    """The command line for this process: rank 0's job overrides in a process Lightning launched for a local rank > 0.

    Lightning re-runs ``sys.argv``, which in a sweep still holds ``-m`` and the comma lists and whose run dir
    would be a new timestamp; rank 0 puts its resolved overrides and run dir in ``VQATTN_DDP_ARGV`` instead.
    Processes from an external launcher (torchrun, SLURM) have no VQATTN_DDP_ARGV and keep their arguments
    (give every rank the same ``hydra.run.dir``: README, "Multi-GPU and multi-node"); only their rank 0
    writes .hydra/.
    """
    rank = environ.get("LOCAL_RANK", "0")
    if rank != "0" and DDP_ARGV in environ:
        return [argv[0], *json.loads(environ[DDP_ARGV]), f"hydra.job.name=rank{rank}"]
    if environ.get("RANK", rank) != "0":
        return [*argv, "hydra.output_subdir=null"]
    return argv
