"""Forward+backward time and peak memory: causal SDPA against causal vq_attention (hard and soft),
window_attention and ovq_attention (online assignment, S slots, relative threshold 0.1).

``vq_hard`` and ``vq_soft`` time the op's defaults (the window scores keys by their codes); ``vq_hard_rope`` and
``vq_soft_rope`` the configuration the default vq layers run: ``exact_window=True`` with the window scored by
RoPE-rotated queries and keys (``q_rot``, ``k_rot``, given as inputs: the rotation is the layer's, not the op's).
The layers themselves are timed by ``benchmarks/layer_speed.py``.

Gradients flow to q, k, v, and to the codebook for soft (learned by gradient); the hard codebook is an EMA
buffer without gradient, as in Transformer-VQ and ``Codebook(learning="ema")``.

    python benchmarks/attention_speed.py                       # T = 1k … 32k, B=1, H=4, D=64, S=512, fp32
    python benchmarks/attention_speed.py --lengths 1024 8192 --reps 5
    python benchmarks/attention_speed.py --block-lens 32 64 128 256 --lengths 8192 --methods vq_hard vq_soft
    python benchmarks/attention_speed.py --modes default compiled

Every method runs in up to three modes (``--modes``), each a column group with the SDPA ratio of that mode:

* ``default``: the allocator untouched, which is what a user's own training script gets;
* ``tuned``: the process calls ``vqattn.utils.tune_cpu_allocator()`` first (glibc keeps freed memory instead of
  page-faulting every large temporary again on every step; it applies to SDPA and vq alike);
* ``compiled``: default allocator, the op wrapped in ``torch.compile`` (compilation is in the warm-up call).

Every (method, T) runs in its own subprocess, so CPU peak memory is that process's high-water RSS above what it
held just before the call (inputs included), and one run's allocations cannot flatter the next. On CUDA the peak
is ``torch.cuda.max_memory_allocated`` above the inputs, and a last column counts the GPU kernels one fwd+bwd
launches (profiled). Ratios are SDPA / vq from the same run: the median over
``--rounds`` interleaved rounds of the per-round ratio, because a shared machine's speed drifts by tens of percent
from one subprocess to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from vqattn.functional import ovq_attention, softmax_attention, vq_attention, window_attention
from vqattn.ops.blocks import Schedule
from vqattn.utils import add_threads_argument, tune_cpu_allocator, use_threads

METHODS = ("sdpa", "vq_hard", "vq_soft", "vq_hard_rope", "vq_soft_rope", "window", "ovq")
# Asked for by name (not in the default list): the library's gated delta rule (q and k L2-normalised, β and the log
# decay drawn per token as Gated DeltaNet's layer makes them; ``impl`` auto runs fla's kernels on CUDA when fla-core is
# installed, ``--impl chunk`` the library's own chunk form), and the peers, flash-linear-attention's chunked simple
# GLA (a per-head decay) and chunked gated delta rule (its fla-core package on a GPU), on (B, T, H, D) inputs.
RECURRENT = ("delta_rule",)
PEERS = ("fla_simple_gla", "fla_gated_delta_rule")


def delta_rule_inputs(q, k, token_axis: int):
    """β (B, H, T) in (0, 1) and log decays ≤ 0 from q's first features, and the L2-normalised q and k, for the
    layout whose token axis is ``token_axis``: 1 for fla's (B, T, H, D), 2 for the library's (B, H, T, D)."""
    to_bht = (0, 1, 2) if token_axis == 2 else (0, 2, 1)
    beta = torch.sigmoid(q[..., 0].detach()).permute(*to_bht).float()
    log_decay = -torch.nn.functional.softplus(q[..., 1].detach()).permute(*to_bht).float() / 16
    return torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1), beta, log_decay


def peer_attention(method: str, q, k, v):
    if method == "fla_simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla

        log_decay = torch.full((q.shape[2],), -1 / 64, device=q.device, dtype=torch.float32)
        return chunk_simple_gla(q, k, v, g_gamma=log_decay)[0]
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, beta, log_decay = delta_rule_inputs(q, k, 1)
    # fla's β and g are (B, T, H)
    return chunk_gated_delta_rule(q, k, v, log_decay.transpose(1, 2), beta.transpose(1, 2))[0]
MODES = ("default", "tuned", "compiled")


def attention(method: str, q, k, v, codebook, block_len, q_rot=None, k_rot=None, impl="auto"):
    if method == "sdpa":
        return softmax_attention(q, k, v, causal=True)
    if method in PEERS:
        return peer_attention(method, q, k, v)
    if method == "delta_rule":
        from vqattn.functional import delta_rule_attention

        q, k, beta, log_decay = delta_rule_inputs(q, k, 2)
        return delta_rule_attention(q, k, v, beta, log_decay, block_len=block_len, impl=impl)
    if method == "window":
        return window_attention(q, k, v, block_len=block_len, impl=impl)
    if method == "ovq":
        return ovq_attention(q, k, v, num_slots=codebook.shape[1], block_len=block_len, threshold=0.1)
    rope = dict(exact_window=True, q_rot=q_rot, k_rot=k_rot) if method.endswith("_rope") else {}
    assign = method.removeprefix("vq_").removesuffix("_rope")
    return vq_attention(q, k, v, codebook, causal=True, assign=assign, block_len=block_len, impl=impl,
                        schedule=schedule(), **rope)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def child(method: str, T: int, device: str, reps: int, block_len: int | None, compiled: bool, B=1, H=4, D=64,
          S=512, impl="auto", dtype="float32") -> dict:
    torch.manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=DTYPES[dtype]).requires_grad_(True)  # noqa: E731
    qkv = (B, T, H, D) if method in PEERS else (B, H, T, D)  # fla's layout
    q, k, v, codebook = make(*qkv), make(*qkv), make(*qkv), make(H, S, D)
    rotated = (make(B, H, T, D), make(B, H, T, D)) if method.endswith("_rope") else ()
    # As in Transformer-VQ, the hard codebook is an EMA k-means buffer (no gradient); the soft one is learned.
    codebook.requires_grad_(method.startswith("vq_soft"))
    fn = torch.compile(attention, fullgraph=True) if compiled else attention

    def run_once():
        out = fn(method, q, k, v, codebook, block_len, *(rotated or (None, None)), impl)
        out.backward(torch.ones_like(out))

    return time_fwd_bwd(run_once, (q, k, v, codebook, *rotated), device, reps)


def time_fwd_bwd(run_once, tensors, device: str, reps: int) -> dict:
    """Median ms of ``run_once`` (a forward and backward pass) over ``reps`` calls, each with fresh gradients of
    ``tensors``, and the peak memory (MB) of its first call above what the process held before it; on CUDA also the
    GPU kernels one call launches."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        rss_before = _status_kib("VmRSS")
        # Reset the process's RSS high-water mark, which would otherwise still hold the peak of importing torch.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    run_once()  # warm-up (and compilation); also the memory measurement
    sync()
    if device == "cuda":
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_mb = (_status_kib("VmHWM") - rss_before) / 1024
    run_once()  # glibc's dynamic mmap threshold settles only after the first step has freed its blocks
    sync()
    times = []
    for _ in range(reps):
        for t in tensors:
            t.grad = None  # fresh gradients every repetition, as in a training step
        sync()
        start = time.perf_counter()
        run_once()
        sync()
        times.append(time.perf_counter() - start)
    result = {"ms": 1000 * statistics.median(times), "peak_mb": peak_mb}
    if device == "cuda":
        result["kernels"] = cuda_kernels(run_once)
    return result


