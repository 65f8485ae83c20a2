"""conf/ against the Python defaults: every value a config file sets differently is a listed, deliberate override."""

import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace

import lightning
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from vqattn.layers import ATTENTIONS, Attention
from vqattn.model import GPT, GPTConfig
from vqattn.train.callbacks import NonFiniteGuard
from vqattn.train.configs import register, signature_defaults
from vqattn.train.data import StdlibDataModule
from vqattn.train.lit import LitLM, OptimConfig

CONF = Path(__file__).resolve().parents[2] / "vqattn" / "train" / "conf"
register()

# (group, option) -> keys the option deliberately sets away from the Python default; each carries a comment
# in its yaml saying why. Options not listed must equal the Python defaults everywhere.
DELIBERATE = {
    ("trainer", "default"): {"devices", "max_steps", "val_check_interval", "check_val_every_n_epoch",
                             "num_sanity_val_steps", "gradient_clip_val", "log_every_n_steps",
                             "use_distributed_sampler"},
    ("model", "tiny"): {"seq_len", "n_layer", "n_head", "n_embd"},  # a smaller model is the point of the option
    ("model", "base"): {"seq_len", "n_layer", "n_head", "n_embd"},
    ("data", "mqar"): {"batch_size"},
    # the Hub datasets: which dataset, how it is laid out, and a larger validation sample
    ("data", "enwik8"): {"name", "hub_name", "revision", "layout", "val_windows"},
    ("data", "wikitext103"): {"name", "hub_name", "val_windows"},
}
DELIBERATE[("trainer", "cpu")] = DELIBERATE[("trainer", "default")] | {"accelerator"}
DELIBERATE[("trainer", "gpu")] = DELIBERATE[("trainer", "default")] | {"accelerator", "precision"}
DELIBERATE[("trainer", "ddp")] = DELIBERATE[("trainer", "default")] | {"strategy"}
# logger option -> {logger name: keys set away from the logger class's defaults}
LOGGERS_DELIBERATE = {"tensorboard": {"tensorboard": {"name", "version", "default_hp_metric"}},
                      "wandb": {"wandb": {"save_dir", "project"}}}
GROUPS = [(group, p.stem) for group in ("model", "data", "trainer") for p in sorted((CONF / group).glob("*.yaml"))]
GROUPS += [("attention", name) for name in sorted(ATTENTIONS)]


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def python_defaults(group: str, node) -> dict:
    """The defaults the group's node shadows, read from the Python code it configures."""
    if group == "model":
        return dataclasses.asdict(GPTConfig())
    if group == "attention":
        return {"kwargs": signature_defaults(ATTENTIONS[node.name], stop=Attention)}
    return signature_defaults(get_class(node._target_))


def differing_keys(node, defaults: dict, prefix: str = "") -> set[str]:
    """Keys whose value differs from the default; interpolations (wiring such as ${model.seq_len}) are skipped."""
    out = set()
    for key in node:
        if key not in defaults or OmegaConf.is_interpolation(node, key):
            continue
        value, default = node[key], defaults[key]
        if OmegaConf.is_dict(value) and isinstance(default, dict):
            out |= differing_keys(value, default, f"{prefix}{key}.")
        elif (OmegaConf.to_container(value) if OmegaConf.is_config(value) else value) != default:
            out.add(f"{prefix}{key}")
    return out


@pytest.mark.parametrize("group,option", GROUPS)
def test_conf_differs_from_python_only_where_declared(group, option):
    node = compose_cfg(f"{group}={option}")[group]
    differs = differing_keys(node, python_defaults(group, node))
    declared = DELIBERATE.get((group, option), set())
    assert differs - declared == set(), f"conf/{group}/{option} silently shadows Python defaults"
    assert declared - differs == set(), f"listed as deliberate but equal to the Python default: {declared - differs}"


def test_the_checker_catches_a_silent_override():
    node = OmegaConf.create({"a": 1, "b": {"c": [1, 2]}, "d": "${x}", "e": 5})
    assert differing_keys(node, {"a": 2, "b": {"c": [1, 2]}, "d": 0, "e": 5}) == {"a"}
    assert differing_keys(node, {"a": 1, "b": {"c": [1, 3]}, "d": 0, "e": 5}) == {"b.c"}


