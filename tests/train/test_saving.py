"""What the trainer writes survives faults, by fault injection: a save cut short, a kill mid-save, the run dir on
another filesystem, a full disk (mid-run, on metrics.csv, train.log, results.json, under DDP, in the export). After
each, the previous checkpoint (or file) still loads. And the kept steps and best.ckpt: checkpoint_keep,
checkpoint_best, resume from a kept step."""

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train import FAST, ROOT, finish_script, run_inprocess, val_rows

from vqattn.checkpoint import load_model, read_checkpoint
from vqattn.files import WriteFailed, atomic_directory, atomic_file, is_temporary, write_text
from vqattn.train.saving import AtomicCheckpointIO, RunLogHandler, clear_failures, note_failure, stop_on_failure

from faults import full_disk

NO_SPACE = r"\[Errno 28\] No space left on device"
TINY = [*FAST, "attention=softmax", "threads=1"]


def temporaries(directory: Path) -> list[Path]:
    return [p for p in directory.rglob(".*") if is_temporary(p) or ".old-" in p.name]


@pytest.fixture(autouse=True)
def no_failures_left():
    clear_failures()
    yield
    clear_failures()


def test_a_write_that_fails_midway_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    path = write_text(tmp_path / "record.json", "old\n")
    with pytest.raises(RuntimeError), atomic_file(path, "wb") as f:  # the writer itself fails after half
        f.write(b"new" * 100)
        raise RuntimeError("the writer died")
    assert path.read_text() == "old\n" and list(tmp_path.iterdir()) == [path]
    full_disk(monkeypatch, tmp_path, budget=10)
    with pytest.raises(WriteFailed, match=rf"^could not write {path}: {NO_SPACE}$"):
        write_text(path, "x" * 100)
    assert path.read_text() == "old\n" and list(tmp_path.iterdir()) == [path]


def test_a_directory_written_in_place_is_the_new_one_whole_or_the_old_one(tmp_path, monkeypatch):
    out = tmp_path / "export"
    with atomic_directory(out) as d:
        (d / "a.json").write_text("1")
    with atomic_directory(out) as d:  # replaced whole: nothing of the old left
        (d / "b.json").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b.json"]
    full_disk(monkeypatch, tmp_path, budget=3)
    with pytest.raises(WriteFailed, match=rf"^could not write {out}: {NO_SPACE}$"), atomic_directory(out) as d:
        (d / "c.json").write_text("a longer file than the disk holds")
    assert sorted(p.name for p in out.iterdir()) == ["b.json"] and (out / "b.json").read_text() == "2"
    assert not temporaries(tmp_path)


def _checkpoint(step: int) -> dict:
    return {"state_dict": {"w": torch.full((4096,), float(step))}, "global_step": step}


