"""Consecutive-segment data (vqattn.train.streams): row continuity, wrap-around, resume, DDP sharding, the carried
validation pass; MQAR with a minimum query gap (experiment=mqar_long)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vqattn.model import IGNORE_INDEX
from vqattn.train import data as D
from vqattn.train.mqar import MQARDataModule, mqar_example
from vqattn.train.streams import CarriedValBatches, StreamBatches


def fake_trainer(global_step=0, max_steps=10, rank=0, world=1, accumulate=1):
    return SimpleNamespace(global_step=global_step, max_steps=max_steps, global_rank=rank, world_size=world,
                           accumulate_grad_batches=accumulate)


def positions(n=1000, **kwargs):
    """StreamBatches over data = 0, 1, ..., n - 1, so every token names its own position."""
    kw = dict(seq_len=8, batch_size=3, rank=0, world_size=1, seed=0, num_batches=50) | kwargs
    return StreamBatches(torch.arange(n), **kw)


def test_row_r_of_batch_i_plus_1_starts_where_row_r_of_batch_i_ended():
    batches = positions()
    length = batches.length  # 1000 // 3 = 333 bytes per stream
    streams = torch.arange(3)[:, None]
    for i in range(len(batches) - 1):
        (x0, y0), (x1, _) = batches[i], batches[i + 1]
        assert x0.shape == y0.shape == (3, 8)
        assert torch.equal(x1[:, 0], y0[:, -1])  # the byte that ended y_i starts x_{i+1}
        assert torch.equal(x0 // length, streams.expand(3, 8))  # row r stays in stream r
        # positions inside the stream: y is x shifted by one, and x moves on by exactly T bytes
        assert torch.equal(y0 % length, (x0 + 1) % length) and torch.equal(x1 % length, (x0 + 8) % length)


def test_a_row_reads_its_stream_as_a_ring_of_consecutive_bytes():
    batches = positions(n=120, seq_len=5, batch_size=2, num_batches=40)  # 60-byte streams, read 3 times over
    for r in range(2):
        tokens = torch.cat([batches[i][0][r] for i in range(len(batches))])  # everything row r saw, in order
        first = r * 60
        assert tokens.min() >= first and tokens.max() < first + 60  # row r never leaves stream r
        steps = (tokens[1:] - tokens[:-1]).tolist()
        assert set(steps) == {1, -59}  # the next byte, or from the stream's last byte back to its first
        assert steps.count(-59) in (200 // 60, 200 // 60 + 1)  # 200 bytes read: 3 or 4 wraps, by the phase


def test_stream_groups_are_read_in_turn_each_continuing_itself():
    groups = 3
    batches = positions(n=3000, groups=groups)  # 9 streams of 333 bytes, 3 per group
    length = batches.length
    assert length == 3000 // 9
    for i in range(len(batches) - groups):
        (x0, y0), (x1, _) = batches[i], batches[i + groups]
        assert torch.equal(x1[:, 0], y0[:, -1])  # batch i + G continues batch i
        stream = torch.arange(3)[:, None] * groups + i % groups  # group g's rows read streams g, G + g, 2G + g
        assert torch.equal(x0 // length, stream.expand(3, 8))
    consecutive = [batches[i][0] // length for i in range(groups)]
    assert all(not set(a.flatten().tolist()) & set(b.flatten().tolist())  # batch i + 1 reads other streams
               for a, b in zip(consecutive, consecutive[1:]))
    one = positions(n=3000)  # G = 1 reads what it read before groups existed: phases drawn for the R streams alone
    phases = torch.from_numpy(np.random.default_rng(0).integers(0, 1000, size=3))
    expected = torch.arange(3)[:, None] * 1000 + (phases[:, None] + 5 * 8 + torch.arange(8)) % 1000
    assert torch.equal(one[5][0], expected)
    with pytest.raises(ValueError, match="stream_groups"):
        positions(n=100, groups=5)  # 6 bytes per stream


@pytest.mark.parametrize("kwargs", [dict(stream=True, stream_groups=0), dict(stream=True, stream_groups=True),
                                    dict(stream=False, stream_groups=2)])
def test_bad_stream_groups_raise_value_error(tmp_path, kwargs):
    with pytest.raises(ValueError, match="data.stream_groups"):
        text_module(tmp_path, **kwargs)


def test_seeds_give_different_phases_and_too_short_streams_are_explained():
    assert not torch.equal(positions(seed=0)[0][0], positions(seed=1)[0][0])
    with pytest.raises(ValueError, match="data.stream"):
        positions(n=20, seq_len=8, batch_size=3)  # 6 bytes per stream < seq_len + 1


@pytest.mark.parametrize("groups", [1, 2])
def test_ddp_ranks_read_disjoint_streams(groups):
    world, b = 3, 2
    seen = []
    for rank in range(world):
        batches = positions(n=3000, rank=rank, world_size=world, batch_size=b, num_batches=400, groups=groups)
        seen.append(set(torch.cat([torch.cat(batches[i]).flatten() for i in range(len(batches))]).tolist()))
        assert all(len(s & seen[-1]) == 0 for s in seen[:-1])
    streams = world * b * groups  # together they cover every stream (each read around more than once)
    assert len(set.union(*seen)) == streams * (3000 // streams)


def test_a_batch_spreads_over_the_text():
    """A group's rows read streams G apart: a batch spans the text as random windows do, not 1/G of it."""
    batches = positions(n=8000, batch_size=4, groups=8)  # 32 streams of 250 bytes
    for i in range(8):
        first = batches[i][0][:, 0]
        assert first.max() - first.min() > 8000 // 2


