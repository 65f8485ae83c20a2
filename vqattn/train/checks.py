"""Checks that explain, in one line naming the key to change, a run that cannot work, before anything is built."""

from __future__ import annotations

import difflib
import re

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf


def positive_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive int, got {value!r}")


def _device_count(devices) -> int | None:
    """How many devices ``trainer.devices`` asks for; None when it depends on the machine ("auto", -1)."""
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool):
        return None if devices == -1 else devices
    if isinstance(devices, str) and "," in devices:  # "0,1": those GPUs
        return len([d for d in devices.split(",") if d.strip()])
    return len(devices) if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)) else None


def check_config(cfg: DictConfig) -> None:
    """Explain settings that cannot work before anything is built."""
    from .callbacks import NonFiniteGuard
    from .lit import OptimConfig

    positive_int("trainer.max_steps", cfg.trainer.max_steps)
    NonFiniteGuard(cfg.nonfinite, cfg.nonfinite_max_skips)  # one line naming nonfinite or nonfinite_max_skips
    positive_int("checkpoint_every", cfg.checkpoint_every)
    positive_int("checkpoint_keep", cfg.checkpoint_keep)
    if not isinstance(cfg.checkpoint_best, bool):
        raise ValueError(f"checkpoint_best must be true or false, got {cfg.checkpoint_best!r}")
    OptimConfig(**OmegaConf.to_container(cfg.optim))  # one line naming optim.KEY for a value out of range
    devices = _device_count(cfg.trainer.devices)
    if cfg.trainer.strategy == "auto" and devices is not None and devices > 1:
        # Lightning would pick a multi-process strategy itself, without the launch handling of trainer=ddp
        raise ValueError(f"trainer.devices={cfg.trainer.devices} starts one process per device: add trainer=ddp "
                         f"(or set trainer.strategy), or use trainer.devices=1")
    check_vocab(cfg)
    check_stack_kwargs(cfg)
    m, d = cfg.model, cfg.data
    if m.pos_emb == "learned" and isinstance(d.seq_len, int) and d.seq_len > m.seq_len:
        raise ValueError(
            f"data.seq_len={d.seq_len} exceeds model.seq_len={m.seq_len}, the longest sequence learned absolute "
            f"positions can encode; set data.seq_len <= model.seq_len or model.pos_emb=rope"
        )


def check_vocab(cfg: DictConfig) -> None:
    """data.tokenizer names a tokenizer, and model.vocab_size is its vocabulary padded to a multiple of 64 (what it is
    unless set): a 50257-way head on bytes would train 6.7x slower for nothing, a smaller head cannot predict."""
    from ..tokenizer import load_tokenizer, padded_vocab

    spec = cfg.data.get("tokenizer")
    if spec is None:  # no tokenizer: MQAR's vocabulary is model.vocab_size itself
        return
    tokenizer = load_tokenizer(spec)
    expected, vocab = padded_vocab(tokenizer.vocab_size), cfg.model.vocab_size
    if vocab != expected:
        raise ValueError(f"model.vocab_size={vocab} does not fit data.tokenizer={spec} ({tokenizer.vocab_size} tokens, "
                         f"padded to {expected}): leave model.vocab_size unset, it follows the tokenizer")


def check_stack_kwargs(cfg: DictConfig) -> None:
    """A hybrid stack (``model.attention`` a list) builds its layers with ``layer_kwargs.NAME``, not with the attention
    group's ``attention.kwargs``: a changed ``attention.kwargs`` would be ignored, so it is a one-line error naming the
    key to set instead."""
    group = cfg.get("attention")
    if OmegaConf.is_list(cfg.model.attention) and group is not None and group.name in cfg.get("layer_kwargs", {}):
        given, layer = (OmegaConf.to_container(node, resolve=True) for node in (group.kwargs, cfg.layer_kwargs[group.name]))
        changed = sorted(key for key in given if key not in layer or given[key] != layer[key])
        if changed:
            key = changed[0]
            raise ValueError(f"attention.kwargs.{key} configures the uniform stack of attention={group.name}; "
                             f"model.attention is a list, whose {group.name} layers take layer_kwargs.{group.name}."
                             f"{key}")


def unknown_option(args: list[str], groups: dict[str, list[str]]) -> str | None:
    """The one-line error for a command-line argument that picks no option of its config group (``attention=foo``,
    also in a sweep ``attention=softmax,foo`` or a list ``logger=[csv,foo]``), else None. Hydra's own report of it
    is twenty lines of search paths. Flags, other keys and anything Hydra cannot parse are left to Hydra."""
    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException:
            continue
        options = groups.get(override.key_or_group)
        if options is None or override.is_delete():
            continue
        value = override.value()
        values = value.list if isinstance(value, ChoiceSweep) else value if isinstance(value, list) else [value]
        for name in values:
            if isinstance(name, str) and name not in options:
                return f"unknown {override.key_or_group} {name!r}; choose one of: {', '.join(options)}"
    return None


def config_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """The dotted keys a command line can set in ``cfg`` (``model.n_layer``, ``attention.kwargs.num_codes``, ...): its
    leaves and nodes, less those that only repeat another key (an interpolation such as ``${block_len}``: the key it
    names is the one to set) and Hydra's own settings (``hydra.``)."""
    keys = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        node = cfg._get_node(key)
        if path == "hydra" or node is None or node._is_interpolation():
            continue
        keys.append(path)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            keys += config_keys(node, path + ".")
    return keys


