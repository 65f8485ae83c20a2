"""LitLM: the summed-NLL metric, the LR schedule, fast_dev_run for every attention, checkpoint round trip."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from vqattn.layers import ATTENTIONS
from vqattn.model import IGNORE_INDEX
from vqattn.train.lit import LitLM, OptimConfig, SummedNLL, warmup_cosine
from vqattn.train.mqar import MQARDataModule

TINY = dict(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=32)


def random_batch(gen, b, t, v=11, ignore_every=3):
    logits = torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, v, (b, t), generator=gen)
    targets[:, ::ignore_every] = IGNORE_INDEX
    return logits, targets


def test_summed_nll_matches_the_mean_over_labelled_tokens():
    gen = torch.Generator().manual_seed(0)
    batches = [random_batch(gen, b, t) for b, t in [(2, 5), (3, 7), (1, 4)]]
    metric = SummedNLL()
    for logits, targets in batches:
        metric.update(logits, targets)
    logits = torch.cat([l.flatten(0, 1) for l, _ in batches])
    targets = torch.cat([t.flatten() for _, t in batches])
    keep = targets != IGNORE_INDEX
    nll = F.cross_entropy(logits[keep], targets[keep])
    acc = (logits[keep].argmax(-1) == targets[keep]).double().mean()
    out = metric.compute()
    torch.testing.assert_close(out["loss"], nll)
    torch.testing.assert_close(out["bpb"], nll / math.log(2))
    torch.testing.assert_close(out["acc"], acc)


def test_summed_nll_merged_over_uneven_ranks_equals_the_global_mean():
    # merge_state applies the same dist_reduce_fx ("sum") that DDP's sync uses.
    gen = torch.Generator().manual_seed(1)
    big, small = random_batch(gen, 5, 9), random_batch(gen, 1, 3)
    whole, rank0, rank1 = SummedNLL(), SummedNLL(), SummedNLL()
    for batch in (big, small):
        whole.update(*batch)
    rank0.update(*big)
    rank1.update(*small)
    rank0.merge_state(rank1)
    torch.testing.assert_close(rank0.compute()["loss"], whole.compute()["loss"])
    mean_of_means = (SummedNLL(), SummedNLL())
    mean_of_means[0].update(*big), mean_of_means[1].update(*small)
    naive = sum(m.compute()["loss"] for m in mean_of_means) / 2
    assert not torch.isclose(naive, whole.compute()["loss"])  # why the states are sums, not means


def test_position_buckets_match_a_per_bucket_reference_and_recombine_to_the_total():
    gen = torch.Generator().manual_seed(2)
    batches = [random_batch(gen, b, 11, ignore_every=4) for b in (2, 3)]
    metric = SummedNLL(position_edges=[0, 3, 5, 8, 64])  # [0, 3), [3, 5), [5, 8), [8, 64) seen up to 10, [64, ...)
    for logits, targets in batches:
        metric.update(logits, targets)
    out = metric.compute()
    assert list(out["by_position"]) == ["0_2", "3_4", "5_7", "8_10"]  # the empty bucket [64, ...) is left out
    logits = torch.cat([l for l, _ in batches])  # (B, T, V)
    targets = torch.cat([t for _, t in batches])  # (B, T)
    for name, bucket in out["by_position"].items():  # reference: positions lo..hi of every row, in float64
        lo, hi = map(int, name.split("_"))
        lg, tg = logits[:, lo:hi + 1].flatten(0, 1), targets[:, lo:hi + 1].flatten()
        keep = tg != IGNORE_INDEX
        assert bucket["tokens"] == keep.sum()
        assert bucket["bpb"] == pytest.approx(F.cross_entropy(lg[keep], tg[keep]).item() / math.log(2), rel=1e-6)
        assert bucket["acc"] == pytest.approx((lg[keep].argmax(-1) == tg[keep]).double().mean().item())
    buckets = out["by_position"].values()
    weighted = sum(b["bpb"] * b["tokens"] for b in buckets) / sum(b["tokens"] for b in buckets)
    assert weighted == pytest.approx(out["bpb"].item(), rel=1e-12)
    assert sum(b["tokens"] for b in buckets) == (targets != IGNORE_INDEX).sum()


def test_position_buckets_merged_over_uneven_ranks_equal_one_process():
    gen = torch.Generator().manual_seed(3)
    long, short = random_batch(gen, 2, 9), random_batch(gen, 3, 4)  # rank 1 never reaches the later buckets
    edges = [0, 2, 6]
    whole, rank0, rank1 = SummedNLL(edges), SummedNLL(edges), SummedNLL(edges)
    for batch in (long, short):
        whole.update(*batch)
    rank0.update(*long)
    rank1.update(*short)
    rank1.merge_state(rank0)  # the rank with the shorter windows must still name the buckets by the longest
    merged, single = rank1.compute()["by_position"], whole.compute()["by_position"]
    assert list(merged) == list(single) == ["0_1", "2_5", "6_8"]
    for name in single:
        assert merged[name] == pytest.approx(single[name], rel=1e-12)


def test_position_metric_update_reads_no_tensor_on_the_host(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    metric = SummedNLL([0, 4, 16])
    for method in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, lambda *a, **k: pytest.fail("host read in SummedNLL.update"))
    metric.update(*random_batch(gen, 2, 20))


@pytest.mark.parametrize("edges", [[], [1, 64], [0, 64, 64], [0, 256, 64], [0, 64.5], [0, True]])
def test_bad_position_edges_name_the_argument(edges):
    with pytest.raises(ValueError, match="position_edges must be strictly increasing ints starting at 0"):
        LitLM(model=TINY, position_edges=edges)


def test_validation_logs_bpb_per_position_bucket(mqar):
    module = LitLM(model={**TINY, "attention": "softmax"}, position_edges=[0, 16, 24])
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, datamodule=mqar, verbose=False)
    val = module.last_validation
    names = list(val["by_position"])
    assert names and set(names) <= {"0_15", "16_23", "24_31"}  # MQAR answers lie after the 4 pairs only
    for name, bucket in val["by_position"].items():
        assert val[f"val_bpb_pos_{name}"] == bucket["bpb"] and val[f"val_acc_pos_{name}"] == bucket["acc"]
    tokens = sum(b["tokens"] for b in val["by_position"].values())
    assert tokens == mqar.num_val_examples * 4  # every answer once
    assert sum(b["bpb"] * b["tokens"] for b in val["by_position"].values()) / tokens == pytest.approx(val["val_bpb"])
    assert not any("_pos_" in key for key in trainer.progress_bar_metrics)  # logged, but not on the progress bar


def test_warmup_then_cosine():
    f = lambda s: warmup_cosine(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


@pytest.fixture(scope="module")
def mqar():
    return MQARDataModule(num_kv_pairs=4, seq_len=32, batch_size=4, num_val_examples=8)


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_fast_dev_run_every_attention(attention, mqar, tmp_path):
    module = LitLM(model={**TINY, "attention": attention}, scheduler=OptimConfig(warmup_steps=1).scheduler(1))
    before = {k: v.clone() for k, v in module.model.state_dict().items() if torch.is_tensor(v)}
    trainer = L.Trainer(fast_dev_run=True, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=mqar)
    assert trainer.global_step == 1
    assert any(not torch.equal(v, module.model.state_dict()[k]) for k, v in before.items())
    assert all(math.isfinite(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val_", "train_")))


def test_checkpoint_round_trip(mqar, tmp_path):
    name = "vq_hard" if "vq_hard" in ATTENTIONS else "softmax"
    module = LitLM(model={**TINY, "attention": name, "attention_kwargs": {}}, optimizer=OptimConfig(lr=1e-3).optimizer())
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=mqar)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    loaded = LitLM.load_from_checkpoint(tmp_path / "m.ckpt")
    assert loaded.hparams["model"]["attention"] == name and "optimizer" not in loaded.hparams  # partials: not saved
    for (k, a), (_, b) in zip(module.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, k
    x = torch.randint(0, 256, (2, 16))
    module.eval(), loaded.eval()
    torch.testing.assert_close(loaded(x).logits, module(x).logits, rtol=0, atol=0)


def test_sample_honours_its_seed_whatever_the_checkpoint_holds(mqar, tmp_path):
    from vqattn.train.callbacks import RNGState
    from vqattn.train.sample import sample

    module = LitLM(model={**TINY, "attention": "softmax"})
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[RNGState()])
    trainer.fit(module, datamodule=mqar)
    trainer.save_checkpoint(tmp_path / "m.ckpt")  # holds the RNG state of the end of training
    texts = {seed: sample(tmp_path / "m.ckpt", "ab", 40, temperature=1.0, seed=seed)[0] for seed in (2, 3, 5)}
    assert len(set(texts.values())) == 3
    assert sample(tmp_path / "m.ckpt", "ab", 40, temperature=1.0, seed=2)[0] == texts[2]


def test_sample_cli_reports_an_invalid_checkpoint_in_one_line(tmp_path, capsys):
    from vqattn.train.sample import main

    (tmp_path / "bad.ckpt").write_bytes(b"garbage")
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "bad.ckpt")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "not a valid checkpoint" in err and "weights_only" not in err
