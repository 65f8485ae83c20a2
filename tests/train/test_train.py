"""train.py end to end: Hydra configs, resume, DDP, local text, error messages (a sweep and its report: the README's
commands, tests/test_docs.py)."""

import csv
import importlib.abc
import json
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
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import MissingConfigException
from hydra.utils import instantiate

from vqattn.layers import ATTENTIONS
from vqattn.train.configs import register

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "vqattn" / "train" / "conf")
register()
ATTENTION_OPTIONS = sorted(name.removesuffix(".yaml") for name in ConfigStore.instance().list("attention"))
FAST = ["experiment=tiny", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
AS_USERS_HAVE_IT = ["experiment=tiny"]  # progress bar and model summary on


def cfg_for(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_every_registered_attention_has_a_config_and_vice_versa():
    assert set(ATTENTION_OPTIONS) == set(ATTENTIONS)


@pytest.mark.parametrize("attention", ATTENTION_OPTIONS)
def test_attention_config_composes_into_the_model(attention):
    cfg = cfg_for(f"attention={attention}")
    assert cfg.model.attention == attention == cfg.attention.name
    assert cfg.model.attention_kwargs == cfg.attention.kwargs
    module = instantiate(cfg.module, _convert_="all")
    assert module.model.config.attention == attention
    assert module.hparams["model"]["n_layer"] == cfg.model.n_layer


def test_defaults_and_groups():
    cfg = cfg_for()
    assert cfg.attention.name == "vq_soft" and cfg.data._target_.endswith("StdlibDataModule")
    assert cfg.trainer.accelerator == "auto" and cfg.data.seq_len == cfg.model.seq_len
    assert cfg_for("trainer=ddp", "trainer.devices=4").trainer.strategy == "ddp"
    assert cfg_for("trainer=gpu").trainer.precision == "bf16-mixed"
    tiny = cfg_for("experiment=tiny")
    assert tiny.model.n_embd == 32 and tiny.data.seq_len == 64
    mqar = cfg_for("experiment=mqar")
    assert mqar.data.num_kv_pairs == 16 and mqar.data.seq_len == 128
    for data in ("default", "text", "enwik8", "wikitext103", "mqar"):
        assert cfg_for(f"data={data}").data._target_.startswith(("vqattn.train.data.", "vqattn.train.mqar."))


def test_unknown_attention_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as info:
        cfg_for("attention=nope")
    assert all(name in str(info.value) for name in ATTENTION_OPTIONS)


@pytest.mark.parametrize("args,group,name", [
    (["attention=foo"], "attention", "foo"),
    (["-m", "attention=softmax,foo", "model=tiny"], "attention", "foo"),  # a sweep
    (["logger=[csv,nope]"], "logger", "nope"),  # a list
    (["+experiment=huge"], "experiment", "huge"),
])
def test_an_unknown_option_is_one_line_naming_the_options(monkeypatch, capsys, args, group, name):
    from vqattn.train import cli
    from vqattn.train.configs import config_groups

    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 2
    options = ", ".join(config_groups()[group])
    assert capsys.readouterr().err == f"error: unknown {group} {name!r}; choose one of: {options}\n"


@pytest.mark.parametrize("args,line", [
    (["model.block_len=5000"], "unknown config key model.block_len; did you mean block_len=5000?"),  # the root key
    (["trainer.max_step=200"], "unknown config key trainer.max_step; did you mean trainer.max_steps=200?"),
    (["modle.n_layer=3"], "unknown config key modle.n_layer; did you mean model.n_layer=3?"),
    (["attention=vq_hard", "attention.kwargs.num_code=3"],
     "unknown config key attention.kwargs.num_code; did you mean attention.kwargs.num_codes=3?"),
    (["-m", "attention=softmax,vq_hard", "optim.warmup_step=10"],  # a sweep
     "unknown config key optim.warmup_step; did you mean optim.warmup_steps=10?"),
    (["model.zzzzzz=1"], "unknown config key model.zzzzzz (python train.py --cfg job prints every key)"),
])
def test_an_unknown_key_is_one_line_naming_the_nearest_valid_key(monkeypatch, capsys, args, line):
    from vqattn.train import cli

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    assert "HYDRA_FULL_ERROR" not in os.environ  # the user's setting is back


def test_with_hydra_full_error_an_unknown_key_keeps_its_traceback(monkeypatch):
    from hydra.errors import ConfigCompositionException

    from vqattn.train import cli

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["train.py", "model.block_len=5000"])
    with pytest.raises(ConfigCompositionException, match="Could not override 'model.block_len'"):
        cli.main()
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


def test_the_nearest_key_prefers_the_same_name_then_a_close_one_beside_it():
    from vqattn.train.checks import config_keys, nearest_key

    keys = config_keys(cfg_for("attention=vq_hard"))
    assert "block_len" in keys and "model.n_layer" in keys and "attention.kwargs.num_codes" in keys
    assert "attention.kwargs.block_len" not in keys and "module.model" not in keys  # interpolations of other keys
    assert not [k for k in keys if k.startswith("hydra")]
    assert nearest_key("model.block_len", keys) == "block_len"  # attention.kwargs.block_len is ${block_len}
    assert nearest_key("data.batchsize", keys) == "data.batch_size"
    assert nearest_key("data.seqlen", keys) == "model.seq_len"  # data.seq_len is ${model.seq_len}
    assert nearest_key("seed_", keys) == "seed"
    assert nearest_key("xyzzy.qqqq", keys) is None


def test_known_options_keys_and_flags_are_left_to_hydra():
    from vqattn.train.checks import unknown_option
    from vqattn.train.configs import config_groups

    groups = config_groups()
    assert set(groups["attention"]) == set(ATTENTIONS) and "tiny" in groups["experiment"]
    args = ["-m", "attention=softmax,vq_hard", "logger=[tensorboard,wandb]", "experiment=null", "+experiment=tiny",
            "~logger", "attention.kwargs.num_codes=3", "model=glob(*)", "hydra.run.dir=x", "--cfg", "job", "data=("]
    assert unknown_option(args, groups) is None


@pytest.mark.parametrize("overrides,warned", [
    (["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=3"], True),
    (["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"], False),  # one process per core
    (["trainer=ddp", "trainer.accelerator=gpu", "trainer.devices=3"], False),  # GPU processes
    (["trainer.devices=1"], False),
])
def test_more_cpu_processes_than_cores_are_warned_about(overrides, warned):
    from vqattn.train.checks import cpu_processes_warning

    message = cpu_processes_warning(cfg_for(*overrides), cores=2, cuda=False)
    assert (message is not None) == warned
    if warned:
        assert message.startswith("trainer.devices=3 starts 3 CPU processes on 2 cores") and "\n" not in message
    auto = cfg_for("trainer=ddp", "trainer.devices=3")  # accelerator=auto: the CPU only without a GPU
    assert cpu_processes_warning(auto, cores=2, cuda=False) and not cpu_processes_warning(auto, cores=2, cuda=True)


def test_the_cpu_process_warning_is_logged_before_training(tmp_path, caplog, monkeypatch):
    from vqattn.train import cli

    monkeypatch.setattr(cli, "available_cores", lambda: 1)
    with caplog.at_level("WARNING", logger="train"):
        cli.build(cfg_for(*FAST, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"), tmp_path)
    (record,) = caplog.records
    assert record.getMessage().startswith("trainer.devices=2 starts 2 CPU processes on 1 cores")


@pytest.mark.parametrize("overrides,warned", [
    (["model.seq_len=128"], True),  # block_len 64: the raw window of a query in block 1 holds blocks 0 and 1
    (["model.seq_len=129"], False),  # position 128 reads block 0 through the codebook
    (["model.seq_len=64", "attention=window"], True),
    (["model.seq_len=64", "attention=ovq"], True),
    (["model.seq_len=64", "attention=softmax"], False),  # no raw window
    (["model.seq_len=64", "attention=vq_hard", "attention.kwargs.exact_window=false"], False),  # a quantised window
    (["experiment=long_carry", "model.seq_len=64"], False),  # the carried cache holds the earlier segments
    (["experiment=tiny"], False),  # 64-byte windows, block_len 16
])
def test_a_sequence_inside_the_raw_window_is_warned_about(overrides, warned):
    from vqattn.train.checks import raw_window_warning

    message = raw_window_warning(cfg_for(*overrides))
    assert (message is not None) == warned
    if warned:
        assert "every key sits in the raw window" in message and "softmax attention" in message
        assert "\n" not in message


def test_compile_says_it_is_compiling_before_the_first_step(tmp_path, caplog):
    from lightning.pytorch.callbacks import LambdaCallback

    from vqattn.train import cli

    _, _, trainer = cli.build(cfg_for(*FAST, "compile=true"), tmp_path)
    with caplog.at_level("INFO", logger="train"):
        for hook in [c for c in trainer.callbacks if isinstance(c, LambdaCallback)]:
            hook.on_fit_start(trainer, None)
    assert "compiling the model" in caplog.text


@pytest.mark.parametrize("overrides,expected", [
    ([], {"LearningRateMonitor", "TokenThroughput", "StepProgressBar", "ParamSummary"}),
    (["~callbacks.lr_monitor", "trainer.enable_progress_bar=false"], {"TokenThroughput", "ParamSummary"}),
    (["callbacks=none", "+callbacks.stop={_target_: lightning.pytorch.callbacks.EarlyStopping, monitor: val_bpb}"],
     {"EarlyStopping"}),
])
def test_callbacks_are_the_group_plus_what_resuming_needs(tmp_path, overrides, expected):
    from vqattn.train import cli

    _, _, trainer = cli.build(cfg_for(*AS_USERS_HAVE_IT, *overrides), tmp_path)
    names = {type(c).__name__ for c in trainer.callbacks}
    every_run = {"LastCheckpoint", "RNGState", "GracefulInterrupt", "NonFiniteGuard"}
    assert every_run <= names  # every run has them
    # what Lightning adds itself where no bar or summary is given (Rich ones when rich is installed)
    lightning_own = {"ModelCheckpoint", "TQDMProgressBar", "ModelSummary", "RichProgressBar", "RichModelSummary"}
    assert names - every_run - lightning_own == expected


def test_another_optimizer_is_one_override(tmp_path):
    from vqattn.train import cli

    module, _, _ = cli.build(cfg_for(*FAST, "optimizer._target_=torch.optim.Adam", "optim.lr=0.003"), tmp_path)
    optimizer = module.configure_optimizers()["optimizer"]
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["lr"] == 0.003


def test_more_than_one_device_needs_a_multi_process_strategy():
    from vqattn.train.checks import check_config

    for fine in (["trainer.devices=auto"], ["trainer.devices=1"], ["trainer=ddp", "trainer.devices=3"]):
        check_config(cfg_for(*fine))
    for many in ("3", "[0,1]", "'0,1'"):
        with pytest.raises(ValueError, match=r"starts one process per device: add trainer=ddp"):
            check_config(cfg_for(f"trainer.devices={many}"))


def run_inprocess(tmp_path, name, *overrides):
    from vqattn.train import cli

    cfg = cfg_for(*FAST, *overrides)
    run_dir = tmp_path / name
    run_dir.mkdir(exist_ok=True)
    return cli.train(cfg, run_dir), run_dir


def val_rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("val_bpb")]


@pytest.mark.slow
def test_resume_10_plus_10_equals_20_straight(tmp_path):
    # vq_soft: its codebook's buffers and EMA statistics resume with the weights and the optimizer (a softmax model's
    # resume is the same path without them)
    common = ["attention=vq_soft", "optim.total_steps=20", "trainer.val_check_interval=5", "checkpoint_every=10"]
    first, a = run_inprocess(tmp_path, "a", *common, "trainer.max_steps=10")
    assert first["steps"] == 10
    saved = torch.load(a / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]["TokenThroughput"]
    resumed, b = run_inprocess(tmp_path, "a", *common, "trainer.max_steps=20",  # resumed in the same run dir
                               f"ckpt_path={a / 'checkpoints' / 'last.ckpt'}")
    straight, c = run_inprocess(tmp_path, "c", *common, "trainer.max_steps=20")
    assert resumed["steps"] == straight["steps"] == 20
    # the totals are the whole run's, not the resumed part's
    assert resumed["train_tokens"] == straight["train_tokens"] == 20 * 8 * 64  # experiment=tiny: 8 x 64 bytes
    assert saved["train_tokens"] == first["train_tokens"] and resumed["wall_seconds"] > saved["wall_seconds"]
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-5, abs=1e-6)
    assert straight["val_loss"] != pytest.approx(first["val_loss"], rel=1e-3)
    # the continued metrics.csv equals the straight run's: every validation once (the final one too), same values
    assert [int(r["step"]) for r in val_rows(c)] == [int(r["step"]) for r in val_rows(b)] == [5, 10, 15, 20]
    bpb_b, bpb_c = ([float(r["val_bpb"]) for r in val_rows(run)] for run in (b, c))
    assert bpb_b == pytest.approx(bpb_c, rel=1e-5)


@pytest.mark.slow
def test_logger_tensorboard_logs_per_step_beside_metrics_csv(tmp_path):
    """logger=tensorboard (vqattn[tensorboard], in the dev extra); logger=wandb: tests/train/test_wandb.py."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results, run_dir = run_inprocess(tmp_path, "run", "logger=tensorboard", "attention=softmax",
                                     "trainer.max_steps=10", "trainer.val_check_interval=5",
                                     "trainer.log_every_n_steps=5")
    assert results["steps"] == 10 and [int(r["step"]) for r in val_rows(run_dir)] == [5, 10]  # metrics.csv as ever
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val_bpb")] == [5, 10]
    assert [e.step for e in events.Scalars("train_bpb")] == [4, 9]  # Lightning's batch index, as in metrics.csv


def start_script(args, cwd) -> subprocess.Popen:
    """train.py in a subprocess, started and left running (most of a short run is start-up and imports, so runs
    that do not depend on each other run side by side)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish_script(proc: subprocess.Popen, timeout=300) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_script(args, cwd, timeout=300) -> subprocess.CompletedProcess:
    return finish_script(start_script(args, cwd), timeout)


def read_results(run_dir):
    results = json.loads((run_dir / "results.json").read_text())
    for key in ("attention", "params", "steps", "val_loss", "val_bpb", "tokens_per_sec", "peak_memory_mb",
                "wall_seconds"):
        assert key in results, key
    assert results["val_bpb"] == results["val_bpb"] and 0 < results["val_bpb"] < 9  # finite
    by_position, tokens = results["val_bpb_by_position"], results["val_tokens_by_position"]
    assert list(by_position) == list(tokens) == list(results["val_acc_by_position"]) and by_position
    recombined = sum(by_position[k] * tokens[k] for k in tokens) / sum(tokens.values())  # over all ranks' windows
    assert recombined == pytest.approx(results["val_bpb"], rel=1e-9)
    return results


NOISE = ("litlogger", "LeafSpec", "weights_only", "exists and is not empty", "dirpath has changed", "Traceback",
         "all_gather is deprecated", "not supported by the model summary", "model summary callbacks")


@pytest.mark.slow
def test_train_script_writes_results_with_a_clean_console_and_its_redirected_log_is_plain_lines_under_10_kb(tmp_path):
    """One run of the script, its console a pipe as a log redirected to a file is. Redirected, the bar wrote a line
    at every step (212 lines and 156 KB for the default run): now a plain line every 5% of the run (or 30 s) and one
    line per validation. The default run's 1200 steps and six validations give as many lines as the 60 steps and six
    validations of the tiny model here, which take seconds."""
    out = tmp_path / "OUT"
    proc = run_script([*AS_USERS_HAVE_IT, "attention=vq_soft", "trainer.max_steps=60", "optim.total_steps=60",
                       "trainer.val_check_interval=10", "trainer.precision=bf16-mixed", "threads=1",
                       f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_results(out)
    assert results["steps"] == 60 and results["attention"] == "vq_soft" and results["headline"] == "val_bpb"
    assert results["device"].endswith(", 1 threads)")
    assert (out / "checkpoints" / "last.ckpt").exists() and (out / ".hydra" / "config.yaml").exists()
    hparams = yaml.safe_load((out / "hparams.yaml").read_text())  # the module's and the optimisation's settings
    assert hparams["model"]["attention"] == "vq_soft" and hparams["optimizer"]["_target_"] == "torch.optim.AdamW"
    assert hparams["optim"]["lr"] > 0 and "_target_" in hparams["scheduler"]
    console = proc.stdout + proc.stderr
    assert not [word for word in NOISE if word in console]
    assert console.count("GPU available") == 1  # Lightning's INFO lines once, not twice
    assert "Total params" in console and "FLOPs" not in console  # the summary, without its zero FLOPs column
    lines = console.replace("\r", "\n").splitlines()  # the bar ends its line before the next log line
    assert [line for line in lines if "`Trainer.fit` stopped" in line][0].startswith("[")
    assert "done: vq_soft, 60 steps" in console and f"run dir {out}" in console
    # one validation row per validation, at the optimizer step it followed: 10, ..., 60 (the final one, once)
    assert [int(r["step"]) for r in val_rows(out)] == list(range(10, 61, 10))
    assert list(results["val_bpb_by_position"]) == ["0_63"]  # experiment=tiny: 64-byte windows
    assert all(float(r["val_bpb_pos_0_63"]) == pytest.approx(float(r["val_bpb"]), rel=1e-9) for r in val_rows(out))
    # the log: plain lines, under 10 KB
    assert len(console.encode()) < 10_000 and "\r" not in console
    lines = console.splitlines()
    progress = [re.search(r"- step (\d+)/60 \(\d+%\): train_bpb [\d.]+, [\d,]+ tokens/s, [\d:]+ elapsed, "
                          r"[\d:]+ left$", line) for line in lines if "- step " in line]
    steps = [int(m.group(1)) for m in progress if m]
    assert len(steps) == len(progress) and set(range(3, 61, 3)) <= set(steps) and len(steps) < 40
    validations = [line for line in lines if "validation at step" in line]
    assert [int(re.search(r"step (\d+)/", line).group(1)) for line in validations] == list(range(10, 61, 10))
    assert all(re.match(r"\[[^]]+\]\[train\]\[INFO\] - validation at step", line) for line in validations)


def wait_for(path, proc):
    """Wait until the run writes ``path``; every run here ends by itself (a bounded number of steps), so a run that
    never writes it fails the test however slow the machine is."""
    while not path.exists():
        assert proc.poll() is None, f"the run ended before it wrote {path.name}"
        time.sleep(0.2)


def resume_command(stderr: str, max_steps: int | None = None) -> list[str]:
    """The command a stopped run printed after "resume with:", to run here (``max_steps``: that many steps)."""
    command = shlex.split(stderr.split("resume with:")[1].strip().splitlines()[0])
    command = [sys.executable if c == "python" else c for c in command]
    if max_steps is not None:
        command = [f"trainer.max_steps={max_steps}" if c.startswith("trainer.max_steps=") else c for c in command]
    return command


@pytest.mark.slow
def test_ctrl_c_saves_and_the_printed_command_resumes_to_the_uninterrupted_run(tmp_path):
    """Ctrl-C finishes the step, saves it and prints the resume command; the printed command resumes in the same run
    dir, and the run ends with the model of a run never stopped. SIGTERM (preemption, ``docker stop``, cluster time
    limits) takes the same handler (lifecycle.STOP_SIGNALS): it stops a DDP carried run, which then resumes exactly,
    in tests/train/test_experiments.py."""
    out = tmp_path / "OUT"
    checkpoint = out / "checkpoints" / "last.ckpt"
    common = ["attention=vq_soft", "optim.total_steps=2000", "checkpoint_every=3", "trainer.val_check_interval=4",
              "threads=1"]
    proc = start_script([*AS_USERS_HAVE_IT, *common, "trainer.max_steps=2000", f"hydra.run.dir={out}"], tmp_path)
    wait_for(checkpoint, proc)
    proc.send_signal(signal.SIGINT)
    interrupted = finish_script(proc, timeout=120)
    _stopped_by_ctrl_c(interrupted)
    step = int(re.search(r"interrupted at step (\d+)", interrupted.stderr).group(1))
    total = step + 5
    command = resume_command(interrupted.stderr, total)
    assert f"ckpt_path={checkpoint}" in command and f"hydra.run.dir={out}" in command
    assert torch.load(checkpoint, weights_only=True)["global_step"] == step
    assert not (out / "results.json").exists()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]  # no second run dir
    assert read_results(out)["steps"] == total
    console = resumed.stdout + resumed.stderr
    assert not [word for word in NOISE if word in console]
    # outside a terminal the bar is a plain line every 5% of the run (here every step), counting the run's steps
    bars = re.findall(r"step (\d+)/(\d+) \(\d+%\): ([^\r\n]*)", console)
    assert bars and {int(t) for _, t, _ in bars} == {total} and int(bars[0][0]) == step + 1
    assert int(bars[-1][0]) == total and "\r" not in console
    first_validation = (step // 4 + 1) * 4  # the resumed run's own, at the next multiple of val_check_interval
    before = [rest for n, _, rest in bars if int(n) < first_validation]  # none when it resumes right at one
    assert len(before) == first_validation - step - 1
    assert not [rest for rest in before if "val_bpb" in rest]  # no value left from the interrupted run
    steps = [int(r["step"]) for r in val_rows(out)]
    assert steps == sorted(set(steps)) and steps[-1] == total  # no validation logged twice, the final one at the end
    assert all(s % 4 == 0 for s in steps[:-1])  # no validation pass on the way out of the interrupted run
    straight, straight_dir = run_inprocess(tmp_path, "straight", *common, f"trainer.max_steps={total}")
    assert straight["steps"] == total
    weights, expected = (torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
                         for d in (out, straight_dir))
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)  # bit for bit, codebooks included


def _stopped_by_ctrl_c(proc):
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "TypeError" not in proc.stderr, proc.stderr[-3000:]


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


CTRL_C_AS_THE_JOB_STARTS = """
import os, signal
from vqattn.train import cli
from vqattn.train.entry import main

quiet_console = cli.quiet_console


def quiet_then_ctrl_c():  # the job's first step, before anything is built
    quiet_console()
    os.kill(os.getpid(), signal.SIGINT)


cli.quiet_console = quiet_then_ctrl_c
main()
"""


@pytest.mark.slow
def test_ctrl_c_during_start_up_exits_130_and_leaves_no_run_dir(tmp_path):
    """Started as a shell without job control starts a background job, with SIGINT ignored: Python then
    installs no KeyboardInterrupt handler, and a SIGINT before training began was once lost (the run finished).
    The SIGINT comes as the job starts, every time (a signal sent after a file appeared once came after training
    had begun, on a fast start-up)."""
    starting = tmp_path / "starting"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    finished = subprocess.run([sys.executable, "-c", CTRL_C_AS_THE_JOB_STARTS, *FAST, f"hydra.run.dir={starting}"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                              preexec_fn=_ignore_sigint)
    _stopped_by_ctrl_c(finished)
    assert finished.stderr.endswith("\ninterrupted: nothing was saved\n") and not starting.exists()


CTRL_C_AS_HYDRA_SETS_THE_JOB_UP = """
import os, signal, sys
import hydra.core.utils
from vqattn.train.cli import main

save_config = hydra.core.utils._save_config


def save_then_ctrl_c(cfg, filename, output_dir):
    save_config(cfg, filename, output_dir)
    if filename == "overrides.yaml":  # the last file Hydra writes to .hydra/ before it calls the job
        os.kill(os.getpid(), signal.SIGINT)


hydra.core.utils._save_config = save_then_ctrl_c
main()
"""


@pytest.mark.slow
def test_ctrl_c_after_hydra_made_the_run_dir_and_before_the_job_ran_leaves_no_run_dir(tmp_path):
    """Hydra makes the run dir and writes .hydra/ before it calls the job, which alone knows that dir: a Ctrl-C
    in between once left the dir behind. The Ctrl-C comes there, every time."""
    starting = tmp_path / "starting"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    finished = subprocess.run([sys.executable, "-c", CTRL_C_AS_HYDRA_SETS_THE_JOB_UP, *FAST, f"hydra.run.dir={starting}"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    _stopped_by_ctrl_c(finished)
    assert finished.stderr.endswith("\ninterrupted: nothing was saved\n") and not starting.exists()


@pytest.mark.slow
def test_a_second_ctrl_c_exits_130_at_once_and_keeps_the_checkpoint(tmp_path):
    training = tmp_path / "training"
    proc = start_script([*FAST, "attention=softmax", "trainer.max_steps=2000", "checkpoint_every=3",
                         f"hydra.run.dir={training}"], tmp_path)
    wait_for(training / "checkpoints" / "last.ckpt", proc)
    proc.send_signal(signal.SIGINT)  # finish the step and stop ...
    proc.send_signal(signal.SIGINT)  # ... no: stop now
    _stopped_by_ctrl_c(finish_script(proc, timeout=120))
    assert (training / "checkpoints" / "last.ckpt").exists()  # kept: a checkpoint to resume from


def test_an_exception_in_training_is_raised_as_itself_and_restores_sigint(tmp_path, monkeypatch):
    from vqattn.train.lit import LitLM

    def broken_step(self, batch, batch_idx):
        raise RuntimeError("broken training step")

    monkeypatch.setattr(LitLM, "training_step", broken_step)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="broken training step"):
        run_inprocess(tmp_path, "run", "trainer.max_steps=2")
    assert signal.getsignal(signal.SIGINT) is handler


# performer: each rank redraws its features from the global step. It runs in a hybrid stack beside a softmax layer,
# so the same run checks a hybrid under DDP. A codebook's all-reduce is checked end to end by the README's own DDP
# command (vq_soft, tests/test_docs.py) and in-process by tests/layers/test_codebook.py.
DDP_ATTENTIONS = ["performer+softmax"]


def attention_override(attention: str) -> str:
    """The command line's attention: ``attention=NAME``, or for ``a+b`` the hybrid stack ``model.attention=[a,b]``."""
    return f"model.attention=[{attention.replace('+', ',')}]" if "+" in attention else f"attention={attention}"


@pytest.fixture(scope="module")
def ddp_bpe(tmp_path_factory):
    """(corpus, BPE tokenizer directory, token cache dir) for the DDP runs, outside their run dirs' parent."""
    from test_tokenizers import write_corpus

    from vqattn.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("ddp_bpe")
    corpus = write_corpus(root / "corpus.txt")
    return corpus, train_bpe([str(corpus)], 300, root / "tok"), root / "cache"


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, ddp_bpe):
    """The README's DDP command (progress bar on) for each of DDP_ATTENTIONS, started together, on a text corpus with
    a BPE tokenizer trained here (so the same runs check a subword tokenizer under DDP): {attention: (cwd,
    process)}."""
    corpus, tokenizer, cache = ddp_bpe
    runs = {}
    for attention in DDP_ATTENTIONS:
        cwd = tmp_path_factory.mktemp(f"ddp_{attention}")
        runs[attention] = (cwd, start_script([*AS_USERS_HAVE_IT, attention_override(attention), "trainer=ddp",
                                              "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=10",
                                              "data=text", f"data.path={corpus}", f"data.tokenizer={tokenizer}",
                                              f"data.cache_dir={cache / attention}", f"hydra.run.dir={cwd / 'OUT'}"],
                                             cwd))
    yield runs
    for _, proc in runs.values():
        proc.kill()
        proc.communicate()


@pytest.mark.xdist_group("ddp_runs")  # the module fixture starts all of its runs once, on one worker
@pytest.mark.slow
@pytest.mark.parametrize("attention", DDP_ATTENTIONS)
def test_ddp_two_cpu_processes_share_one_run_dir_and_stay_in_sync(ddp_runs, ddp_bpe, attention):
    tmp_path, running = ddp_runs[attention]
    out = tmp_path / "OUT"
    proc = finish_script(running)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert not [word for word in NOISE if word in console]
    assert console.count("step 10/10 (100%)") == 1  # rank 0's progress line; the others draw none
    results = read_results(out)
    assert results["world_size"] == 2 and results["steps"] == 10 and results["attention"] == attention
    assert results["ddp_buffer_divergence"] == 0.0  # codebook EMA / feature draws identical on both ranks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]  # no second run dir (outputs/, multirun/)
    assert (out / "rank1.log").exists()
    _, tokenizer, cache = ddp_bpe
    assert results["tokenizer"] == str(tokenizer) and results["val_bytes_per_token"] > 2
    assert len(list((cache / attention).iterdir())) == 1  # rank 1 reused rank 0's token files


# SIGTERM to rank 0 alone stops every DDP rank at the same saved step: tests/train/test_experiments.py, whose
# stopped DDP run is then resumed (test_sigterm_to_rank_0_alone_stops_a_ddp_carried_run_and_it_resumes_exactly).


def test_local_text_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(300)))
    results, _ = run_inprocess(tmp_path, "OUT", "data=text", f"data.path={text}", "attention=softmax",
                               "trainer.max_steps=5")
    assert results["data"] == "TextDataModule" and results["steps"] == 5


CONFIG_ERRORS = [
    (["data=text", "data.path=nope.txt"], "nope.txt"),
    (["data=mqar", "data.num_kv_pairs=40", "model.seq_len=128"], "seq_len >= 4 * num_kv_pairs"),
    (["trainer.max_steps=abc"], "trainer.max_steps must be a positive int, got 'abc'"),
    (["model.seq_len=-1"], "model.seq_len must be a positive int"),
    (["ckpt_path=corrupt.ckpt"], "is not a valid checkpoint"),
    (["trainer.val_check_interval=abc"], "val_check_interval"),
    (["optim.lr=-1"], "optim.lr must be > 0, got -1"),
    (["attention=vq_soft", "ckpt_path=softmax.ckpt"], "trained with attention=softmax, this run has attention=vq_soft"),
    (["trainer.accelerator=cpu", "trainer.devices=3"], "trainer.devices=3 starts one process per device: add trainer=ddp"),
    (["attention=vq_hard", "attention.kwargs.num_codes=0"], "attention.kwargs.num_codes must be a positive int"),
    (["threads=0"], "threads must be a positive int, auto or null, got 0"),
    (["attention=softmax", "model.n_embd=64", "ckpt_path=softmax.ckpt"], "does not fit this model"),
    (["data.tokenizer=nope/tokenizer.json"], "nope/tokenizer.json' does not exist: give bytes, a tokenizer.json"),
    (["model.vocab_size=50257"], "model.vocab_size=50257 does not fit data.tokenizer=bytes (256 tokens"),
]
# The whole path as a user meets it, in a subprocess: one line, exit 2, no run dir, no warning on the console. One case
# for the errors train() finds (each process is seconds of imports): the checkpoint's, which loads a file on the way;
# every message, one line, no run dir: in-process below. Errors found while Hydra composes the config come before any
# job, so the command line's main() runs them in-process: test_an_unknown_key_is_one_line_naming_the_nearest_valid_key
# and test_a_config_hydra_cannot_compose_exits_2_too.
SUBPROCESS_ERRORS = [CONFIG_ERRORS[7]]


def write_softmax_checkpoint(path: Path) -> None:
    """A checkpoint as train.py writes one (hyperparameters, state_dict, global_step), of a softmax model."""
    module = instantiate(cfg_for(*FAST, "attention=softmax").module, _convert_="all")
    torch.save({"state_dict": module.state_dict(), "global_step": 5, "hyper_parameters": dict(module.hparams)}, path)


def write_bad_checkpoints(cwd: Path) -> None:
    (cwd / "corrupt.ckpt").write_bytes(b"PK\x03\x04 not really")
    write_softmax_checkpoint(cwd / "softmax.ckpt")


@pytest.mark.parametrize("overrides,message", CONFIG_ERRORS, ids=[message for _, message in CONFIG_ERRORS])
def test_config_errors_are_one_line_messages(tmp_path, monkeypatch, overrides, message):
    from vqattn.train import cli, lifecycle

    write_bad_checkpoints(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as info:
        cli.train(cfg_for(*FAST, *overrides), tmp_path / "run")
    line = lifecycle.user_error(info.value)  # what the command line prints after "error: ", else the traceback
    assert line is not None and message in line and "\n" not in line, repr(info.value)
    assert not (tmp_path / "run").exists()  # nothing was written before the check


@pytest.fixture(scope="module")
def config_error_runs(tmp_path_factory):
    """Every SUBPROCESS_ERRORS run, started together, each in its own directory: {overrides: (cwd, process)}."""
    runs = {}
    for case, (overrides, _) in enumerate(SUBPROCESS_ERRORS):
        cwd = tmp_path_factory.mktemp(f"config_error_{case}")
        write_bad_checkpoints(cwd)
        runs[tuple(overrides)] = (cwd, start_script([*FAST, *overrides], cwd))
    yield runs
    for _, proc in runs.values():
        proc.kill()
        proc.communicate()


def finish_config_error(runs, overrides) -> subprocess.CompletedProcess:
    tmp_path, running = runs[tuple(overrides)]
    proc = finish_script(running)  # started with the others: 300 s for all of them
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "weights_only" not in proc.stderr
    assert not (tmp_path / "outputs").exists()
    return proc


@pytest.mark.xdist_group("config_error_runs")  # the module fixture starts all of its runs once, on one worker
@pytest.mark.slow
@pytest.mark.parametrize("overrides,message", SUBPROCESS_ERRORS, ids=[message for _, message in SUBPROCESS_ERRORS])
def test_config_errors_are_one_line_exit_2_and_leave_no_run_dir(config_error_runs, overrides, message):
    proc = finish_config_error(config_error_runs, overrides)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert "HYDRA_FULL_ERROR" not in proc.stderr  # the error line alone


def test_a_config_hydra_cannot_compose_exits_2_too(tmp_path, monkeypatch, capsys):
    """Hydra's own report of a command line it cannot parse, exit status 2 as for the trainer's errors, no traceback
    and no run dir."""
    from vqattn.train import cli

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", *FAST, "model.n_layer=["])
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "no viable alternative at input '['" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_mqar_results_lead_with_recall_accuracy(tmp_path, monkeypatch):
    from vqattn.train import cli

    versions = iter(["abc1234", "def5678+changes"])  # the checkout moves on while the run trains
    monkeypatch.setattr(cli, "code_version", lambda: next(versions))

    cfg = cfg_for("model=tiny", "data=mqar", "data.num_kv_pairs=4", "data.batch_size=4", "data.num_val_examples=8",
                  "trainer.max_steps=2", "trainer.val_check_interval=2", "threads=1", *FAST[1:])
    run_dir = tmp_path / "mqar"
    run_dir.mkdir()
    results = cli.train(cfg, run_dir)
    assert results["headline"] == "recall_acc" and results["recall_acc"] == results["val_acc"]
    # what a report states of its runs: corpus, tokenizer, threads, device and code
    assert results["corpus"] == {"name": "mqar", "source": f"synthetic, 4 key-value pairs in {cfg.data.seq_len} tokens"}
    assert results["tokenizer"] == "bytes" and results["threads"] == 1  # the run's (threads=auto: the cores idle as it starts)
    assert results["device"].startswith("cpu") and results["code"] == "abc1234"  # the code the run started with
    assert (run_dir / "checkpoints" / "last.ckpt").exists()


class _InterruptedImport(importlib.abc.MetaPathFinder):
    """Ctrl-C while Python imports ``name``."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname == self.name:
            raise KeyboardInterrupt
        return None


def test_ctrl_c_while_the_trainer_imports_is_one_line_and_exit_130(monkeypatch, capsys):
    from vqattn.train import entry

    monkeypatch.delitem(sys.modules, "vqattn.train.cli", raising=False)  # imported again, interrupted (restored after the test)
    monkeypatch.setattr(sys, "meta_path", [_InterruptedImport("vqattn.train.cli"), *sys.meta_path])
    with pytest.raises(SystemExit) as exit:
        entry.main()
    assert exit.value.code == 130
    assert capsys.readouterr().err == "\ninterrupted while starting: nothing was saved\n"
