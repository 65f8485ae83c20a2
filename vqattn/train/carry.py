"""Carried recurrent state for training and validating on consecutive segments (Transformer-XL / Transformer-VQ).

Segment i + 1 of a batch row continues segment i (see :mod:`vqattn.train.streams`), so each forward starts from the
state the previous one ended with, detached from its autograd graph:

    out_i = GPT(x_i, state=s_{i-1}),   s_i = out_i.state.detached(max_cache=T)

The vq and kernel-family states have a constant size (the compressed cache), so the effective context is
unbounded at a constant cost per step; softmax and the kernel smoothers keep the newest T keys and values (the
Transformer-XL memory). Gradients stop at the segment boundary.

For exact resume the state goes into the checkpoint. Under DDP every rank carries the state of its own rows,
so saving gathers all ranks' states (a collective: every rank must save, as Lightning's ``save_checkpoint``
already requires) and each rank takes its own back on load. States are stored as plain tensors, lists and dicts
(``encode``), loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
import torch.distributed as dist

from ..model import GPT, GPTOutput, GPTState

_TYPE = "__type__"


def encode(obj):
    """A GPTState (or any nest of dataclasses, NamedTuples, lists, tensors and scalars) as plain containers.

    Tensors move to the CPU; a dataclass or NamedTuple becomes {"__type__": "module:Name", "fields": ...}.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if dataclasses.is_dataclass(obj):
        fields = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {_TYPE: f"{type(obj).__module__}:{type(obj).__qualname__}", "fields": fields}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        fields = {name: encode(value) for name, value in zip(obj._fields, obj)}
        return {_TYPE: f"{type(obj).__module__}:{type(obj).__qualname__}", "fields": fields}
    if isinstance(obj, (list, tuple)):
        return [encode(x) for x in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ValueError(f"cannot store a state holding {type(obj).__name__}")


def decode(tree, device: torch.device | str = "cpu"):
    """Inverse of :func:`encode`, with tensors on ``device``. Only vqattn's own state classes are rebuilt."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, list):
        return [decode(x, device) for x in tree]
    if isinstance(tree, dict) and _TYPE in tree:
        module, name = tree[_TYPE].split(":")
        if module.split(".")[0] != "vqattn":
            raise ValueError(f"refusing to rebuild a state of type {tree[_TYPE]!r} (not a vqattn class)")
        cls = getattr(importlib.import_module(module), name)
        return cls(**{k: decode(v, device) for k, v in tree["fields"].items()})
    return tree


class CarriedState:
    """The detached states of one process's batch rows between consecutive segments, one per stream group
    (``data.stream_groups``: batch i reads group i mod G); a missing group = fresh start."""

    def __init__(self):
        self.states: dict[int, GPTState] = {}
        self._stored: list | None = None  # encoded states loaded from a checkpoint, decoded onto the device at first use

    @property
    def state(self) -> GPTState | None:
        """The state of group 0 (the only one without stream groups)."""
        return self.states.get(0)

    def reset(self) -> None:
        self.states, self._stored = {}, None

    def forward(self, model: GPT, x: torch.Tensor, group: int = 0) -> GPTOutput:
        """Run ``model`` on segment x (B, T) continuing ``group``'s carried state; carry the state after x."""
        if self._stored is not None:
            self.states = {g: decode(tree, x.device) for g, tree in enumerate(self._stored) if tree is not None}
            self._stored = None
        state = self.states.get(group)
        if state is not None and state.layers:
            rows = _batch_rows(state)
            if rows is not None and rows != x.shape[0]:
                raise ValueError(f"carry_state: the carried state holds {rows} batch rows but this segment has "
                                 f"{x.shape[0]}; every step of a carried run needs the same batch size")
        out = model(x, state=state, return_state=True)
        self.states[group] = out.state.detached(max_cache=x.shape[1])
        return out

    def gathered(self, world_size: int) -> dict:
        """Every rank's encoded states, a list by group (a collective under DDP), for the checkpoint."""
        groups = range(max(self.states, default=-1) + 1)
        mine = [encode(self.states[g]) if g in self.states else None for g in groups]
        if self._stored is not None:  # loaded but not yet used: keep it
            mine = self._stored
        states = [mine]
        if world_size > 1:
            states = [None] * world_size
            dist.all_gather_object(states, mine)
        return {"world_size": world_size, "states": states}

    def load(self, stored: dict, rank: int, world_size: int) -> None:
        """Take this rank's states from :meth:`gathered`'s output."""
        if stored["world_size"] != world_size:
            raise ValueError(
                f"carry_state: the checkpoint holds the carried states of {stored['world_size']} ranks but this run "
                f"has {world_size}; resume a carried run with the same number of devices (its rows differ otherwise)"
            )
        mine = stored["states"][rank]
        # checkpoints written before stream groups hold one state per rank rather than a list by group
        self.states, self._stored = {}, mine if isinstance(mine, list) else [mine]


def _batch_rows(state: GPTState) -> int | None:
    """Batch size of a state: the leading dimension of its first tensor (None without tensors)."""
    stack = [state.layers]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            return obj.shape[0]
        if dataclasses.is_dataclass(obj):
            stack.extend(getattr(obj, f.name) for f in reversed(dataclasses.fields(obj)))
        elif isinstance(obj, (list, tuple)):
            stack.extend(reversed(obj))
    return None