def nearest_key(key: str, keys: list[str]) -> str | None:
    """The valid key a mistyped ``key`` most likely meant, else None: one with the same last name (the fewest
    dots first: ``model.block_len`` -> the root key ``block_len``), else the one whose last name is closest,
    beside it on a tie (``trainer.max_step`` -> ``trainer.max_steps``; ``data.seqlen`` -> ``model.seq_len``
    rather than ``data.repeat_len``), else the closest key anywhere."""
    parent, _, name = key.rpartition(".")
    same_name = sorted((k for k in keys if k.rpartition(".")[2] == name), key=lambda k: (k.count("."), k))
    if same_name:
        return same_name[0]

    def score(k: str) -> tuple:
        k_parent, _, k_name = k.rpartition(".")
        return difflib.SequenceMatcher(None, name, k_name).ratio(), k_parent == parent, -k.count(".")

    best = max(keys, key=score, default=None)
    if best is not None and score(best)[0] >= 0.6:
        return best
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key_error(err: BaseException) -> str | None:
    """The one-line error for Hydra's report that a command line sets a key the config does not have (``Could not
    override 'model.block_len'``), naming the nearest valid key with the override rewritten for it; else None."""
    found = re.match(r"Could not override '([^']+)'\.", str(err))
    if found is None:
        return None
    key = found.group(1)
    value = re.search(r"use \+\S+?=(.*)$", str(err), re.MULTILINE)
    parent = getattr(err.__cause__, "parent_node", None)
    root = parent._get_root() if parent is not None else None
    near = nearest_key(key, config_keys(root)) if isinstance(root, DictConfig) else None
    if near is None:
        return f"unknown config key {key} (python train.py --cfg job prints every key)"
    return f"unknown config key {key}; did you mean {near}{'=' + value.group(1) if value else ''}?"


def cpu_processes_warning(cfg: DictConfig, cores: int, cuda: bool) -> str | None:
    """A one-line warning when a multi-process strategy starts more CPU processes than there are ``cores`` for them
    (``cuda``: whether accelerator=auto would pick a GPU), else None: such processes take turns on the cores, and
    every step waits for the slowest."""
    devices = _device_count(cfg.trainer.devices)
    on_cpu = cfg.trainer.accelerator == "cpu" or cfg.trainer.accelerator == "auto" and not cuda
    if cfg.trainer.strategy == "auto" or not on_cpu or devices is None or devices <= cores:
        return None
    return (f"trainer.devices={devices} starts {devices} CPU processes on {cores} cores: they take turns on the cores "
            f"and every step waits for the slowest; trainer.devices={cores} or fewer avoids it")


def raw_window_warning(cfg: DictConfig) -> str | None:
    """A one-line warning when an attention with a raw window of blocks (``block_len`` L: vq, ovq, window) holds
    every key of a training sequence in that window, else None. A query of block b reads blocks b-1 and b raw and
    only older keys through the codebook or memory, so with seq_len T <= 2L the run trains softmax attention and
    never reads what it is meant to test. Carried state (older segments in the cache) and a quantised window
    (``exact_window=false``) read the codebook all the same."""
    seq_len = cfg.data.seq_len
    for name, kwargs in stack_kwargs(cfg).items():  # each attention of a hybrid stack
        block_len = kwargs.get("block_len")
        if block_len is None or cfg.carry_state or kwargs.get("exact_window") is False or seq_len > 2 * block_len:
            continue
        return (f"block_len={block_len} with seq_len={seq_len}: every key sits in the raw window (2 x block_len keys), "
                f"so {name} is plain softmax attention here; set block_len below seq_len / 2 "
                f"(block_len={max(1, (seq_len - 1) // 2)} or less), or carry_state=true")
    return None


def stack_kwargs(cfg: DictConfig) -> dict:
    """{attention name: its kwargs} over the model's attentions: the attention group's for attention=X, each name's
    own for a hybrid stack (model.attention_kwargs keyed by name)."""
    attention, kwargs = cfg.model.attention, cfg.model.attention_kwargs
    if isinstance(attention, str):
        return {attention: kwargs}
    return {name: kwargs.get(name, {}) for name in dict.fromkeys(attention)}


def check_resumable(module, checkpoint: dict, path: str) -> None:
    """Raise a one-line ValueError unless the checkpoint's weights fit the module (same attention, same shapes) and
    its optimizer state the module's optimizer (Muon's groups where optimizer=muon has them, none elsewhere)."""
    groups = (checkpoint.get("optimizer_states") or [{}])[0].get("param_groups")
    if groups is not None:
        saved_muon = any(group.get("muon") for group in groups)
        muon = bool(getattr(getattr(module.optimizer, "func", module.optimizer), "muon_groups", False))
        if saved_muon and not muon:
            raise ValueError(f"ckpt_path={path} was trained with optimizer=muon, this run's optimizer is another: "
                             "resume with optimizer=muon")
        if muon and not saved_muon:
            raise ValueError(f"ckpt_path={path} was trained with another optimizer than this run's optimizer=muon: "
                             "resume with the optimizer it was trained with (optimizer=adamw by default)")
    trained = checkpoint.get("hyper_parameters", {}).get("model", {}).get("attention")
    attention = module.model.config.attention
    if trained is not None and trained != attention:
        def key(value) -> str:  # as the command line sets it
            return f"attention={value}" if isinstance(value, str) else f"model.attention=[{','.join(map(str, value))}]"
        raise ValueError(f"ckpt_path={path} was trained with {key(trained)}, this run has {key(attention)}: "
                         f"resume with {key(trained)}")
    saved, own = checkpoint["state_dict"], module.state_dict()
    mismatch = sorted(k for k in own.keys() | saved.keys()
                      if k not in own or k not in saved or own[k].shape != saved[k].shape)
    if mismatch:
        raise ValueError(f"ckpt_path={path} does not fit this model ({len(mismatch)} weights differ, e.g. "
                         f"{mismatch[0]}): resume with the model and attention settings it was trained with")
