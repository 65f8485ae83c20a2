"""Trainer glue: per-rank RNG state, metrics.csv continued on resume, DDP argv, environment restore, errors."""

import csv
import io
import os
import signal
import warnings
from types import SimpleNamespace

import pytest
import torch

from vqattn.checkpoint import model_config, read_checkpoint
from vqattn.train import cli, launch, lifecycle
from vqattn.train.callbacks import GracefulInterrupt, ParamSummary, RNGState, StepProgressBar, TokenThroughput
from vqattn.train.loggers import RunCSVLogger, extra_loggers
from vqattn.train.report import markdown_table


def fake_trainer(rank, world):
    return SimpleNamespace(global_rank=rank, world_size=world, strategy=SimpleNamespace(root_device=torch.device("cpu")))


def test_each_rank_gets_its_own_rng_state_back():
    states = []
    for seed in (10, 11):  # what ranks 0 and 1 held when the checkpoint was saved
        torch.manual_seed(seed)
        states.append(torch.get_rng_state())
    expected = [torch.rand(3, generator=torch.Generator().manual_seed(s)) for s in (10, 11)]
    saved = {"world_size": 2, "cpu": torch.stack(states)}
    for rank in (0, 1):
        callback = RNGState()
        callback.setup(fake_trainer(rank, 2), None, "fit")
        torch.manual_seed(99)
        callback.load_state_dict(saved)
        torch.testing.assert_close(torch.rand(3), expected[rank])


def test_single_process_state_round_trip_and_world_size_mismatch():
    callback = RNGState()
    callback.setup(fake_trainer(0, 1), None, "fit")
    torch.manual_seed(5)
    state = callback.state_dict()
    assert state["cpu"].shape[0] == 1
    after = torch.rand(4)
    callback.load_state_dict(state)
    torch.testing.assert_close(torch.rand(4), after)
    other = RNGState()
    other.setup(fake_trainer(0, 2), None, "fit")
    with pytest.warns(UserWarning, match="from 1 ranks"):
        other.load_state_dict(state)


def test_metrics_csv_is_continued_from_the_resume_step(tmp_path):
    path = tmp_path / "metrics.csv"
    rows = [{"step": s, "train_loss": 1.0 / (s + 1), "val_bpb": ""} for s in (9, 19, 20, 29)]
    rows.insert(2, {"step": 20, "train_loss": "", "val_bpb": 5.0})  # the validation after step 20
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "train_loss", "val_bpb"])
        writer.writeheader()
        writer.writerows(rows)
    logger = RunCSVLogger(tmp_path, resume_step=20)
    logger.log_metrics({"train_loss": 0.5}, step=20)  # the resumed run's 21st batch
    logger.save()
    logger.log_metrics({"train_loss": 0.25, "val_acc": 0.5}, step=21)  # a new column: the header is rewritten
    logger.finalize("success")
    with path.open(newline="") as f:
        rows = [(int(r["step"]), r["train_loss"], r["val_bpb"]) for r in csv.DictReader(f)]
    # kept: everything up to the checkpoint, including the validation after its step; dropped: the old 21st batch
    assert rows == [(9, "0.1", ""), (19, "0.05", ""), (20, "", "5.0"), (20, "0.5", ""), (21, "0.25", "")]
    with path.open(newline="") as f:
        assert next(csv.reader(f)) == ["step", "train_loss", "val_acc", "val_bpb"]


def test_a_run_dir_holding_hydra_files_is_not_warned_about(tmp_path):
    (tmp_path / "train.log").write_text("log\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = RunCSVLogger(tmp_path)
        logger.log_metrics({"train_loss": 1.0}, step=0)
        logger.save()
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]
    assert (tmp_path / "train.log").read_text() == "log\n"


def test_ddp_child_argv():
    argv = ["train.py", "-m", "attention=a,b"]
    assert launch.ddp_child_argv(argv, {}) == argv
    child = {"LOCAL_RANK": "1", launch.DDP_ARGV: '["attention=a", "hydra.run.dir=\\"/x\\""]'}
    assert launch.ddp_child_argv(argv, child) == ["train.py", "attention=a", 'hydra.run.dir="/x"', "hydra.job.name=rank1"]
    assert launch.ddp_child_argv(["train.py", "x=1"], {"RANK": "3"}) == ["train.py", "x=1", "hydra.output_subdir=null"]


