"""python -m vqattn.train.length_eval: streamed bits per byte by absolute position, on tiny models."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from model_helpers import tiny_model

pytest.importorskip("lightning")
from vqattn.train.length_eval import (  # noqa: E402
    bucket_edges,
    change_interval,
    length_eval,
    main,
    read_with_memory_decay,
    stream_bits,
)


def test_buckets_double_and_end_at_the_stream_length():
    assert bucket_edges(64, 16) == [0, 64, 128, 256, 512, 1024]
    assert bucket_edges(64, 5) == [0, 64, 128, 256, 320]
    assert bucket_edges(10, 1) == [0, 10]


@pytest.mark.parametrize("name", ["window", "vq_hard", "ovq", "softmax"])
def test_streamed_bits_equal_one_forward_over_the_whole_stream(name):
    """Segments of T with the carried state read exactly what one call over the whole stream reads (length 41: the
    last segment is partial)."""
    torch.manual_seed(0)
    model = tiny_model(name).eval()
    streams = torch.randint(0, 17, (2, 42), dtype=torch.uint8)  # tiny_model has 17 tokens
    bits = stream_bits(model, streams, model.config.seq_len)
    idx = streams.long()
    logits = model(idx[:, :-1]).logits.double()
    expected = F.cross_entropy(logits.transpose(1, 2), idx[:, 1:], reduction="none") / math.log(2)
    torch.testing.assert_close(bits, expected, rtol=1e-10, atol=1e-10)


def test_length_eval_reports_one_bpb_per_bucket_and_refuses_what_it_cannot_read():
    torch.manual_seed(0)
    model = tiny_model("vq_soft").eval()
    T = model.config.seq_len
    text = bytes(range(17)) * 60  # the tiny models read 17 tokens
    result = length_eval(model, text, multiple=4, streams=3)
    assert result["edges"] == [0, T, 2 * T, 4 * T] and len(result["bpb"]) == 3
    assert all(0 < x < 20 for x in result["bpb"])
    # the first stream alone (float32 sums differ in the last bits from a batch of three)
    bits = stream_bits(model, torch.tensor(list(text[:4 * T + 1]), dtype=torch.uint8)[None], T)
    assert result["bpb_by_stream"][0] == pytest.approx([bits[0, a:b].mean().item() for a, b in
                                                        zip(result["edges"][:-1], result["edges"][1:])], rel=1e-5)
    by_stream = torch.tensor(result["bpb_by_stream"], dtype=torch.float64)
    assert result["bpb"] == pytest.approx(by_stream.mean(0).tolist(), rel=1e-12)
    with pytest.raises(ValueError, match="learned absolute positions"):
        length_eval(tiny_model("window", pos_emb="learned"), text)
    with pytest.raises(ValueError, match="held-out text has 100 bytes"):
        length_eval(model, bytes(100), multiple=16)
    with pytest.raises(ValueError, match="streams must be a positive int"):
        length_eval(model, text, streams=0)


def _result(by_stream: torch.Tensor, attention: str = "ovq") -> dict:
    """A length_eval result from per-stream bucket bpb (N, buckets)."""
    return {"attention": attention, "seq_len": 4, "streams": by_stream.shape[0],
            "edges": bucket_edges(4, 2 ** (by_stream.shape[1] - 1)), "bpb": by_stream.mean(0).tolist(),
            "bpb_by_stream": by_stream.tolist()}


def test_the_change_interval_is_the_bootstrap_of_the_change_over_streams():
    torch.manual_seed(0)
    by_stream = 2 + 0.3 * torch.rand(32, 5, dtype=torch.float64)  # (streams, buckets)
    got = change_interval(_result(by_stream), resamples=2000, seed=3)
    bpb = by_stream.mean(0)
    assert got["change"] == pytest.approx(100 * (bpb[-1] / bpb[0] - 1).item(), rel=1e-12)
    draws = torch.randint(0, 32, (2000, 32), generator=torch.Generator().manual_seed(3))
    changes = [100 * (by_stream[row, -1].mean() / by_stream[row, 0].mean() - 1) for row in draws]
    low, high = torch.quantile(torch.stack(changes), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    assert (got["low"], got["high"]) == pytest.approx((low, high), rel=1e-10)
    assert got["low"] < got["change"] < got["high"]
    more = change_interval(_result(by_stream.repeat(16, 1)), resamples=2000)  # 16x the streams: 1/4 the width
    assert 0.15 < (more["high"] - more["low"]) / (got["high"] - got["low"]) < 0.35


def test_the_paired_interval_cancels_what_both_models_read():
    """Streams that differ in their own drift (the text) but whose second model reads every bucket 1% better past the
    first: the difference is -1 point however wide each model's own interval is."""
    torch.manual_seed(0)
    text = 2 + 0.5 * torch.rand(32, 5, dtype=torch.float64)  # each stream's own drift, wide
    better = text * torch.tensor([1, 0.99, 0.99, 0.99, 0.99], dtype=torch.float64)
    alone, paired = change_interval(_result(better)), change_interval(_result(better), _result(text, "window"))
    assert alone["high"] - alone["low"] > 5
    assert paired["change"] == pytest.approx(alone["change"] - change_interval(_result(text))["change"], rel=1e-12)
    assert paired["low"] < paired["change"] < paired["high"] and paired["high"] - paired["low"] < 0.5
    assert paired["low"] > -1.5 and paired["high"] < -0.5
    assert change_interval(_result(text), _result(text)) == {"change": 0.0, "low": 0.0, "high": 0.0}
    with pytest.raises(ValueError, match="baseline must read the same streams"):
        change_interval(_result(text), _result(text[:16]))


