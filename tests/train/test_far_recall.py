"""The far-recall sweep driver (benchmarks/far_recall.py) and the report's recall-against-state reading of a sweep
(best learning rate per cell, mean over seeds; Zoology's figure)."""

import importlib.util
import json
from pathlib import Path

import pytest
from hydra.utils import instantiate
from test_train import cfg_for

from vqattn.layers import ATTENTIONS
from vqattn.train.report import draw_recall_vs_state, recall_cells, recall_table
from vqattn.train.report import main as report

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("far_recall", ROOT / "benchmarks" / "far_recall.py")
far_recall = importlib.util.module_from_spec(spec)
spec.loader.exec_module(far_recall)


def state_floats(*overrides):
    cfg = cfg_for("experiment=mqar_far", *overrides)
    return instantiate(cfg.module, _convert_="all").model.state_floats(cfg.data.seq_len)


@pytest.mark.parametrize("attention", [a for a in far_recall.ATTENTIONS if a in ATTENTIONS])
def test_each_size_override_sets_the_state_size(attention):
    knob = far_recall.size_override(attention, 16)
    if knob is None:  # a single size: the runs differ by rate and seed only
        assert {n for n, _ in far_recall.plan([attention], [16, 64], [1e-3], [0])} == {f"{attention}_lr0.001_seed0"}
        return
    sizes = [state_floats(f"attention={attention}", far_recall.size_override(attention, s)) for s in (16, 64)]
    assert sizes[0] < sizes[1]


def test_plan_is_the_full_grid_with_distinct_run_names():
    runs = far_recall.plan(["softmax", "vq_hard"], [16, 64], [1e-3, 3e-3], [0, 1, 2])
    assert len(runs) == (1 + 2) * 2 * 3 and len({name for name, _ in runs}) == len(runs)
    assert ("vq_hard_s64_lr0.003_seed2",
            ["attention=vq_hard", "attention.kwargs.num_codes=64", "optim.lr=0.003", "seed=2"]) in runs


def test_dry_run_lists_the_runs_and_leaves_out_unregistered_attentions(tmp_path, capsys):
    code = far_recall.main([str(tmp_path), "--attentions", "softmax,nope", "--lrs", "1e-3", "--seeds", "0,1",
                            "--dry-run", "--", "trainer.max_steps=5"])
    out, err = capsys.readouterr()
    assert code == 0 and "nope" in err and out.splitlines()[-1] == "2 runs"
    assert "softmax_lr0.001_seed1 attention=softmax optim.lr=0.001 seed=1 trainer.max_steps=5" in out
    assert list(tmp_path.iterdir()) == []


def mqar_result(attention, state, lr, seed, recall):
    return {"attention": attention, "state_floats": state, "lr": lr, "seed": seed, "recall_acc": recall}


def test_recall_cells_take_the_best_rate_of_each_cell_averaged_over_seeds():
    runs = [mqar_result("vq", 100, 1e-3, s, r) for s, r in enumerate([0.2, 0.9, 0.4])]  # mean 0.5
    runs += [mqar_result("vq", 100, 3e-3, s, r) for s, r in enumerate([0.6, 0.6, 0.6])]  # mean 0.6: the best
    runs += [mqar_result("vq", 400, 1e-3, s, r) for s, r in enumerate([0.8, 1.0])]
    runs += [mqar_result("softmax", 900, 1e-3, 0, 1.0), {"attention": "lm", "val_bpb": 2.0, "state_floats": 5}]
    cells = recall_cells(runs)
    assert [(c["attention"], c["state_floats"]) for c in cells] == [("softmax", 900), ("vq", 100), ("vq", 400)]
    vq100 = cells[1]
    assert vq100["lr"] == 3e-3 and vq100["recall"] == pytest.approx(0.6) and vq100["seeds"] == 3
    assert vq100["rates"] == 2 and vq100["min"] == vq100["max"] == 0.6
    assert cells[2]["recall"] == pytest.approx(0.9) and (cells[2]["min"], cells[2]["max"]) == (0.8, 1.0)
    assert "| vq | 100 | 0.003 | 0.6000 |" in recall_table(cells)