def test_restore_environ_undoes_only_the_changes(monkeypatch):
    monkeypatch.setenv("VQATTN_KEEP", "1")
    monkeypatch.setenv("VQATTN_CHANGED", "old")
    monkeypatch.delenv("VQATTN_ADDED", raising=False)
    before = dict(os.environ)
    os.environ["VQATTN_CHANGED"] = "new"
    os.environ["VQATTN_ADDED"] = "x"
    lifecycle.restore_environ(before)
    assert os.environ["VQATTN_CHANGED"] == "old" and "VQATTN_ADDED" not in os.environ
    assert os.environ["VQATTN_KEEP"] == "1"


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", b"PK\x03\x04 truncated zip"])
def test_an_invalid_checkpoint_is_one_safe_line(tmp_path, content):
    path = tmp_path / "bad.ckpt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a valid checkpoint") as info:
        read_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and "weights_only" not in message
    with pytest.raises(FileNotFoundError):
        read_checkpoint(tmp_path / "missing.ckpt")
    torch.save({"something": 1}, path)
    with pytest.raises(ValueError, match="not a Lightning checkpoint"):
        read_checkpoint(path)


def test_model_errors_name_the_model_key():
    with pytest.raises(ValueError, match=r"^model\.seq_len must be a positive int, got -1"):
        model_config({"seq_len": -1})
    with pytest.raises(ValueError, match=r"^unknown attention"):
        model_config({"attention": "nope"})


def test_user_errors_are_one_line_and_bugs_are_not():
    assert lifecycle.user_error(ValueError("data.x must be 1\nmore")) == "ValueError: data.x must be 1"
    assert lifecycle.user_error(RuntimeError("a bug")) is None


def test_mqar_report_ranks_by_recall_accuracy():
    run = dict(attention="a", tokens_per_sec=1.0, params=1, peak_memory_mb=1.0, steps=1)
    runs = [{**run, "name": "worse", "val_bpb": 7.0, "recall_acc": 0.4},
            {**run, "name": "better", "val_bpb": 7.2, "recall_acc": 0.9}]
    table = markdown_table(runs)
    assert "recall acc" in table and table.index("| better |") < table.index("| worse |")


def test_extra_loggers_are_built_from_their_target_with_the_run_dir(tmp_path):
    from omegaconf import OmegaConf

    node = {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": None, "name": "extra"}
    [logger] = extra_loggers(OmegaConf.create({"csv": node}), tmp_path)
    assert logger.save_dir == str(tmp_path) and logger.name == "extra"
    [logger] = extra_loggers(OmegaConf.create({"csv": {**node, "save_dir": str(tmp_path / "x")}}), tmp_path)
    assert logger.save_dir == str(tmp_path / "x")
    with pytest.raises(ValueError, match="logger.bad must be a config with a _target_"):
        extra_loggers(OmegaConf.create({"bad": 1}), tmp_path)


@pytest.mark.parametrize("disable", [True, False])  # ranks > 0 have a disabled bar
def test_the_step_bar_continues_at_the_resumed_step(disable):
    from tqdm import tqdm

    bar = StepProgressBar()
    bar.train_progress_bar = tqdm(disable=disable, file=io.StringIO())
    bar._reset(SimpleNamespace(max_steps=10, global_step=3))
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 10)


@pytest.mark.parametrize("ending", ["on_train_end", "on_exception"])
def test_graceful_interrupt_gives_the_sigint_and_sigterm_handlers_back_however_training_ends(ending):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    callback = GracefulInterrupt()
    callback.on_train_start(None, None)
    assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == callback._handler
    args = (RuntimeError("the real error"),) if ending == "on_exception" else ()
    getattr(callback, ending)(None, None, *args)  # the arguments Lightning passes
    assert {s: signal.getsignal(s) for s in before} == before