def _checkpoint(model, path):
    torch.save({"global_step": 3, "hyper_parameters": {"model": dataclasses.asdict(model.config)},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)


def test_command_writes_the_table_json_and_plot(tmp_path, capsys):
    torch.manual_seed(0)
    model = tiny_model("ovq")
    _checkpoint(model, tmp_path / "last.ckpt")
    (tmp_path / "held_out.txt").write_bytes(bytes(range(17)) * 30)
    out = tmp_path / "eval"
    assert main([str(tmp_path / "last.ckpt"), "--multiple", "4", "--streams", "2", "--text",
                 str(tmp_path / "held_out.txt"), "--out", str(out)]) == 0
    result = json.loads((out / "length_eval.json").read_text())
    assert result["attention"] == "ovq" and len(result["bpb"]) == 3
    assert (out / "length_eval.png").stat().st_size > 0
    assert "| ovq |" in capsys.readouterr().out
    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in result.items() if k != "bpb_by_stream"}))
    for bad in ("last.ckpt.json", "old.json", "held_out.txt"):  # missing, written without per-stream bpb, not json
        with pytest.raises(SystemExit):  # argparse's one-line error, exit status 2
            main([str(tmp_path / "last.ckpt"), "--against", str(tmp_path / bad)])
        assert "usage:" in capsys.readouterr().err
    args = [str(tmp_path / "last.ckpt"), "--multiple", "4", "--text", str(tmp_path / "held_out.txt")]
    assert main([*args, "--streams", "2", "--against", str(out / "length_eval.json"), "--out", str(tmp_path / "b")]) == 0
    captured = capsys.readouterr()
    printed = captured.out.splitlines()
    assert "| against ovq (points) |" in printed[0] and printed[2].startswith("| ovq |")
    assert "note: 2 streams" not in captured.err  # 2 × 129 bytes fit in 510: disjoint
    # the saved results again, a row each labelled by its directory, plotted together
    saved = [str(out / "length_eval.json"), str(tmp_path / "b" / "length_eval.json")]
    assert main([*saved, "--against", str(out / "length_eval.json"), "--plot", str(tmp_path / "ab.png")]) == 0
    again = capsys.readouterr().out.splitlines()
    assert again[:2] == printed[:2] and again[3] == printed[2].replace("| ovq |", "| b |")
    assert again[2].startswith("| eval |") and again[2].endswith("| +0.00 (+0.00 to +0.00) |")  # itself: exactly 0
    assert (tmp_path / "ab.png").stat().st_size > 0
    for mixed in ([saved[0], str(tmp_path / "last.ckpt")], [str(tmp_path / "last.ckpt"), "--plot", "x.png"]):
        with pytest.raises(SystemExit):
            main(mixed)
    with pytest.raises(SystemExit):  # other streams: the result is written, the comparison refused
        main([*args, "--streams", "3", "--against", str(out / "length_eval.json"), "--out", str(tmp_path / "c")])
    assert "baseline must read the same streams" in capsys.readouterr().err
    assert main([*args, "--streams", "9", "--out", str(tmp_path / "d")]) == 0  # 9 × 129 bytes in 510: overlapping
    assert "note: 9 streams of 128 bytes overlap in 510 bytes" in capsys.readouterr().err
    assert json.loads((tmp_path / "c" / "length_eval.json").read_text())["streams"] == 3


