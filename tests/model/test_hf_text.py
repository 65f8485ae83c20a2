"""The ``vqattn_text`` lm-eval task: bits per byte of the user's own text (``--metadata path=FILE_OR_GLOB``), one
document per file, equal to the trainer's validation over the same windows."""

import math
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from test_hf import hf_model, write_trainer_checkpoint  # noqa: E402

from vqattn.hf import VQAttnByteTokenizer  # noqa: E402
from vqattn.hf.tasks.data import TextTaskError, text, text_results  # noqa: E402

T = 32  # the model's seq_len: lm-eval's rolling windows are this long


def text_of(n_bytes: int, seed: int) -> bytes:
    """``n_bytes`` of Python-like UTF-8 text with multi-byte characters (bits per byte counts bytes, not
    characters), ending on a whole character, ASCII-padded to the length."""
    lines = [f"x{seed}_{i} = 'é{i * (seed + 3)}ü'  # ñ\r\n" if i % 4 == 0 else f"def f{i}(a):\n    return a + {i}\n"
             for i in range(n_bytes)]
    data = "".join(lines).encode()[:n_bytes]
    data = data.decode("utf-8", errors="ignore").encode()
    return data + b" " * (n_bytes - len(data))


def test_the_task_reads_a_file_or_a_sorted_glob_exactly_and_names_a_bad_path(tmp_path):
    (tmp_path / "b.py").write_bytes(b"def f():\r\n    return 1\n")
    (tmp_path / "a.txt").write_bytes("héllo\n".encode())
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"")  # empty: no byte to predict, no document
    docs = text(path=str(tmp_path / "**" / "*.*"))["test"]
    assert [d["file"] for d in docs] == [str(tmp_path / "a.txt"), str(tmp_path / "b.py")]
    assert [d["text"] for d in docs] == ["héllo\n", "def f():\r\n    return 1\n"]  # no newline translation
    assert list(docs["tokens"]) == [-1, -1]  # no tokenizer named: no token count
    VQAttnByteTokenizer().save_pretrained(tmp_path / "model")  # lm-eval's metadata holds the model arguments
    counted = text(path=str(tmp_path / "a.txt"), pretrained=str(tmp_path / "model"), version=1.0)["test"]
    assert list(counted["tokens"]) == [len("héllo\n".encode())]  # one token a byte
    scores = text_results(counted[0], [-3.5])
    assert scores == {"word_perplexity": (-3.5, 2), "byte_perplexity": (-3.5, 7), "bits_per_byte": (-3.5, 7),
                      "token_perplexity": (-3.5, 7)}  # lm-eval's word count: "héllo", "" around the newline
    assert "token_perplexity" not in text_results(docs[0], [-3.5])

    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for kwargs, message in (({"path": str(tmp_path / "*.md")}, f"no file found at path='{tmp_path / '*.md'}'"),
                            ({}, "needs the text to score: pass --metadata path=FILE_OR_GLOB"),
                            ({"path": str(tmp_path / "sub" / "*")}, "is empty"),
                            ({"path": str(tmp_path / "latin1.txt")}, "latin1.txt is not UTF-8 text (byte 3)")):
        with pytest.raises(TextTaskError, match="^vqattn_text") as err:
            text(**kwargs)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_vqattn_eval_says_a_path_that_matches_nothing_in_one_line_before_loading_the_model(tmp_path, capsys,
                                                                                          monkeypatch):
    import lm_eval.utils

    from vqattn.hf.eval import main

    monkeypatch.setattr(sys, "argv", sys.argv)  # main sets lm-eval's
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", True)  # no lm-eval handler on capsys's stream
    threads = torch.get_num_threads()  # main sets them as the command line does
    try:
        missing = str(tmp_path / "notes" / "*.md")
        for metadata in (f"path={missing}", f'{{"path": "{missing}"}}'):
            with pytest.raises(SystemExit) as exit:  # the model directory does not exist: nothing was loaded
                main(["--threads", "1", "--model", "hf", "--model_args", f"pretrained={tmp_path / 'no_model'}",
                      "--tasks", "vqattn_text", "--metadata", metadata, "--device", "cpu"])
            assert exit.value.code == 2
            err = capsys.readouterr().err.splitlines()[-1]
            assert err == (f"vqattn-eval: error: vqattn_text: no file found at path={missing!r} (give an existing "
                           "file or a glob that matches files)")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_vqattn_text_bits_per_byte_equal_the_trainers_validation_over_the_same_windows(tmp_path):
    """An exported checkpoint scored by lm-eval over two files (a glob) whose lengths are multiples of seq_len
    equals the trainer's validation (LitLM.validation_step over TextDataModule's windows) of NUL + each file: the
    same windows, so the same bits per byte."""
    pytest.importorskip("lightning")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from vqattn.hf.eval import TASKS_DIR
    from vqattn.hf.export import main as export
    from vqattn.train.data import TextDataModule
    from vqattn.train.lit import LitLM

    write_trainer_checkpoint(tmp_path / "last.ckpt", hf_model("vq_soft", seq_len=T))
    assert export([str(tmp_path / "last.ckpt"), str(tmp_path / "hf")]) == 0
    texts = {"b.py": text_of(3 * T, seed=1), "a.py": text_of(2 * T, seed=2)}
    (tmp_path / "text").mkdir()
    for name, data in texts.items():
        (tmp_path / "text" / name).write_bytes(data)
    model_args = {"pretrained": str(tmp_path / "hf"), "backend": "causal"}
    tasks = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,  # lm-eval's own tasks: seconds to index
                        metadata={**model_args, "path": str(tmp_path / "text" / "*.py")})  # as its CLI merges them
    results = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=["vqattn_text"], device="cpu",
                                      task_manager=tasks)["results"]["vqattn_text"]

    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    lit = LitLM(model=checkpoint["hyper_parameters"]["model"]).eval()  # the trainer's module, as it was saved
    lit.load_state_dict(checkpoint["state_dict"])
    for name, data in sorted(texts.items()):  # the trainer reads its validation text as it is: NUL + the file
        (tmp_path / f"{name}.nul").write_bytes(b"\0" + data)
        windows = TextDataModule(path=str(tmp_path / f"{name}.nul"), val_path=str(tmp_path / f"{name}.nul"),
                                 seq_len=T, batch_size=2, cache_dir=str(tmp_path / "cache"))
        windows.setup("validate")
        assert len(windows.val_set) == len(data) // T  # every byte of the file is one window's target
        with torch.no_grad():
            for i, batch in enumerate(windows.val_dataloader()):
                lit.validation_step(batch, i)
    assert int(lit.val_nll.bytes.sum()) == sum(map(len, texts.values()))
    assert results["bits_per_byte,none"] == pytest.approx(float(lit.val_nll.compute()["bpb"]), rel=1e-5)
    assert results["token_perplexity,none"] == pytest.approx(results["byte_perplexity,none"], rel=1e-9)
    assert results["byte_perplexity,none"] == pytest.approx(2 ** results["bits_per_byte,none"], rel=1e-9)


