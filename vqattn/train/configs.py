"""Hydra schema for train.py, generated from the Python signatures it configures: one source of defaults.

``register()`` stores in Hydra's ConfigStore, under the ``schema`` group, the keyword defaults of
``GPTConfig`` (``schema/model``), ``OptimConfig`` (``schema/optim``), ``lightning.Trainer``
(``schema/trainer``) and each data module (``schema/data/<class>``), and one ``attention`` option per
registered attention layer (``attention.kwargs`` = the layer's own keyword defaults), and the same kwargs of every
attention under the root key ``layer_kwargs`` (``layer_kwargs.ovq.num_slots``: what the layers of a hybrid stack,
``model.attention=[ovq,ovq,ovq,softmax]``, are built with). The yaml files in
conf/ extend these nodes and set only what a configuration deliberately changes, each with a comment
saying why; every key still exists in the composed config, so any default can be overridden from the
command line (``model.qk_norm=true``, ``attention.kwargs.num_codes=128``, ``trainer.precision=bf16-mixed``).
tests/train/test_configs.py fails when a conf/ value differs from the default it shadows without being listed
as deliberate.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

_PLAIN = (type(None), bool, int, float, str)


def _plain(value):
    """A default as a config value: tuples become lists (OmegaConf has no tuples)."""
    return list(value) if isinstance(value, tuple) else value


def signature_defaults(cls: type, stop: type | None = None) -> dict:
    """Keyword defaults of ``cls``'s constructor chain, subclass first.

    Follows ``__init__`` up the MRO for as long as each one forwards ``**kwargs`` to its parent, and stops at
    ``stop`` (excluded). Parameters without a default are left out (the config must set them); so are
    defaults that are not plain values (objects cannot be written in yaml).
    """
    out: dict = {}
    for klass in cls.__mro__:
        if klass is stop or klass is object:
            break
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        for p in params:
            default = _plain(p.default)
            if p.default is not p.empty and isinstance(default, (*_PLAIN, list, dict)):
                out.setdefault(p.name, default)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return out


def _dataclass_defaults(cls) -> dict:
    return {k: _plain(v) for k, v in dataclasses.asdict(cls()).items()}


def instantiate_targets(cfg, group: str, overrides=lambda node: {}) -> list:
    """Each entry of a group of named objects (``logger``, ``callbacks``: {name: {_target_: ..., arg: ...}}), built
    with ``hydra.utils.instantiate(node, **overrides(node))``; a one-line ValueError for an entry without
    ``_target_``."""
    built = []
    for name, node in (cfg or {}).items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ValueError(f"{group}.{name} must be a config with a _target_, got {node!r}")
        built.append(hydra.utils.instantiate(node, **overrides(node)))
    return built


def data_classes() -> dict[str, type]:
    """The data modules conf/data/ builds, by schema name."""
    from . import data, mqar, token_files

    return {"stdlib": data.StdlibDataModule, "text": data.TextDataModule, "hub": data.HubTextDataModule,
            "tokens": token_files.TokenFilesDataModule, "mqar": mqar.MQARDataModule}


def config_groups() -> dict[str, list[str]]:
    """The options of each config group a command line picks from (``model=tiny``): the yaml files of conf/GROUP/
    and, for ``attention``, the registered layers (call ``register()`` first)."""
    conf = Path(__file__).parent / "conf"
    groups = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in conf.iterdir() if any(d.glob("*.yaml"))}
    groups["attention"] = sorted(name.removesuffix(".yaml") for name in ConfigStore.instance().list("attention"))
    return groups


def tokenizer_vocab(spec: str | None) -> int:
    """The model vocabulary data.tokenizer asks for (``${tokenizer_vocab:...}`` in conf/config.yaml): the tokenizer's
    size padded to a multiple of 64; 256 for bytes or a corpus without a tokenizer (MQAR)."""
    from ..tokenizer import load_tokenizer, padded_vocab

    return padded_vocab(load_tokenizer(spec).vocab_size)


def stack_kwargs(attention, group, layer_kwargs):
    """``model.attention_kwargs`` (conf/model/small.yaml) for ``model.attention``: for the attention group's own name
    its ``attention.kwargs`` (the uniform stack ``attention=X`` builds); for another name, or a list (a hybrid stack),
    each name's ``layer_kwargs.NAME``, resolved, keyed by name for a list. Unknown names are left out: GPTConfig
    names them in its error."""
    if isinstance(attention, str):
        return group.kwargs if attention == group.name else layer_kwargs.get(attention, OmegaConf.create({}))
    names = dict.fromkeys(name for name in attention if isinstance(name, str) and name in layer_kwargs)
    # a config node, not a dict: OmegaConf.resolve (as instantiate calls it) can put only a node in its place
    return OmegaConf.create({name: OmegaConf.to_container(layer_kwargs[name], resolve=True) for name in names})


def _layers(attention, n_layer) -> list[str]:
    """model.attention as one name per layer, where it is a name or a list whose length divides n_layer; as it is
    otherwise (GPTConfig then says what is wrong)."""
    names = [attention] if isinstance(attention, str) else [str(name) for name in attention]
    if names and isinstance(n_layer, int) and n_layer > 0 and n_layer % len(names) == 0:
        names *= n_layer // len(names)
    return names


def stack_label(attention, n_layer) -> str:
    """``${stack_label:${model.attention},${model.n_layer}}``: the stack's short readable name (``ovq``,
    ``ovq×3+softmax``: :func:`vqattn.model.stack_name`), which results.json, the report and W&B name runs by."""
    from ..model import stack_name

    return stack_name(_layers(attention, n_layer))


def stack_dir(attention, n_layer) -> str:
    """``${stack_dir:...}``: the stack's name in ASCII (``ovqx3+softmax``), the suffix of its run dir."""
    from ..model import stack_name

    return stack_name(_layers(attention, n_layer), ascii=True)