def test_by_default_the_results_go_to_the_checkpoints_run_dir(tmp_path, monkeypatch, capsys):
    """Not to length_eval/ in the current directory, where a checkout kept it untracked beside the code."""
    torch.manual_seed(0)
    run = tmp_path / "outputs" / "run"
    (run / "checkpoints").mkdir(parents=True)
    _checkpoint(tiny_model("window"), run / "checkpoints" / "last.ckpt")
    (tmp_path / "held_out.txt").write_bytes(bytes(range(17)) * 30)
    monkeypatch.chdir(tmp_path)
    assert main(["outputs/run/checkpoints/last.ckpt", "--multiple", "2", "--streams", "2", "--text",
                 "held_out.txt"]) == 0
    assert sorted(p.name for p in (run / "length_eval").iterdir()) == ["length_eval.json", "length_eval.png"]
    assert not (tmp_path / "length_eval").exists()
    _checkpoint(tiny_model("window"), tmp_path / "loose.ckpt")  # a checkpoint outside a run's checkpoints/
    assert main(["loose.ckpt", "--multiple", "2", "--streams", "2", "--text", "held_out.txt"]) == 0
    assert (tmp_path / "length_eval" / "length_eval.json").exists()
    saved = [str(run / "length_eval" / "length_eval.json"), str(tmp_path / "length_eval" / "length_eval.json")]
    capsys.readouterr()
    assert main(saved) == 0  # rows named by their run dir, not by the default's folder
    assert [line.split(" |")[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["| run", f"| {tmp_path.name}"]


def test_the_plots_position_labels_are_plain_numbers_that_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vqattn.train.length_eval import draw

    result = {"attention": "ovq", "seq_len": 256, "edges": bucket_edges(256, 16), "bpb": [2.2, 2.1, 2.1, 2.0, 2.0]}
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    draw(ax, [result])
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ticks = [t for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True) if t.get_text()]
    assert [t.get_text() for t in ticks] == ["256", "512", "1,024", "2,048", "4,096"]
    boxes = sorted((t.get_window_extent(renderer) for t in ticks), key=lambda b: b.x0)
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))
    plt.close(fig)


@pytest.mark.parametrize("name", ["vq_hard", "ovq"])
def test_the_ablations_edit_only_the_memory(name, monkeypatch):
    """benchmarks/length_ablations.py: capping the total count keeps every code's mean value; emptying the memory
    empties it; the raw window is left alone. ovq's novel keys join their nearest slot here, so that its memory
    holds every key and its count passes T."""
    length_ablations = _length_ablations(monkeypatch)
    torch.manual_seed(0)
    model = tiny_model(name).eval()
    for block in model.blocks:
        if name == "ovq":
            block.attn.overflow = "nearest"
    T = model.config.seq_len
    state = model(torch.randint(0, 17, (2, 3 * T)), return_state=True).state
    capped = length_ablations.between_segments("cap_T", T)(state)
    emptied = length_ablations.between_segments("no_memory", T)(state)
    for before, after, empty in zip(state.layers, capped.layers, emptied.layers):
        names = length_ablations.MEMORY_FIELDS[type(before.inner)]
        n, n_capped = before.inner.counts, after.inner.counts
        assert n.sum(-1).max() > T and n_capped.sum(-1).max() <= T + 1e-3
        for field in names[1:]:
            mean = getattr(before.inner, field) / n.clamp(min=1e-9)[..., None]
            torch.testing.assert_close(getattr(after.inner, field) / n_capped.clamp(min=1e-9)[..., None], mean)
        assert all(getattr(empty.inner, f).abs().max() == 0 for f in names)
        assert torch.equal(after.inner.keys, before.inner.keys)


