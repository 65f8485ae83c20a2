"""Training steps of every attention under bf16 autocast (what Lightning's ``bf16-mixed`` does), on CPU.

Projections and MLPs run in bf16 under autocast; the attention ops and the codebook compute in float32 inside. The
model's logits then match an fp32 step to bf16 accuracy (relative error ~2⁻⁸ per matmul, a few layers deep), and
losses and gradients are finite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vqattn.model import GPT, GPTConfig

from model_helpers import NAMES, layer_kwargs, scramble_short_conv

ROOT = Path(__file__).resolve().parents[2]
# Logits are O(1); bf16 rounding of the projections/MLP inputs gives errors of a few 1e-2 after two layers.
LOGIT_ATOL = 0.1


def _model(name: str, short_conv: int = 0) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=64, n_layer=2, n_head=2, n_embd=32, attention=name,
                       attention_kwargs=layer_kwargs(name, rope=True), pos_emb="rope", short_conv=short_conv)
    return scramble_short_conv(GPT(config).train())


@pytest.mark.parametrize("name,short_conv", [(name, 0) for name in NAMES] + [("softmax", 4), ("vq_hard", 4)])
def test_autocast_training_step_matches_fp32(name, short_conv):
    idx = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(1))
    reference, mixed = _model(name, short_conv), _model(name, short_conv)
    torch.manual_seed(2)
    expected = reference(idx, idx)
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mixed(idx, idx)
    assert got.logits.dtype == torch.bfloat16
    assert torch.isfinite(got.loss) and torch.isfinite(got.aux_loss)
    assert got.loss.dtype == got.aux_loss.dtype == torch.float32
    torch.testing.assert_close(got.logits.float(), expected.logits, rtol=0, atol=LOGIT_ATOL)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0.02, atol=0)
    (got.loss + got.aux_loss).backward()
    grads = [p.grad for p in mixed.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    for name_, buffer in mixed.named_buffers():
        assert buffer.dtype != torch.bfloat16, name_  # codebook statistics stay float32


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The number of training batches")
@pytest.mark.parametrize("attention", ["vq_hard", "vq_soft"])
def test_the_trainer_runs_bf16_mixed_on_cpu(tmp_path, monkeypatch, attention):
    """Lightning's bf16-mixed, as train.py's job sets it, for both codebook attentions (train.py as a process runs it
    in tests/train/test_train.py, vq_soft; its start-up is not what this checks)."""
    from hydra import compose, initialize_config_dir

    from vqattn.train import cli

    trainers, build = [], cli.build

    def recording_build(*args, **kwargs):  # the run's Trainer, to read its precision
        built = build(*args, **kwargs)
        trainers.append(built[2])
        return built

    monkeypatch.setattr(cli, "build", recording_build)
    with initialize_config_dir(config_dir=str(ROOT / "vqattn" / "train" / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "experiment=tiny", f"attention={attention}", "trainer.precision=bf16-mixed", "trainer.accelerator=cpu",
            "trainer.max_steps=6", "trainer.val_check_interval=6", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "threads=1"])
    results = cli.train(cfg, tmp_path)
    assert [trainer.precision for trainer in trainers] == ["bf16-mixed"]
    assert results["attention"] == attention and results["steps"] == 6 and 0 < results["val_bpb"] < 9
    assert json.loads((tmp_path / "results.json").read_text())["val_bpb"] == results["val_bpb"]
