"""GPT: losses, causality of the whole model, embeddings, positions, statistics and configuration errors."""

from __future__ import annotations

import pytest
import torch

from vqattn.model import GPT, GPTConfig

from model_helpers import COMBINATIONS, NAMES, VQ_NAMES, layer_kwargs, tiny_model


@pytest.mark.parametrize("name,pos_emb", COMBINATIONS)
def test_causality_of_the_full_model(name, pos_emb):
    torch.manual_seed(0)
    model = tiny_model(name, pos_emb)
    idx = torch.randint(0, 17, (2, 11))
    logits = model(idx).logits
    assert logits.shape == (2, 11, 17)
    for cut in (1, 5, 10):
        changed = idx.clone()
        changed[:, cut:] = (changed[:, cut:] + 1 + torch.randint(0, 16, changed[:, cut:].shape)) % 17
        other = model(changed).logits
        torch.testing.assert_close(other[:, :cut], logits[:, :cut], rtol=0, atol=1e-12)
        assert not torch.allclose(other[:, cut:], logits[:, cut:])


@pytest.mark.parametrize("name", NAMES)
def test_loss_is_nll_and_aux_is_separate(name):
    torch.manual_seed(1)
    model = tiny_model(name).train()
    idx, targets = torch.randint(0, 17, (2, 2, 9)).unbind(0)
    layer_aux = []  # each layer's returned aux loss, captured on the way
    for block in model.blocks:
        block.attn.register_forward_hook(lambda module, args, output: layer_aux.append(output.aux_loss))
    out = model(idx, targets)
    nll = -out.logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(out.loss, nll, rtol=0, atol=1e-12)
    assert out.aux_loss.shape == () and len(layer_aux) == len(model.blocks)
    torch.testing.assert_close(out.aux_loss, sum(layer_aux))
    if name == "vq_hard":
        assert out.aux_loss > 0
    elif name not in VQ_NAMES:
        assert out.aux_loss == 0
    (out.loss + out.aux_loss).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model(idx).loss is None


def test_tied_and_untied_embeddings():
    tied, untied = tiny_model("softmax"), tiny_model("softmax", tie_embeddings=False)
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 17 * 16


def test_num_params_counts_every_distinct_parameter():
    model = tiny_model("softmax", "learned")
    c, v, layers, t = 16, 17, 2, 32
    per_block = 4 * c * c + 2 * 4 * c * c + 2 * c  # qkv + proj, MLP, two norms
    assert model.num_params() == v * c + t * c + layers * per_block + c


def test_learned_positions_reject_long_sequences_and_rope_accepts_them():
    with pytest.raises(ValueError, match="seq_len=32.*pos_emb='rope' or 'none'"):
        tiny_model("vq_soft", "learned")(torch.zeros(1, 33, dtype=torch.long))
    assert tiny_model("vq_soft", "rope")(torch.zeros(1, 40, dtype=torch.long)).logits.shape == (1, 40, 17)


@pytest.mark.parametrize("name", NAMES)
def test_codebook_stats(name):
    model = tiny_model(name).train()
    model(torch.randint(0, 17, (2, 9)))
    stats = model.codebook_stats()
    if name in (*VQ_NAMES, "ovq"):
        layer_stats = [block.attn.usage_stats() for block in model.blocks]
        assert set(stats) == set(layer_stats[0])
        for key, value in stats.items():
            assert value == pytest.approx(sum(s[key] for s in layer_stats) / len(layer_stats))
    else:
        assert stats == {}


def test_performer_layers_draw_different_features():
    model = tiny_model("performer")
    omegas = [block.attn.features.omega for block in model.blocks]
    assert not torch.equal(omegas[0], omegas[1])


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"attention": "flash"}, "valid names are: deltanet, gated_deltanet, kernel_linear, kernel_poly, kernel_rbf, "
                                 "linear, mamba2, ovq, performer, softmax, taylor, vq_hard, vq_soft"),
        ({"pos_emb": "alibi"}, "pos_emb"),
        ({"n_embd": 30, "n_head": 4}, "divisible"),
        ({"seq_len": 0}, "seq_len"),
    ],
)
def test_bad_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**overrides)


def test_vq_rope_without_raw_window_is_explained():
    config = GPTConfig(attention="vq_hard", pos_emb="rope", attention_kwargs={"num_codes": 8, "exact_window": False})
    with pytest.raises(ValueError, match="exact_window=True"):
        GPT(config)


def test_bad_forward_inputs():
    model = tiny_model("linear")
    with pytest.raises(ValueError, match="torch.long"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\[0, 17\)"):
        model(torch.full((1, 3), 17))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def test_dropout_only_in_training():
    model = tiny_model("softmax", dropout=0.5)
    idx = torch.randint(0, 17, (1, 8))
    torch.testing.assert_close(model(idx).logits, model(idx).logits)
    model.train()
    assert not torch.allclose(model(idx).logits, model(idx).logits)


def test_layer_kwargs_reach_the_layer():
    config = GPTConfig(n_embd=16, n_head=2, attention="vq_hard", attention_kwargs=layer_kwargs("vq_hard"))
    assert all(block.attn.block_len == 4 for block in GPT(config).blocks)


@pytest.mark.parametrize("name", NAMES)
def test_forward_with_a_carried_state_continues_the_sequence(name):
    """Segments fed with the (detached) state of the previous one give the logits of one pass over the whole."""
    torch.manual_seed(3)
    model = tiny_model(name)
    idx = torch.randint(0, 17, (2, 13))
    full = model(idx).logits
    first = model(idx[:, :6], return_state=True)
    assert first.state.pos == 6
    second = model(idx[:, 6:], idx[:, 6:], state=first.state.detached(), return_state=True)
    torch.testing.assert_close(torch.cat((first.logits, second.logits), 1), full, rtol=0, atol=1e-10)
    assert second.state.pos == 13 and model(idx).state is None


def test_detached_state_has_no_history_and_bounded_kv_cache():
    model = tiny_model("softmax").train()
    out = model(torch.randint(0, 17, (2, 9)), return_state=True)
    cache = out.state.layers[0].inner
    assert cache.k.requires_grad
    carried = out.state.detached(max_cache=4)
    for before, after in zip(out.state.layers, carried.layers):
        assert after.pos == before.pos == 9
        assert not after.inner.k.requires_grad and not after.inner.v.requires_grad
        torch.testing.assert_close(after.inner.k, before.inner.k[:, :, -4:].detach(), rtol=0, atol=0)
        torch.testing.assert_close(after.inner.v, before.inner.v[:, :, -4:].detach(), rtol=0, atol=0)
