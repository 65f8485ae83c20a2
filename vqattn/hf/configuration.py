"""``VQAttnConfig``: the Hugging Face configuration of a :class:`vqattn.model.GPT`.

Its fields are :class:`vqattn.model.GPTConfig`'s, under the same names, except that the embedding tie is
transformers' own ``tie_word_embeddings`` (also readable as ``tie_embeddings``), so that transformers ties (and
saves once) exactly the weights GPT ties. ``max_position_embeddings`` reads ``seq_len``: tools that size their
windows by it (lm-evaluation-harness's rolling log-likelihood) then score windows of the training context.
``extra_states`` carries the model's non-tensor module state (Performer feature draws).

A hybrid stack's ``attention`` is saved one name per layer (a pattern given to GPTConfig is written out over the
depth), and ``layer_types`` says per layer what kind of attention it is in transformers' terms (as Qwen3-Next's
config does): ``full_attention`` for a layer whose state is a KV cache of every token (softmax, the kernel
smoothers), ``sliding_attention`` for the raw window, ``linear_attention`` for a constant-size state (the codebook,
ovq and feature-map layers, and any other registered layer). It is derived from ``attention`` whenever the config is
built, so a config read back always agrees with the model it builds.
"""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedConfig

from ..model import GPTConfig

_DEFAULTS = GPTConfig()


def layer_type(attention: str) -> str:
    """The kind of a registered attention in transformers' ``layer_types`` terms (allowed names of
    ``transformers.configuration_utils.ALLOWED_ATTN_LAYER_TYPES``), by what its decoding state holds."""
    from ..layers import ATTENTIONS, CachedAttention, WindowAttention

    cls = ATTENTIONS[attention]
    if issubclass(cls, CachedAttention):
        return "full_attention"
    return "sliding_attention" if issubclass(cls, WindowAttention) else "linear_attention"


class VQAttnConfig(PreTrainedConfig):
    model_type = "vqattn"
    attribute_map = {
        "tie_embeddings": "tie_word_embeddings",
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "seq_len",
    }

    vocab_size: int = _DEFAULTS.vocab_size
    seq_len: int = _DEFAULTS.seq_len
    n_layer: int = _DEFAULTS.n_layer
    n_head: int = _DEFAULTS.n_head
    n_embd: int = _DEFAULTS.n_embd
    dropout: float = _DEFAULTS.dropout
    bias: bool = _DEFAULTS.bias
    tie_word_embeddings: bool = _DEFAULTS.tie_embeddings
    attention: str | list = _DEFAULTS.attention
    layer_types: list | None = None  # derived from attention: see the module docstring
    attention_kwargs: dict = dataclasses.field(default_factory=dict)
    pos_emb: str = _DEFAULTS.pos_emb
    qk_norm: bool | str = _DEFAULTS.qk_norm
    short_conv: int = _DEFAULTS.short_conv
    mlp_ratio: int = _DEFAULTS.mlp_ratio
    use_cache: bool = True
    # {submodule of GPT: its get_extra_state()}, e.g. a Performer feature map's draw index: plain values that
    # safetensors files cannot hold, so they travel in config.json (written by VQAttnForCausalLM.save_pretrained)
    extra_states: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        gpt = self.gpt_config()  # a one-line ValueError now (unknown attention, bad sizes), not at model construction
        if not isinstance(self.attention, str):
            self.attention = gpt.layer_attentions
        self.layer_types = [layer_type(name) for name in gpt.layer_attentions]

    def gpt_config(self) -> GPTConfig:
        """The :class:`GPTConfig` these fields describe (ValueError when they describe none)."""
        names = [f.name for f in dataclasses.fields(GPTConfig)]
        return GPTConfig(**{name: getattr(self, name) for name in names})

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' from_dict, refusing another model's config (transformers only warns, then fails later on
        missing weights or builds a wrong model)."""
        model_type = config_dict.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"this config is of model_type {model_type!r}, not {cls.model_type!r}: a vqattn class cannot "
                             f"load it (use AutoModelForCausalLM / AutoConfig, which pick the class by model_type)")
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_gpt_config(cls, config: GPTConfig, **kwargs) -> VQAttnConfig:
        return cls(**dataclasses.asdict(config), **kwargs)
