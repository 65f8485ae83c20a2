"""Forward+backward time and peak memory of every registered attention layer against the softmax layer, as a user
composing a model gets them: ``build_attention(name, dim=256, num_heads=4, rope=True)`` with the layer's default
kwargs (vq layers: exact window, codebook in training mode, ``--num-codes`` codes), in training mode, B=1.

    python benchmarks/layer_speed.py                                   # T = 1k … 32k, every layer, fp32
    python benchmarks/layer_speed.py --lengths 8192 32768 --layers softmax vq_hard vq_soft window
    python benchmarks/layer_speed.py --device cuda --autocast bf16     # GPU: softmax runs SDPA's flash kernel
    python benchmarks/layer_speed.py --device cuda --autocast bf16 --compile   # torch.compile(layer), as users train
    python benchmarks/layer_speed.py --lengths 32768 --tuned-allocator  # CPU: without glibc's fresh pages

The loss is the sum of the outputs plus the layer's auxiliary loss; gradients reach x and every parameter. On the
GPU, ``--autocast bf16`` runs the step as mixed-precision training does (parameters fp32, matmuls in bf16), where
the softmax layer's causal SDPA picks the flash kernel; ``--dtype`` casts parameters and input instead.
``--tuned-allocator`` calls ``vqattn.utils.tune_cpu_allocator()`` in every measured process (glibc then keeps freed
memory instead of page-faulting every large temporary afresh): what a CPU step costs without fresh pages.
The measurement machinery is :mod:`attention_speed`'s: every (layer, T) in its own process, so its peak memory is its
own; ``--rounds`` interleaved rounds, and the ratio softmax ms / layer ms is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
from attention_speed import (
    add_design_argument,
    add_in_process_argument,
    design,
    fresh_page_ms_per_mb,
    machine,
    note,
    run_child,
    schedule,
    set_design,
    set_in_process,
    summarise,
    time_fwd_bwd,
)

from vqattn.layers import ATTENTIONS, build_attention
from vqattn.utils import add_threads_argument, tune_cpu_allocator, use_threads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
AUTOCASTS = ("none", "bf16")


# the layers whose op takes an ``impl`` (``--impl``)
IMPL_LAYERS = ("vq_hard", "vq_soft", "window", "ovq", "gated_deltanet", "deltanet", "mamba2")


def build(name: str, dim: int, num_heads: int, num_codes: int, device: str, dtype: torch.dtype, impl: str = "auto"):
    kwargs = {"num_codes": num_codes} if name.startswith("vq_") else {}
    if name in IMPL_LAYERS:
        kwargs["impl"] = impl
    layer = build_attention(name, dim=dim, num_heads=num_heads, rope=True, **kwargs).to(device, dtype).train()
    if hasattr(layer, "schedule"):  # vq layers: the kernel design --superblock-blocks chose
        layer.schedule = schedule()
    return layer


def child(name: str, T: int, device: str, reps: int, dtype: str, autocast: str, dim: int, num_heads: int,
          num_codes: int, compiled: bool = False, tuned_allocator: bool = False, impl: str = "auto",
          batch: int = 1) -> dict:
    if tuned_allocator:
        tune_cpu_allocator()
    torch.manual_seed(0)
    layer = build(name, dim, num_heads, num_codes, device, DTYPES[dtype], impl)
    if compiled:
        layer = torch.compile(layer)  # compiled by the warm-up step, which is not timed
    x = torch.randn(batch, T, dim, device=device, dtype=DTYPES[dtype], requires_grad=True)
    mixed = torch.autocast(device, dtype=torch.bfloat16) if autocast == "bf16" else contextlib.nullcontext()

    def run_once():
        with mixed:
            out, aux_loss, _ = layer(x)
            loss = out.float().sum() + aux_loss
        loss.backward()

    return time_fwd_bwd(run_once, [x, *layer.parameters()], device, reps)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--layers", nargs="+", default=list(ATTENTIONS), choices=list(ATTENTIONS),
                        help="the softmax layer, the baseline of the ratios, is always measured")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--autocast", default="none", choices=AUTOCASTS)
    parser.add_argument("--compile", action="store_true", help="time torch.compile(layer), as users train")
    parser.add_argument("--tuned-allocator", action="store_true",
                        help="call vqattn.utils.tune_cpu_allocator() first in every measured process (CPU)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--num-codes", type=int, default=512, help="codes per head of the vq layers")
    parser.add_argument("--impl", default="auto", choices=["auto", "chunk", "triton"],
                        help="the op impl of the vq, window, ovq and delta-rule layers (auto: triton on CUDA where it "
                             "applies; for the delta rule, flash-linear-attention's kernels)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per step: B = tokens // T (at least 1); default B = 1")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; ratios are per-round medians")
    add_threads_argument(parser)
    add_in_process_argument(parser)
    add_design_argument(parser)
    args = parser.parse_args(argv)
    set_in_process(args)
    set_design(args)
    if "softmax" not in args.layers:
        args.layers = ["softmax", *args.layers]
    return args


def measure(args: argparse.Namespace, name: str, T: int) -> dict:
    """One layer at one length in a fresh process, noted at once (``note``)."""
    return note(f"{name} T={T}", run_child(__file__, [json.dumps({
        "name": name, "T": T, "device": args.device, "reps": args.reps, "dtype": args.dtype, "autocast": args.autocast,
        "dim": args.dim, "num_heads": args.heads, "num_codes": args.num_codes, "compiled": args.compile,
        "tuned_allocator": args.tuned_allocator, "impl": args.impl, "batch": batch_size(args, T)})]))


def batch_size(args: argparse.Namespace, T: int) -> int:
    return 1 if args.tokens is None else max(1, args.tokens // T)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":  # the measuring processes get the same count
        use_threads(args.threads, "timing", children=True)
    compiled = (", compiled" if args.compile else "") + (", tuned allocator" if args.tuned_allocator else "")
    batch = "B=1" if args.tokens is None else f"B={args.tokens}//T"
    print(f"# layer fwd+bwd, {batch} impl={args.impl} dim={args.dim} heads={args.heads} S={args.num_codes} {args.dtype} autocast "
          f"{args.autocast}{compiled}, superblocks={design()}, training mode, "
          f"{args.device}: {machine()}, torch {torch.__version__}; "
          f"median of {args.reps} reps in each of {args.rounds} interleaved rounds")
    if args.device == "cpu":
        print(f"# fresh memory costs {fresh_page_ms_per_mb():.2f} ms per MB beyond warm writes on this machine now")
    print("| T | layer | ms | softmax/x | peak MB |")
    print("|---|---|---|---|---|")
    for T in args.lengths:
        rounds = [{name: measure(args, name, T) for name in args.layers} for _ in range(args.rounds)]
        for name, r in summarise(rounds, "softmax").items():
            print(f"| {T} | {name} | {r['ms']:.1f} | {r['ratio']:.2f}x | {r['peak_mb']:.0f} |", flush=True)
            if r["errors"]:
                print(f"  {name} T={T} failed: {r['errors'][0]}", file=sys.stderr)


def child_from_argv(argv: list[str]) -> dict:
    """One measurement from :func:`measure`'s arguments."""
    return child(**json.loads(argv[0]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child_from_argv(sys.argv[2:])))
    else:
        main()
