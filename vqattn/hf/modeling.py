"""``VQAttnForCausalLM``: :class:`vqattn.model.GPT` as a transformers causal LM, with its recurrent state as
the generation cache.

The wrapped model is the project's own GPT (``self.model``), unchanged: its parameter names are prefixed by
``model.`` and transformers' weight tie is GPT's (``head.weight`` is ``tok_emb.weight``). ``forward`` is
GPT's forward; with a :class:`VQAttnCache` it continues the tokens the cache summarises, exactly as
``GPT.forward(idx, state=..., return_state=True)`` does. The cache holds a :class:`vqattn.model.GPTState`: a KV
cache for softmax, the constant-size codebook / slot / feature-map sums for the others, so each generated token
costs O(1) time and memory for those (O(t) for softmax).

Padding: the layers have no padding mask (a recurrent state summarises every token it was fed), so an
``attention_mask`` may only mark right padding, and only in a forward without a cache (a causal model's outputs
at real tokens never see the padding after them). Anything else is a ValueError.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import Cache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..model import GPT, GPTState
from .configuration import VQAttnConfig

HF_IGNORE_INDEX = -100  # transformers' label for positions without a loss


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` (a GPTState, or any nesting of lists, NamedTuples and dataclasses) with ``fn`` applied to every
    tensor in it; the other fields (lengths, block sizes) are kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(x, fn) for x in obj]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


class VQAttnCache(Cache):
    """The generation cache of a VQAttnForCausalLM: one :class:`GPTState` (None before the first token).

    Every tensor of the state has the batch as its first dimension, so beam search's reordering and the
    expansion for several sequences per prompt are index operations on dim 0. The state cannot be cropped
    (a codebook sum does not forget), so assisted decoding, which rolls back rejected tokens, is unsupported.
    """

    def __init__(self, state: GPTState | None = None):
        super().__init__(layers=[])  # the per-layer states live in ``state``, not in transformers' layer objects
        self.state = state

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.state is None else self.state.pos

    @property
    def batch_size(self) -> int:
        if self.state is None:
            return -1
        found = []
        map_tensors(self.state, lambda t: found.append(t.shape[0]) or t)
        return found[0] if found else -1

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a vqattn cache cannot be cropped: its compressed states do not forget tokens")

    def reset(self) -> None:
        self.state = None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.state is not None:
            self.state = map_tensors(self.state, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))


def check_attention_mask(attention_mask: torch.Tensor | None, cached: bool) -> None:
    """ValueError unless ``attention_mask`` (B, T) is all ones, or marks right padding in a forward without a
    cache."""
    if attention_mask is None or bool(attention_mask.all()):
        return
    mask = attention_mask.bool()
    right_padded = bool((mask.cummin(dim=1).values == mask).all())  # no real token after a padded one
    if cached or not right_padded:
        raise ValueError(
            "attention_mask with padding is unsupported by vqattn models (their recurrent states summarise every "
            "token fed, with no padding mask): allowed are an all-ones attention_mask, or right padding in a "
            "forward without a cache; generate with unpadded prompts, one prompt length per batch"
        )


class VQAttnPreTrainedModel(PreTrainedModel):
    config_class = VQAttnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def _init_weights(self, module):
        """GPT initialises its own weights (GPT-2 scheme) when it is built, so there is nothing to draw here. But
        from_pretrained replaces every non-persistent buffer (Performer's features, usage statistics: in no
        checkpoint) by an empty tensor and calls this to refill it: with the values GPT built them with."""
        for name, value in self._built_buffers.get(module, {}).items():
            getattr(module, name).copy_(value)


class VQAttnForCausalLM(VQAttnPreTrainedModel, GenerationMixin):
    """A :class:`vqattn.model.GPT` (``self.model``) behind transformers' causal-LM interface.

    ``forward(input_ids (B, T), cache=None, use_cache=None, labels=None)`` returns logits (B, T, V), the loss
    (mean next-token cross-entropy in nats over labels != -100, labels shifted inside as transformers does) and,
    with a cache or ``use_cache=True``, the cache after input_ids.
    """

    _tied_weights_keys = {"model.head.weight": "model.tok_emb.weight"}

    def __init__(self, config: VQAttnConfig):
        super().__init__(config)
        # from_pretrained builds models on the meta device and then loads the saved tensors; GPT's layers compute
        # tables and non-persistent buffers (Performer's features, RoPE split points) while they are built, which
        # a meta tensor cannot, and which no checkpoint holds. So GPT is built on a real device.
        device = torch.get_default_device()
        with torch.device("cpu" if device.type == "meta" else device):
            self.model = GPT(config.gpt_config())
            for name, state in config.extra_states.items():
                self.model.get_submodule(name).set_extra_state(state)
        self._built_buffers = {  # {module: {name: value}} of GPT's non-persistent buffers, for _init_weights
            module: {name: getattr(module, name).clone() for name in module._non_persistent_buffers_set}
            for module in self.model.modules() if module._non_persistent_buffers_set
        }
        self.post_init()

    def _extra_states(self) -> dict:
        """{submodule name: get_extra_state()} over GPT's modules that define one (Performer feature maps)."""
        return {name: module.get_extra_state() for name, module in self.model.named_modules()
                if type(module).get_extra_state is not torch.nn.Module.get_extra_state}

    def state_dict(self, *args, **kwargs):
        """The tensors of the model's state dict: the non-tensor extra states (a feature map's draw index) go to
        ``config.extra_states``, as safetensors and transformers' loader hold and count tensors only."""
        state = super().state_dict(*args, **kwargs)
        for key in [key for key, value in state.items() if not isinstance(value, torch.Tensor)]:
            del state[key]
        return state

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, after recording the modules' extra states in the config."""
        self.config.extra_states = self._extra_states()
        return super().save_pretrained(save_directory, *args, **kwargs)

    def get_input_embeddings(self):
        return self.model.tok_emb

    def set_input_embeddings(self, value):
        self.model.tok_emb = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value):
        self.model.head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate gets its VQAttnCache from the first forward (use_cache=True), as for Mamba

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: VQAttnCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        **kwargs,  # position_ids and the like from generic callers: positions come from the cache
    ) -> CausalLMOutputWithPast:
        if cache is not None and not isinstance(cache, VQAttnCache):
            raise ValueError(f"cache must be a VQAttnCache, got {type(cache).__name__}")
        if cache is None and use_cache:
            cache = VQAttnCache()
        check_attention_mask(attention_mask, cached=cache is not None and cache.state is not None)
        if cache is None:
            logits = self.model(input_ids).logits
        else:
            out = self.model(input_ids, state=cache.state, return_state=True)
            logits, cache.state = out.logits, out.state
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=HF_IGNORE_INDEX)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
