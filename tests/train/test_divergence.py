"""A run whose loss or gradient stops being finite: it stops at that step (exit status 1) with last.ckpt holding the
last finite step, or skips such steps with nonfinite=skip; results.json stays strict JSON."""

import csv
import json
import math
import re
import shlex

import pytest
import torch
from test_train import FAST, ROOT, cfg_for, finish_script, run_inprocess, start_script

from vqattn.train import cli
from vqattn.train.cli import strict_json
from vqattn.train.lifecycle import Diverged
from vqattn.train.lit import LitLM

# The reproduction, scaled to a test: softmax at lr 100 diverges a few steps after its checkpoint at step 5.
DIVERGING = ["attention=softmax", "optim.lr=100", "trainer.max_steps=40", "checkpoint_every=5", "threads=1"]


def finite(path) -> bool:
    checkpoint = torch.load(path, weights_only=True)
    tensors = [*checkpoint["state_dict"].values(),
               *(t for state in checkpoint["optimizer_states"][0]["state"].values() for t in state.values())]
    return all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


@pytest.fixture
def poisoned(monkeypatch):
    """LitLM's loss times NaN at the global steps put in the returned set."""
    steps = set()
    step = LitLM.training_step

    def training_step(self, batch, batch_idx):
        loss = step(self, batch, batch_idx)
        return loss * math.nan if self.trainer.global_step in steps else loss

    monkeypatch.setattr(LitLM, "training_step", training_step)
    return steps


def test_a_nan_loss_stops_the_run_at_its_step_and_last_ckpt_keeps_the_last_finite_step(tmp_path, poisoned):
    poisoned.add(7)
    with pytest.raises(Diverged) as info:
        run_inprocess(tmp_path, "run", "attention=softmax", "trainer.max_steps=20", "checkpoint_every=3")
    stop = info.value
    assert stop.step == 7 and math.isnan(stop.loss) and stop.what == "non-finite loss" and stop.lr > 0
    line = str(stop)
    assert "\n" not in line and line.startswith("training diverged at step 7: non-finite loss (loss nan, lr ")
    assert "optim.lr" in line and "nonfinite=skip" in line  # what to try
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 6 and finite(checkpoint)
    assert not (tmp_path / "run" / "results.json").exists()


def test_nonfinite_skip_drops_those_steps_and_counts_them(tmp_path, poisoned):
    poisoned.update({3, 7})
    results, run_dir = run_inprocess(tmp_path, "run", "attention=softmax", "trainer.max_steps=12", "nonfinite=skip")
    assert results["steps"] == 12 and results["nonfinite_skipped"] == 2 and results["nonfinite"] == "skip"
    assert math.isfinite(results["val_bpb"])
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert finite(run_dir / "checkpoints" / "last.ckpt")
    adam_steps = {float(s["step"]) for s in checkpoint["optimizer_states"][0]["state"].values()}
    assert adam_steps == {10.0}  # AdamW applied 10 of the 12 steps, to every parameter
    assert checkpoint["callbacks"]["NonFiniteGuard"] == {"skipped": 2}  # a resumed run counts on from it
    assert json.loads((run_dir / "results.json").read_text())["nonfinite_skipped"] == 2


def test_nonfinite_skip_stops_past_its_limit(tmp_path, poisoned):
    poisoned.update({2, 3, 4})
    with pytest.raises(Diverged, match=r"at step 4: non-finite loss after 2 skipped steps \(nonfinite_max_skips=2\)"):
        run_inprocess(tmp_path, "run", "attention=softmax", "trainer.max_steps=12", "nonfinite=skip",
                      "nonfinite_max_skips=2")


@pytest.mark.parametrize("overrides,message", [
    (["nonfinite=ignore"], "nonfinite must be one of stop, skip, got 'ignore'"),
    (["nonfinite_max_skips=-1"], "nonfinite_max_skips must be an int >= 0, got -1"),
])
def test_bad_nonfinite_settings_are_one_line_errors(tmp_path, overrides, message):
    from vqattn.train import cli

    with pytest.raises(ValueError, match=re.escape(message)):
        cli.train(cfg_for(*FAST, *overrides), tmp_path / "run")