def register() -> None:
    """Store the schema nodes and the attention options, and the resolvers ``tokenizer_vocab``, ``stack_kwargs``,
    ``stack_label`` and ``stack_dir`` (idempotent: a second call stores the same nodes)."""
    import lightning

    from ..layers import ATTENTIONS, Attention
    from ..model import GPTConfig
    from .lit import OptimConfig

    OmegaConf.register_new_resolver("tokenizer_vocab", tokenizer_vocab, use_cache=True, replace=True)
    for name, resolver in (("stack_kwargs", stack_kwargs), ("stack_label", stack_label), ("stack_dir", stack_dir)):
        OmegaConf.register_new_resolver(name, resolver, replace=True)
    cs = ConfigStore.instance()
    cs.store(group="schema", name="model", node=_dataclass_defaults(GPTConfig))
    cs.store(group="schema", name="optim", node=_dataclass_defaults(OptimConfig))
    cs.store(group="schema", name="trainer",
             node={"_target_": "lightning.Trainer", **signature_defaults(lightning.Trainer)})
    for name, cls in data_classes().items():
        cs.store(group="schema/data", name=name,
                 node={"_target_": f"{cls.__module__}.{cls.__qualname__}", **signature_defaults(cls)})
    layer_kwargs = {}  # every attention's kwargs, for the layers of a hybrid stack
    for name, cls in ATTENTIONS.items():
        kwargs = signature_defaults(cls, stop=Attention)
        if "block_len" in kwargs:  # the root key block_len (conf/config.yaml) sets every attention that has one
            kwargs["block_len"] = "${block_len}"
        if "memory_cap" in kwargs:  # the compressed memory weighs at most as many keys as the raw window holds
            kwargs["memory_cap"] = "${memory_cap}"
        if "memory_decay" in kwargs:  # the online memory's forgetting, which training with carried state sets
            kwargs["memory_decay"] = "${memory_decay}"
        cs.store(group="attention", name=name, node={"name": name, "kwargs": kwargs})
        layer_kwargs[name] = kwargs
    cs.store(group="schema", name="layer_kwargs", node=layer_kwargs)