class FakeStrategy:
    """Two ranks' DDP collectives for one rank: the other rank's flag and signal are given."""

    def __init__(self, other_stops: bool, other_signal: int = 0):
        self.other_stops, self.other_signal = other_stops, other_signal
        self.root_device = torch.device("cpu")

    def reduce_boolean_decision(self, decision, all=True):
        return decision or self.other_stops

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "max"
        return torch.maximum(tensor, torch.tensor(self.other_signal))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_finishes_the_step_then_a_second_one_raises(monkeypatch, signum):
    from vqattn.train import lifecycle

    monkeypatch.setattr(lifecycle._Signals, "last", signal.SIGINT)  # the handlers set it: back after the test
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    callback = GracefulInterrupt()
    trainer = SimpleNamespace(world_size=1, global_step=7, should_stop=False, limit_val_batches=1.0)
    callback.on_train_start(trainer, None)
    try:
        callback.on_train_batch_end(trainer, None, None, None, 0)
        assert not trainer.should_stop and callback.interrupted_at is None
        signal.raise_signal(signum)  # the handler runs here: it only sets the flag
        callback.on_train_batch_end(trainer, None, None, None, 0)
        assert trainer.should_stop and trainer.limit_val_batches == 0
        assert (callback.interrupted_at, callback.signum) == (7, signum)
        with pytest.raises(KeyboardInterrupt):  # a second one stops at once
            signal.raise_signal(signum)
    finally:
        callback.on_train_end(trainer, None)
    assert {s: signal.getsignal(s) for s in before} == before


def test_under_ddp_every_rank_stops_at_the_step_a_signal_reached_any_rank():
    callback = GracefulInterrupt()
    trainer = SimpleNamespace(world_size=2, global_step=5, should_stop=False, limit_val_batches=1.0,
                              strategy=FakeStrategy(other_stops=False))
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert not trainer.should_stop
    trainer.strategy = FakeStrategy(other_stops=True, other_signal=int(signal.SIGTERM))  # rank 1 got SIGTERM
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.should_stop and (callback.interrupted_at, callback.signum) == (5, signal.SIGTERM)


def test_the_model_summary_has_no_flops_column(caplog):
    data = [(" ", ["0"]), ("Name", ["model"]), ("Type", ["GPT"]), ("Params", ["1.0 K"]), ("FLOPs", ["0"])]
    with caplog.at_level("INFO"):
        ParamSummary.summarize(data, 1000, 1000, 0.004, {"train": 1, "eval": 0}, total_flops=0)
    assert "GPT" in caplog.text and "1.0 K" in caplog.text and "FLOP" not in caplog.text.upper()


class FakeClock:
    """A clock that moves only when told to: seconds are exact, whatever the machine's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fit_timed(throughput, clock, max_steps, val_check_interval=10, ckpt_path=None, tmp_path=None):
    """A BoringModel fit whose training steps take 1 s and validation steps 100 s of ``clock``."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Timed(BoringModel):
        def training_step(self, batch, batch_idx):
            clock.now += 1.0
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            clock.now += 100.0
            return super().validation_step(batch, batch_idx)

    trainer = L.Trainer(max_steps=max_steps, val_check_interval=val_check_interval, limit_val_batches=2,
                        num_sanity_val_steps=0, callbacks=[throughput], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    model = Timed()
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=False)
    return trainer, model


def test_token_throughput_counts_training_time_after_validations_and_not_the_validations():
    clock = FakeClock()
    throughput = TokenThroughput(clock=clock)
    trainer, model = fit_timed(throughput, clock, max_steps=30)
    tokens, seconds = throughput.totals(1)
    assert tokens == 30 * 32  # items per step: batch[0], which for a BoringModel batch (2, 32) is one row of 32
    # All 30 steps count (the clock runs again after each validation) and the 3 validations (600 s) do not.
    assert seconds == 30.0
    assert throughput.wall_seconds() == 30.0 + 3 * 2 * 100.0  # the wall time counts everything
    trainer.validate(model, verbose=False)  # a validation after fit leaves the training clock stopped
    assert throughput.totals(1)[1] == seconds


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended")
def test_token_throughput_totals_continue_across_a_resume(tmp_path):
    clock = FakeClock()
    first = TokenThroughput(clock=clock)
    trainer, _ = fit_timed(first, clock, max_steps=20, tmp_path=tmp_path)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    clock.now += 1000.0  # the time between the two processes counts nowhere
    resumed = TokenThroughput(clock=clock)  # a new process, started now
    clock.now += 5.0  # its start-up
    fit_timed(resumed, clock, max_steps=40, ckpt_path=tmp_path / "half.ckpt", tmp_path=tmp_path)
    assert resumed.totals(1) == (40 * 32, 40.0)  # steps 0-40, however the run was split
    # the first part's 20 steps and 2 validations, the second's start-up, 20 steps and 2 validations
    assert resumed.wall_seconds() == (20.0 + 400.0) + (5.0 + 20.0 + 400.0)