def test_results_json_is_strict_json_with_the_reason_for_each_null():
    results = {"val_bpb": math.nan, "val_loss": math.inf, "steps": 3, "by": {"0_63": -math.inf, "ok": 1.5}, "l": [1.0]}
    out = strict_json(results)
    text = json.dumps(out, allow_nan=False)  # raises on NaN or Infinity
    assert json.loads(text) == {"val_bpb": None, "val_loss": None, "steps": 3, "by": {"0_63": None, "ok": 1.5},
                                "l": [1.0], "not_finite": {"val_bpb": "nan", "val_loss": "inf", "by.0_63": "-inf"}}
    assert strict_json({"val_bpb": 1.2}) == {"val_bpb": 1.2}


@pytest.mark.slow
def test_a_diverging_run_exits_1_naming_the_step_and_its_resume_command_works(tmp_path):
    out = tmp_path / "OUT"
    stopped = finish_script(start_script([*FAST, *DIVERGING, f"hydra.run.dir={out}"], tmp_path))
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stopped.stderr[-3000:]
    step = int(re.match(r"error: training diverged at step (\d+): non-finite (loss|gradient) \(loss \S+, lr \S+\); "
                        r"try a lower optim.lr", errors[0]).group(1))
    checkpoint = out / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["global_step"]
    assert 5 <= saved < step + 1 and finite(checkpoint)
    assert f"the last finite checkpoint is {checkpoint} (step {saved})" in stopped.stderr
    assert not (out / "results.json").exists()
    # the printed command's overrides with a lower lr, in this process (the Ctrl-C and SIGTERM tests of test_train.py
    # run printed resume commands, which one function writes for every stop, as processes)
    command = shlex.split(stopped.stderr.split("resume with:")[1].strip().splitlines()[0])
    assert command[:2] == ["python", str(ROOT / "train.py")] and command[-1] == f"hydra.run.dir={out}"
    overrides = [c for c in command[2:-1] if not c.startswith(("optim.lr=", "trainer.max_steps="))]
    cli.train(cfg_for(*overrides, "optim.lr=0.001", "trainer.max_steps=10"), out)
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 10 and results["nonfinite_skipped"] == 0 and math.isfinite(results["val_bpb"])
    lrs = {int(r["step"]): float(r["lr-AdamW/pg1"]) for r in csv.DictReader(open(out / "metrics.csv"))
           if r.get("lr-AdamW/pg1")}
    assert lrs and all(lr <= 0.001 for step, lr in lrs.items() if step >= saved)  # the resumed run took the new lr


@pytest.mark.slow
def test_under_ddp_every_rank_stops_at_the_same_step(tmp_path):
    out = tmp_path / "OUT"
    stopped = finish_script(start_script([*FAST, *DIVERGING, "trainer=ddp", "trainer.accelerator=cpu",
                                          "trainer.devices=2", f"hydra.run.dir={out}"], tmp_path))
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert stopped.stderr.count("error: training diverged") == 1  # from rank 0 alone
    steps = {re.search(r"training diverged at step (\d+)", log.read_text()).group(1)
             for log in (out / "train.log", out / "rank1.log")}
    assert len(steps) == 1 and "Traceback" not in (out / "rank1.log").read_text()
    assert finite(out / "checkpoints" / "last.ckpt")


def test_the_finiteness_check_gathers_tensors_of_two_devices():
    """On a GPU, AdamW keeps its step counts on the CPU beside CUDA moments: the check stacks them on the
    accelerator's device (here "meta" stands in for it: no CUDA in CI), and reads nothing."""
    from vqattn.train.callbacks import _all_finite

    on_device = _all_finite([torch.ones(3, device="meta"), torch.tensor(2.0), torch.tensor(1, dtype=torch.long)])
    assert on_device.device.type == "meta" and on_device.shape == ()
    assert bool(_all_finite([torch.tensor(1.0), torch.ones(2)])) and not bool(_all_finite([torch.tensor(float("nan"))]))