def test_root_values_are_the_python_defaults():
    cfg = compose_cfg()
    assert OmegaConf.to_container(cfg.optim) == {**dataclasses.asdict(OptimConfig()), "betas": [0.9, 0.95]}
    for key in ("aux_weight", "compile", "carry_state", "carry_segments", "position_edges"):
        assert cfg[key] == inspect.signature(LitLM).parameters[key].default, key
    assert cfg.block_len == inspect.signature(ATTENTIONS["vq_hard"]).parameters["block_len"].default
    guard = inspect.signature(NonFiniteGuard).parameters
    assert (cfg.nonfinite, cfg.nonfinite_max_skips) == (guard["mode"].default, guard["max_skips"].default)
    assert cfg.block_len == inspect.signature(ATTENTIONS["window"]).parameters["block_len"].default


def test_default_config_builds_the_python_default_model():
    # A user who writes GPT(GPTConfig()) gets the model the README's default run trains.
    torch.manual_seed(0)
    module = instantiate(compose_cfg().module, _convert_="all")
    torch.manual_seed(0)
    plain = GPT(GPTConfig())
    assert dataclasses.replace(module.model.config, attention_kwargs={}) == GPTConfig()
    for (name, a), (_, b) in zip(module.model.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    python = LitLM(model={})  # LitLM's own optimizer and schedule: OptimConfig's over the run's max_steps
    python.trainer = module.trainer = SimpleNamespace(max_steps=compose_cfg().trainer.max_steps)
    assert learning_rates(module) == learning_rates(python)


def learning_rates(module, steps: int | None = None) -> list[list[float]]:
    """Each parameter group's (lr, weight_decay) at every step of the module's optimizer and schedule."""
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    out = []
    for _ in range(steps or module.trainer.max_steps + 1):
        out.append([(group["lr"], group["weight_decay"]) for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


def test_the_optim_keys_reach_the_optimizer_and_its_schedule():
    cfg = compose_cfg("model=tiny", "optim.lr=0.001", "optim.weight_decay=0.2", "optim.betas=[0.8,0.9]",
                      "optim.warmup_steps=4", "optim.min_lr_ratio=0.5", "optim.total_steps=10", "trainer.max_steps=30")
    module = instantiate(cfg.module, _convert_="all")
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.8, 0.9)
    rates = learning_rates(module, steps=12)
    assert [wd for _, wd in rates[0]] == [0.2, 0.0]  # matrices decay; norms, biases and codebooks do not
    lr = [group[0][0] for group in rates]
    assert lr[:4] == pytest.approx([0.00025, 0.0005, 0.00075, 0.001])  # warmup over 4 steps
    assert lr[10:] == pytest.approx([0.0005, 0.0005])  # min_lr_ratio * lr from total_steps on, not max_steps
    assert all(a > b for a, b in zip(lr[4:10], lr[5:11]))  # cosine decay in between


# callback -> keys set away from the callback class's defaults, each with a comment in conf/callbacks/default.yaml
CALLBACKS_DELIBERATE = {"lr_monitor": {"logging_interval"}}


def test_callbacks_differ_from_python_only_where_declared():
    callbacks = compose_cfg().callbacks
    assert set(callbacks) == {"lr_monitor", "throughput", "progress_bar", "model_summary"}
    for name, node in callbacks.items():
        assert differing_keys(node, signature_defaults(get_class(node._target_))) == \
            CALLBACKS_DELIBERATE.get(name, set()), name
    assert compose_cfg("callbacks=none").callbacks == {}


def test_signature_defaults_follow_the_kwargs_chain():
    assert signature_defaults(StdlibDataModule) == {"max_bytes": 8_000_000, "val_windows": 256, "seq_len": 256,
                                                    "batch_size": 8, "seed": 0, "num_workers": 0, "stream": False,
                                                    "stream_groups": 1, "val_carried": False,
                                                    "pack_documents": False, "separator": None,
                                                    "tokenizer": "bytes", "cache_dir": None, "repeat_fraction": 0.0,
                                                    "repeat_len": 32}
    trainer = signature_defaults(lightning.Trainer)
    assert trainer["max_steps"] == -1 and trainer["accelerator"] == "auto"
    vq = signature_defaults(ATTENTIONS["vq_soft"], stop=Attention)
    assert {"num_codes", "block_len", "exact_window"} <= set(vq) and "dropout" not in vq  # base kwargs: GPTConfig's


@pytest.mark.parametrize("override", [
    "attention.kwargs.num_codes=128", "model.qk_norm=true", "model.pos_emb=learned", "trainer.precision=bf16-mixed",
    "trainer.accumulate_grad_batches=2", "data.num_workers=2", "optim.lr=1e-3", "attention.kwargs.block_len=32",
])
def test_every_default_can_be_overridden_without_plus(override):
    key, value = override.split("=")
    assert str(OmegaConf.select(compose_cfg(override), key)).lower() == value.lower().replace("1e-3", "0.001")


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "logger").glob("*.yaml")))
def test_logger_options_differ_from_lightning_only_where_declared(option):
    loggers = compose_cfg(f"logger={option}").logger
    declared = LOGGERS_DELIBERATE.get(option, {})
    assert set(loggers) == set(declared)
    for name, node in loggers.items():
        assert differing_keys(node, signature_defaults(get_class(node._target_))) == declared[name], name


