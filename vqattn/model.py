"""A small decoder-only language model (nanoGPT-style) whose attention is picked by name.

    tokens -> embedding (+ learned positions) -> n_layer x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> logits

Pre-norm RMSNorm blocks, a GELU MLP and optionally tied input/output embeddings. ``forward`` returns the
NLL loss and the summed auxiliary (commitment) loss separately, so the trainer decides how to mix them.
``forward_step`` decodes incrementally with a per-layer recurrent state (a KV cache for softmax, the
constant-size codebook or feature-map state for the others); ``generate`` samples with it.

The layers may differ (a hybrid stack, as Qwen3-Next's 3 linear : 1 softmax): ``GPTConfig.attention`` takes one name
per layer, or a shorter pattern repeated over the depth, and ``attention_kwargs`` is then keyed by attention name.
Each layer keeps its own state (a KV cache beside O(1) states) and packs documents its own way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import ATTENTIONS, AttentionState, build_attention
from .ops.blocks import DEFAULT_BLOCK_LEN, resolve_block_len
from .ops.utils import check_choice, check_positive_int, compute_dtype
from .ops.varlen import Packing, Segments, check_state_list, resolve_call

IGNORE_INDEX = -1  # the target value the loss and every metric skip (unlabelled positions)

POS_EMBS = ("rope", "learned", "none")


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256  # training context; a hard limit only for pos_emb="learned"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    tie_embeddings: bool = True
    # every layer's attention; or a list: one name per layer, or a pattern repeated over n_layer ([ovq, ovq, ovq,
    # softmax] with n_layer=8 is 3:1 twice)
    attention: str | list[str] = "vq_soft"
    # extra constructor kwargs of the attention layers; for a list of several attentions keyed by attention name
    # ({"ovq": {"num_slots": 32}, "softmax": {}}: each applies to every layer of that name; a name left out: defaults)
    attention_kwargs: dict = field(default_factory=dict)
    pos_emb: str = "rope"  # "rope" (inside the attention), "learned" (absolute, added to embeddings), "none"
    qk_norm: bool | str = False  # False, True (RMSNorm) or "l2" (unit q and k, learned scale): see layers.base
    short_conv: int = 0  # kernel size of the attention layers' short convolution over q/k/v (0 = none)
    mlp_ratio: int = 4

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            check_positive_int(name, getattr(self, name))
        check_choice("pos_emb", self.pos_emb, POS_EMBS)
        self._check_attention()
        self._check_attention_kwargs()
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def _check_attention(self) -> None:
        valid = ", ".join(sorted(ATTENTIONS))
        if isinstance(self.attention, str):
            if self.attention not in ATTENTIONS:
                raise ValueError(f"unknown attention {self.attention!r}; valid names are: {valid}")
            return
        if not isinstance(self.attention, Sequence) or not self.attention:
            raise ValueError(f"attention must be an attention name or a non-empty list of them (one per layer, or a "
                             f"pattern repeated over the n_layer layers), got {self.attention!r}")
        self.attention = list(self.attention)  # a tuple or an OmegaConf list: configs compare and save as lists
        for i, name in enumerate(self.attention):
            if not isinstance(name, str) or name not in ATTENTIONS:
                raise ValueError(f"attention lists an unknown attention {name!r} (entry {i}); valid names are: {valid}")
        if self.n_layer % len(self.attention):
            divisors = [str(d) for d in range(1, self.n_layer + 1) if self.n_layer % d == 0]
            lengths = " or ".join([", ".join(divisors[:-1]), divisors[-1]] if len(divisors) > 1 else divisors)
            raise ValueError(f"attention lists {len(self.attention)} attentions, which does not divide "
                             f"n_layer={self.n_layer}: list {lengths} attentions (one per layer, or a pattern repeated over "
                             f"the depth)")

    def _keyed_kwargs(self) -> bool:
        """Whether attention_kwargs is keyed by attention name (every key a registered attention), not the kwargs
        of one attention (no layer takes a kwarg named like an attention)."""
        kwargs = self.attention_kwargs
        return bool(kwargs) and all(isinstance(key, str) and key in ATTENTIONS for key in kwargs)

    def _check_attention_kwargs(self) -> None:
        kwargs = self.attention_kwargs
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"attention_kwargs must be a dict, got {type(kwargs).__name__}")
        names = sorted(set(self.layer_attentions))
        if self._keyed_kwargs():
            for name, value in kwargs.items():
                if name not in names:
                    raise ValueError(f"attention_kwargs has kwargs for {name!r}, but no layer is {name}; the "
                                     f"layers' attentions: {', '.join(names)}")
                if not isinstance(value, Mapping):
                    raise ValueError(f"attention_kwargs[{name!r}] must be a dict of {name}'s kwargs, got {value!r}")
        elif kwargs and len(names) > 1:
            raise ValueError(f"attention_kwargs of a stack of several attentions ({', '.join(names)}) must be keyed "
                             f"by attention name, e.g. {{{names[0]!r}: {{...}}}}; got the keys {', '.join(kwargs)}")

    @property
    def layer_attentions(self) -> list[str]:
        """Each layer's attention name (n_layer of them): the name, or the list repeated over the depth."""
        if isinstance(self.attention, str):
            return [self.attention] * self.n_layer
        return list(self.attention) * (self.n_layer // len(self.attention))

    def layer_kwargs(self, name: str) -> dict:
        """The extra constructor kwargs of the layers of attention ``name``."""
        if self._keyed_kwargs():
            return dict(self.attention_kwargs.get(name, {}))
        return dict(self.attention_kwargs)

    @property
    def stack_name(self) -> str:
        """The stack in a short readable form (:func:`stack_name`): ``ovq`` for every layer ovq, ``ovq×3+softmax``
        for three ovq layers then a softmax one, ``(ovq×3+softmax)×2`` for that pattern twice."""
        return stack_name(self.layer_attentions)


def stack_name(layers: Sequence[str], ascii: bool = False) -> str:
    """Per-layer attention names in a short readable form: the shortest pattern whose repetition gives them, its runs
    of one name as ``name×count`` joined by ``+``, and ``(pattern)×repeats`` when it repeats: ``ovq`` (every layer
    alike), ``ovq×3+softmax``, ``(ovq×3+softmax)×2``. ``ascii``: the same with ``x`` for ``×`` and ``_x2`` for a
    repeat (``ovqx3+softmax_x2``), for a directory name."""
    layers, times = list(layers), "x" if ascii else "×"
    n = len(layers)
    period = next(p for p in range(1, n + 1) if n % p == 0 and layers == layers[:p] * (n // p)) if n else 0
    runs: list[list] = []
    for name in layers[:period]:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    if len(runs) <= 1:
        return runs[0][0] if runs else ""
    body = "+".join(name if count == 1 else f"{name}{times}{count}" for name, count in runs)
    repeats = n // period
    if repeats == 1:
        return body
    return f"{body}_x{repeats}" if ascii else f"({body})×{repeats}"


@dataclass
class GPTState:
    """Recurrent state after ``pos`` tokens: one AttentionState per layer."""

    pos: int
    layers: list[AttentionState]

    def detached(self, max_cache: int | None = None) -> GPTState:
        """The state without autograd history, to carry into the next training segment (Transformer-XL style).

        ``max_cache`` keeps only the newest keys of growing KV caches (softmax, kernel smoothers): their memory.
        The vq and kernel-family states have a constant size and are carried whole.
        """
        return GPTState(self.pos, [layer.detached(max_cache) for layer in self.layers])


class GPTOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, vocab_size)
    loss: torch.Tensor | None  # mean next-token cross-entropy (nats) when targets are given
    aux_loss: torch.Tensor  # scalar: sum of the attention layers' auxiliary losses
    state: GPTState | None = None  # the state after idx, when forward was called with return_state=True


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.n_embd)
        name = config.layer_attentions[layer_idx]
        kwargs = config.layer_kwargs(name)
        try:
            self.attn = build_attention(
                name,
                dim=config.n_embd,
                num_heads=config.n_head,
                bias=config.bias,
                dropout=config.dropout,
                qk_norm=config.qk_norm,
                short_conv=config.short_conv,
                rope=config.pos_emb == "rope",
                layer_idx=layer_idx,
                **kwargs,
            )
        except ValueError as err:  # a keyed kwarg's error names its key as it is written: attention_kwargs.ovq.KEY
            if config._keyed_kwargs() and str(err).split(" ", 1)[0] in kwargs:
                raise ValueError(f"attention_kwargs.{name}.{err}") from None
            raise
        self.norm2 = nn.RMSNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, state: AttentionState | None = None, return_state: bool = False, cu_seqlens=None):
        """x (B, T, C) -> (x (B, T, C), aux_loss scalar, state after x or None)."""
        h, aux_loss, state = self.attn(self.norm1(x), state, return_state, cu_seqlens=cu_seqlens)
        x = x + h
        x = x + self.mlp(self.norm2(x))
        return x, aux_loss, state


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.seq_len, config.n_embd) if config.pos_emb == "learned" else None
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def block_lens(self) -> tuple[int, ...]:
        """The block lengths of the layers that run blocks (vq, ovq, window): the layouts that
        :meth:`~vqattn.ops.varlen.Packing.segments` forms for a packed call."""
        lens = {resolve_block_len(getattr(block.attn, "block_len", None)) for block in self.blocks
                if hasattr(block.attn, "block_len")}
        return tuple(sorted(lens)) or (DEFAULT_BLOCK_LEN,)

    def num_params(self) -> int:
        """Number of distinct parameters (tied embeddings count once)."""
        return sum(p.numel() for p in self.parameters())

    def _check_idx(self, name: str, idx: torch.Tensor, start: int) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
            shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            dtype = idx.dtype if isinstance(idx, torch.Tensor) else None
            raise ValueError(f"{name} must be a (B, T) torch.long tensor of token ids, got {shape} {dtype}")
        if idx.shape[1] == 0:
            raise ValueError(f"{name} must hold at least one token (T >= 1)")
        in_range = ((idx >= 0) & (idx < self.config.vocab_size)).all()
        if self.training or torch.compiler.is_compiling():
            # A Python-side check would synchronise the GPU on every training step (and break a compiled graph);
            # this assert runs on the device.
            torch._assert_async(in_range, f"{name} token ids must lie in [0, {self.config.vocab_size})")
        elif not in_range:
            raise ValueError(f"{name} token ids must lie in [0, {self.config.vocab_size}), got range "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        end = start + idx.shape[1]
        if self.pos_emb is not None and end > self.config.seq_len:
            raise ValueError(
                f"sequence reaches length {end} but config.seq_len={self.config.seq_len}: learned absolute positions "
                f"exist only for positions 0..{self.config.seq_len - 1}. Use at most seq_len tokens, raise seq_len "
                f"(and retrain), or use pos_emb='rope' or 'none', which accept any length."
            )

    def _body(self, idx: torch.Tensor, start: int, states: list[AttentionState | None] | None, cu_seqlens=None,
              positions: torch.Tensor | None = None):
        """Token ids (B, T) at positions start.. -> final hidden states (B, T, C), the summed auxiliary loss and
        the new layer states (when ``states`` is given: one per layer, None = fresh start). With ``cu_seqlens``
        (packed sequences, no states) each sequence's positions start at 0."""
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:
            pos = torch.arange(start, start + idx.shape[1], device=idx.device) if positions is None else positions
            x = x + self.pos_emb(pos)
        x = self.dropout(x)
        aux_losses, new_states = [], []
        for i, block in enumerate(self.blocks):
            x, aux_loss, state = block(x, None if states is None else states[i], return_state=states is not None,
                                       cu_seqlens=cu_seqlens)
            aux_losses.append(aux_loss)
            new_states.append(state)
        return self.norm(x), torch.stack(aux_losses).sum(), new_states

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        state: GPTState | None = None,
        return_state: bool = False,
        cu_seqlens: torch.Tensor | Packing | Segments | None = None,
    ) -> GPTOutput:
        """idx, targets: (B, T) token ids. loss is the mean NLL; aux_loss is returned separately.

        ``state`` (from an earlier call with ``return_state=True``) makes idx continue the tokens it summarises;
        with ``return_state`` the output carries the state after idx. Training on consecutive segments with a
        carried state passes ``out.state.detached()`` to the next step.

        ``cu_seqlens`` (int32 (N+1,), flash-attn's convention, with B = 1): idx packs N sequences (documents)
        along T, and no token sees another sequence; positions restart at each (:mod:`vqattn.ops.varlen`). The
        loss is the mean over all tokens, as unpacked. ``state`` is then a list of N GPTStates (None entries start
        fresh) and the output's state such a list. The boundaries are read on the host once per call (never per
        layer); a :class:`~vqattn.ops.varlen.Packing` built where they are known (a data loader) is not read at all,
        and :class:`~vqattn.ops.varlen.Segments` (``packing.segments(model.block_lens())``, the boundaries as tensors)
        run the packed call in a form ``torch.compile`` traces whole (no states).
        """
        if cu_seqlens is not None and not isinstance(cu_seqlens, Segments):
            self._check_idx("idx", idx, 0)
        call = resolve_call(cu_seqlens, batch=idx.shape[0], length=idx.shape[1], state=state,
                            return_state=return_state, device=idx.device)
        if call.each is not None:
            return self._per_sequence(idx, targets, call.each, state, return_state)
        if state is not None and not isinstance(state, GPTState):
            raise ValueError(f"state must be a GPTState or None, got {type(state).__name__}")
        start = 0 if state is None else state.pos
        self._check_idx("idx", idx, start)
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape != idx.shape):
            shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {shape}")
        layer_states = None
        if state is not None or return_state:
            layer_states = [None] * len(self.blocks) if state is None else state.layers
        h, aux_loss, layer_states = self._body(idx, start, layer_states, call.boundaries, call.positions)
        logits = self.head(h)  # (B, T, V)
        loss = None if targets is None else self._loss(logits, targets)
        new_state = GPTState(start + idx.shape[1], layer_states) if return_state else None
        return GPTOutput(logits, loss, aux_loss, new_state)

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).to(compute_dtype(logits.dtype)), targets.flatten(),
                               ignore_index=IGNORE_INDEX)

    def _per_sequence(self, idx, targets, bounds: tuple[int, ...], state, return_state: bool) -> GPTOutput:
        """A packed call with states: each sequence alone with its own state (their positions differ)."""
        check_state_list(state, bounds, "GPTStates")
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape != idx.shape):
            self.forward(idx, targets)  # raises the ValueError about targets
        parts = [self(idx[:, a:b], state=None if state is None else state[i], return_state=return_state)
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        logits = torch.cat([p.logits for p in parts], 1)
        aux = sum(p.aux_loss * (b - a) for p, a, b in zip(parts, bounds, bounds[1:])) / bounds[-1]
        return GPTOutput(logits, None if targets is None else self._loss(logits, targets), aux,
                         [p.state for p in parts] if return_state else None)

    def forward_step(self, idx: torch.Tensor, state: GPTState | None = None) -> tuple[torch.Tensor, GPTState]:
        """Decode a chunk: idx (B, T) follows the tokens summarised by ``state`` (None: start of sequence).

        Returns logits (B, T, V), equal to the matching rows of ``forward`` on the whole sequence, and the
        state after the chunk. Use it for prefill (the prompt) and then for single tokens; after
        :meth:`compile_step` the single tokens run compiled.
        """
        if self._compiled_step is not None and state is not None and idx.shape[1] == 1:
            return self._compiled_step(idx, state)
        return self._step(idx, state)

    def _step(self, idx: torch.Tensor, state: GPTState | None) -> tuple[torch.Tensor, GPTState]:
        out = self(idx, state=state, return_state=True)
        return out.logits, out.state

    _compiled_step = None  # set by compile_step

    def compile_step(self, **options) -> GPT:
        """Compile the one-token decoding step, in place, and return the model.

        From then on ``forward_step`` of one token (B, 1) after a state, which is every token ``generate`` samples
        after the prompt, runs under ``torch.compile(dynamic=True, **options)``; the prefill of a prompt stays
        eager. Dynamic shapes make the position, the KV cache's length and the raw window's length symbolic, so a
        few graphs, one per branch of the step (e.g. whether it folds a block into the cache), serve every prompt
        length and position: nothing recompiles for a new prompt. (``torch.compile(model)`` compiles ``forward``
        only: its ``generate`` runs eager; a model compiled in place by ``model.compile()`` also compiles its
        prefill, again for new prompt lengths.)
        """
        step = torch.compile(self._step, **{"dynamic": True, **options})
        # Floats stay constants (a layer's temperature or threshold): symbolic ones break the graph at every check
        self._compiled_step = torch._dynamo.config.patch(specialize_float=True)(step)
        return self

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt idx (B, T); returns (B, T + max_new_tokens).

        The prompt is consumed once (prefill) and every new token costs one ``forward_step``: constant time
        and memory per token for vq and the kernel family, a growing KV cache for softmax.
        ``temperature=0`` picks the most likely token (greedy). Runs in eval mode (no dropout, no codebook
        updates) and restores the previous mode.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {temperature!r}")
        if top_k is not None:
            check_positive_int("top_k", top_k)
        self._check_idx("idx", idx, 0)
        if self.pos_emb is not None and idx.shape[1] + max_new_tokens > self.config.seq_len:
            raise ValueError(
                f"prompt length {idx.shape[1]} + max_new_tokens {max_new_tokens} exceeds config.seq_len="
                f"{self.config.seq_len}, the last position learned absolute positions can encode; use a shorter "
                f"prompt/continuation or a model with pos_emb='rope' or 'none'"
            )
        was_training = self.training
        self.eval()
        try:
            out, step_in, state = idx, idx, None
            for _ in range(max_new_tokens):
                logits, state = self.forward_step(step_in, state)
                step_in = self._sample(logits[:, -1, :].float(), temperature, top_k)  # (B, 1)
                out = torch.cat((out, step_in), dim=1)
            return out
        finally:
            self.train(was_training)

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
        """logits (B, V) -> next token ids (B, 1)."""
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)

    def layer_state_floats(self, seq_len: int | None = None) -> list[int]:
        """Numbers in each layer's decoding state after ``seq_len`` tokens (default: config.seq_len)."""
        seq_len = self.config.seq_len if seq_len is None else seq_len
        return [block.attn.state_floats(seq_len) for block in self.blocks]

    def state_floats(self, seq_len: int | None = None, *, total: bool = False) -> int:
        """Numbers in one layer's decoding state after ``seq_len`` tokens (default: config.seq_len): the memory that
        recall must fit through, which runs compare per layer (as Zoology does). For a hybrid stack, the layers'
        mean: their sum (:meth:`layer_state_floats`) over n_layer, rounded. ``total``: summed layer by layer, the
        whole model's decoding state."""
        floats = self.layer_state_floats(seq_len)
        return sum(floats) if total else round(sum(floats) / len(floats))

    def codebook_stats(self) -> dict[str, float]:
        """Codebook usage statistics averaged over the vq layers ({} when there are none)."""
        per_layer = [s for s in (block.attn.usage_stats() for block in self.blocks) if s]
        if not per_layer:
            return {}
        return {key: sum(s[key] for s in per_layer) / len(per_layer) for key in per_layer[0]}