@pytest.mark.parametrize("resumed", [True, False])
def test_the_step_bar_keeps_the_runs_clock_and_rate_across_epochs(monkeypatch, resumed):
    """A resumed run's first epoch is what remained of the interrupted one: at the next epoch the bar's elapsed
    time once jumped back to the parts resumed from, and its rate to that of this process's last steps."""
    from tqdm import tqdm

    from vqattn.train import callbacks

    clock = FakeClock()
    clock.now = 5000.0  # the bar's clock (time.time) reads 5000 s as training starts
    monkeypatch.setattr(callbacks, "time", SimpleNamespace(time=clock))
    totals = TokenThroughput()
    totals.wall_before = 600.0 if resumed else 0.0  # the parts resumed from, restored from the checkpoint
    bar = StepProgressBar()
    bar.run_totals = totals
    bar.train_progress_bar = tqdm(file=io.StringIO())
    trainer = SimpleNamespace(max_steps=100, global_step=40)
    bar._start_clock(trainer)
    bar._reset(trainer)
    tq = bar.train_progress_bar
    assert tq.start_t == 5000.0 - totals.wall_before  # elapsed: the parts resumed from, at the resumed step
    # the rate counts all 40 steps over that elapsed time when it includes the parts resumed from
    assert (tq.initial, tq.n) == (0 if resumed else 40, 40)
    clock.now, trainer.global_step = 5300.0, 70  # 300 s and 30 steps later, a new epoch starts
    bar.on_train_epoch_start(trainer)
    elapsed = clock.now - tq.start_t  # what the bar shows: tqdm's elapsed is its clock's time since start_t
    assert elapsed == 300.0 + totals.wall_before  # the run's, not restarted
    assert (tq.initial, tq.n) == (0 if resumed else 40, 70)
    assert (tq.n - tq.initial) / elapsed == pytest.approx(70 / 900 if resumed else 30 / 300)  # tqdm's rate


def test_idle_cores_are_those_busy_less_than_half_the_time():
    from vqattn.utils import count_idle

    before = {0: (0, 0), 1: (0, 0), 2: (0, 0), 3: (5, 5)}
    after = {0: (10, 100), 1: (90, 100), 2: (50, 100), 3: (5, 5)}  # 90%, 10%, 50% busy; core 3 had no ticks
    assert count_idle(before, after) == 3


def test_threads_auto_takes_the_idle_cores_unless_omp_num_threads_chose(monkeypatch, caplog):
    from vqattn import utils
    from vqattn.utils import available_cores, idle_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert 1 <= idle_cores(0.01) <= available_cores()
    monkeypatch.setattr(utils, "idle_cores", lambda: 1)
    with caplog.at_level("INFO", logger="train"):
        assert cli.run_threads("auto") == 1
    assert caplog.messages == [f"threads=auto: 1 of {available_cores()} cores idle, training with 1 thread"]
    monkeypatch.setattr(utils, "idle_cores", lambda: 10**6)
    assert cli.run_threads("auto") == torch.get_num_threads()  # never more than torch's default
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cli.run_threads("auto") is None  # torch's default, which reads OMP_NUM_THREADS
    assert cli.run_threads(3) == 3 and cli.run_threads(None) is None
    for bad in (0, "four", True, 2.5):
        with pytest.raises(ValueError, match="threads must be a positive int, auto or null"):
            cli.run_threads(bad)


