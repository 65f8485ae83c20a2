"""Carried state (vqattn.train.carry, LitLM carry_state): segments carried = one long sequence, checkpoint encoding,
rank bookkeeping, validation carried vs independent, exact resume (slow), DDP (slow)."""

import dataclasses
import io

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vqattn.train.carry import CarriedState, decode, encode
from vqattn.train.data import TextDataModule
from vqattn.train.lit import LitLM

from model_helpers import scramble_short_conv, tiny_model


def segments(model, x, t):
    """Logits of x (B, n·t) fed as n carried segments of t tokens, and the carrier."""
    carry = CarriedState()
    logits = torch.cat([carry.forward(model, x[:, i : i + t]).logits for i in range(0, x.shape[1], t)], dim=1)
    return logits, carry


def tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a (nested) state."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return [t for x in obj for t in tensors(x)] if isinstance(obj, (list, tuple)) else []


@pytest.mark.parametrize("name,short_conv", [("vq_hard", 0), ("vq_soft", 0), ("performer", 0), ("linear", 0),
                                             ("ovq", 0), ("vq_hard", 4)])
def test_carried_segments_equal_one_pass_over_the_whole_sequence(name, short_conv):
    # constant-size states carry the whole past, so segment after segment is the long sequence
    model = scramble_short_conv(tiny_model(name, short_conv=short_conv))
    x = torch.randint(0, 17, (3, 40), generator=torch.Generator().manual_seed(0))
    logits, carry = segments(model, x, 8)
    torch.testing.assert_close(logits, model(x).logits)
    assert carry.state.pos == 40
    held = tensors(carry.state)
    assert held and not any(t.requires_grad for t in held)  # gradients stop at the segment boundary
    assert any(t.requires_grad for t in tensors(model(x[:, :8], return_state=True).state))  # ... by detaching


def test_softmax_carries_a_memory_of_one_segment():
    model = tiny_model("softmax")
    x = torch.randint(0, 17, (2, 24), generator=torch.Generator().manual_seed(1))
    logits, carry = segments(model, x, 8)
    torch.testing.assert_close(logits[:, :16], model(x[:, :16]).logits)  # the first 8 keys are still held
    assert carry.state.layers[0].inner.k.shape[2] == 8  # detached(max_cache=T): the newest T keys
    assert not torch.allclose(logits[:, 16:], model(x).logits[:, 16:])  # segment 3 no longer sees keys 0..7


@pytest.mark.parametrize("name,short_conv", [("vq_hard", 0), ("softmax", 0), ("performer", 0), ("ovq", 0),
                                             ("softmax", 2)])
def test_encoded_state_survives_a_weights_only_checkpoint(name, short_conv):
    model = scramble_short_conv(tiny_model(name, short_conv=short_conv))
    x = torch.randint(0, 17, (2, 20), generator=torch.Generator().manual_seed(2))
    _, carry = segments(model, x[:, :12], 6)
    buf = io.BytesIO()
    torch.save({"carry_state": carry.gathered(world_size=1)}, buf)
    buf.seek(0)
    stored = torch.load(buf, weights_only=True)["carry_state"]
    resumed = CarriedState()
    resumed.load(stored, rank=0, world_size=1)
    torch.testing.assert_close(resumed.forward(model, x[:, 12:]).logits, carry.forward(model, x[:, 12:]).logits,
                               rtol=0, atol=0)
    assert type(decode(encode(carry.state))) is type(carry.state)


def test_decode_rebuilds_only_vqattn_classes_and_loads_check_ranks_and_rows():
    with pytest.raises(ValueError, match="not a vqattn class"):
        decode({"__type__": "os:system", "fields": {}})
    stored = {"world_size": 2, "states": [None, None]}
    with pytest.raises(ValueError, match="same number of devices"):
        CarriedState().load(stored, rank=0, world_size=4)
    model = tiny_model("vq_hard")
    _, carry = segments(model, torch.zeros(2, 8, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="same batch size"):
        carry.forward(model, torch.zeros(3, 8, dtype=torch.long))


def test_rank_takes_its_own_state_back():
    model = tiny_model("vq_hard")
    states = []
    for seed in range(2):  # two "ranks", each with its own rows
        _, carry = segments(model, torch.randint(0, 17, (2, 8), generator=torch.Generator().manual_seed(seed)), 8)
        states.append(carry.gathered(world_size=1)["states"][0])
    for rank in range(2):
        carry = CarriedState()
        carry.load({"world_size": 2, "states": states}, rank=rank, world_size=2)
        assert carry.gathered(world_size=1)["states"][0] is states[rank]  # unused yet: stored as loaded


TINY = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32, pos_emb="rope", attention="vq_hard",
            attention_kwargs={"num_codes": 8, "block_len": 4, "exact_window": True})


