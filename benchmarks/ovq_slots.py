"""Where a trained ovq model's online assignment puts the key-value pairs of MQAR: ``python benchmarks/ovq_slots.py
CHECKPOINT`` (a ``train.py experiment=mqar_far attention=ovq`` run's ``checkpoints/last.ckpt``).

On fresh validation-like sequences (the pairs first, the queries at least ``--gap`` tokens later), for every ovq
layer, averaged over the sequences and heads:

* the distinct slots the P keys' tokens (and the P values' tokens) take: below P, pairs share a slot;
* the later tokens (fillers and queries) that join those slots: each one moves the slot's mean key and mixes its
  value into the value the query reads;
* the slots used in all;
* the pairs' tokens and the later tokens not stored (``overflow="drop"``: novel once the slots are full).

It measures what limits far recall per float of state (docs/far_recall.md); the recall itself is the run's.

    python benchmarks/ovq_slots.py outputs/DATE/TIME_ovq/checkpoints/last.ckpt --pairs 16 --gap 80
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import torch

import vqattn.ops.ovq.chunk as ovq_chunk
from vqattn.model import GPT
from vqattn.train.mqar import mqar_example


@contextlib.contextmanager
def recorded_slots():
    """The slots of every online assignment the chunk impl runs while active, in call order (one per layer)."""
    calls, original = [], ovq_chunk.online_slots

    def recording(*args, **kwargs):
        slots = original(*args, **kwargs)
        calls.append(slots.detach().clone())
        return slots

    ovq_chunk.online_slots = recording
    try:
        yield calls
    finally:
        ovq_chunk.online_slots = original


def slot_sharing(model: GPT, x: torch.Tensor, pairs: int) -> list[dict[str, float]]:
    """For every ovq layer of ``model`` run on MQAR sequences x (B, T) whose first 2·pairs tokens are the pairs:
    the mean over sequences and heads of the distinct slots of the keys' and the values' tokens, of the later tokens
    in those slots (summed over the pairs), of the slots used, and of the tokens not stored (slot −1)."""
    model.eval()
    with torch.no_grad(), recorded_slots() as calls:
        model(x)
    rows = []
    for slots in calls:  # (B, H, T)
        flat = slots.flatten(0, 1)  # (B·H, T)
        stats = {"keys' slots": 0.0, "values' slots": 0.0, "later tokens in the keys' slots": 0.0,
                 "later tokens in the values' slots": 0.0, "slots used": 0.0, "pair tokens not stored": 0.0,
                 "later tokens not stored": 0.0}
        for s in flat:
            later = s[2 * pairs:]
            for name, taken in (("keys'", s[0:2 * pairs:2]), ("values'", s[1:2 * pairs:2])):
                stored = [slot for slot in taken.tolist() if slot >= 0]
                stats[f"{name} slots"] += len(set(stored))
                stats[f"later tokens in the {name} slots"] += sum(int((later == slot).sum()) for slot in stored)
                stats["pair tokens not stored"] += len(taken) - len(stored)
            stats["slots used"] += len(set(s.tolist()) - {-1})
            stats["later tokens not stored"] += int((later < 0).sum())
        rows.append({name: value / flat.shape[0] for name, value in stats.items()})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--gap", type=int, default=80, help="the least distance of a query from its pair")
    parser.add_argument("--sequences", type=int, default=128)
    args = parser.parse_args(argv)
    from vqattn.checkpoint import load_model

    model = load_model(args.checkpoint)
    x, _ = mqar_example(np.random.default_rng(0), args.sequences, seq_len=model.config.seq_len,
                        num_kv_pairs=args.pairs, min_query_gap=args.gap)
    rows = slot_sharing(model, x, args.pairs)
    names = list(rows[0]) if rows else []
    print("| layer | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for i, row in enumerate(rows):
        print(f"| {i} | " + " | ".join(f"{row[name]:.2f}" for name in names) + " |")


if __name__ == "__main__":
    main()
