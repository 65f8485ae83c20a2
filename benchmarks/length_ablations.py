"""Why do compressed memories degrade past the training length? Evaluation-time ablations on trained checkpoints.

    python benchmarks/length_ablations.py OUT/window/checkpoints/last.ckpt OUT/vq_hard/checkpoints/last.ckpt ...

Every checkpoint reads the same held-out streams as ``python -m vqattn.train.length_eval`` (16 training lengths,
in segments of T with the carried state) once per ablation; the table has one row per (checkpoint, ablation), the
bits per byte of each doubling bucket of absolute positions, and the change from the first bucket to the last.
Between two segments an ablation edits the carried compressed memory (the vq layers' per-code counts and value
sums, the ovq layer's per-slot counts and key and value sums; raw windows and KV caches are left alone), or it
changes the model before the streams run:

- ``carried``: no change, the baseline.
- ``no_memory``: the memory emptied after every segment: each segment sees only its own past and the raw window
  carried into it (what the window layer keeps), i.e. the memory's contribution past T removed.
- ``cap_T``: the memory's total count scaled down to at most T keys (counts and sums alike, so every code's mean
  value is unchanged): the log-count bias stays in the range of training, the content does not.
- ``decay_0.5``: counts and sums halved after every segment: older keys fade, as in an EMA codebook.
- ``float64``: the whole model in float64 (long sums in high precision).
- ``memory_cap_T/2``, ``memory_cap_T/4``, ...: the layers' ``memory_cap`` at that fraction of T instead of T (a
  query in the middle of a training window saw about T/2 keys in memory).
- ``slots_x4`` (ovq): four times the slots; ``no_memory_rope`` (ovq): the memory scored with unrotated q and k;
  ``rope_clamp_T`` (ovq): the memory's slow RoPE pairs rotated by positions clamped at T (``memory_rope_clamp``).
- ``memory_decay_T`` (ovq): the layers' ``memory_decay`` at exp(−1/T), a horizon of T keys, so that past T a slot's
  mean weighs about as many recent keys as in training instead of every key since the start.

``--only`` runs just the ablations named (``carried`` included only if named). ``--out DIR`` writes every row as
``DIR/<run>_<ablation>/length_eval.json`` in ``length_eval``'s format, so ``python -m vqattn.train.length_eval
DIR/*/length_eval.json --against WINDOW.json`` gives each one's change with its interval, paired with the window.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch

from vqattn.checkpoint import load_model
from vqattn.model import GPTState
from vqattn.ops.ovq.state import OVQState
from vqattn.ops.vq.state import VQState
from vqattn.train.length_eval import default_held_out, length_eval, read_with_memory_decay
from vqattn.utils import add_threads_argument, use_threads

MEMORY_FIELDS = {VQState: ("counts", "sums"), OVQState: ("counts", "key_sums", "value_sums")}


def edit_memory(state: GPTState, scale_of) -> GPTState:
    """The state with every layer's memory fields multiplied by ``scale_of(counts)`` (B, H, 1) (broadcast)."""
    layers = []
    for layer in state.layers:
        inner = layer.inner
        names = MEMORY_FIELDS.get(type(inner))
        if names is not None:
            scale = scale_of(inner.counts)  # (B, H, 1)
            inner = dataclasses.replace(inner, **{n: getattr(inner, n) * (scale if n == "counts" else scale[..., None])
                                                  for n in names})
        layers.append(dataclasses.replace(layer, inner=inner))
    return GPTState(state.pos, layers)


def between_segments(name: str, seq_len: int):
    """The state edit an ablation applies after every segment (None: no edit)."""
    if name == "no_memory":
        return lambda s: edit_memory(s, lambda n: torch.zeros_like(n[..., :1]))
    if name == "cap_T":
        return lambda s: edit_memory(s, lambda n: (seq_len / n.sum(-1, keepdim=True).clamp(min=1)).clamp(max=1))
    if name == "decay_0.5":
        return lambda s: edit_memory(s, lambda n: torch.full_like(n[..., :1], 0.5))
    return None


def ablated_model(model, name: str):
    """The model an ablation reads with (a copy when it changes the model)."""
    if name == "float64":
        return copy.deepcopy(model).double()
    if name.startswith("memory_cap_T/"):
        model = copy.deepcopy(model)
        for block in model.blocks:
            block.attn.memory_cap = model.config.seq_len // int(name.split("/")[1])
    if name == "memory_decay_T":
        return read_with_memory_decay(model, "T")
    if name in ("slots_x4", "no_memory_rope", "rope_clamp_T"):
        model = copy.deepcopy(model)
        for block in model.blocks:
            if name == "slots_x4":
                block.attn.num_slots *= 4
            elif name == "rope_clamp_T":
                block.attn.memory_rope_clamp = model.config.seq_len
            else:
                block.attn.memory_rope, block.attn.memory_raw_from = False, 0
    return model


def ablations_for(model) -> list[str]:
    names = ["carried"]
    if model.config.attention in ("vq_hard", "vq_soft", "ovq"):
        names += ["no_memory", "cap_T", "decay_0.5", "float64", "memory_cap_T/2", "memory_cap_T/4", "memory_cap_T/8"]
    if model.config.attention == "ovq":
        names += ["slots_x4", "no_memory_rope", "rope_clamp_T", "memory_decay_T"]
    return names


def evaluate(model, text: bytes, name: str, multiple: int, streams: int) -> dict:
    """length_eval's result for the model read with ablation ``name``."""
    edit = between_segments(name, model.config.seq_len)
    return length_eval(ablated_model(model, name), text, multiple=multiple, streams=streams, edit_state=edit)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpts", nargs="+")
    p.add_argument("--multiple", type=int, default=16)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--only", nargs="*", default=None, help="run only these ablations (carried only if named)")
    p.add_argument("--text", default=None, help="held-out text file (default: the default corpus's validation split)")
    p.add_argument("--out", default=None, help="write every row as OUT/<run>_<ablation>/length_eval.json")
    add_threads_argument(p)
    args = p.parse_args(argv)
    use_threads(args.threads, "evaluating")
    text = Path(args.text).read_bytes() if args.text else default_held_out()
    for path in args.ckpts:
        model, run = load_model(path), Path(path).parts[-3]
        for name in ablations_for(model):
            if args.only is not None and name not in args.only:
                continue
            result = evaluate(model, text, name, args.multiple, args.streams)
            bpb = result["bpb"]
            print(f"| {run} | {name} | " + " | ".join(f"{x:.3f}" for x in bpb)
                  + f" | {100 * (bpb[-1] / bpb[0] - 1):+.1f}% |", flush=True)
            if args.out is not None:
                out = Path(args.out) / f"{run}_{name.replace('/', '_')}"
                out.mkdir(parents=True, exist_ok=True)
                (out / "length_eval.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