def _length_ablations(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import length_ablations

    return length_ablations


def test_the_ablations_write_length_eval_results(tmp_path, monkeypatch, capsys):
    """--only runs just the ablations named; --out writes each as a length_eval.json: "carried" is length_eval's own
    result, and memory_decay_T reads the same streams with the layers' memory_decay at exp(-1/T)."""
    torch.manual_seed(0)
    model = tiny_model("ovq").eval()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    _checkpoint(model, tmp_path / "run" / "checkpoints" / "last.ckpt")
    (tmp_path / "held_out.txt").write_bytes(bytes(range(17)) * 30)
    length_ablations = _length_ablations(monkeypatch)
    assert length_ablations.main([str(tmp_path / "run" / "checkpoints" / "last.ckpt"), "--multiple", "4",
                                  "--streams", "2", "--text", str(tmp_path / "held_out.txt"), "--only", "carried",
                                  "memory_decay_T", "--out", str(tmp_path / "ablations")]) == 0
    assert sorted(p.name for p in (tmp_path / "ablations").iterdir()) == ["run_carried", "run_memory_decay_T"]
    assert len(capsys.readouterr().out.splitlines()) == 2
    carried, decayed = (json.loads((tmp_path / "ablations" / f"run_{n}" / "length_eval.json").read_text())
                        for n in ("carried", "memory_decay_T"))
    expected = length_eval(model, (tmp_path / "held_out.txt").read_bytes(), multiple=4, streams=2)
    torch.testing.assert_close(torch.tensor(carried["bpb_by_stream"]), torch.tensor(expected["bpb_by_stream"]),
                               rtol=1e-5, atol=1e-5)  # a loaded copy: float32 in the last bits
    model.blocks[0].attn.memory_decay = model.blocks[1].attn.memory_decay = math.exp(-1 / model.config.seq_len)
    forgetting = length_eval(model, (tmp_path / "held_out.txt").read_bytes(), multiple=4, streams=2)
    torch.testing.assert_close(torch.tensor(decayed["bpb_by_stream"]), torch.tensor(forgetting["bpb_by_stream"]),
                               rtol=1e-5, atol=1e-5)
    assert decayed["bpb"] != pytest.approx(carried["bpb"], rel=1e-6)


def test_reading_with_memory_decay_sets_the_ovq_layers_of_a_copy(tmp_path, capsys):
    torch.manual_seed(0)
    model = tiny_model("ovq").eval()
    forgetting = read_with_memory_decay(model, "T")
    assert [b.attn.memory_decay for b in forgetting.blocks] == [math.exp(-1 / model.config.seq_len)] * 2
    assert [b.attn.memory_decay for b in model.blocks] == [None, None]
    assert [b.attn.memory_decay for b in read_with_memory_decay(model, 0.99).blocks] == [0.99, 0.99]
    with pytest.raises(ValueError, match="memory_decay applies to ovq layers; this model's attention is vq_hard"):
        read_with_memory_decay(tiny_model("vq_hard"), "T")
    with pytest.raises(ValueError, match="memory_decay=1e-09 forgets too fast"):
        read_with_memory_decay(model, 1e-9)
    _checkpoint(model, tmp_path / "last.ckpt")
    (tmp_path / "held_out.txt").write_bytes(bytes(range(17)) * 30)
    args = [str(tmp_path / "last.ckpt"), "--multiple", "4", "--streams", "2", "--text", str(tmp_path / "held_out.txt")]
    assert main([*args, "--memory-decay", "T", "--out", str(tmp_path / "T")]) == 0
    got = json.loads((tmp_path / "T" / "length_eval.json").read_text())
    expected = length_eval(forgetting, (tmp_path / "held_out.txt").read_bytes(), multiple=4, streams=2)
    assert got["bpb"] == pytest.approx(expected["bpb"], rel=1e-5) and got["memory_decay"] == "T"
    with pytest.raises(SystemExit):
        main([*args, "--memory-decay", "slow"])
    assert "argument --memory-decay: a number in (0, 1] or T, got 'slow'" in capsys.readouterr().err
