"""A training step (forward + backward) of every attention never reads a tensor on the host: on a GPU such a read
(``.item()``, ``bool(tensor)``, ``.tolist()``) stalls the pipeline. On CPU we catch the Python-side reads, with the
ops run as on a GPU (on a CPU in eager mode they read one flag on purpose, where a read is free:
``vqattn.ops.op_utils.host_read_is_free``); on CUDA, ``torch.cuda.set_sync_debug_mode("error")`` catches every
synchronisation."""

from __future__ import annotations

import pytest
import torch

from vqattn.model import GPT, GPTConfig
from vqattn.ops import utils as op_utils

from model_helpers import NAMES

VQ_KWARGS = {"num_codes": 8, "block_len": 4}
CASES = NAMES + ["vq_soft_learned_temperature", "vq_hard_rope_slow"]


def _model(name: str, device: str) -> GPT:
    kwargs = {"vq_hard": VQ_KWARGS, "vq_soft": VQ_KWARGS,
              "vq_soft_learned_temperature": {**VQ_KWARGS, "codebook": {"learn_temperature": True}},
              "vq_hard_rope_slow": {**VQ_KWARGS, "cache_scores": "slow"}}.get(name, {})
    rope = name not in ("vq_hard", "vq_soft", "vq_soft_learned_temperature")
    name = name.removesuffix("_learned_temperature").removesuffix("_rope_slow")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=17, seq_len=32, n_layer=2, n_head=2, n_embd=16, attention=name,
                       attention_kwargs=kwargs, pos_emb="rope" if rope else "none")
    return GPT(config).to(device).train()


def _step(model: GPT, idx: torch.Tensor) -> None:
    out = model(idx, idx)
    (out.loss + out.aux_loss).backward()


def _refuse(*args, **kwargs):
    raise AssertionError("host read of a tensor inside a training step")


@pytest.mark.parametrize("name", CASES)
def test_training_step_reads_no_tensor_on_the_host(name, monkeypatch):
    model = _model(name, "cpu")
    idx = torch.randint(0, 17, (2, 11))
    monkeypatch.setattr(op_utils, "host_read_is_free", lambda x: False)  # as on a GPU
    for method in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, _refuse)
    for _ in range(3):  # the first steps initialise and restart codes: also without host reads
        _step(model, idx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CASES)
def test_training_step_does_not_synchronise_cuda(name):
    model = _model(name, "cuda")
    idx = torch.randint(0, 17, (2, 11), device="cuda")
    _step(model, idx)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
