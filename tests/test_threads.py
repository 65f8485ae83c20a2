"""Every command line beside the trainer picks its threads as the trainer does (``threads=auto``: the cores other
work leaves idle) and says so in one line: vqattn.utils.use_threads, and the entry points that call it."""

import dataclasses
import importlib
import io
import sys

import pytest
import torch

from vqattn import utils
from vqattn.utils import pick_threads, threads_arg, use_threads


@pytest.fixture
def one_idle_core(monkeypatch):
    """No OMP_NUM_THREADS, 1 idle core by the measurement, and torch's threads put back after the test."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(utils, "idle_cores", lambda: 1)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_pick_threads_says_what_it_chose(one_idle_core, monkeypatch):
    cores = utils.available_cores()
    assert pick_threads("auto", "sampling") == (1, f"threads=auto: 1 of {cores} cores idle, sampling with 1 thread")
    assert pick_threads(1, "timing") == (1, "threads=1: timing with 1 thread")
    assert pick_threads(None)[0] is None
    monkeypatch.setattr(utils, "idle_cores", lambda: 10**6)
    assert pick_threads("auto")[0] == torch.get_num_threads()  # never more than torch's default
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    chosen, line = pick_threads("auto", "exporting")
    assert chosen is None and line.startswith("threads=auto: OMP_NUM_THREADS=2 set, exporting with ")
    for bad in (0, -1, "four", True, 2.5):
        with pytest.raises(ValueError, match="threads must be a positive int, auto or null"):
            pick_threads(bad)


def test_a_count_the_user_set_beyond_the_idle_cores_is_said_with_its_cost_and_what_auto_would_take(one_idle_core,
                                                                                                monkeypatch):
    cores = utils.available_cores()
    busy = (f", but only 1 of {cores} cores is idle: threads on busy cores stall each other, often several times "
            f"slower; threads=auto would use 1 thread")
    assert pick_threads(3, "training") == (3, f"threads=3: training with 3 threads{busy}")
    torch.set_num_threads(2)
    assert pick_threads(None, "training") == (None, f"threads=null: torch's default, training with 2 threads{busy}")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    chosen, line = pick_threads("auto", "training")
    assert chosen is None and line == ("threads=auto: OMP_NUM_THREADS=2 set, training with 2 threads"
                                       + busy.replace("threads=auto", "threads=auto without OMP_NUM_THREADS"))
    monkeypatch.setattr(utils, "idle_cores", lambda: 3)  # the count fits the idle cores: nothing added
    assert pick_threads(3, "training") == (3, "threads=3: training with 3 threads")


def test_use_threads_sets_them_says_so_in_one_line_and_can_hand_them_to_children(one_idle_core, monkeypatch):
    out = io.StringIO()
    assert use_threads("auto", "sampling", file=out) == torch.get_num_threads() == 1
    assert out.getvalue().count("\n") == 1 and "sampling with 1 thread" in out.getvalue()
    monkeypatch.setattr(utils.os, "environ", {})  # what children=True writes, without touching this process's
    use_threads(2, "timing", children=True, file=io.StringIO())
    assert torch.get_num_threads() == 2 and utils.os.environ["OMP_NUM_THREADS"] == "2"


def test_the_threads_option_takes_a_positive_int_or_auto():
    assert threads_arg("auto") == "auto" and threads_arg("3") == 3
    for bad in ("0", "-2", "two", ""):
        with pytest.raises(Exception, match="a positive int or auto"):
            threads_arg(bad)


ENTRY_POINTS = ["vqattn.train.sample", "vqattn.train.length_eval", "vqattn.hf.export", "attention_speed",
                "layer_speed", "decode_speed", "length_ablations"]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_has_the_threads_option(name, monkeypatch, capsys):
    if name.startswith("vqattn.hf"):
        pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(utils.Path(__file__).resolve().parents[1] / "benchmarks"))
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [name, "--help"])  # the benchmarks whose main reads sys.argv
    with pytest.raises(SystemExit) as info:
        module.main(["--help"]) if "argv" in module.main.__code__.co_varnames else module.main()
    assert info.value.code == 0 and "--threads N|auto" in capsys.readouterr().out


def test_sample_runs_with_the_idle_cores_and_says_so(one_idle_core, tmp_path, capsys, monkeypatch):
    from vqattn.train import sample

    from model_helpers import tiny_model

    model = tiny_model("softmax")  # 17 byte values: prompts from bytes below 17
    torch.save({"global_step": 3, "hyper_parameters": {"model": dataclasses.asdict(model.config)},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "last.ckpt")
    seen = []
    generate = type(model).generate
    monkeypatch.setattr(type(model), "generate", lambda self, *a, **k: seen.append(torch.get_num_threads())
                        or generate(self, *a, **k))
    assert sample.main([str(tmp_path / "last.ckpt"), "--prompt", "\n\t", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert seen == [1] and "sampling with 1 thread" in err and "threads" not in out  # stdout: the text alone
    torch.set_num_threads(2)
    assert sample.main([str(tmp_path / "last.ckpt"), "--max-new-tokens", "1", "--device", "cpu", "--threads", "2"]) == 0
    assert seen == [1, 2] and "threads=2: sampling with 2 threads" in capsys.readouterr().err


def test_vqattn_eval_takes_its_threads_option_out_of_lm_evals(monkeypatch):
    pytest.importorskip("lm_eval")
    from vqattn.hf.eval import split_threads

    assert split_threads(["--model", "hf", "--threads", "2", "--limit", "4"]) == (2, ["--model", "hf", "--limit", "4"])
    assert split_threads(["--threads=auto", "--tasks", "x"]) == ("auto", ["--tasks", "x"])
    assert split_threads(["--tasks", "x"]) == ("auto", ["--tasks", "x"])
    with pytest.raises(SystemExit, match="argument --threads: a positive int or auto"):
        split_threads(["--threads", "0"])
