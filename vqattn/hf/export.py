"""``vqattn-export CKPT OUT_DIR``: a trainer checkpoint as a Hugging Face model directory.

The trainer (``vqattn-train``) saves Lightning checkpoints whose ``hyper_parameters["model"]`` holds the
GPTConfig fields and whose ``state_dict`` holds the GPT under the prefix ``model.`` (LitLM's attribute). The
export builds a :class:`VQAttnForCausalLM` of that config, loads those tensors (strictly: every parameter and
persistent buffer, codebooks and their EMA state included, plus the feature maps' draws) and writes
``config.json``, ``model.safetensors``, ``generation_config.json`` and the run's tokenizer (the one the
checkpoint keeps: the byte tokenizer's ``tokenizer_config.json``, or a subword tokenizer's ``tokenizer.json`` and
config), which ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(OUT_DIR)`` load
after ``import vqattn.hf``. Reading a checkpoint needs the ``train`` extra (it comes from a training run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..files import WriteFailed, atomic_directory, failed_write_exit
from ..utils import add_threads_argument, use_threads
from .configuration import VQAttnConfig
from .modeling import VQAttnForCausalLM
from .tokenizer import VQAttnByteTokenizer


def load_checkpoint(path: str | Path) -> VQAttnForCausalLM:
    """The model of the trainer checkpoint at ``path`` (eval mode), or a one-line ValueError when the file is not
    a vqattn trainer checkpoint."""
    from ..checkpoint import load_model

    gpt = load_model(path)
    model = VQAttnForCausalLM(VQAttnConfig.from_gpt_config(gpt.config))
    model.model.load_state_dict(gpt.state_dict())  # every tensor, the feature maps' draws included
    return model.eval()


def export(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the model of ``checkpoint`` and its tokenizer to ``out_dir``; returns it."""
    return save(load_checkpoint(checkpoint), out_dir, checkpoint_tokenizer(checkpoint))


def checkpoint_tokenizer(checkpoint: str | Path):
    """The transformers tokenizer of the run that wrote ``checkpoint`` (bytes for one from before tokenizers)."""
    from ..checkpoint import read_tokenizer
    from ..tokenizer import transformers_tokenizer

    tokenizer = read_tokenizer(checkpoint)
    return VQAttnByteTokenizer() if tokenizer.to_json() is None else transformers_tokenizer(tokenizer)


def save(model: VQAttnForCausalLM, out_dir: str | Path, tokenizer=None) -> Path:
    """Write ``model`` and ``tokenizer`` (a transformers tokenizer; None: the byte tokenizer) to ``out_dir``;
    returns it. The files go to a temporary directory beside ``out_dir``, fsynced and renamed into its place when
    all are written (:func:`vqattn.files.atomic_directory`): a fault leaves the directory that was there, whole; a
    failed write raises :class:`vqattn.files.WriteFailed`."""
    with atomic_directory(out_dir) as temporary:
        model.save_pretrained(temporary)
        (tokenizer if tokenizer is not None else VQAttnByteTokenizer()).save_pretrained(temporary)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vqattn-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a trainer checkpoint, e.g. RUN_DIR/checkpoints/last.ckpt")
    parser.add_argument("out_dir", help="the directory to write (created if missing)")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load_checkpoint(args.checkpoint), checkpoint_tokenizer(args.checkpoint)
    except (ValueError, FileNotFoundError) as err:
        print(f"vqattn-export: error: {err}", file=sys.stderr)
        return 2
    use_threads(args.threads, "exporting")
    try:
        out = save(model, args.out_dir, tokenizer)
    except WriteFailed as failure:  # a full disk, a read-only directory: what was at out_dir is still there
        return failed_write_exit("vqattn-export", failure)

    print(f"wrote {out}: load it with `import vqattn.hf` then AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
