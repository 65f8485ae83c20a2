"""Launch settings: each tuned kernel's candidate ``triton.Config`` list, its first entry the setting it runs with.

A kernel decorated with :func:`tuned` launches with its first config (the settings measured best on an H200,
docs/triton_kernels.md, "The vq_hard step kernel by kernel"), with no search and no startup cost.
``VQATTN_AUTOTUNE=1`` (read when the kernels are defined, as ``TRITON_INTERPRET``) lets ``@triton.autotune`` time
every candidate on the first call of each shape key and keep the fastest, as flash-linear-attention does on every
GPU: worth it on a GPU the defaults were not measured on, at the cost of compiling and timing every candidate once
(seconds per kernel; the choice is kept in Triton's cache directory for later processes).
``TRITON_PRINT_AUTOTUNING=1`` prints what it chose. Under the interpreter a kernel always runs its first config;
the tests run every candidate's meta-parameters there (``kernel.candidates``).
"""

from __future__ import annotations

import inspect
import itertools
import os

from ..utils import INTERPRET, triton

AUTOTUNE = os.environ.get("VQATTN_AUTOTUNE", "0") not in ("", "0") and not INTERPRET
# What the tuned choice depends on: the widths and the block length, not T (a prefill of a new length would
# otherwise time every candidate again); Triton adds the tensors' dtypes.
SHAPE_KEY = ["S", "DC", "DV", "L"]


def configs(first: dict, **choices) -> list:
    """``triton.Config`` for ``first`` (meta-parameters and num_warps / num_stages), then every other combination
    of ``choices`` (name: values), each setting ``first``'s names where it does not choose them; none without
    Triton (no kernel is defined then)."""
    if triton is None:
        return []
    names = list(choices)
    settings = [first] + [dict(first, **dict(zip(names, values))) for values in itertools.product(*choices.values())]
    unique = list({tuple(sorted(s.items())): s for s in settings}.values())  # first stays first
    return [_config(s) for s in unique]


def _config(setting: dict):
    launch = {name: setting[name] for name in ("num_warps", "num_stages", "maxnreg") if name in setting}
    meta = {name: value for name, value in setting.items() if name not in launch}
    return triton.Config(meta, **launch)


def tuned(candidates: list, *, key=tuple(SHAPE_KEY), **autotune_kwargs):
    """``@triton.autotune`` over ``candidates`` when :data:`AUTOTUNE` is on, else over the first alone (no
    search). ``autotune_kwargs``: ``reset_to_zero`` / ``restore_value`` for the tensors a kernel adds into, so that
    the search's repeated launches leave them as one launch would. The decorated kernel keeps every candidate as
    ``.candidates``."""
    def decorate(kernel):
        names = [name for name in key if name in kernel.arg_names]  # the widths the kernel takes
        if AUTOTUNE and "cache_results" in inspect.signature(triton.autotune).parameters:
            autotune_kwargs["cache_results"] = True  # on disk: later processes skip the search
        tuner = triton.autotune(candidates if AUTOTUNE else candidates[:1], key=names, **autotune_kwargs)(kernel)
        tuner.candidates = candidates
        return tuner
    return decorate
