"""Stateful decoding: prefill + token-by-token steps reproduce the full forward pass, for every attention."""

from __future__ import annotations

import pytest
import torch

from model_helpers import COMBINATIONS, NAMES, decode_in_chunks, scramble_short_conv, tiny_model

T = 13  # not a multiple of the block / chunk length 4


@pytest.mark.parametrize("name,pos_emb", COMBINATIONS)
@pytest.mark.parametrize("prompt_len", [1, 6])
def test_prefill_then_single_steps_match_forward(name, pos_emb, prompt_len):
    torch.manual_seed(0)
    model = tiny_model(name, pos_emb)
    idx = torch.randint(0, 17, (2, T))
    full = model(idx).logits
    steps, state = decode_in_chunks(model, idx, [prompt_len] + [1] * (T - prompt_len))
    assert state.pos == T
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("short_conv", [0, 3])
def test_uneven_chunks_match_forward(name, short_conv):
    torch.manual_seed(1)
    model = scramble_short_conv(tiny_model(name, "rope", short_conv=short_conv))
    idx = torch.randint(0, 17, (1, 20))
    full = model(idx).logits
    steps, _ = decode_in_chunks(model, idx, [3, 5, 1, 7, 4])
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-10)


def state_numel(state) -> int:
    """Number of tensor elements held by a model's decoding state."""
    total = 0
    for layer in state.layers:
        inner = layer.inner
        fields = inner._asdict().values() if hasattr(inner, "_asdict") else vars(inner).values()
        total += sum(t.numel() for t in fields if isinstance(t, torch.Tensor))
    return total


@pytest.mark.parametrize("name", NAMES)
def test_state_size(name):
    """vq and the kernel family keep a constant-size state; the KV caches of softmax and the quadratic kernel
    smoothers grow with the length.

    20 and 28 are both multiples of block_len 4, so vq's raw window has the same length (one block) at both.
    """
    torch.manual_seed(2)
    model = tiny_model(name, "none")
    idx = torch.randint(0, 17, (1, 28))
    _, short = decode_in_chunks(model, idx[:, :20], [20])
    _, long = decode_in_chunks(model, idx, [20] + [1] * 8)
    if name == "softmax" or name.startswith("kernel_"):
        assert state_numel(long) == state_numel(short) * 28 // 20
    else:
        assert state_numel(long) == state_numel(short)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_matches_full_forward_loop(name):
    torch.manual_seed(3)
    model = tiny_model(name, "rope")
    prompt = torch.randint(0, 17, (2, 5))
    out = model.generate(prompt, 9, temperature=0)
    assert out.shape == (2, 14) and torch.equal(out[:, :5], prompt)
    naive = prompt
    for _ in range(9):
        naive = torch.cat((naive, model(naive).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, naive)


def test_sampling_top_k_and_seed():
    model = tiny_model("vq_soft", "learned")
    prompt = torch.randint(0, 17, (3, 2))
    torch.manual_seed(4)
    a = model.generate(prompt, 6, temperature=0.8, top_k=3)
    torch.manual_seed(4)
    b = model.generate(prompt, 6, temperature=0.8, top_k=3)
    assert torch.equal(a, b)
    assert torch.equal(model.generate(prompt, 6, top_k=1), model.generate(prompt, 6, temperature=0))
    # every sampled token is among the 3 most likely ones given its prefix
    logits = model(a).logits[:, 1:-1]  # predictions for positions 2..7
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == a[:, 2:, None]).any(-1).all()


def test_generate_restores_training_mode():
    model = tiny_model("performer", "none").train()
    model.generate(torch.zeros(1, 1, dtype=torch.long), 2)
    assert model.training


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 2, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 2, "top_k": 0}, "top_k"),
        ({"max_new_tokens": 40}, "seq_len"),
    ],
)
def test_generate_bad_arguments(kwargs, match):
    model = tiny_model("softmax", "learned")
    with pytest.raises(ValueError, match=match):
        model.generate(torch.zeros(1, 3, dtype=torch.long), **kwargs)


def test_forward_step_bad_state():
    model = tiny_model("linear", "none")
    with pytest.raises(ValueError, match="state"):
        model.forward_step(torch.zeros(1, 1, dtype=torch.long), state={"pos": 0})