def test_learned_positions_or_random_windows_cannot_carry(tmp_path):
    with pytest.raises(ValueError, match="pos_emb=rope or none"):
        LitLM(model={**TINY, "pos_emb": "learned"}, carry_state=True)
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 8)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="stream=True"):
        trainer.fit(LitLM(model=TINY, carry_state=True), datamodule=TextDataModule(path=str(path), seq_len=16))


@pytest.mark.parametrize("carry_segments,groups,fresh_steps", [
    (2, 1, [0, 2, 4]),
    (None, 1, [0]),
    (1, 2, [0, 1, 2, 3, 4, 5]),  # every 1 x 2 steps: each group's streams read one segment per sequence
    (2, 2, [0, 1, 4, 5]),  # every 4 steps: groups 0 and 1 start afresh, then each continues its own state
])
def test_training_state_starts_afresh_every_carry_segments_steps(tmp_path, carry_segments, groups, fresh_steps):
    path = tmp_path / "t.txt"
    path.write_bytes(b"".join(b"%d: the quick brown fox %d\n" % (i, i * i) for i in range(300)))
    module = LitLM(model=TINY, carry_state=True, carry_segments=carry_segments)
    fresh, groups_read = [], []
    carry_forward = module.carry.forward

    def recording_forward(model, x, group):
        if group not in module.carry.states and module.carry._stored is None:
            fresh.append(module.trainer.global_step)
        groups_read.append(group)
        return carry_forward(model, x, group)

    module.carry.forward = recording_forward
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
    dm = TextDataModule(path=str(path), seq_len=16, batch_size=2, stream=True, stream_groups=groups)
    trainer.fit(module, datamodule=dm)
    assert fresh == fresh_steps and groups_read == [step % groups for step in range(6)]


def test_stream_groups_hold_one_state_each_and_a_checkpoint_keeps_them_all():
    model = tiny_model("vq_hard")
    x = torch.randint(0, 17, (2, 24), generator=torch.Generator().manual_seed(3))
    carry = CarriedState()
    for i in range(3):  # segments 0 and 2 continue group 0; segment 1 is group 1's first
        carry.forward(model, x[:, 8 * i : 8 * (i + 1)], group=i % 2)
    assert sorted(carry.states) == [0, 1] and carry.states[0].pos == 16 and carry.states[1].pos == 8
    resumed = CarriedState()
    resumed.load(carry.gathered(world_size=1), rank=0, world_size=1)
    step = torch.randint(0, 17, (2, 8), generator=torch.Generator().manual_seed(4))
    for group in (1, 0):
        torch.testing.assert_close(resumed.forward(model, step, group=group).logits,
                                   carry.forward(model, step, group=group).logits, rtol=0, atol=0)
    _, single = segments(model, x[:, :16], 8)
    older = CarriedState()  # a checkpoint from before stream groups: one state per rank, not a list
    older.load({"world_size": 1, "states": [encode(single.state)]}, rank=0, world_size=1)
    torch.testing.assert_close(older.forward(model, step).logits, single.forward(model, step).logits, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_carry_segments_raise_value_error(bad):
    with pytest.raises(ValueError, match="carry_segments must be a positive int or None"):
        LitLM(model=TINY, carry_state=True, carry_segments=bad)


def test_validation_reports_independent_and_carried_bpb_over_the_same_bytes(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"".join(b"%d: the quick brown fox %d\n" % (i, i * i) for i in range(300)))
    dm = TextDataModule(path=str(path), seq_len=16, batch_size=2, val_windows=11, val_carried=True)
    torch.manual_seed(1)  # the gap between the two losses depends on the initialisation (2.5e-4), not on test order
    module = LitLM(model=TINY)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, datamodule=dm, verbose=False)
    out = module.last_validation
    # reference: the 11 windows dealt into 2 rows of 6 and 5 consecutive windows, each row one long sequence
    windows = [dm.val_set[j] for j in range(11)]
    model = module.model.eval()
    nll, count, nll_ind = 0.0, 0, 0.0
    for rows in (windows[:6], windows[6:]):
        x, y = torch.cat([w[0] for w in rows])[None], torch.cat([w[1] for w in rows])[None]
        nll += F.cross_entropy(model(x).logits[0].double(), y[0], reduction="sum").item()
        nll_ind += sum(F.cross_entropy(model(w[0][None]).logits[0].double(), w[1], reduction="sum").item()
                       for w in rows)
        count += y.numel()
    assert out["val_loss_carried"] == pytest.approx(nll / count, rel=1e-5)
    assert out["val_loss"] == pytest.approx(nll_ind / count, rel=1e-5)
    assert out["val_loss"] != pytest.approx(out["val_loss_carried"], rel=1e-5)  # apart at the precision checked
    assert out["val_bpb_carried"] == pytest.approx(out["val_loss_carried"] / np.log(2), rel=1e-6)
    plain = LitLM(model=TINY)
    trainer.validate(plain, datamodule=TextDataModule(path=str(path), seq_len=16), verbose=False)
    assert "val_bpb" in plain.last_validation and "val_bpb_carried" not in plain.last_validation
