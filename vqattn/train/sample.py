"""Sample text from a checkpoint: ``python -m vqattn.train.sample CKPT --prompt "def " --max-new-tokens 200``.

CKPT is a checkpoint written by train.py (e.g. OUT/checkpoints/last.ckpt). The prompt is encoded with the
checkpoint's tokenizer (UTF-8 bytes for a byte-level model), continued with ``GPT.generate`` (stateful decoding:
constant memory per token for vq and the kernel family, a KV cache for softmax), and the tokens are printed, decoded
by that tokenizer (with replacement characters where a byte-level model produced invalid UTF-8).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..utils import add_threads_argument, use_threads


def sample(ckpt: str | Path, prompt: str, max_new_tokens: int, *, temperature: float = 1.0,
           top_k: int | None = None, num_samples: int = 1, seed: int | None = None,
           device: str = "cpu", threads: int | str | None = None) -> list[str]:
    """Continue ``prompt`` ``num_samples`` times with the model in ``ckpt``; returns prompt + continuation texts.

    ``threads``: torch's intra-op threads for the sampling, set and said in one line on stderr
    (:func:`vqattn.utils.use_threads`: "auto" takes the idle cores, as the trainer does); None leaves them as they
    are (the command line's default is auto)."""
    from ..checkpoint import load_model, read_tokenizer

    if not prompt:
        raise ValueError("prompt must not be empty (the model needs at least one byte to condition on)")
    model = load_model(ckpt, device)  # a one-line error for a missing or invalid file
    tokenizer = read_tokenizer(ckpt)
    if threads is not None:
        use_threads(threads, "sampling")
    if seed is not None:
        torch.manual_seed(seed)  # after loading, so nothing the checkpoint restores can override it
    ids = tokenizer.encode(prompt.encode()).tolist()
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no token")
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (N, T)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)  # (N, T + new)
    return [tokenizer.decode(row.tolist()) for row in out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vqattn.train.sample", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", help="checkpoint path (OUT/checkpoints/last.ckpt)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_threads_argument(p)
    args = p.parse_args(argv)
    try:
        texts = sample(args.ckpt, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       num_samples=args.num_samples, seed=args.seed, device=args.device, threads=args.threads)
    except (ValueError, FileNotFoundError) as err:
        p.error(str(err))
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i} ---")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
