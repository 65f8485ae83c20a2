"""The long-context experiments (long, long_carry, mqar_long): Hydra composition, what they promise (codebook
share, query gaps), the state-size sweep, the report's state_floats and recall columns; exact resume with carried
state, a DDP carried run and an mqar_long smoke run (slow)."""

import json
import re
import signal

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from test_train import FAST, cfg_for, finish_script, run_inprocess, start_script, val_rows, wait_for

from vqattn.model import IGNORE_INDEX
from vqattn.train.report import markdown_table

LONG_ATTENTIONS = ["softmax", "vq_hard", "vq_soft", "performer", "linear"]


def compressed_share(seq_len: int, block_len: int) -> float:
    """Share of causal query-key pairs (j <= i) outside the raw window [(i // L - 1) L, i] of query i."""
    i = np.arange(seq_len)
    raw = i - np.maximum(0, (i // block_len - 1) * block_len) + 1
    return 1 - raw.sum() / (seq_len * (seq_len + 1) / 2)


@pytest.mark.parametrize("experiment", ["long", "long_carry"])
@pytest.mark.parametrize("attention", LONG_ATTENTIONS)
def test_long_experiments_compose_for_every_attention(experiment, attention):
    cfg = cfg_for(f"experiment={experiment}", f"attention={attention}")
    assert cfg.data.seq_len == cfg.model.seq_len >= 2048 and cfg.model.pos_emb in ("rope", "none")
    assert cfg.data._target_.endswith("StdlibDataModule") and cfg.data.val_carried
    assert cfg.carry_state == cfg.data.stream == cfg.module.carry_state == (experiment == "long_carry")
    module = instantiate(cfg.module, _convert_="all")
    if attention.startswith("vq"):
        block_len = module.model.blocks[0].attn.block_len
        assert block_len <= 64 and compressed_share(cfg.model.seq_len, block_len) > 0.94
    assert (module.carry is not None) == cfg.carry_state
    data = instantiate(cfg.data)
    assert data.stream == cfg.carry_state and data.stream_groups == (8 if cfg.carry_state else 1)


def test_compressed_share_counts_pairs():
    assert compressed_share(8, 4) == 0  # L = 4: queries 0..7 lie in blocks 0 and 1 and see every key raw
    assert compressed_share(12, 4) == pytest.approx(4 * 4 / 78)  # queries 8..11 see keys 0..3 through codes


@pytest.mark.parametrize("experiment", ["mqar_long", "mqar_far"])
def test_mqar_validation_queries_lie_beyond_what_the_windows_of_all_layers_reach(experiment):
    cfg = cfg_for(f"experiment={experiment}", "attention=vq_hard")
    block_len, layers, conv = cfg.attention.kwargs.block_len, cfg.model.n_layer, cfg.model.short_conv
    reach = layers * (2 * block_len + conv - 1)  # raw window plus short convolution, layer after layer
    assert cfg_for(f"experiment={experiment}", "attention=window").attention.kwargs.block_len == block_len
    assert cfg.data.val_min_query_gap > reach
    dm = instantiate(cfg.data)
    dm.setup()
    x, y = dm.val_set.tensors
    assert x.shape == (cfg.data.num_val_examples, cfg.model.seq_len)
    pairs = cfg.data.num_kv_pairs
    for xs, ys in zip(x.tolist(), y.tolist()):
        value_at = {xs[2 * j]: 2 * j + 1 for j in range(pairs)}
        queries = [i for i, t in enumerate(ys) if t != IGNORE_INDEX]
        assert len(queries) == pairs and all(i - value_at[xs[i]] > reach for i in queries)
    _, y_train = dm._train_batch(np.random.default_rng(0))
    assert ((y_train != IGNORE_INDEX).float().argmax(dim=1) < 2 * pairs + 2 * block_len).any()  # near queries train
    for attention in LONG_ATTENTIONS:
        instantiate(cfg_for(f"experiment={experiment}", f"attention={attention}").module, _convert_="all")


def test_state_size_sweep_overrides_change_state_floats():
    def floats(*overrides):
        cfg = cfg_for("experiment=mqar_long", *overrides)
        return instantiate(cfg.module, _convert_="all").model.state_floats(cfg.data.seq_len)

    vq = [floats("attention=vq_hard", f"attention.kwargs.num_codes={s}") for s in (16, 64, 256)]
    performer = [floats("attention=performer", f"+attention.kwargs.features.num_features={m}") for m in (32, 128)]
    assert vq[0] < vq[1] < vq[2] and vq[2] - vq[1] == 4 * (vq[1] - vq[0])  # S (Dh + 1) per head, plus the window
    assert performer[0] < performer[1]
    cfg = cfg_for("experiment=mqar_long")
    conv = (cfg.model.short_conv - 1) * 3 * cfg.model.n_embd  # the short convolution's last projections
    assert floats("attention=softmax") == 2 * cfg.model.seq_len * cfg.model.n_embd + conv


def fake_run(name, attention, bpb, acc, state, data="MQARDataModule"):
    run = {"name": name, "attention": attention, "val_bpb": bpb, "val_acc": acc, "state_floats": state, "data": data,
           "tokens_per_sec": 1000.0, "params": 10, "peak_memory_mb": 1.0, "steps": 5}
    return {**run, "recall_acc": acc} if data == "MQARDataModule" else run  # as train.py writes results.json


def test_report_shows_state_floats_and_ranks_mqar_by_recall():
    runs = [fake_run("a", "vq_hard", 3.0, 0.95, 24832), fake_run("b", "performer", 2.0, 0.40, 16896)]
    table = markdown_table(runs).splitlines()
    assert "recall" in table[0] and "state floats" in table[0]
    assert table[2].startswith("| a | vq_hard | 0.9500 |") and "24,832" in table[2]  # best recall first
    lm = markdown_table([fake_run("a", "vq_hard", 3.0, 0.5, 1, "StdlibDataModule"),
                         fake_run("b", "softmax", 2.0, 0.6, 2, "StdlibDataModule")]).splitlines()
    assert "recall" not in lm[0] and lm[2].startswith("| b | softmax | 2.0000 |")  # best bpb first


def test_code_version_names_the_checkout():
    import re

    from vqattn.train.cli import code_version

    assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?|vqattn \S+", code_version())


def test_report_names_the_code_and_the_process_wide_peak():
    """The table and the figure's caption name the commit, date and device of results.json; a multirun's later CPU
    runs report their process's peak so far, and the table says what that is."""
    from vqattn.train.report import provenance

    runs = [{**fake_run("a", "window", 3.0, 0.5, 1, "StdlibDataModule"), "code": "abc1234", "date": "2026-11-28",
             "device": "cpu (x86_64, 1 threads)", "peak_memory_kind": kind}
            for kind in ("cpu_max_rss", "cpu_max_rss_of_process")]
    assert provenance(runs) == "code abc1234, run 2026-11-28; cpu (x86_64, 1 threads); corpus StdlibDataModule"
    table = markdown_table(runs)
    assert "- code: abc1234; run 2026-11-28" in table and "cpu_max_rss_of_process: the process's peak" in table
    assert "of_process" not in markdown_table(runs[:1])


@pytest.mark.slow
def test_resume_with_carried_state_10_plus_10_equals_20_straight(tmp_path):
    # two stream groups: the checkpoint at step 10 holds both groups' states, mid-sequence (a reset every 32 steps)
    common = ["carry_state=true", "data.stream_groups=2", "attention=vq_hard", "optim.total_steps=20",
              "trainer.val_check_interval=10", "checkpoint_every=10"]
    first, a = run_inprocess(tmp_path, "a", *common, "trainer.max_steps=10")
    ckpt = a / "checkpoints" / "last.ckpt"
    resumed, b = run_inprocess(tmp_path, "b", *common, "trainer.max_steps=20", f"ckpt_path={ckpt}")
    straight, c = run_inprocess(tmp_path, "c", *common, "trainer.max_steps=20")
    assert resumed["steps"] == straight["steps"] == 20 and straight["carry_state"]
    for key in ("val_loss", "val_loss_carried"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-7), key
    # metrics.csv: the resumed run writes the validation at step 20 once, as the straight run does
    final_b, final_c = ({int(r["step"]): float(r["val_bpb_carried"]) for r in val_rows(d)} for d in (b, c))
    assert list(final_b) == [20] and final_b[20] == pytest.approx(final_c[20], rel=1e-6)
    # the test can fail: resuming without the carried state (a fresh state at step 10) gives another run
    stored = torch.load(ckpt, weights_only=True)
    del stored["carry_state"]
    torch.save(stored, tmp_path / "stateless.ckpt")
    fresh, _ = run_inprocess(tmp_path, "d", *common, "trainer.max_steps=20", f"ckpt_path={tmp_path / 'stateless.ckpt'}")
    assert fresh["val_loss"] != pytest.approx(straight["val_loss"], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_sigterm_to_rank_0_alone_stops_a_ddp_carried_run_and_it_resumes_exactly(tmp_path):
    """SIGTERM (preemption, docker stop, cluster time limits) finishes the step, saves it and prints the resume
    command, as Ctrl-C does (tests/train/test_train.py). docker stop signals the main process only: rank 1 hears of
    it through the per-step all-reduce and stops at the same step (a rank that went on would hang the checkpoint's
    collective save). The checkpoint holds both ranks' carried states, and the run resumed from it ends as one never
    stopped. (One stopped run serves both: a DDP run is two processes of start-up.)"""
    common = [*FAST, "carry_state=true", "attention=vq_hard", "trainer=ddp", "trainer.accelerator=cpu",
              "trainer.devices=2", "optim.total_steps=2000", "checkpoint_every=3"]

    def run(name, *extra):
        return start_script([*common, *extra, f"hydra.run.dir={tmp_path / name}"], tmp_path)

    checkpoint = tmp_path / "a" / "checkpoints" / "last.ckpt"
    proc = run("a", "trainer.max_steps=2000")
    wait_for(checkpoint, proc)
    proc.send_signal(signal.SIGTERM)
    stopped = finish_script(proc, timeout=120)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    step = int(re.search(r"terminated \(SIGTERM\) at step (\d+): saved", stopped.stderr).group(1))
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["global_step"] == step and saved["callbacks"]["RNGState"]["world_size"] == 2
    assert stopped.stderr.count("resume with:") == 1  # from rank 0 alone
    assert "Traceback" not in stopped.stderr and "aborted" not in stopped.stderr  # saved, not stopped at once
    assert "Traceback" not in (tmp_path / "a" / "rank1.log").read_text()
    stored = saved["carry_state"]
    assert stored["world_size"] == 2 and len(stored["states"]) == 2  # both ranks' rows are kept, and differ
    # each rank's states by stream group: one group here
    counts = [s[0]["fields"]["layers"][0]["fields"]["inner"]["fields"]["counts"] for s in stored["states"]]
    assert counts[0].shape == counts[1].shape and not torch.equal(*counts)
    # b resumes a; c runs as many steps straight: independent, side by side
    total = f"trainer.max_steps={step + 4}"
    b_and_c = {"b": run("b", total, f"ckpt_path={checkpoint}"), "c": run("c", total)}
    runs = {}
    for name, proc in b_and_c.items():
        finished = finish_script(proc)
        assert finished.returncode == 0, finished.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    assert runs["b"]["world_size"] == 2 and runs["b"]["steps"] == step + 4
    for key in ("val_loss", "val_loss_carried"):
        assert runs["b"][key] == pytest.approx(runs["c"][key], rel=1e-6, abs=1e-7), key


@pytest.mark.slow
def test_mqar_long_smoke_run(tmp_path):
    from vqattn.train import cli

    cfg = cfg_for("trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "experiment=mqar_long",
                  "attention=vq_hard", "model.n_embd=32", "model.n_head=2", "data.batch_size=2",
                  "data.num_val_examples=4", "trainer.max_steps=3", "trainer.val_check_interval=3")
    results = cli.train(cfg, tmp_path)
    assert results["steps"] == 3 and results["seq_len"] == 512 and 0.0 <= results["val_acc"] <= 1.0
    # state_floats: codes of every head, the raw window of 2 x 64 keys and values, 3 rows of q/k/v for the convolution
    assert results["state_floats"] == 2 * 64 * (16 + 1) + 2 * 128 * 32 + 3 * 3 * 32


def fake_run_dir(root, name, attention, curve, by_position=None, **results):
    """A run dir as train.py leaves it: results.json and the validation rows of metrics.csv."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    step, bpb = curve[-1]
    run = {**fake_run(name, attention, bpb, 0.5, 1000, "StdlibDataModule"), "steps": step, **results}
    if by_position:
        run["val_bpb_by_position"] = by_position
    run.pop("name")
    (run_dir / "results.json").write_text(json.dumps(run))
    rows = "".join(f"0,{s},{b}\n" for s, b in curve)
    (run_dir / "metrics.csv").write_text("epoch,step,val_bpb\n" + rows)
    return run_dir


def test_report_writes_the_pngs_of_fake_run_dirs(tmp_path):
    from vqattn.train.report import main

    positions = {"0_63": 3.0, "64_255": 2.5, "256_1023": 2.4}
    fake_run_dir(tmp_path, "0_softmax", "softmax", [(20, 2.9)], positions)
    fake_run_dir(tmp_path, "1_window", "window", [(20, 2.9)], {**positions, "256_1023": 2.6})
    assert main([str(tmp_path)]) == 0
    for name in ("val_bpb.png", "by_position.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG", name
    assert "| 0_softmax | softmax |" in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "recall_vs_state.png").exists()  # language-model runs: no recall figure


def drawn(draw, data):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    draw(ax, data)
    fig.canvas.draw()
    return fig, ax


def test_one_validation_per_run_gives_integer_step_ticks_and_equal_curves_stay_apart(tmp_path):
    import matplotlib.pyplot as plt

    from vqattn.train.report import draw_curves, load_runs

    for i in range(3):  # three setups, each validated once at step 20 with the same bpb
        fake_run_dir(tmp_path, f"{i}_vq", "vq_hard", [(20, 2.9)], lr=10.0**-i)
    fig, ax = drawn(draw_curves, load_runs(tmp_path))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["20"]  # not 19.00 ... 21.00
    styles = {(line.get_linestyle(), line.get_marker()) for line in ax.get_lines()}
    assert len(styles) == 3  # identical points drawn with different markers and line styles
    plt.close(fig)
    many = tmp_path / "many"
    fake_run_dir(many, "a", "softmax", [(s, 3.0 - s / 1000) for s in range(0, 1001, 50)])
    fig, ax = drawn(draw_curves, load_runs(many))
    assert all(float(t).is_integer() for t in ax.get_xticks())
    plt.close(fig)


def test_position_figure_draws_bucket_midpoints_on_a_log_axis(tmp_path):
    import matplotlib.pyplot as plt

    from vqattn.train.report import draw_positions, load_runs

    fake_run_dir(tmp_path, "a", "softmax", [(5, 2.0)], {"64_255": 2.5, "0_63": 3.0})
    fig, ax = drawn(draw_positions, load_runs(tmp_path))
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [31.5, 159.5] and list(line.get_ydata()) == [3.0, 2.5]
    assert ax.get_xscale() == "log"
    plt.close(fig)


def seed_run_dir(root, name, attention, seed, curve, overrides=(), **results):
    """A Hydra run dir: fake_run_dir's files plus .hydra/config.yaml and overrides.yaml, which name the seed."""
    run_dir = fake_run_dir(root, name, attention, curve, seed=seed, **results)
    (run_dir / ".hydra").mkdir()
    config = {"seed": seed, "threads": "auto", "attention": {"name": attention}, "optim": {"lr": 0.002}}
    for override in overrides:
        key, value = override.split("=")
        config["optim"][key.split(".")[1]] = float(value)
    (run_dir / ".hydra" / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    (run_dir / ".hydra" / "overrides.yaml").write_text(json.dumps([f"attention={attention}", f"seed={seed}",
                                                                   *overrides]))
    return run_dir


def test_a_report_pools_runs_that_differ_only_in_seed(tmp_path):
    """A sweep over seeds got one row per run and no mean or spread: now each setup is one row of mean, standard
    deviation, min – max and count, and one line of the figure, the mean with bars spanning the seeds."""
    import matplotlib.pyplot as plt

    from vqattn.train.report import draw_curves, load_runs, main

    for seed, curve in enumerate([[(10, 2.6), (20, 2.0)], [(10, 2.8), (20, 2.1)], [(10, 2.7), (20, 2.3)]]):
        seed_run_dir(tmp_path, f"{seed}_vq_soft", "vq_soft", seed, curve)
    seed_run_dir(tmp_path, "3_vq_soft", "vq_soft", 0, [(10, 2.9), (20, 2.5)], ["optim.lr=0.001"], lr=0.001)
    seed_run_dir(tmp_path, "4_softmax", "softmax", 0, [(10, 2.5), (20, 1.9)])
    assert main([str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    pooled = report[report.index("Over seeds"):].splitlines()
    assert pooled[2].startswith("| setup | runs | seeds | val bpb mean | std | min – max |")
    assert pooled[4:7] == ["| softmax | 1 | 0 | 1.9000 | 0.0000 | 1.9000 – 1.9000 | 1,000 |",
                           "| vq_soft (0_vq_soft) | 3 | 0, 1, 2 | 2.1333 | 0.1528 | 2.0000 – 2.3000 | 1,000 |",
                           "| vq_soft (optim.lr=0.001) | 1 | 0 | 2.5000 | 0.0000 | 2.5000 – 2.5000 | 1,000 |"]
    fig, ax = drawn(draw_curves, load_runs(tmp_path))
    [bars] = ax.containers  # the one setup with several seeds
    assert bars.get_label() == "vq_soft (0_vq_soft), mean of 3 seeds (bars: min–max)"
    line, _, (segments,) = bars
    assert list(line.get_xdata()) == [10, 20] and list(line.get_ydata()) == pytest.approx([2.7, 2.1333333])
    assert [tuple(seg[:, 1]) for seg in segments.get_segments()] == pytest.approx([(2.6, 2.8), (2.0, 2.3)])
    assert sorted(ax.get_legend_handles_labels()[1])[0] == "softmax"  # a single run's legend is its attention
    plt.close(fig)


def test_a_single_runs_legend_names_its_attention(tmp_path):
    """A report of one run dir (``report OUT``) labelled its line "vq_soft (.)"."""
    import matplotlib.pyplot as plt

    from vqattn.train.report import draw_curves, load_runs

    run_dir = fake_run_dir(tmp_path, "run", "vq_soft", [(10, 2.5), (20, 2.2)])
    fig, ax = drawn(draw_curves, load_runs(run_dir))
    assert ax.get_legend_handles_labels()[1] == ["vq_soft"]
    plt.close(fig)


def test_every_report_states_the_corpus_tokenizer_threads_device_and_code_of_its_runs(tmp_path):
    from vqattn.train.report import main

    corpus = {"name": "text", "source": "notes/*.txt", "train_bytes": 95_000, "val_bytes": 5_000}
    for i, threads in enumerate([1, 2]):
        fake_run_dir(tmp_path, f"{i}_softmax", "softmax", [(20, 2.0 + i)], seed=i, corpus=corpus, tokenizer="bytes",
                     threads=threads, device=f"cpu (x86_64, {threads} threads)", code="abc1234", date="2026-12-01")
    assert main([str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    for line in ("- corpus: text from notes/*.txt, 95,000 train / 5,000 validation bytes", "- tokenizer: bytes",
                 "- threads: 1; 2", "- device: cpu (x86_64, 1 threads); cpu (x86_64, 2 threads)",
                 "- code: abc1234; run 2026-12-01"):
        assert line in report.splitlines(), line
    assert ("tokens/s are not comparable across these runs: they ran with different threads or devices "
            "(1 threads on cpu (x86_64, 1 threads); 2 threads on cpu (x86_64, 2 threads))") in report
    assert "| 0_softmax | softmax | 2.0000 | 1,000 | 1 |" in report  # each row's threads beside its tokens/s
    one = tmp_path / "one"
    fake_run_dir(one, "a", "softmax", [(20, 2.0)], threads=1, device="cpu (x86_64, 1 threads)")
    assert main([str(one)]) == 0
    assert "not comparable" not in (one / "report.md").read_text()