def test_recall_against_state_figure_one_line_per_attention_on_log_state(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = recall_cells([mqar_result("vq", s, 1e-3, 0, r) for s, r in ((400, 0.9), (100, 0.3))]
                         + [mqar_result("softmax", 900, 1e-3, 0, 1.0)])
    fig, ax = plt.subplots()
    draw_recall_vs_state(ax, cells)
    lines = {bars.get_label(): bars.lines[0] for bars in ax.containers}  # errorbar: (data line, caps, bars)
    assert set(lines) == {"softmax", "vq"} and list(lines["vq"].get_xdata()) == [100, 400]
    assert ax.get_xscale() == "log"
    plt.close(fig)
    for i, (attention, state, recall) in enumerate([("vq", 100, 0.3), ("vq", 400, 0.9), ("softmax", 900, 1.0)]):
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        result = {**mqar_result(attention, state, 1e-3, 0, recall), "val_bpb": 5.0, "tokens_per_sec": 1.0,
                  "params": 1, "peak_memory_mb": 1.0, "steps": 3}
        (run_dir / "results.json").write_text(json.dumps(result))
    assert report([str(tmp_path)]) == 0
    assert (tmp_path / "recall_vs_state.png").read_bytes()[:4] == b"\x89PNG"
    assert "Recall against state" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_the_driver_trains_the_grid_skips_finished_runs_and_reports(tmp_path, capsys):
    # a grid of one run (each run is a process of seconds of start-up): its size override reaches the run, whose
    # state is that size's; that each size override sets the state size, and the plan of a larger grid, are tested
    # above
    model = ["model.n_embd=32", "model.n_head=2"]
    args = [str(tmp_path), "--attentions", "vq_hard", "--sizes", "8", "--lrs", "1e-3", "--seeds", "0",
            "--threads", "1", "--", "trainer.max_steps=2", "trainer.enable_model_summary=false", *model,
            "data.batch_size=2", "data.num_val_examples=4"]
    assert far_recall.main(args) == 0
    results = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.rglob("results.json")}
    assert sorted(results) == ["vq_hard_s8_lr0.001_seed0"]
    (result,) = results.values()
    assert result["state_floats"] == state_floats("attention=vq_hard", "attention.kwargs.num_codes=8", *model)
    assert state_floats("attention=vq_hard", *model) != result["state_floats"]  # the default size's differs
    assert result["steps"] == 2 and result["lr"] == 1e-3 and result["seed"] == 0
    assert (tmp_path / "recall_vs_state.png").exists()
    before = {p: p.stat().st_mtime for p in tmp_path.rglob("results.json")}
    assert far_recall.main(args) == 0  # everything finished: nothing retrained
    assert {p: p.stat().st_mtime for p in tmp_path.rglob("results.json")} == before


figure_spec = importlib.util.spec_from_file_location("far_recall_figure", ROOT / "benchmarks" / "far_recall_figure.py")
far_recall_figure = importlib.util.module_from_spec(figure_spec)
figure_spec.loader.exec_module(far_recall_figure)


def test_the_docs_figure_is_drawn_from_the_measured_points(tmp_path):
    """docs/far_recall_points.csv, the runs behind docs/far_recall.md's tables: every row a registered attention of
    the sweep, and the figure drawn from them with one line per attention."""
    points = far_recall_figure.read_points(ROOT / "docs" / "far_recall_points.csv")
    assert {p["attention"] for p in points} <= set(far_recall.ATTENTIONS)
    cells = recall_cells(points)
    assert {c["attention"] for c in cells} >= {"softmax", "ovq", "gated_deltanet", "deltanet", "mamba2"}
    out = tmp_path / "figure.png"
    far_recall_figure.main([str(ROOT / "docs" / "far_recall_points.csv"), str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_point_out_of_range_names_its_line(tmp_path):
    bad = tmp_path / "points.csv"
    bad.write_text("attention,state_floats,lr,seed,recall,date,commit,machine\n"
                   "ovq,100,0.002,0,0.5,d,c,m\novq,100,0.002,1,1.5,d,c,m\n")
    with pytest.raises(ValueError, match=r"line 3: recall must be in \[0, 1\]"):
        far_recall_figure.read_points(bad)
    bad.write_text("attention,recall\novq,0.5\n")
    with pytest.raises(ValueError, match="missing columns state_floats, lr, seed, date, commit, machine"):
        far_recall_figure.read_points(bad)
