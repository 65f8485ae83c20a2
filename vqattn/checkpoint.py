"""Trainer checkpoints read without the trainer: :func:`load_model` (the GPT of a checkpoint), :func:`read_tokenizer`
(the tokenizer it trained with) and :func:`read_checkpoint` (the file itself, loaded safely). What sampling, the
length and copy evaluations, the Hugging Face export and the benchmarks read a run with; it needs torch alone
(Lightning wrote the file, but reading it needs no Lightning).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from .model import GPT, GPTConfig


def model_config(model: dict) -> GPTConfig:
    """GPTConfig(**model), with errors about a field named as the config key a user types (model.seq_len)."""
    try:
        return GPTConfig(**model)
    except ValueError as err:
        first = str(err).split(" ", 1)[0]
        if first in {f.name for f in fields(GPTConfig)}:
            raise ValueError(f"model.{err}") from None
        raise


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint at ``path``, loaded safely (``weights_only=True``: tensors and plain values only).

    Raises FileNotFoundError or a one-line ValueError when it is missing or is not a valid checkpoint (never
    with torch's advice to load untrusted files with ``weights_only=False``).
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated, not a zip, not a torch file, or unsafe pickled objects
        raise ValueError(f"{str(path)!r} is not a valid checkpoint (torch.load failed: {type(err).__name__})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "global_step" not in checkpoint:
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint written by train.py (no state_dict/global_step)")
    return checkpoint


def read_tokenizer(path: str | Path):
    """The tokenizer the trainer checkpoint at ``path`` was trained with (vqattn.tokenizer): the one it keeps,
    else (a checkpoint from before tokenizers) bytes."""
    from .tokenizer import from_json  # numpy; a subword tokenizer needs the train extra

    kept = read_checkpoint(path).get("tokenizer") or {}
    return from_json(kept.get("json"), kept.get("spec", "bytes"))


def load_model(path: str | Path, device: str | torch.device = "cpu") -> GPT:
    """The GPT of the trainer checkpoint at ``path``, in eval mode on ``device``: its GPTConfig from the
    checkpoint's hyper_parameters["model"], its tensors from the state_dict's ``model.`` entries (LitLM.model).
    A one-line ValueError for a file that is not such a checkpoint."""
    checkpoint = read_checkpoint(path)
    fields_ = checkpoint.get("hyper_parameters", {}).get("model")
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    if not isinstance(fields_, dict) or not state:
        raise ValueError(f"{str(path)!r} is not a vqattn trainer checkpoint (no model config in its hyper_parameters "
                         "or no model.* tensors in its state_dict)")
    model = GPT(model_config(fields_))
    try:
        model.load_state_dict(state)
    except RuntimeError as err:  # missing / unexpected / misshapen tensors
        raise ValueError(f"{str(path)!r}: its tensors do not fit its model config: "
                         f"{' '.join(str(err).split())}") from None
    return model.to(device).eval()