def text_module(tmp_path, **kwargs):
    path = tmp_path / "notes.txt"
    path.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 6000, dtype=np.uint8)))
    dm = D.TextDataModule(path=str(path), **{"seq_len": 16, "batch_size": 2, **kwargs})
    dm.setup()
    return dm


def test_stream_mode_of_a_byte_corpus_is_consecutive_and_resumes_exactly(tmp_path):
    dm = text_module(tmp_path, stream=True)
    dm.trainer = fake_trainer(max_steps=6)
    straight = list(dm.train_dataloader())
    length = len(dm.train_data) // 2
    for r in range(2):
        row = torch.cat([x[r] for x, _ in straight] + [straight[-1][1][r, -1:]])
        ring = bytes(dm.train_data[r * length : (r + 1) * length].tolist()) * 2
        assert bytes(row.tolist()) in ring  # 6 x 16 + 1 consecutive bytes of stream r
    dm.trainer = fake_trainer(global_step=4, max_steps=6)
    resumed = list(dm.train_dataloader())
    assert len(resumed) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(straight[4:], resumed))
    independent = text_module(tmp_path)
    independent.trainer = fake_trainer(max_steps=6)
    x, y = map(torch.stack, zip(*independent.train_dataloader()))
    assert not torch.equal(x[1:, :, 0], y[:-1, :, -1])  # random windows do not continue each other


def window_set(n, t=4):
    """n consecutive windows of positions: window j holds x = jt .. jt + t - 1 and y = x + 1."""
    data = torch.arange(n * t + 1)
    return D._WindowSet(data, torch.arange(n) * t, t)