def test_the_task_loads_through_lm_eval_without_warnings_and_takes_its_path_from_the_metadata(tmp_path, caplog,
                                                                                             monkeypatch):
    """The YAML names every metric's aggregation and direction, and its functions resolve to the package's module
    (whose TextTaskError vqattn-eval catches)."""
    import logging

    from lm_eval.tasks import TaskManager

    from vqattn.hf.eval import TASKS_DIR, _not_about_our_functions

    (tmp_path / "notes.md").write_text("# notes\n")
    monkeypatch.setattr(logging.getLogger("lm_eval"), "propagate", True)  # to caplog, whoever set up lm-eval's logs
    task_log = logging.getLogger("lm_eval.api.task")
    task_log.addFilter(_not_about_our_functions)  # as vqattn-eval's main installs it
    try:
        with caplog.at_level("WARNING"):
            manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                                  metadata={"path": str(tmp_path / "*.md")})
            task = manager.load(["vqattn_text"])["tasks"]["vqattn_text"]
        with pytest.raises(TextTaskError, match="no file found"):
            TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                        metadata={"path": str(tmp_path / "*.txt")}).load(["vqattn_text"])
    finally:
        task_log.removeFilter(_not_about_our_functions)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [doc["text"] for doc in task.test_docs()] == ["# notes\n"]
    assert task.higher_is_better() == {"word_perplexity": False, "byte_perplexity": False, "bits_per_byte": False,
                                       "token_perplexity": False}


def test_vqattn_copy_scores_copy_evals_streams_as_a_forward_pass_does(tmp_path):
    """The lm-eval task of copy at a distance, through an exported model: its documents are copy_eval's streams of
    the shipped held-out text (window from the model's config, number of streams from the task's metadata), and its
    bits are the model's own over each continuation, with the trailing whitespace lm-eval moves into it."""
    pytest.importorskip("lightning")
    import lm_eval
    import torch.nn.functional as F
    from lm_eval.tasks import TaskManager

    from vqattn.hf.eval import TASKS_DIR
    from vqattn.hf.tasks.data import copy, heldout_docs_shipped
    from vqattn.train.copy_eval import copy_streams, layout
    from vqattn.train.length_eval import held_out_streams

    model = hf_model("softmax", seq_len=T)
    model.save_pretrained(tmp_path)
    VQAttnByteTokenizer().save_pretrained(tmp_path)
    model_args = {"pretrained": str(tmp_path), "backend": "causal"}
    tasks = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={**model_args, "streams": 6})
    results = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=["vqattn_copy"], device="cpu",
                                      task_manager=tasks)["results"]["vqattn_copy"]

    docs = copy(seq_len=T, streams=6)["test"]
    lead, passage, _ = layout(T)
    repeat, control = copy_streams(held_out_streams("".join(heldout_docs_shipped()).encode(), T, 6), lead, passage)
    for doc, r, c in zip(docs, repeat, control):  # copy_eval's streams, cut before the repeat's second byte
        assert [*doc["contexts"][0].encode(), *doc["continuation"].encode()] == r.tolist()
        assert [*doc["contexts"][1].encode(), *doc["continuation"].encode()] == c.tolist()
    bits, size = {0: 0.0, 1: 0.0}, {0: 0, 1: 0}
    with torch.no_grad():
        for doc in docs:
            for i, context in enumerate(doc["contexts"]):
                ids = torch.tensor([*(context + doc["continuation"]).encode()])
                scored = len(doc["continuation"]) + len(context) - len(context.rstrip())
                nll = F.cross_entropy(model(ids[None, :-1]).logits[0].double(), ids[1:], reduction="none")
                bits[i] += nll[-scored:].sum().item() / math.log(2)
                size[i] += scored
    assert results["bits_per_byte_repeat,none"] == pytest.approx(bits[0] / size[0], rel=1e-5)
    assert results["bits_per_byte_control,none"] == pytest.approx(bits[1] / size[1], rel=1e-5)
    assert results["copied,none"] == pytest.approx(1 - bits[0] / bits[1], rel=1e-3, abs=1e-6)
    assert bits[0] != bits[1]  # softmax sees the first occurrence
    with pytest.raises(TextTaskError, match="^vqattn_copy needs the model's window"):
        copy()
    with pytest.raises(TextTaskError, match="^vqattn_copy: two passages"):
        copy(seq_len=T, passage=20)