def test_a_checkpoint_save_cut_short_keeps_the_previous_one_loadable(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(1), path)
    full_disk(monkeypatch, tmp_path, budget=path.stat().st_size // 2)  # a writer that fails after half the bytes
    with pytest.raises(WriteFailed, match=rf"could not write {path}: {NO_SPACE}"):
        io.save_checkpoint(_checkpoint(2), path)
    assert read_checkpoint(path)["global_step"] == 1 and list(tmp_path.iterdir()) == [path]


SLOW_SAVE = """
import sys, time, torch
from pathlib import Path
from vqattn.train.saving import AtomicCheckpointIO
path, marker = Path(sys.argv[1]), Path(sys.argv[2])
io = AtomicCheckpointIO()
io.save_checkpoint({"state_dict": {"w": torch.ones(1 << 16)}, "global_step": 1}, path)
real = torch.save
def slow_save(obj, f):  # half the bytes, a sign to the parent, then a long wait: killed there
    class Slow:
        def __init__(self): self.n = 0
        def write(self, b):
            self.n += len(b)
            if self.n > (1 << 17):
                f.flush(); marker.write_text("half"); time.sleep(60)
            return f.write(b)
        def flush(self): f.flush()
    real(obj, Slow())
torch.save = slow_save
io.save_checkpoint({"state_dict": {"w": torch.zeros(1 << 16)}, "global_step": 2}, path)
"""


@pytest.mark.slow
def test_sigkill_during_a_slow_save_leaves_the_previous_checkpoint_and_a_temporary_the_next_run_removes(tmp_path):
    from vqattn.files import remove_temporaries

    path, marker = tmp_path / "ckpt" / "last.ckpt", tmp_path / "half"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(path), str(marker)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the child never reached the slow save"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    checkpoint = read_checkpoint(path)
    assert checkpoint["global_step"] == 1 and bool((checkpoint["state_dict"]["w"] == 1).all())
    left = temporaries(path.parent)
    assert len(left) == 1 and left[0].name.startswith(".last.ckpt.tmp-")  # half a checkpoint, never last.ckpt
    remove_temporaries(path.parent, "last.ckpt")  # LastCheckpoint does this as a run starts
    assert list(path.parent.iterdir()) == [path]


@contextlib.contextmanager
def another_filesystem(tmp_path: Path):
    """A directory on a filesystem of its own (a tmpfs mounted where this process may mount), else None."""
    target = tmp_path / "tmpfs"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)],
                             capture_output=True).returncode == 0 if os.geteuid() == 0 else False
    try:
        yield target if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.mark.slow
def test_on_another_filesystem_than_the_temp_dir_every_save_is_a_new_file_renamed_into_place(tmp_path, monkeypatch):
    renames = []
    replace = os.replace

    def recording_replace(src, dst):
        replace(src, dst)
        renames.append((Path(src), Path(dst), os.stat(dst).st_ino))

    monkeypatch.setattr(os, "replace", recording_replace)
    with another_filesystem(tmp_path) as mount:
        if mount is None:  # no mount here: the temp dir elsewhere stands for the other filesystem
            other = tmp_path / "elsewhere"
            other.mkdir()
            monkeypatch.setenv("TMPDIR", str(other))
            monkeypatch.setattr("tempfile.tempdir", str(other))
        else:
            assert os.stat(mount).st_dev != os.stat(tmp_path).st_dev
        base = mount or tmp_path
        _, run_dir = run_inprocess(base, "run", *TINY, "trainer.max_steps=15", "checkpoint_every=5")
        last = run_dir / "checkpoints" / "last.ckpt"
        saves = [(src, ino) for src, dst, ino in renames if dst == last]
        assert len(saves) == 3  # steps 5, 10, 15
        assert all(src.parent == last.parent and src.name.startswith(".last.ckpt.tmp-") for src, _ in saves)
        assert len({ino for _, ino in saves}) == 3 and os.stat(last).st_ino == saves[-1][1]  # a new file each time
        assert read_checkpoint(last)["global_step"] == 15 and not temporaries(run_dir)


def run_faulty(args: list[str], cwd: Path, root: Path | None = None, budget: int = 0, timeout: int = 300):
    """train.py in a subprocess whose disk under ``root`` fills after ``budget`` bytes (tests/faults.py)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    if root is not None:
        env.update(FAULT_ROOT=str(root), FAULT_BUDGET=str(budget))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "faults.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return finish_script(proc, timeout)


@pytest.fixture(scope="module")
def checkpoint_size(tmp_path_factory) -> int:
    """The bytes of a checkpoint of TINY's model, saved once (for every test of this module that needs it)."""
    _, run_dir = run_inprocess(tmp_path_factory.mktemp("size"), "run", *TINY, "trainer.max_steps=1",
                               "checkpoint_every=1")
    return (run_dir / "checkpoints" / "last.ckpt").stat().st_size


