"""optimizer=muon: Muon on the blocks' weight matrices, AdamW on the rest, as one optimizer (MuonAdamW) that the
schedule, Lightning and the checkpoint see as any other."""

import copy
import csv
import re
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from test_train import FAST, cfg_for, run_inprocess, val_rows

from vqattn.model import GPT, GPTConfig
from vqattn.train.lit import LitLM, MuonAdamW, OptimConfig, parameter_groups

# every kind of parameter a model can have: codebook codes (vq_soft), a short convolution, biases, learned
# q/k scales, learned positions and an untied head
EVERY_KIND = dict(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=32, attention="vq_soft", short_conv=4,
                  bias=True, qk_norm="l2", pos_emb="learned", tie_embeddings=False)
HIDDEN = re.compile(r"blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj)\.weight")


def names(model, group) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {name for name, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tied", [False, True])
def test_the_split_gives_muon_the_blocks_linear_weights_and_every_parameter_one_group(tied):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**EVERY_KIND, "tie_embeddings": tied}))
    adamw, no_decay, muon = parameter_groups(model, muon=True)
    assert (adamw["name"], no_decay["name"], muon["name"]) == ("adamw", "adamw_no_decay", "muon")
    assert muon["muon"] and not adamw.get("muon") and no_decay["weight_decay"] == 0.0
    every = [p for g in (adamw, no_decay, muon) for p in g["params"]]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))  # each exactly once
    assert names(model, muon) == {n for n, _ in model.named_parameters() if HIDDEN.fullmatch(n)}
    assert len(names(model, muon)) == 4 * 2 and all(p.ndim == 2 for p in muon["params"])
    # embeddings, the head (when untied) and the convolution's (C, 1, K) kernel: AdamW, with weight decay
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.attn.conv.weight", "blocks.1.attn.conv.weight",
            *(() if tied else ("head.weight",))} <= names(model, adamw)
    assert "head.weight" not in names(model, adamw) | names(model, muon) or not tied  # tied: the embedding, once
    # norms, biases and the codebooks' codes: AdamW without weight decay
    assert {n.split(".")[-1] for n in names(model, no_decay)} == {"weight", "bias", "codes"}
    assert all(p.ndim == 1 or "codebook" in n for n, p in model.named_parameters() if n in names(model, no_decay))
    # without muon: the two groups as ever; Muon's matrices are the only ones that leave AdamW's decaying group
    decay, plain_no_decay = parameter_groups(model)
    assert names(model, adamw) == names(model, decay) - names(model, muon) and "name" not in decay
    assert names(model, muon) <= names(model, decay) and names(model, plain_no_decay) == names(model, no_decay)


def reference_step(model, groups, grads, cfg: OptimConfig):
    """The same step by torch.optim.Muon and torch.optim.AdamW side by side, as two optimizers."""
    params = dict(model.named_parameters())
    muon = torch.optim.Muon([params[n] for n in groups["muon"]], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                            weight_decay=cfg.muon_weight_decay)
    adamw = torch.optim.AdamW([{"params": [params[n] for n in groups["adamw"]]},
                               {"params": [params[n] for n in groups["adamw_no_decay"]], "weight_decay": 0.0}],
                              lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    for grad in grads:
        for name, p in params.items():
            p.grad = grad[name].clone()
        muon.step()
        adamw.step()


def test_each_parameter_takes_its_rules_update_exactly():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**EVERY_KIND))
    twin, initial = copy.deepcopy(model), copy.deepcopy(model)
    cfg = OptimConfig(lr=3e-3, weight_decay=0.2, betas=(0.8, 0.9), muon_lr=0.05, muon_momentum=0.9,
                      muon_weight_decay=0.1)
    optimizer = cfg.optimizer("muon")(parameter_groups(model, muon=True))
    assert isinstance(optimizer, MuonAdamW)
    grads = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(3)]
    for grad in grads:
        for name, p in model.named_parameters():
            p.grad = grad[name].clone()
        optimizer.step()
    groups = {g["name"]: names(model, g) for g in optimizer.param_groups}
    reference_step(twin, groups, grads, cfg)
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert all(not torch.equal(a, b) for a, b in zip(model.parameters(), initial.parameters()))  # every one moved