def cuda_kernels(step) -> int:
    """GPU kernels (and copies) one fwd+bwd launches: it must not grow with T / block_len (no per-block loop)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def _status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: its high-water mark), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(method, T, device, reps, block_len, mode, shape: dict):
    """``shape``: child()'s keyword arguments B, H, D, S, impl and dtype."""
    return run_child(__file__, [method, str(T), device, str(reps), str(block_len or 0), mode, json.dumps(shape)])


def measure_noted(method, T, device, reps, block_len, mode, shape: dict):
    """:func:`measure`, noted (:func:`note`)."""
    return note(f"{method} {mode} T={T}", measure(method, T, device, reps, block_len, mode, shape))


def note(label: str, result: dict) -> dict:
    """Print one measurement on stderr at once (a run cut short by a time limit still tells what it measured)."""
    print(f"# {label}: {result.get('ms', float('nan')):.2f} ms, peak {result.get('peak_mb', float('nan')):.0f} MB",
          file=sys.stderr, flush=True)
    return result


def failure(stderr: str) -> str:
    """The exception a child died of: the last line naming one (dynamo ends its message with advice), or the last
    line; for a torch.compile failure, with the user code where it happened."""
    lines = stderr.strip().splitlines() or [""]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Unsupported)\b", line)]
    where = [lines[i + 1].strip() for i, line in enumerate(lines[:-1]) if line.startswith("from user code:")]
    return " at ".join([(raised or lines)[-1], *where[-1:]])