@pytest.mark.parametrize("n,batch,world", [(23, 2, 3), (12, 3, 2), (4, 3, 2), (7, 1, 1)])
def test_carried_validation_predicts_every_window_once_in_consecutive_rows(n, batch, world):
    windows = window_set(n)
    labelled, steps = [], set()
    for rank in range(world):
        carried = CarriedValBatches(windows, batch_size=batch, rank=rank, world_size=world)
        steps.add(len(carried))
        batches = [carried[s] for s in range(len(carried))]
        for r in range(batch):
            xs = [x[r] for x, y in batches if (y[r] != IGNORE_INDEX).all()]
            pads = [y[r] for x, y in batches if (y[r] == IGNORE_INDEX).all()]
            assert len(xs) + len(pads) == len(batches)  # a step feeds a row a whole window or padding
            for a, b in zip(xs, xs[1:]):
                assert b[0] == a[-1] + 1  # the row's next window continues the text
            labelled += [y[r] for x, y in batches if (y[r] != IGNORE_INDEX).all()]
    assert steps == {-(-n // (batch * world))}  # every rank runs the same number of steps
    expected = sorted(tuple(windows[j][1].tolist()) for j in range(n))
    assert sorted(tuple(y.tolist()) for y in labelled) == expected  # each window's targets exactly once


def test_val_carried_adds_a_second_loader_over_the_first_val_windows(tmp_path):
    dm = text_module(tmp_path, val_carried=True, val_windows=5)
    assert torch.equal(dm.val_set.offsets, torch.arange(5) * 16)  # consecutive, not spread over the split
    dm.trainer = fake_trainer()
    independent, carried = dm.val_dataloader()
    x_ind = torch.cat([x for x, _ in independent])
    x_car = [row for x, y in carried for row, labels in zip(x, y) if (labels != IGNORE_INDEX).all()]
    assert sorted(map(tuple, x_ind.tolist())) == sorted(tuple(row.tolist()) for row in x_car)
    spread = text_module(tmp_path, val_windows=5)
    assert spread.val_set.offsets[-1] > 4 * 16 and not isinstance(spread.val_dataloader(), list)


def test_mqar_refuses_stream_modes():
    with pytest.raises(ValueError, match="byte corpus"):
        MQARDataModule(num_kv_pairs=4, seq_len=64, stream=True)
    with pytest.raises(ValueError, match="byte corpus"):
        MQARDataModule(num_kv_pairs=4, seq_len=64, val_carried=True)


@pytest.mark.parametrize("seq_len,pairs,gap,block_len", [(1024, 16, 256, 32), (300, 8, 130, 64), (97, 4, 65, 32)])
def test_mqar_queries_sit_outside_the_raw_window(seq_len, pairs, gap, block_len):
    x, y = mqar_example(np.random.default_rng(3), 64, seq_len, pairs, min_query_gap=gap)
    assert x.shape == y.shape == (64, seq_len)
    for xs, ys in zip(x.tolist(), y.tolist()):
        where = {xs[2 * j]: 2 * j for j in range(pairs)}  # key -> its position (its value follows it)
        answers = [i for i, t in enumerate(ys) if t != IGNORE_INDEX]
        assert len(answers) == pairs and sorted(xs[i] for i in answers) == sorted(where)
        for i in answers:
            assert ys[i] == xs[where[xs[i]] + 1]  # the answer is the value bound to the queried key
            assert i - (where[xs[i]] + 1) > gap >= 2 * block_len  # query far from its key and value
    first_answer = lambda labels: int((labels != IGNORE_INDEX).float().argmax(dim=1).min())  # noqa: E731
    assert first_answer(y) >= 2 * pairs + gap  # the gap holds no query ...
    _, y_default = mqar_example(np.random.default_rng(3), 64, seq_len, pairs)
    assert first_answer(y_default) < 2 * pairs + gap  # ... where the default layout puts some


def test_mqar_gap_too_long_for_the_sequence_is_explained():
    with pytest.raises(ValueError, match="min_query_gap=200"):
        MQARDataModule(num_kv_pairs=16, seq_len=256, min_query_gap=200)
    with pytest.raises(ValueError, match="min_query_gap must be an int"):
        MQARDataModule(num_kv_pairs=16, seq_len=256, min_query_gap=-1)
    with pytest.raises(ValueError, match="val_min_query_gap=200"):
        MQARDataModule(num_kv_pairs=16, seq_len=256, val_min_query_gap=200)
    with pytest.raises(ValueError, match="val_min_query_gap must be an int"):
        MQARDataModule(num_kv_pairs=16, seq_len=256, val_min_query_gap=1.5)


def test_mqar_validation_gap_applies_to_validation_only():
    def first_query(y):  # earliest answer position over the batch
        return int((y != IGNORE_INDEX).float().argmax(dim=1).min())

    dm = MQARDataModule(num_kv_pairs=8, seq_len=256, min_query_gap=0, val_min_query_gap=100, num_val_examples=64)
    dm.setup()
    _, y_val = dm.val_set.tensors
    _, y_train = dm._train_batch(np.random.default_rng(0))
    assert first_query(y_val) >= 16 + 100 > first_query(y_train)
    same = MQARDataModule(num_kv_pairs=8, seq_len=256, min_query_gap=100, num_val_examples=64)
    same.setup()
    _, y_same = same._train_batch(np.random.default_rng(0))
    assert first_query(same.val_set.tensors[1]) >= 116 and first_query(y_same) >= 116


def test_a_new_loader_iterator_starts_at_the_trainer_step(tmp_path):
    # Lightning re-creates the training iterator of a resumed DDP run after its first batch; it must not replay it.
    dm = text_module(tmp_path, stream=True)
    dm.trainer = fake_trainer(global_step=2, max_steps=6)
    loader = dm.train_dataloader()
    straight = StreamBatches(dm.train_data, seq_len=16, batch_size=2, rank=0, world_size=1, seed=0, num_batches=6)
    assert torch.equal(next(iter(loader))[0], straight[2][0])
    dm.trainer.global_step = 3  # one step trained, then a fresh iterator
    batches = list(loader)
    assert len(batches) == 3 and torch.equal(batches[0][0], straight[3][0])