def train_steps(model, optimizer, steps: int, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (4, 33), generator=gen)
    losses = []
    for _ in range(steps):
        out = model(x[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten()) + out.aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_it_trains_and_its_state_dict_resumes_both_rules():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**EVERY_KIND))
    optimizer = OptimConfig(lr=1e-2).optimizer("muon")(parameter_groups(model, muon=True))
    losses = train_steps(model, optimizer, 8)
    assert losses[-1] < losses[0] - 1.0, losses  # a batch learnt by heart
    kinds = {frozenset(s) for s in optimizer.state.values()}
    assert kinds == {frozenset({"step", "exp_avg", "exp_avg_sq"}), frozenset({"momentum_buffer"})}
    # a fresh optimizer loaded from the state continues exactly as the one that saved it
    saved, twin = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(model)
    loaded = OptimConfig(lr=1e-2).optimizer("muon")(parameter_groups(twin, muon=True))
    loaded.load_state_dict(saved)
    assert train_steps(twin, loaded, 3, seed=1) == train_steps(model, optimizer, 3, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    # AdamW's state (two groups) is not MuonAdamW's: one line saying so
    adamw = OptimConfig().optimizer()(parameter_groups(model))
    with pytest.raises(ValueError, match=r"^the optimizer state to load is not optimizer=muon's \(2 parameter groups, "
                                         r"0 of them Muon's; this one has 3, 1 of them Muon's\): resume with the "
                                         r"optimizer it was trained with$"):
        loaded.load_state_dict(adamw.state_dict())


def test_groups_without_a_muon_group_are_refused():
    model = GPT(GPTConfig(**EVERY_KIND))
    for params in (parameter_groups(model), list(model.parameters())):
        with pytest.raises(ValueError, match='at least one marked "muon": True'):
            MuonAdamW(params)


def test_optimizer_muon_reads_the_optim_keys_and_the_schedule_scales_both_rules():
    cfg = cfg_for("optimizer=muon", "model=tiny", "optim.lr=0.001", "optim.muon_lr=0.04", "optim.muon_momentum=0.9",
                  "optim.muon_weight_decay=0.01", "optim.warmup_steps=4", "optim.total_steps=10")
    module = instantiate(cfg.module, _convert_="all")
    module.trainer = SimpleNamespace(max_steps=20)
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    muon = optimizer.param_groups[2]
    assert (muon["name"], muon["momentum"], muon["weight_decay"], muon["nesterov"]) == ("muon", 0.9, 0.01, True)
    assert [g["weight_decay"] for g in optimizer.param_groups[:2]] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) for g in optimizer.param_groups[:2])
    assert module._configured_lrs == [0.001, 0.001, 0.04]
    rates = []
    for _ in range(12):
        rates.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    for step, (adamw, no_decay, muon_lr) in enumerate(rates):  # one multiplier for every group, at every step
        assert adamw == no_decay and muon_lr == pytest.approx(40 * adamw, rel=1e-12), step
    assert [r[2] for r in rates[:4]] == pytest.approx([0.01, 0.02, 0.03, 0.04])  # warmup
    assert [r[2] for r in rates[10:]] == pytest.approx([0.004, 0.004])  # min_lr_ratio * muon_lr from total_steps on
    assert isinstance(LitLM(model=dict(n_layer=1), optimizer=OptimConfig().optimizer("muon")).optimizer(
        parameter_groups(GPT(GPTConfig(n_layer=1)), muon=True)), MuonAdamW)
    with pytest.raises(ValueError, match="optimizer must be adamw or muon, got 'sgd'"):
        OptimConfig().optimizer("sgd")


@pytest.mark.parametrize("override,message", [
    ("optim.muon_lr=0", "optim.muon_lr must be > 0, got 0"),
    ("optim.muon_momentum=1.5", "optim.muon_momentum must be in [0, 1), got 1.5"),
    ("optim.muon_weight_decay=-1", "optim.muon_weight_decay must be >= 0, got -1"),
])
def test_a_bad_muon_value_is_one_line(tmp_path, override, message):
    from vqattn.train import cli, lifecycle

    with pytest.raises(ValueError) as info:
        cli.train(cfg_for(*FAST, "optimizer=muon", override), tmp_path / "run")
    assert lifecycle.user_error(info.value) == f"ValueError: {message}"
    assert not (tmp_path / "run").exists()