# Measure in this process instead of one process per measurement (the scripts' --in-process): on CUDA, where the
# allocator's own peak is reset per measurement, this saves the import, CUDA start-up and profiler start of each
# (about 15 s a row on an H200).
IN_PROCESS = False


def run_child(script: str, args: list[str]) -> dict:
    """``script --child *args`` in a fresh process (its allocator and peak RSS its own); the JSON it prints last.
    With :data:`IN_PROCESS`, the script's ``child_from_argv(args)`` in this process, an exception as its error."""
    if IN_PROCESS:
        module = __import__(Path(script).stem)
        try:
            return module.child_from_argv(args)
        except Exception as error:  # noqa: BLE001 - a failed row is reported, as a child's death is
            return {"ms": float("nan"), "peak_mb": float("nan"), "error": f"{type(error).__name__}: {error}"}
        finally:
            torch.cuda.empty_cache()
    result = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True)
    if result.returncode != 0:
        return {"ms": float("nan"), "peak_mb": float("nan"), "error": failure(result.stderr)}
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarise(rounds: list[dict], baseline) -> dict:
    """Interleaved rounds {key: measurement} -> {key: median ms, max peak MB, errors, and the median over rounds of
    the per-round ratio baseline ms / key ms}: a slow spell of a shared machine hits both sides of a ratio alike."""
    return {key: {"ms": statistics.median(r[key]["ms"] for r in rounds),
                  "peak_mb": max(r[key]["peak_mb"] for r in rounds),
                  "errors": [r[key]["error"] for r in rounds if "error" in r[key]],
                  "ratio": statistics.median(r[baseline]["ms"] / r[key]["ms"] for r in rounds)
                  if baseline in rounds[0] else float("nan")}
            for key in rounds[0]}


