"""Decoding latency: milliseconds per generated token against context length, and ``generate`` tokens/s.

A 2-layer byte-level GPT (n_embd 256, 4 heads, RoPE; vq layers S=512 codes, block_len 128, exact window) first
consumes a context of T tokens (prefill, chunked), then decodes single tokens with ``GPT.forward_step``. softmax
keeps a KV cache that grows with T; window keeps under 2·block_len keys; vq keeps per-code counts and value sums plus
that window; ovq keeps per-slot counts, key and value sums plus that window (S=512 slots); performer keeps its
feature-space sums. Ratios are softmax / X from the same run.

    python benchmarks/decode_speed.py                                  # T = 256 … 32k
    python benchmarks/decode_speed.py --lengths 1024 8192 --methods softmax vq_hard --steps 50

The per-token figure is the median over ``--steps`` single-token steps after the prefill (one warm-up step first).
The last column is ``GPT.generate`` end to end (prefill of a 1024-token prompt plus ``--new-tokens`` tokens).
``--step-impl`` picks the decoding step's impl in the window, vq and ovq layers: "auto" (on CUDA the fused Triton
step, one kernel per layer and token) or "recurrent" (the PyTorch step); the prefill runs "auto" either way.

    python benchmarks/decode_speed.py --device cuda --lengths 1024 4096 8192 32768 --step-impl recurrent
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch

from vqattn.layers import ATTENTIONS
from vqattn.model import GPT, GPTConfig
from vqattn.utils import add_threads_argument, use_threads

DEFAULT_METHODS = [m for m in ("softmax", "window", "vq_hard", "vq_soft", "ovq", "performer") if m in ATTENTIONS]
VQ_KWARGS = {"num_codes": 512, "block_len": 128, "exact_window": True}
KWARGS = {"vq_hard": VQ_KWARGS, "vq_soft": VQ_KWARGS, "window": {"block_len": 128},
          "ovq": {"num_slots": 512, "block_len": 128}}


def build(method: str, device: str) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, seq_len=256, n_layer=2, n_head=4, n_embd=256, attention=method,
                       attention_kwargs=KWARGS.get(method, {}), pos_emb="rope")
    return GPT(config).to(device).eval()


def prefill(model: GPT, context: int, device: str, chunk: int = 2048):
    """The state after ``context`` random tokens, consumed in chunks (SDPA on 32k at once would need 16 GB)."""
    state = None
    for start in range(0, context, chunk):
        idx = torch.randint(0, 256, (1, min(chunk, context - start)), device=device)
        _, state = model.forward_step(idx, state)
    return state


@contextlib.contextmanager
def using_impl(model: GPT, impl: str):
    """The attention layers that take an op ``impl`` run ``impl`` inside (those without keep theirs)."""
    layers = [m for m in model.modules() if hasattr(m, "impl")]
    before = [m.impl for m in layers]
    for m in layers:
        m.impl = impl
    try:
        yield
    finally:
        for m, old in zip(layers, before):
            m.impl = old


def ms_per_token(model: GPT, context: int, steps: int, device: str, step_impl: str = "auto") -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    state = prefill(model, context, device)
    token = torch.randint(0, 256, (1, 1), device=device)
    times = []
    with using_impl(model, step_impl):
        _, state = model.forward_step(token, state)  # warm-up
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            _, state = model.forward_step(token, state)
            sync()
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def generate_tokens_per_sec(model: GPT, new_tokens: int, device: str) -> float:
    """``GPT.generate`` with the layers' own impls (its prefill and steps pick theirs by "auto")."""
    prompt = torch.randint(0, 256, (1, 1024), device=device)
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=new_tokens, temperature=1.0)
    if device == "cuda":
        torch.cuda.synchronize()
    return new_tokens / (time.perf_counter() - start)


def machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 8192, 16384, 32768])
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=sorted(ATTENTIONS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--step-impl", default="auto", choices=["auto", "recurrent"],
                        help="the decoding step's impl in the window, vq and ovq layers (auto: the fused Triton "
                             "step on CUDA)")
    add_threads_argument(parser)
    args = parser.parse_args()
    if args.device == "cpu":
        use_threads(args.threads, "timing")

    print(f"# ms per decoded token (2 layers, n_embd 256, 4 heads, RoPE; vq S=512, block_len 128), {args.device}: "
          f"{machine(args.device)}, torch {torch.__version__}; step impl {args.step_impl}; median of {args.steps}")
    models = {m: build(m, args.device) for m in args.methods}
    header = ["method"] + [f"T={t}" for t in args.lengths] + [f"T={args.lengths[-1]} / T={args.lengths[0]}",
                                                               "generate tok/s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    rows = {}
    with torch.inference_mode():
        for method, model in models.items():
            rows[method] = [ms_per_token(model, t, args.steps, args.device, args.step_impl) for t in args.lengths]
            tps = generate_tokens_per_sec(model, args.new_tokens, args.device)
            cells = [f"{ms:.2f}" for ms in rows[method]] + [f"{rows[method][-1] / rows[method][0]:.2f}x", f"{tps:.0f}"]
            print("| " + " | ".join([method, *cells]) + " |", flush=True)
    if "softmax" in rows:
        print("\nsoftmax (KV cache) / method, per token:")
        for method, times in rows.items():
            if method != "softmax":
                ratios = " ".join(f"T={t}: {s / m:.2f}x" for t, s, m in zip(args.lengths, rows["softmax"], times))
                print(f"  {method}: {ratios}")


if __name__ == "__main__":
    main()
