"""Where one forward + backward step spends its GPU time, kernel by kernel (``torch.profiler``).

Profiles the op (``benchmarks/attention_speed.py``'s methods, bf16 inputs) or a layer (``benchmarks/layer_speed.py``'s,
bf16 autocast) at a shape that fills a GPU, after two warm-up steps, and prints the kernels that took the most
device time in one step, with their share. ``--dtype float32`` runs float32 inputs (a layer without autocast), in
IEEE float32 products, or in TF32 with ``--tf32`` (``torch.set_float32_matmul_precision("high")``):

    python benchmarks/kernel_profile.py --what op --method vq_hard_rope --batch 8 --length 8192
    python benchmarks/kernel_profile.py --what layer --method vq_hard --batch 8 --length 8192 --dim 1024 --heads 16
    python benchmarks/kernel_profile.py --what op --method vq_hard_rope --dtype float32 --tf32
"""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from attention_speed import DTYPES, METHODS, add_design_argument, attention, set_design
from attention_speed import design as kernel_design
from kernel_floor import SOFT_CURRENT, Shape, gpu_of, kernels
from layer_speed import build
from torch.profiler import ProfilerActivity, profile

from vqattn.layers import ATTENTIONS


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype and --tf32, which :func:`set_precision` applies (kernel_resources.py takes them too)."""
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="the op's inputs; a layer's autocast type, or float32 without autocast")
    parser.add_argument("--tf32", action="store_true", help="float32 products in TF32, as PyTorch's may be")


def set_precision(args) -> None:
    if args.tf32:
        torch.set_float32_matmul_precision("high")


def fresh_gradients(*tensors) -> None:
    """Every step starts without gradients, as a training step after ``zero_grad()`` does: gradients kept from
    the warm-up would add into the new ones (one more pass per tensor that a step does not make)."""
    for t in tensors:
        if t is not None:
            t.grad = None


def op_step(args, device: str = "cuda"):
    make = lambda *shape: torch.randn(*shape, device=device, dtype=DTYPES[args.dtype]).requires_grad_(True)  # noqa: E731
    B, H, T, D = args.batch, args.heads, args.length, 64
    q, k, v, codebook = make(B, H, T, D), make(B, H, T, D), make(B, H, T, D), make(H, args.num_codes, D)
    codebook.requires_grad_(args.method.startswith("vq_soft"))
    rotated = (make(B, H, T, D), make(B, H, T, D)) if args.method.endswith("_rope") else (None, None)

    def step():
        fresh_gradients(q, k, v, codebook, *rotated)
        out = attention(args.method, q, k, v, codebook, args.block_len, *rotated, args.impl)
        out.backward(torch.ones_like(out))

    return step


def layer_step(args, device: str = "cuda"):
    layer = build(args.method, args.dim, args.heads, args.num_codes, device, torch.float32, args.impl)
    x = torch.randn(args.batch, args.length, args.dim, device=device, requires_grad=True)

    def step():
        fresh_gradients(x, *layer.parameters())
        with torch.autocast(device, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            out, aux_loss, _ = layer(x)
            loss = out.float().sum() + aux_loss
        loss.backward()

    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", choices=["op", "layer"], default="op")
    parser.add_argument("--method", default="vq_hard_rope",
                        help=f"an op method {METHODS} or a layer {tuple(ATTENTIONS)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024, help="the layer's width")
    parser.add_argument("--num-codes", type=int, default=512)
    parser.add_argument("--block-len", type=int, default=None)
    parser.add_argument("--impl", default="auto", choices=["auto", "chunk", "triton"])
    parser.add_argument("--top", type=int, default=25)
    add_design_argument(parser)
    add_precision_arguments(parser)
    args = parser.parse_args(argv)
    set_precision(args)
    set_design(args)
    torch.manual_seed(0)
    step = op_step(args) if args.what == "op" else layer_step(args)
    for _ in range(2):  # warm-up: Triton's compilation and the allocator's pools
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = device_kernels(prof.events())  # name -> (ms, launches)
    total = sum(ms for ms, _ in kernels.values())
    print(f"{args.what} {args.method} B={args.batch} T={args.length} H={args.heads} S={args.num_codes} "
          f"impl={args.impl} {args.dtype}{' tf32' if args.tf32 else ''}: {total:.2f} ms of kernels in one step")
    top = sorted(kernels, key=lambda name: kernels[name][0], reverse=True)[:args.top]
    for name in top:
        ms, count = kernels[name]
        print(f"{ms:8.2f} ms {100 * ms / total:5.1f}% x{count:<4d} {name[:110]}")
    print("\nwhat launched each PyTorch kernel (the op, and the autograd node or module around it):")
    for kernel, callers in launchers(prof.events(), top).items():
        print(f"  {kernel[:60]}: " + "; ".join(f"{n}x {c}" for c, n in callers.most_common(4)))
    if args.method.startswith(("vq_hard", "vq_soft", "ovq")):  # the methods the floor model covers
        measured = {name: ms for name, (ms, _) in kernels.items()}
        print("\n".join(floor_rows(args, measured, gpu_of(torch.cuda.get_device_name()))))


def device_kernels(events) -> dict[str, tuple[float, int]]:
    """The GPU's own events of a profile (kernels and copies; not the CPU ranges that launched them, whose device
    time would count each kernel twice): name -> (ms in the step, launches)."""
    found = collections.defaultdict(lambda: [0.0, 0])
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            found[event.name][0] += event.device_time_total / 1000
            found[event.name][1] += 1
    return {name: (ms, count) for name, (ms, count) in found.items()}


def launchers(events, kernels: list[str]) -> dict[str, collections.Counter]:
    """For each PyTorch kernel of ``kernels`` (Triton's are named by their kernels, and skipped: those names start
    with an underscore), the operators that launched it: the innermost aten op and the outermost named range or
    autograd node above it, counted."""
    wanted = {k for k in kernels if not k.startswith("_")}
    found = collections.defaultdict(collections.Counter)
    for event in events:
        for kernel in getattr(event, "kernels", []):
            if kernel.name not in wanted:
                continue
            chain, parent = [], event
            while parent is not None:
                chain.append(parent.name)
                parent = parent.cpu_parent
            op = next((name for name in chain if name.startswith("aten::")), chain[0])
            found[kernel.name][f"{op} < {chain[-1]}"] += 1
    return found


def floor_rows(args, measured: dict[str, float], gpu: str | None) -> list[str]:
    """Each modelled kernel's measured ms (``measured``: kernel name -> ms in the step) beside its floor
    (benchmarks/kernel_floor.py's "today" design at this shape) on ``gpu``, and its efficiency, floor / measured;
    then the step's kernels outside the model (PyTorch's glue) in one row."""
    if gpu is None:
        return ["no floor model for this GPU (kernel_floor.GPUS)"]
    code_dims = 32 if args.what == "layer" and args.method.startswith("vq") else 64  # a vq layer scores the codes
    # on its 30 slow RoPE pairs, padded; ovq's layer has 64 slots, the op as many as --num-codes
    slots = 64 if args.what == "layer" and args.method == "ovq" else args.num_codes
    shape = Shape(B=args.batch, H=args.heads, T=args.length, S=slots, Dc=code_dims)
    K = kernel_design()  # hard keys take the superblock kernels when K > 0, else the per-block caches
    if args.method.startswith("vq_soft"):  # soft keys: per-block caches, the weights recomputed
        design = SOFT_CURRENT
    elif args.method == "ovq":
        design = "ovq"
    elif K > 0:
        design = "superblock"
    else:
        design = "block_dc"
    rows = [f"\nagainst the floor on an {gpu} (kernel_floor.py, design {design}"
            + (f", K = {K})" if design == "superblock" else ")"),
            "| kernel | measured ms | floor ms | floor / measured |", "|---|---:|---:|---:|"]
    modelled = 0.0
    for cost in kernels(design, shape, K=K):
        ms, floor = measured.get(cost.name), cost.floor_s(gpu) * 1000
        if ms is None:
            continue
        modelled += ms
        rows.append(f"| {cost.name} | {ms:.3f} | {floor:.3f} | {100 * floor / ms:.0f}% |")
    rows.append(f"| everything else (PyTorch) | {sum(measured.values()) - modelled:.3f} | | |")
    return rows


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