def test_several_loggers_compose_together():
    loggers = compose_cfg("logger=[tensorboard,wandb]").logger
    assert set(loggers) == {"tensorboard", "wandb"} and loggers.wandb.name == compose_cfg().attention.name
    assert compose_cfg().logger == {}  # the default: metrics.csv alone


def test_the_memory_layers_get_twice_the_block_as_memory_cap():
    for name in ("vq_hard", "vq_soft", "ovq"):
        assert ATTENTIONS[name](32, 2).memory_cap == 128  # the layers' Python default: 2 × their block_len, 64
        assert ATTENTIONS[name](32, 2, block_len=8, memory_cap=None).memory_cap is None
        cfg = compose_cfg(f"attention={name}", "block_len=16")
        assert instantiate(cfg.module, _convert_="all").model.blocks[0].attn.memory_cap == 32
    build = lambda *overrides: instantiate(compose_cfg("attention=ovq", *overrides).module,  # noqa: E731
                                           _convert_="all").model.blocks[0].attn
    assert build("memory_cap=null").memory_cap is None
    assert build("memory_cap=500").memory_cap == 500
    # the soft mixture window reads the previous block through the codes: no bound by default, an error if asked
    assert ATTENTIONS["vq_soft"](32, 2, exact_window=False, rope=False).memory_cap is None
    mixture = compose_cfg("attention=vq_soft", "attention.kwargs.exact_window=false", "model.pos_emb=learned")
    assert instantiate(mixture.module, _convert_="all").model.blocks[0].attn.memory_cap is None
    with pytest.raises(ValueError, match="memory_cap needs exact_window=True"):
        ATTENTIONS["vq_soft"](32, 2, memory_cap=64, exact_window=False, rope=False)
    for bad in (0, 2.5, True, "raw"):
        with pytest.raises(ValueError, match="memory_cap must be a positive int"):
            ATTENTIONS["ovq"](32, 2, memory_cap=bad)


def test_the_root_memory_decay_reaches_the_online_memory():
    build = lambda *overrides: instantiate(compose_cfg(*overrides).module,  # noqa: E731
                                           _convert_="all").model.blocks[0].attn
    assert build("attention=ovq").memory_decay is None
    assert build("attention=ovq", "memory_decay=0.99").memory_decay == 0.99
    assert not hasattr(build("attention=vq_hard", "memory_decay=0.99"), "memory_decay")  # only ovq forgets
    for bad in (0, 1.5, True, "fast"):
        with pytest.raises(ValueError, match="memory_decay must be a number in"):
            ATTENTIONS["ovq"](32, 2, memory_decay=bad)
