"""What a packed call costs: a row of documents of mixed lengths (``cu_seqlens``) against the same tokens as one
document, forward and backward, op by op, side by side.

    python benchmarks/packed_speed.py                          # CPU, one thread: 7168 + 16 x 64 = 8192 tokens
    python benchmarks/packed_speed.py --layout 1024 16x64      # 2048 tokens
    python benchmarks/packed_speed.py --form segments          # the segmented form that a compiled model runs
    python benchmarks/packed_speed.py --form segments --compile  # both calls compiled (inductor)
    python benchmarks/packed_speed.py --device cuda --heads 16 --dtype bfloat16 --in-process

The layout lists the documents: ``N`` one of N tokens, ``KxN`` K of them. The packed row is called with their
``cu_seqlens`` (``--form classes``: a ``Packing``, read once, as an eager model passes it, which runs the length
classes; ``--read-every-call``: a tensor; ``--form segments``: ``Segments``, the block layout that a compiled model
traces), the single document with none; both hold the same tokens. ``--compile``: both calls run compiled
(``torch.compile``, compiled once before the timing). The table gives each one's median ms,
packed / single (the median of the per-round ratios of interleaved rounds) and the peak memory of each (its own
process's high-water RSS above what it held before the call on a CPU, ``max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import torch
from attention_speed import DTYPES, add_in_process_argument, machine, run_child, set_in_process, time_fwd_bwd

from vqattn.functional import ovq_attention, vq_attention, window_attention
from vqattn.ops.varlen import Packing
from vqattn.utils import add_threads_argument, use_threads

OPS = ("vq_hard", "vq_soft", "ovq", "window")


def parse_layout(items: list[str]) -> list[int]:
    """Document lengths from ``N`` and ``KxN`` items: ["7168", "16x64"] -> [7168, 64, …, 64]."""
    lengths = []
    for item in items:
        match = re.fullmatch(r"(?:(\d+)x)?(\d+)", item)
        if match is None or int(match[2]) < 1 or (match[1] is not None and int(match[1]) < 1):
            raise ValueError(f"layout items are N or KxN with positive K and N, got {item!r}")
        lengths += [int(match[2])] * int(match[1] or 1)
    return lengths


def call(op: str, q, k, v, codebook, *, block_len: int, slots: int, cu_seqlens):
    """The op on (1, H, T, D) inputs as a layer calls it by default (ovq: its memory cap of two blocks)."""
    if op in ("vq_hard", "vq_soft"):
        return vq_attention(q, k, v, codebook, causal=True, assign=op[3:], block_len=block_len,
                            cu_seqlens=cu_seqlens)
    if op == "ovq":
        return ovq_attention(q, k, v, num_slots=slots, block_len=block_len, memory_cap=2 * block_len,
                             cu_seqlens=cu_seqlens)
    return window_attention(q, k, v, block_len=block_len, cu_seqlens=cu_seqlens)


def child(op: str, lengths: list[int], packed: bool, device: str, reps: int, H: int, D: int, S: int, slots: int,
          block_len: int, dtype: str, read_every_call: bool = False, form: str = "classes",
          compile: bool = False) -> dict:
    torch.manual_seed(0)
    T = sum(lengths)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=DTYPES[dtype]).requires_grad_(True)  # noqa: E731
    q, k, v, codebook = make(1, H, T, D), make(1, H, T, D), make(1, H, T, D), make(H, S, D)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = None
    if packed:  # a Packing read once, as a model hands it to its layers; or the tensor, read by every call
        cu = torch.tensor(bounds, dtype=torch.int32, device=device) if read_every_call else Packing.from_bounds(
            bounds, device)
        if form == "segments":  # the boundaries as tensors, for a compiled model
            cu = Packing.from_bounds(bounds, device).segments([block_len])
    run = torch.compile(call) if compile else call

    def run_once():
        out = run(op, q, k, v, codebook, block_len=block_len, slots=slots, cu_seqlens=cu)
        out.backward(torch.ones_like(out))

    return time_fwd_bwd(run_once, (q, k, v, codebook), device, reps)


def child_from_argv(argv: list[str]) -> dict:
    op, lengths, packed, device, reps, shape = argv
    return child(op, json.loads(lengths), packed == "packed", device, int(reps), **json.loads(shape))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", nargs="+", default=["7168", "16x64"], help="documents: N or KxN (see above)")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-codes", type=int, default=256)
    parser.add_argument("--num-slots", type=int, default=64)
    parser.add_argument("--block-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--read-every-call", action="store_true",
                        help="pass cu_seqlens as a tensor, read on the host by every call (default: a Packing, the "
                             "boundaries read once, as GPT.forward and the trainer hand them to the layers)")
    parser.add_argument("--form", default="classes", choices=["classes", "segments"],
                        help="the packed call's form: the length classes (a Packing, eager models) or the segmented "
                             "block layout (Segments, what a compiled model runs)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both calls (inductor)")
    add_threads_argument(parser)
    add_in_process_argument(parser)
    parser.set_defaults(threads=1)  # as the cost was first measured: one thread, so a busy core count skews less
    args = parser.parse_args(argv)
    lengths = parse_layout(args.layout)
    set_in_process(args)
    if args.device == "cpu":
        use_threads(args.threads, "timing", children=True)
    shape = dict(H=args.heads, D=args.head_dim, S=args.num_codes, slots=args.num_slots, block_len=args.block_len,
                 dtype=args.dtype, read_every_call=args.read_every_call, form=args.form, compile=args.compile)
    form = f"packed form {args.form}{', compiled' if args.compile else ''}"
    print(f"# fwd+bwd, impl auto, {form}, H={args.heads} D={args.head_dim} S={args.num_codes} "
          f"(ovq {args.num_slots} slots) "
          f"L={args.block_len} {args.dtype}, {args.device}: {machine()}, torch {torch.__version__}; "
          f"{len(lengths)} documents ({' '.join(args.layout)}) = {sum(lengths)} tokens against one document of "
          f"{sum(lengths)}; median of {args.reps} reps in each of {args.rounds} interleaved rounds")
    print("| op | one document ms | packed ms | packed / one | one document MB | packed MB | packed / one (MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for op in args.ops:
        rounds = []
        for _ in range(args.rounds):
            rounds.append({kind: run_child(__file__, [op, json.dumps(lengths), kind, args.device, str(args.reps),
                                                      json.dumps(shape)]) for kind in ("single", "packed")})
        errors = [r[kind]["error"] for r in rounds for kind in r if "error" in r[kind]]
        if errors:
            print(f"| {op} | failed: {errors[0]} | | | | | |", flush=True)
            continue
        ms = {kind: statistics.median(r[kind]["ms"] for r in rounds) for kind in ("single", "packed")}
        mb = {kind: max(r[kind]["peak_mb"] for r in rounds) for kind in ("single", "packed")}
        ratio = statistics.median(r["packed"]["ms"] / r["single"]["ms"] for r in rounds)
        print(f"| {op} | {ms['single']:.1f} | {ms['packed']:.1f} | {ratio:.2f}x | {mb['single']:.0f} | "
              f"{mb['packed']:.0f} | {mb['packed'] / max(mb['single'], 1e-9):.2f}x |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child_from_argv(sys.argv[2:8])))
    else:
        main()