def assert_one_line_stop(proc, path_pattern: str, step: int, run_dir: Path) -> list[str]:
    """A run stopped by a failed write: exit 74, no traceback, the line naming the path and the error, the intact
    step and the resume command; returns that command."""
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.fullmatch(rf"error: could not write {path_pattern}: {NO_SPACE}", errors[0]), errors[0]
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert lines[-2] == (f"the last intact checkpoint is {checkpoint} (step {step}); once that path can be written, "
                         f"resume with:")
    assert read_checkpoint(checkpoint)["global_step"] == step and not temporaries(run_dir)
    return shlex.split(lines[-1])


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_stops_it_with_one_line_and_the_printed_command_resumes(tmp_path, checkpoint_size):
    run_dir = tmp_path / "run"
    common = [*TINY, "trainer.max_steps=30", "optim.total_steps=30", "checkpoint_every=10"]
    # the disk holds the run's first files and two checkpoints (the save of step 20 replaces step 10's), not a third
    proc = run_faulty([*common, f"hydra.run.dir={run_dir}"], tmp_path, run_dir, budget=int(2.5 * checkpoint_size))
    resume = assert_one_line_stop(proc, re.escape(str(run_dir)) + r"/\S+", 20, run_dir)
    assert resume[-2:] == [f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={run_dir}"]
    assert resume[:2] == ["python", str(ROOT / "tests" / "faults.py")]
    # the disk has room again: the printed command's overrides, in this process (the Ctrl-C and SIGTERM tests of
    # test_train.py run printed resume commands, which one function writes for every stop, as processes)
    run_inprocess(tmp_path, "run", *resume[2:-1])
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 30 and [int(r["step"]) for r in val_rows(run_dir)] == [25, 30]


@pytest.mark.slow
def test_a_disk_full_before_the_job_starts_stops_with_one_line_and_leaves_no_run_dir(tmp_path):
    """Hydra writes the job's .hydra/ and train.log before the job starts; a disk already full there is one line
    naming the run dir, exit status 74, and no half-written run dir left behind."""
    run_dir = tmp_path / "outputs" / "run"
    proc = run_faulty([*TINY, "trainer.max_steps=1", f"hydra.run.dir={run_dir}"], tmp_path, run_dir, budget=10)
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == f"error: could not write {run_dir}: [Errno 28] No space left on device; nothing was saved"
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_a_full_disk_on_metrics_csv_stops_the_run_and_its_rows_read_back_whole(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    full_disk(monkeypatch, run_dir, budget=1500, match="metrics.csv")  # a few rows, then a row cut short
    with pytest.raises(WriteFailed, match=rf"could not write {run_dir / 'metrics.csv'}: {NO_SPACE}"):
        run_inprocess(tmp_path, "run", *TINY, "trainer.max_steps=200", "checkpoint_every=5",
                      "trainer.log_every_n_steps=1")
    text = (run_dir / "metrics.csv").read_text()
    assert not text.endswith("\n")  # the append that failed left part of a row
    from vqattn.train.loggers import RunCSVLogger

    step = read_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"]
    rows = RunCSVLogger(run_dir, resume_step=step)._read_file(resuming=False)
    assert rows and all(int(row["step"]) >= 0 and None not in row for row in rows)


def test_a_full_disk_on_train_log_is_noted_without_a_traceback(tmp_path, capsys):
    handler = RunLogHandler(tmp_path / "train.log")
    logger = logging.getLogger("test_saving")
    logger.addHandler(handler)
    try:
        handler.stream.write = lambda text: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        logger.warning("a line the disk has no room for")
        logger.warning("and another")
    finally:
        logger.removeHandler(handler)
        handler.stream = None
    assert "Logging error" not in capsys.readouterr().err
    with pytest.raises(WriteFailed, match=rf"^could not write {tmp_path / 'train.log'}: {NO_SPACE}$"):
        stop_on_failure()
    stop_on_failure()  # raised once


def test_the_first_noted_failure_is_the_one_raised_and_it_pickles():
    import pickle

    note_failure(WriteFailed("/a", OSError(28, "No space left on device")))
    note_failure(WriteFailed("/b", OSError(30, "Read-only file system")))
    with pytest.raises(WriteFailed) as info:
        stop_on_failure()
    again = pickle.loads(pickle.dumps(info.value))  # how the ranks of a DDP run share it
    assert str(again) == str(info.value) == "could not write /a: [Errno 28] No space left on device"


@pytest.mark.slow
def test_a_full_disk_on_results_json_keeps_the_last_results(tmp_path, monkeypatch):
    common = [*TINY, "optim.total_steps=20", "checkpoint_every=10"]
    first, run_dir = run_inprocess(tmp_path, "run", *common, "trainer.max_steps=10")
    full_disk(monkeypatch, run_dir, budget=0, match="results.json")
    with pytest.raises(WriteFailed, match=rf"could not write {run_dir / 'results.json'}: {NO_SPACE}"):
        run_inprocess(tmp_path, "run", *common, "trainer.max_steps=20",
                      f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}")
    assert json.loads((run_dir / "results.json").read_text())["steps"] == first["steps"] == 10
    assert read_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 20 and not temporaries(run_dir)


@pytest.mark.slow
def test_under_ddp_a_failed_save_stops_every_rank_with_the_same_line(tmp_path, checkpoint_size):
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=30",
            "optim.total_steps=30", "checkpoint_every=10", f"hydra.run.dir={run_dir}"]
    proc = run_faulty(args, tmp_path, run_dir, budget=int(2.5 * checkpoint_size), timeout=400)  # no rank left waiting
    assert_one_line_stop(proc, re.escape(str(run_dir)) + r"/\S+", 20, run_dir)
    line = next(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert (run_dir / "rank1.log").read_text().splitlines()[-1].endswith(line)  # rank 1 stopped on the same line


@pytest.mark.slow
def test_checkpoint_keep_and_best_and_a_resume_from_a_kept_step(tmp_path):
    common = [*TINY, "trainer.max_steps=20", "optim.total_steps=20", "trainer.val_check_interval=5",
              "checkpoint_every=5", "checkpoint_keep=3", "checkpoint_best=true"]
    results, a = run_inprocess(tmp_path, "a", *common)
    saved = a / "checkpoints"
    assert sorted(p.name for p in saved.iterdir()) == ["best.ckpt", "best.json", "last.ckpt", "step-000010.ckpt",
                                                       "step-000015.ckpt", "step-000020.ckpt"]
    assert os.stat(saved / "last.ckpt").st_ino == os.stat(saved / "step-000020.ckpt").st_ino  # one file, two names
    for step in (10, 15, 20):
        assert read_checkpoint(saved / f"step-{step:06d}.ckpt")["global_step"] == step
    bpbs = {int(r["step"]): float(r["val_bpb"]) for r in val_rows(a)}
    best = json.loads((saved / "best.json").read_text())
    assert best["step"] == min(bpbs, key=bpbs.get) and best["val_bpb"] == pytest.approx(bpbs[best["step"]], rel=1e-6)
    assert read_checkpoint(saved / "best.ckpt")["global_step"] == best["step"]
    # resumed from a kept step, the run is the one that never stopped
    resumed, b = run_inprocess(tmp_path, "b", *common, f"ckpt_path={saved / 'step-000010.ckpt'}")
    assert resumed["steps"] == 20 and resumed["val_loss"] == pytest.approx(results["val_loss"], rel=1e-5, abs=1e-6)
    # sampling and the export take any of them
    from vqattn.hf.export import main as export
    from vqattn.train.sample import sample

    for name in ("best.ckpt", "step-000015.ckpt"):
        assert sample(saved / name, "ab", 4, seed=0)[0].startswith("ab")
        assert export([str(saved / name), str(tmp_path / f"hf-{name}")]) == 0
    assert load_model(saved / "best.ckpt").config == load_model(saved / "last.ckpt").config


def test_checkpoint_keep_and_best_are_checked_before_anything_is_built():
    from test_train import cfg_for

    from vqattn.train.checks import check_config

    for bad, message in (("checkpoint_keep=0", "checkpoint_keep must be a positive int, got 0"),
                         ("checkpoint_best=3", "checkpoint_best must be true or false, got 3")):
        with pytest.raises(ValueError, match=message):
            check_config(cfg_for(bad))


def test_a_full_disk_during_the_export_keeps_the_export_that_was_there(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from test_length_eval import _checkpoint as write_checkpoint

    from vqattn.hf.export import main as export

    from model_helpers import tiny_model

    write_checkpoint(tiny_model("window"), tmp_path / "last.ckpt")
    out = tmp_path / "hf"
    assert export([str(tmp_path / "last.ckpt"), str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    full_disk(monkeypatch, tmp_path, budget=0, match="config.json")
    assert export([str(tmp_path / "last.ckpt"), str(out)]) == 74
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the threads line
    assert re.fullmatch(rf"vqattn-export: error: could not write {out}: {NO_SPACE}", err), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not temporaries(tmp_path)


def test_a_full_disk_while_training_a_tokenizer_keeps_the_one_that_was_there(tmp_path, monkeypatch, capsys):
    from test_tokenizers import write_corpus

    from vqattn.tokenizer import load_tokenizer, main

    corpus, out = write_corpus(tmp_path / "corpus.txt"), tmp_path / "bpe"
    assert main(["train", "--files", str(corpus), "--vocab-size", "300", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    full_disk(monkeypatch, tmp_path, budget=0, match="tokenizer_config.json")  # after tokenizer.json's own write
    assert main(["train", "--files", str(corpus), "--vocab-size", "320", "--out", str(out)]) == 74
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"python -m vqattn.tokenizer: error: could not write {out}: {NO_SPACE}", err), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not temporaries(tmp_path)
    assert load_tokenizer(str(out)).vocab_size == 300


def test_a_full_disk_during_a_report_keeps_each_of_its_files_whole(tmp_path, monkeypatch, capsys):
    """report.md and each figure are replaced whole or not at all; the command says which in one line."""
    from test_experiments import fake_run_dir

    from vqattn.train.report import main

    positions = {"0_63": 3.0, "64_255": 2.5}
    fake_run_dir(tmp_path, "0_softmax", "softmax", [(20, 2.9)], positions)
    assert main([str(tmp_path)]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    fake_run_dir(tmp_path, "1_window", "window", [(20, 2.7)], positions)  # the next report differs
    capsys.readouterr()
    for name in ("report.md", "val_bpb.png", "by_position.png"):
        with monkeypatch.context() as patch:
            full_disk(patch, tmp_path, budget=100, match=name)  # its first 100 bytes written, then the disk is full
            assert main([str(tmp_path)]) == 74
        err = capsys.readouterr().err.strip()
        assert re.fullmatch(rf"python -m vqattn.train.report: error: could not write {tmp_path / name}: {NO_SPACE}",
                            err), err
        assert (tmp_path / name).read_bytes() == before[name], name
    assert not temporaries(tmp_path)
    assert main([str(tmp_path)]) == 0 and "1_window" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("command", ["length_eval", "copy_eval"])
def test_a_full_disk_during_an_eval_keeps_what_its_out_dir_held(tmp_path, monkeypatch, capsys, command):
    import importlib

    from test_length_eval import _checkpoint as write_checkpoint

    from model_helpers import tiny_model

    main = importlib.import_module(f"vqattn.train.{command}").main
    torch.manual_seed(0)
    write_checkpoint(tiny_model("window"), tmp_path / "last.ckpt")
    (tmp_path / "held_out.txt").write_bytes(bytes(range(17)) * 200)  # the tiny model's 17 token ids
    out = tmp_path / "eval"
    args = [str(tmp_path / "last.ckpt"), "--streams", "4", "--text", str(tmp_path / "held_out.txt"), "--out", str(out)]
    args += ["--multiple", "2"] if command == "length_eval" else []
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    for name in sorted(before):
        with monkeypatch.context() as patch:
            full_disk(patch, out, budget=10, match=name)
            assert main([*args, "--streams", "3"]) == 74
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after the threads line
        assert re.fullmatch(rf"python -m vqattn.train.{command}: error: could not write {out / name}: {NO_SPACE}",
                            err), err
        assert (out / name).read_bytes() == before[name], name
    assert not temporaries(tmp_path)
