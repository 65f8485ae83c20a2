"""Copy at a distance (vqattn.train.copy_eval) and the training mix that repeats passages (data.repeat_fraction)."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_helpers import tiny_model

pytest.importorskip("lightning")
from vqattn.train import data as D  # noqa: E402
from vqattn.train.copy_eval import copy_eval, copy_streams, layout, main  # noqa: E402


def test_the_layout_fills_one_window_and_refuses_what_does_not_fit():
    assert layout(256) == (64, 64, 65)  # lead + passage + gap + passage = T + 1; the copy T/2 + 1 tokens back
    assert layout(256, passage=16) == (112, 16, 113) and layout(256, passage=128) == (0, 128, 1)
    assert layout(256, passage=16, gap=100) == (125, 16, 100)
    for kwargs, match in (({"passage": 1}, "passage must be an int ≥ 2"), ({"gap": -1}, "gap must be"),
                          ({"passage": 100, "gap": 100}, "need 300 tokens, more than a window of seq_len \\+ 1 = 257"),
                          ({"passage": 2.5}, "passage must be an int")):
        with pytest.raises(ValueError, match=match):
            layout(256, **kwargs)


def test_the_repeat_and_its_control_differ_only_in_the_first_occurrence():
    stretches = torch.arange(3 * 20).view(3, 20)
    repeat, control = copy_streams(stretches, lead=2, passage=4)
    assert torch.equal(repeat[:, -4:], stretches[:, 2:6]) and torch.equal(repeat[:, :-4], stretches[:, :-4])
    assert torch.equal(control[:, 2:6], stretches[[1, 2, 0], 2:6])  # the next stretch's passage
    keep = torch.ones(20, dtype=torch.bool)
    keep[2:6] = False
    assert torch.equal(control[:, keep], repeat[:, keep])
    with pytest.raises(ValueError, match="streams must be at least 2"):
        copy_streams(stretches[:1], 2, 4)


def _text():
    return bytes(np.random.default_rng(0).integers(0, 17, 2000).astype(np.uint8))  # tiny_model reads 17 tokens


def test_a_window_beyond_reach_copies_nothing_and_softmax_does():
    """The default gap puts the first passage out of two windows' reach (tiny_model: 2 layers of block_len 4, at most
    7 keys back each; T = 32, so each token of the repeat is 17 back from its source): the window's bits of the repeat
    equal its control's exactly; softmax's do not."""
    torch.manual_seed(0)
    window = copy_eval(tiny_model("window"), _text(), streams=8)
    assert (window["lead"], window["passage"], window["gap"]) == (8, 8, 9)
    assert window["bits_repeat"] == window["bits_control"] and window["copied"] == 0
    assert window["low"] == window["high"] == 0
    near = copy_eval(tiny_model("window"), _text(), passage=4, gap=2, streams=8)  # within the window: it differs
    assert near["bits_repeat"] != near["bits_control"]
    soft = copy_eval(tiny_model("softmax"), _text(), streams=8)
    assert soft["bits_repeat"] != soft["bits_control"] and soft["low"] <= soft["copied"] <= soft["high"]


def test_the_score_is_the_bits_of_the_repeats_tokens_after_its_first():
    """Against a forward pass written out here: the NLL of stream tokens T + 2 − P … T, summed, over their bytes."""
    torch.manual_seed(0)
    model = tiny_model("ovq")
    T, text = model.config.seq_len, _text()
    result = copy_eval(model, text, passage=6, gap=10, streams=4)
    offsets = torch.linspace(0, len(text) - (T + 1), 4).round().long().tolist()
    data = torch.tensor(list(text))
    stretches = torch.stack([data[o:o + T + 1] for o in offsets])
    lead = T + 1 - 12 - 10
    rows = {"repeat": stretches.clone()}
    rows["repeat"][:, -6:] = stretches[:, lead:lead + 6]
    rows["control"] = rows["repeat"].clone()
    rows["control"][:, lead:lead + 6] = stretches[[1, 2, 3, 0], lead:lead + 6]
    for name, idx in rows.items():
        with torch.no_grad():
            logits = model(idx[:, :-1]).logits.double()
        nll = F.cross_entropy(logits.transpose(1, 2), idx[:, 1:], reduction="none") / math.log(2)
        assert result[f"bits_{name}"] == pytest.approx(nll[:, T + 1 - 6:].sum(1).tolist(), rel=1e-9)
        assert result[f"bpb_{name}"] == pytest.approx(nll[:, T + 1 - 6:].mean().item(), rel=1e-9)
    assert result["copied"] == pytest.approx(1 - result["bpb_repeat"] / result["bpb_control"], rel=1e-12)


def test_the_command_writes_the_json_and_tables_saved_results(tmp_path, capsys):
    torch.manual_seed(0)
    model = tiny_model("window")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 3, "hyper_parameters": {"model": dataclasses.asdict(model.config)},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, run / "checkpoints" / "last.ckpt")
    (tmp_path / "held_out.txt").write_bytes(_text())
    ckpt = str(run / "checkpoints" / "last.ckpt")
    assert main([ckpt, "--streams", "4", "--text", str(tmp_path / "held_out.txt")]) == 0
    result = json.loads((run / "copy_eval" / "copy_eval.json").read_text())
    assert result["attention"] == "window" and result["copied"] == 0 and result["streams"] == 4
    assert "| window | 8 / 9 |" in capsys.readouterr().out
    assert main([str(run / "copy_eval" / "copy_eval.json")]) == 0
    assert "| run | 8 / 9 |" in capsys.readouterr().out  # a saved result is named by its run dir
    for bad in ([ckpt, "--passage", "30"], [ckpt, "--streams", "1"], [ckpt, ckpt]):
        with pytest.raises(SystemExit):  # argparse's one-line error
            main([*bad, "--text", str(tmp_path / "held_out.txt")])
        assert "usage:" in capsys.readouterr().err


# ---------------------------------------------------------------- the training mix


def test_repeated_passages_copy_a_span_to_a_later_place_at_every_gap():
    """Rows of distinct tokens: each changed row holds exactly one run of ``length`` tokens seen earlier, its source
    before it; over many rows the gaps cover 0 … T + 1 − 2·length."""
    T1, P = 20, 4
    rows = torch.arange(2000 * T1).view(2000, T1)
    out = D.repeat_passages(rows, np.random.default_rng(0), 1.0, P)
    assert torch.equal(rows, torch.arange(2000 * T1).view(2000, T1))  # the input is not written
    gaps = set()
    for before, after in zip(rows.tolist(), out.tolist()):
        changed = [j for j in range(T1) if before[j] != after[j]]
        assert changed, "with fraction 1 every row repeats a passage"
        b = changed[0]
        a = before.index(after[b])
        assert after[b:b + P] == before[a:a + P] and a + P <= b <= T1 - P
        assert len(changed) == P and changed == list(range(b, b + P))
        gaps.add(b - a - P)
    assert gaps == set(range(T1 - 2 * P + 1))
    some = D.repeat_passages(rows, np.random.default_rng(1), 0.25, P)
    changed_rows = (some != rows).any(1).float().mean().item()
    assert 0.2 < changed_rows < 0.3
    assert torch.equal(D.repeat_passages(rows, np.random.default_rng(1), 0.0, P), rows)


def _module(tmp_path, **kwargs):
    (tmp_path / "a.txt").write_bytes(_text() * 3)
    module = D.TextDataModule(path=str(tmp_path / "a.txt"), seq_len=32, batch_size=64, cache_dir=str(tmp_path / "c"),
                              **kwargs)
    module.setup()
    return module


def test_the_data_module_repeats_passages_in_training_rows_only(tmp_path):
    plain, mixed = _module(tmp_path), _module(tmp_path, repeat_fraction=1.0, repeat_len=8)
    x0, y0 = plain._train_batch(np.random.default_rng([0, 5, 0]))
    x1, y1 = mixed._train_batch(np.random.default_rng([0, 5, 0]))
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # still one stream shifted by one
    assert not torch.equal(x0, x1) and (x0 != x1).sum(1).le(8).all()  # the same windows, 8 tokens written at most
    again = mixed._train_batch(np.random.default_rng([0, 5, 0]))
    assert torch.equal(again[0], x1)  # a pure function of the batch's seed
    for i in range(len(plain.val_set)):
        assert all(torch.equal(a, b) for a, b in zip(plain.val_set[i], mixed.val_set[i]))


@pytest.mark.parametrize("kwargs,match", [
    ({"repeat_fraction": 1.5}, "data.repeat_fraction must be a number in \\[0, 1\\]"),
    ({"repeat_fraction": True}, "data.repeat_fraction must be a number"),
    ({"repeat_fraction": 0.5, "repeat_len": 17}, "data.repeat_len must be an int in \\[1, 16\\]"),
    ({"repeat_fraction": 0.5, "repeat_len": 0}, "data.repeat_len must be an int"),
    ({"repeat_fraction": 0.5, "repeat_len": 8, "pack_documents": True}, "across the documents or the carried windows of "
                                                       "data.pack_documents=true"),
    ({"repeat_fraction": 0.5, "repeat_len": 8, "stream": True}, "data.stream=true"),
])
def test_bad_repeat_settings_are_one_line_errors(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.TextDataModule(path=str(tmp_path / "a.txt"), seq_len=32, **kwargs)