def fresh_page_ms_per_mb(mb: int = 256) -> float:
    """What touching freshly mapped memory costs on this machine beyond writing warm memory (ms per MB): the
    page-fault and zero-fill price that every large temporary above glibc's mmap threshold pays. It drifts on a
    VM, and it is what moves the T = 32768 ratios between runs."""
    x = torch.empty(mb * 2**18)  # fresh pages, untouched
    start = time.perf_counter()
    x.fill_(1.0)
    fresh = time.perf_counter() - start
    start = time.perf_counter()
    x.fill_(2.0)
    return 1000 * (fresh - (time.perf_counter() - start)) / mb


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + RECURRENT + PEERS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--block-lens", type=int, nargs="+", default=[0], help="0 = vq_attention's default")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure every method this many times, interleaved; the ratio is the median of the "
                             "per-round ratios, so a slow spell of a shared machine hits SDPA and vq alike")
    parser.add_argument("--impl", default="auto", choices=["auto", "chunk", "triton"],
                        help="the impl of vq_attention and window_attention (auto: triton on CUDA where it applies)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the inputs' dtype")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--num-codes", type=int, default=512)
    add_threads_argument(parser)
    add_in_process_argument(parser)
    add_design_argument(parser)
    args = parser.parse_args()
    set_in_process(args)
    set_design(args)
    if args.device == "cpu":  # the measuring processes get the same count
        use_threads(args.threads, "timing", children=True)
    shape = dict(B=args.batch, H=args.heads, S=args.num_codes, impl=args.impl, dtype=args.dtype)

    print(f"# causal fwd+bwd, B={args.batch} H={args.heads} D=64 S={args.num_codes} {args.dtype} impl={args.impl}, "
          f"superblocks={design()}, {args.device}: {machine()}, torch {torch.__version__}; "
          f"median of {args.reps} reps in each of {args.rounds} interleaved rounds; peak MB from the {args.modes[0]} mode")
    if args.device == "cpu":
        print(f"# fresh memory costs {fresh_page_ms_per_mb():.2f} ms per MB beyond warm writes on this machine now")
    header = ["T", "block_len", "method"]
    for mode in args.modes:
        header += [f"{mode} ms", f"sdpa/x {mode}"]
    header += ["peak MB"] + (["GPU kernels"] if args.device == "cuda" else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for T in args.lengths:
        for block_len in args.block_lens:
            rounds = [{(m, mode): measure_noted(m, T, args.device, args.reps, block_len, mode, shape)
                       for mode in args.modes for m in args.methods} for _ in range(args.rounds)]
            results = {mode: summarise([{m: r[m, mode] for m in args.methods} for r in rounds], "sdpa")
                       for mode in args.modes}
            for m in args.methods:
                row = [str(T), str(block_len or "default"), m]
                for mode in args.modes:
                    row += [f"{results[mode][m]['ms']:.1f}", f"{results[mode][m]['ratio']:.2f}x"]
                row += [f"{results[args.modes[0]][m]['peak_mb']:.0f}"]
                if args.device == "cuda":
                    row += [str(rounds[0][m, args.modes[0]].get("kernels", "nan"))]
                print("| " + " | ".join(row) + " |", flush=True)
            for mode, by_method in results.items():
                for m, r in by_method.items():
                    if r["errors"]:
                        print(f"  {m} {mode} T={T} failed: {r['errors'][0]}", file=sys.stderr)


def child_from_argv(argv: list[str]) -> dict:
    """One measurement from :func:`measure`'s arguments."""
    method, T, device, reps, block_len, mode, shape = argv
    if mode == "tuned":
        tune_cpu_allocator()
    return child(method, int(T), device, int(reps), int(block_len) or None, mode == "compiled", **json.loads(shape))


# The fused vq step's one design choice (vqattn.ops.blocks.Schedule.superblocks) that this process's vq calls and
# layers run, as --superblock-blocks sets it, for this process and the measuring processes it starts (through the
# environment): a benchmark's choice, handed to the library by name.
DESIGN_ENV = "VQATTN_BENCH_SUPERBLOCKS"


def design() -> int:
    """Hard keys' superblock size in this benchmark process: the library's default unless a flag chose another."""
    return int(os.environ.get(DESIGN_ENV, Schedule().superblocks))


def schedule() -> Schedule:
    """The Schedule that hands :func:`design` to a vq call (and to a vq layer's ``schedule``)."""
    return Schedule(superblocks=design())


def add_design_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--superblock-blocks", type=int, default=None,
                        help="hard vq keys' superblock caches of K blocks (Schedule.superblocks; 0: the per-block "
                             "caches and walks); default: the library's")


def set_design(args: argparse.Namespace) -> None:
    if args.superblock_blocks is not None:
        os.environ[DESIGN_ENV] = str(args.superblock_blocks)


def add_in_process_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--in-process", action="store_true",
                        help="CUDA: every measurement in this process, peak memory from the allocator's own reset "
                             "(no process start per row)")


def set_in_process(args: argparse.Namespace) -> None:
    global IN_PROCESS
    if args.in_process and args.device != "cuda":
        raise ValueError("--in-process measures CUDA memory only: on a CPU each row needs its own process")
    IN_PROCESS = args.in_process


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child_from_argv(sys.argv[2:9])))
    else:
        main()