@pytest.mark.parametrize("threads", [2, 1])
def test_a_run_that_slows_down_gets_one_hint_about_threads(monkeypatch, caplog, threads):
    clock = FakeClock()
    throughput = TokenThroughput(window_size=4, clock=clock)  # the median of 3 steps
    trainer = SimpleNamespace(world_size=1, is_global_zero=True)
    module = SimpleNamespace(log_dict=lambda *args, **kwargs: None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    throughput.on_train_start(trainer, module)
    with caplog.at_level("WARNING", logger="train"):
        # steps of 1 s; one step of 60 s (a moment of other work: no hint); 3 s (no hint); then 6 s (one hint)
        for seconds in [1.0] * 6 + [60.0] + [1.0] * 6 + [3.0] * 6 + [6.0] * 8:
            clock.now += seconds
            throughput.on_train_batch_end(trainer, module, None, (torch.zeros(2, 32),), 0)
    hints = [r.getMessage() for r in caplog.records]
    assert hints == (["training runs 6x slower than earlier in this run: if other work took a core, fewer threads "
                      "can be many times faster (Ctrl-C, then resume with threads=1)"] if threads > 1 else [])


@pytest.mark.parametrize("terminal", [False, True])
def test_each_validation_is_one_log_line_and_bars_are_drawn_only_in_a_terminal(tmp_path, capsys, caplog, terminal):
    """Outside a terminal every redraw of a bar was a log line, and train.log had no validation metrics until the end
    of the run: now each validation is one line, in the console only outside a terminal, where training logs plain
    progress lines instead of its bar."""
    import logging

    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Validated(BoringModel):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", float(self.global_step), prog_bar=True)
            return super().validation_step(batch, batch_idx)

    file_log = logging.FileHandler(tmp_path / "train.log")  # as Hydra's train.log handler
    logging.getLogger().addHandler(file_log)
    try:
        trainer = L.Trainer(max_steps=6, val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=1,
                            callbacks=[StepProgressBar(terminal=terminal)], logger=False,
                            enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
        with caplog.at_level("INFO", logger="train"):
            trainer.fit(Validated())
    finally:
        logging.getLogger().removeHandler(file_log)
        file_log.close()
    lines = ["validation at step 3/6: val_loss 3.0000", "validation at step 6/6: val_loss 6.0000"]
    assert [line for line in (tmp_path / "train.log").read_text().splitlines() if "validation" in line] == lines
    console = capsys.readouterr().out
    assert ("Validation" in console and "Sanity" in console) == terminal  # the bars
    assert ("Training:" in console and "6/6" in console) == terminal  # the training bar
    progress = [r.getMessage() for r in caplog.records if r.name == "train" and r.getMessage().startswith("step ")]
    every_step = [f"step {i}/6 ({p}%)" for i, p in zip(range(1, 7), (17, 33, 50, 67, 83, 100))]  # 5% of 6 steps
    assert [line.split(":")[0] for line in progress] == ([] if terminal else every_step)
    shown = [r.getMessage() for r in caplog.records if r.name == "train" and r.getMessage().startswith("validation")]
    if terminal:  # to train.log alone: the bar shows the metrics
        assert shown == []
    else:  # each on its own line, after the training bar's
        assert shown == lines


def test_outside_a_terminal_progress_is_a_plain_line_every_5_percent_or_30_seconds(monkeypatch):
    """Redirected to a file, the bar wrote a line at every step (212 lines for 200 steps); now a line comes every
    5% of the run or every 30 s, whichever is first, and at the last step, with the step, the loss, tokens/s and the
    time elapsed and left."""
    from tqdm import tqdm

    from vqattn.train import callbacks

    clock = FakeClock()
    clock.now = 1000.0
    monkeypatch.setattr(callbacks, "time", SimpleNamespace(time=clock))
    bar = StepProgressBar(terminal=False)
    bar.train_progress_bar = tqdm(disable=True)
    trainer = SimpleNamespace(max_steps=200, global_step=0)
    bar._start_clock(trainer)
    bar._reset(trainer)
    bar._last_line = (0, clock.now)
    due = []
    for step in range(1, 201):
        clock.now += 0.1 if step <= 100 else 7.0  # 10 s for the first half, then 7 s a step
        trainer.global_step = step
        if bar._line_due(trainer):
            due.append(step)
    assert due == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, *range(105, 201, 5)]  # 10 steps; then 30 s: 5 steps
    line = callbacks.progress_line(120, 1200, {"train_bpb": 2.51234}, 7512.4, 45.0, 120)
    assert line == "step 120/1200 (10%): train_bpb 2.5123, 7,512 tokens/s, 00:45 elapsed, 06:45 left"
    assert callbacks.progress_line(1, 10, {}, None, 2.0, 0) == "step 1/10 (10%): 00:02 elapsed"
    for bad in ({"every": 0}, {"every": 1.5}, {"seconds": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            StepProgressBar(**bad)
