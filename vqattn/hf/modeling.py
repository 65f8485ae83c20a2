"""``VQAttnForCausalLM``: :class:`vqattn.model.GPT` as a transformers causal LM, with its recurrent state as
the generation cache.

The wrapped model is the project's own GPT (``self.model``), unchanged: its parameter names are prefixed by
``model.`` and transformers' weight tie is GPT's (``head.weight`` is ``tok_emb.weight``). ``forward`` is
GPT's forward; with a :class:`VQAttnCache` it continues the tokens the cache summarises, exactly as
``GPT.forward(idx, state=..., return_state=True)`` does. The cache holds a :class:`vqattn.model.GPTState`: a KV
cache for softmax, the constant-size codebook / slot / feature-map sums for the others, so each generated token
costs O(1) time and memory for those (O(t) for softmax).

Padding: a batch with an ``attention_mask`` that pads rows on the left or the right (``generate`` on prompts of
different lengths, lm-eval at a batch size above 1) runs as flash-linear-attention's layers run it: the pads are
removed, the rows run as packed sequences (``cu_seqlens``, :mod:`vqattn.ops.varlen`), and the outputs are padded
back: left pads get zero logits, right pads repeat their row's last real logits (generate reads every row's next
token from the last column, so right-padded prompts generate correctly too). Each row then is exactly the row
alone: positions start at its first real token. The cache then holds one state per row. A mask with a hole inside
a row, or a row without tokens, is a ValueError.
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

    def __init__(self, state: GPTState | list[GPTState] | None = None):
        super().__init__(layers=[])  # the per-layer states live in ``state``, not in transformers' layer objects
        self.state = state
        # tokens fed per row, pads included: the length generate's positions and masks count
        self.length = 0 if state is None else max(s.pos for s in state) if isinstance(state, list) else state.pos

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def per_row(self) -> bool:
        """Whether the cache holds one GPTState per row (after a padded batch), not one for the batch."""
        return isinstance(self.state, list)

    @property
    def batch_size(self) -> int:
        if self.state is None:
            return -1
        if self.per_row:
            return len(self.state)
        found = []
        map_tensors(self.state, lambda t: found.append(t.shape[0]) or t)
        return found[0] if found else -1

    def rows(self) -> list[GPTState | None]:
        """One state per row: the per-row states, or the batch's state split by row."""
        if self.per_row:
            return self.state
        if self.state is None:
            return None
        return [map_tensors(self.state, lambda t, i=i: t[i:i + 1]) for i in range(self.batch_size)]

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a vqattn cache cannot be cropped: its compressed states do not forget tokens")

    def reset(self) -> None:
        self.state = None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], rows: Callable[[list], list]) -> None:
        """fn on every tensor of a batch state (rows on dim 0); rows() on the list of a per-row one."""
        if self.per_row:
            self.state = rows(self.state)
        elif self.state is not None:
            self.state = map_tensors(self.state, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)), lambda s: [s[i] for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices], lambda s: [s[i] for i in torch.arange(len(s))[indices.cpu()].tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0), lambda s: [x for x in s for _ in range(repeats)])


def real_tokens(attention_mask: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """The (B, T) bool mask of input_ids' real tokens (the last T columns of ``attention_mask``, which covers the
    cached tokens too), or None when every token is real; ValueError for a mask with a hole inside a row (a pad
    between real tokens) or a row without a token."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != shape[0] or attention_mask.shape[1] < shape[1]:
        raise ValueError(f"attention_mask must be (B, T') with B = {shape[0]} and T' >= {shape[1]} (the cached "
                         f"tokens and input_ids), got {tuple(attention_mask.shape)}")
    mask = attention_mask[:, -shape[1]:].bool()
    if bool(mask.all()):
        return None
    ones = mask.int()
    runs = (ones[:, 1:] > ones[:, :-1]).sum(1) + ones[:, 0]  # runs of real tokens per row
    if bool((runs != 1).any()):
        row = int((runs != 1).nonzero()[0])
        what = "no token" if int(runs[row]) == 0 else "a pad between real tokens"
        raise ValueError(f"attention_mask row {row} has {what}: rows may be padded on the left or the right only, "
                         "around at least one real token")
    return mask


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
        mask = real_tokens(attention_mask, input_ids.shape)
        if mask is not None or cache is not None and cache.per_row:
            logits = self._unpadded(input_ids, mask, cache)
        elif cache is None:
            logits = self.model(input_ids).logits
        else:
            out = self.model(input_ids, state=cache.state, return_state=True)
            logits, cache.state = out.logits, out.state
        if cache is not None:
            cache.length += input_ids.shape[1]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=HF_IGNORE_INDEX)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def _unpadded(self, input_ids: torch.Tensor, mask: torch.Tensor | None, cache: VQAttnCache | None):
        """Logits (B, T, V) of a padded batch: its real tokens packed into one row of sequences (one per row),
        run with cu_seqlens (and the cache's per-row states), scattered back; zeros at left pads, the row's last
        real token's logits at right pads."""
        mask = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask
        lengths = mask.sum(1)
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        packed = input_ids[mask][None]  # (1, N): row 0's real tokens, then row 1's, ...
        if cache is None:
            out = self.model(packed, cu_seqlens=cu_seqlens).logits
        else:
            result = self.model(packed, cu_seqlens=cu_seqlens, state=cache.rows(), return_state=True)
            out, cache.state = result.logits, result.state
        logits = out.new_zeros(*input_ids.shape, out.shape[-1])
        logits[mask] = out[0]
        # right pads repeat their row's last logits: generate reads the last column for every row's next token
        cols = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(mask, cols, -1).max(1, keepdim=True).values  # (B, 1)
        source = torch.minimum(cols[None], last)  # (B, T)
        return logits.gather(1, source[..., None].expand_as(logits))