def test_a_misspelt_muon_key_is_one_line_naming_the_key(monkeypatch, capsys):
    from vqattn.train import cli

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", "optimizer=muon", "optim.muon_lrr=0.01"])
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err == "error: unknown config key optim.muon_lrr; did you mean optim.muon_lr=0.01?\n"


@pytest.mark.parametrize("trained,resumed,message", [
    ("muon", "adamw", "was trained with optimizer=muon, this run's optimizer is another: resume with optimizer=muon"),
    ("adamw", "muon", "was trained with another optimizer than this run's optimizer=muon: resume with the optimizer "
                      "it was trained with (optimizer=adamw by default)"),
])
def test_a_checkpoint_resumes_with_its_own_optimizer_alone(tmp_path, trained, resumed, message):
    from vqattn.train import cli, lifecycle

    module = instantiate(cfg_for(*FAST, f"optimizer={trained}").module, _convert_="all")
    module.trainer = SimpleNamespace(max_steps=50)
    optimizer = module.configure_optimizers()["optimizer"]
    path = tmp_path / f"{trained}.ckpt"
    torch.save({"state_dict": module.state_dict(), "global_step": 5, "hyper_parameters": dict(module.hparams),
                "optimizer_states": [optimizer.state_dict()]}, path)
    with pytest.raises(ValueError) as info:
        cli.train(cfg_for(*FAST, f"optimizer={resumed}", f"ckpt_path={path}"), tmp_path / "run")
    assert lifecycle.user_error(info.value) == f"ValueError: ckpt_path={path} {message}"
    assert not (tmp_path / "run").exists()


def lr_rows(run_dir, group: str) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r[f"lr-MuonAdamW/{group}"]) for r in csv.DictReader(f)
                if r.get(f"lr-MuonAdamW/{group}")}


@pytest.mark.slow
def test_resume_10_plus_10_equals_20_straight_and_takes_a_new_muon_lr(tmp_path):
    common = ["optimizer=muon", "attention=vq_soft", "optim.total_steps=20", "trainer.val_check_interval=10",
              "checkpoint_every=10", "trainer.log_every_n_steps=1", "threads=1"]
    first, a = run_inprocess(tmp_path, "a", *common, "trainer.max_steps=10")
    checkpoint = a / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]
    assert [g["name"] for g in saved["param_groups"]] == ["adamw", "adamw_no_decay", "muon"]
    assert {frozenset(s) for s in saved["state"].values()} == {frozenset({"step", "exp_avg", "exp_avg_sq"}),
                                                               frozenset({"momentum_buffer"})}
    straight, c = run_inprocess(tmp_path, "c", *common, "trainer.max_steps=20")
    resumed, b = run_inprocess(tmp_path, "b", *common, "trainer.max_steps=20", f"ckpt_path={checkpoint}")
    assert resumed["steps"] == straight["steps"] == 20 and straight["val_loss"] != first["val_loss"]
    assert resumed["val_loss"] == straight["val_loss"]  # bit for bit: both rules' state was restored
    assert [float(r["val_bpb"]) for r in val_rows(b)] == [float(r["val_bpb"]) for r in val_rows(c)][1:]
    assert len(lr_rows(c, "muon")) == 20 and lr_rows(b, "muon") == {k: v for k, v in lr_rows(c, "muon").items()
                                                                     if k >= 10}
    # resumed with another muon lr: Muon's schedule takes it, AdamW's stays
    _, d = run_inprocess(tmp_path, "d", *common, "trainer.max_steps=20", "optim.muon_lr=0.01",
                         f"ckpt_path={checkpoint}")
    muon, adamw = lr_rows(d, "muon"), lr_rows(d, "adamw")
    assert muon and all(lr == pytest.approx(lr_rows(c, "muon")[step] / 2) for step, lr in muon.items())
    assert adamw == {k: v for k, v in lr_rows(c, "adamw").items() if k >= 10}
