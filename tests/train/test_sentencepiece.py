"""SentencePiece models as data.tokenizer: unigram and BPE models trained here by the command on a corpus made here,
exact bytes (non-ASCII, invalid UTF-8, "▁"), bad models as one-line errors, the export's tokenizer against the
trainer's, and a run's checkpoint through bits per byte, sampling, length_eval, the export and lm-eval."""

import io
import math
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from test_tokenizers import write_corpus
from test_train import FAST, cfg_for, run_inprocess

from vqattn.checkpoint import load_model, read_tokenizer
from vqattn.tokenizer import SentencePieceTokenizer, from_json, load_tokenizer, main, padded_vocab
from vqattn.train.lit import LN2

sentencepiece = pytest.importorskip("sentencepiece")

KINDS = ["unigram", "bpe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(corpus file, {model type: directory the command wrote}) made for this module."""
    root = tmp_path_factory.mktemp("sentencepiece")
    corpus = write_corpus(root / "corpus.txt")
    # first (the validation split is the end): the characters of "<s>", "</s>", "<unk>" and "<0x41>" as pieces
    corpus.write_text("a <b> c/d, 0x41 <unk>\n" * 200 + corpus.read_text(encoding="utf-8"), encoding="utf-8")
    for kind in KINDS:
        assert main(["train", "--kind", "sentencepiece", "--model-type", kind, "--files", str(corpus),
                     "--vocab-size", "320", "--out", str(root / kind)]) == 0
    return corpus, {kind: root / kind for kind in KINDS}


def texts(corpus) -> list[bytes]:
    return [corpus.read_bytes(), "naïve café данные über 𝄞 ½ ｱ ﬁ e\u0301".encode(),
            b"\xff\xfe invalid bytes, a cut \xe2\x96 character and a lone \xc3",
            "a ▁ marker, ▁▁ two, and ▁the word".encode(),
            b"  two spaces first, a\ttab,\r\nNUL \x00 </s> <s> <unk> <0x41> and a space last ", b""]


@pytest.mark.parametrize("kind", KINDS)
def test_a_sentencepiece_model_encodes_any_bytes_exactly_and_counts_each_byte_once(models, kind):
    corpus, directories = models
    tokenizer = load_tokenizer(str(directories[kind]))
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.model_type == kind
    assert tokenizer.vocab_size == 320 and padded_vocab(tokenizer.vocab_size) == 320
    assert load_tokenizer(str(directories[kind] / "tokenizer.model")).fingerprint == tokenizer.fingerprint
    table = tokenizer.token_bytes()
    for text in texts(corpus):
        ids = tokenizer.encode(text)
        assert tokenizer.decode_bytes(ids) == text
        assert table[ids].sum() == len(text)  # every byte counted once: no dummy prefix, "▁" of the text is 3
    assert len(tokenizer.encode(corpus.read_bytes())) < corpus.stat().st_size / 1.25  # pieces learned
    assert tokenizer.decode(tokenizer.encode(b"caf\xc3\xa9 \xff")) == "café \ufffd"  # as text: invalid UTF-8 replaced
    # the checkpoint's copy (base64 of the proto) and a tokenizing worker's (pickled): the same model
    for copy in (from_json(tokenizer.to_json(), "checkpoint"), pickle.loads(pickle.dumps(tokenizer))):
        assert copy.fingerprint == tokenizer.fingerprint
        assert copy.encode(texts(corpus)[2]).tolist() == tokenizer.encode(texts(corpus)[2]).tolist()


def train_directly(tmp_path, name, **options) -> str:
    """A SentencePiece model trained by sentencepiece itself with ``options``, written to tmp_path/NAME.model."""
    corpus = write_corpus(tmp_path / "small.txt", lines=300)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_writer=model, vocab_size=300, minloglevel=2,
                                             hard_vocab_limit=False, **options)
    path = tmp_path / f"{name}.model"
    path.write_bytes(model.getvalue())
    return str(path)


def test_a_model_that_is_not_a_model_or_changes_text_is_a_one_line_error(tmp_path):
    (tmp_path / "text.model").write_text("not a model\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "tokenizer.model").write_bytes(b"\x00\x01garbage")
    cases = [(str(tmp_path / "text.model"), "is not a SentencePiece model"),
             (str(tmp_path / "dir"), "is not a SentencePiece model"),
             (train_directly(tmp_path, "nfkc", byte_fallback=True), "is a SentencePiece model that changes the "
                                                                      "text it encodes"),  # the defaults
             (train_directly(tmp_path, "prefix", byte_fallback=True, normalization_rule_name="identity",
                             remove_extra_whitespaces=False), "is a SentencePiece model that changes"),  # "▁" first
             (train_directly(tmp_path, "nobytes", normalization_rule_name="identity", add_dummy_prefix=False,
                             remove_extra_whitespaces=False), "is a SentencePiece model without byte fallback")]
    for spec, message in cases:
        with pytest.raises(ValueError, match=f"^data.tokenizer='{spec}' {message}") as info:
            load_tokenizer(spec)
        assert "\n" not in str(info.value)
    assert load_tokenizer(train_directly(tmp_path, "kept", byte_fallback=True, normalization_rule_name="identity",
                                         add_dummy_prefix=False, remove_extra_whitespaces=False)).vocab_size > 259


@pytest.mark.parametrize("args,message", [
    (["--min-frequency", "3"], "--min-frequency is not an option of --kind sentencepiece"),
    (["--vocab-size", "259"], "--vocab-size must be at least 260 for --kind sentencepiece"),
    (["--vocab-size", "100000"], "SentencePiece could not train: .*[Vv]ocabulary size"),
])
def test_the_command_s_bad_arguments_are_one_line_errors(tmp_path, capsys, args, message):
    corpus = write_corpus(tmp_path / "c.txt", lines=200)
    argv = ["train", "--kind", "sentencepiece", "--files", str(corpus), "--vocab-size", "300", "--out",
            str(tmp_path / "out"), *args]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m vqattn.tokenizer: error: ")
    assert re.search(message, last), last


@pytest.mark.parametrize("kind", KINDS)
def test_the_exported_tokenizer_loads_with_auto_tokenizer_and_encodes_as_the_trainer(models, tmp_path, kind):
    from transformers import AutoTokenizer

    from vqattn.tokenizer import transformers_tokenizer

    corpus, directories = models
    tokenizer = load_tokenizer(str(directories[kind]))
    transformers_tokenizer(tokenizer).save_pretrained(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in texts(corpus)[:2] + ["the lazy dog </s> <s> naïve\n  café", "  spaces\tand\r\nlines "]:
        text = text if isinstance(text, str) else text.decode()
        ids = hf.encode(text)
        assert ids == tokenizer.encode(text.encode()).tolist() and hf.decode(ids) == text
    assert (hf.eos_token, hf.bos_token, hf.unk_token) == ("</s>", "<s>", "<unk>") and hf.eos_token_id == 2
    # the export's directory as data.tokenizer (its tokenizer.json): the same bytes for every piece
    again = load_tokenizer(str(tmp_path / "hf"))
    text = corpus.read_bytes().rpartition(b"<unk>\n")[2]  # its special tokens match in text: "<unk>" is id 0
    assert again.encode(text).tolist() == tokenizer.encode(text).tolist()
    assert (again.token_bytes()[3:] == tokenizer.token_bytes()[3:]).all()  # beyond <unk>, <s>, </s>


@pytest.mark.slow
def test_a_sentencepiece_run_counts_bits_per_byte_samples_and_exports_for_lm_eval(models, tmp_path):
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vqattn.hf  # noqa: F401
    from vqattn.hf.export import export
    from vqattn.train.length_eval import length_eval
    from vqattn.train.sample import sample

    corpus, directories = models
    spec = str(directories["unigram"])
    overrides = ["attention=softmax", "data=text", f"data.path={corpus}", f"data.tokenizer={spec}",
                 f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=8", "trainer.limit_val_batches=null"]
    results, run_dir = run_inprocess(tmp_path, "run", *overrides)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    tokenizer, model = read_tokenizer(checkpoint), load_model(checkpoint)
    assert tokenizer.fingerprint == load_tokenizer(spec).fingerprint and results["tokenizer"] == spec
    assert model.config.vocab_size == 320 and results["val_bytes_per_token"] > 1.2
    # val_bpb: the summed NLL of the validation windows over ln 2 x the bytes their target pieces spell
    datamodule = instantiate(cfg_for(*FAST, *overrides).data)
    datamodule.setup()
    nll, n_bytes = 0.0, 0
    with torch.no_grad():
        for x, y in datamodule.val_set:
            nll += float(F.cross_entropy(model(x[None]).logits[0].double(), y, reduction="sum"))
            n_bytes += len(tokenizer.decode_bytes(y.tolist()))
    assert results["val_bpb"] == pytest.approx(nll / (LN2 * n_bytes), rel=1e-4)

    text = sample(checkpoint, "the quick", 20, seed=0)[0]
    assert text.startswith("the quick") and len(text) > len("the quick") + 20  # pieces: more than a byte each
    held_out = length_eval(model, corpus.read_bytes(), multiple=2, streams=2, tokenizer=tokenizer)
    assert len(held_out["bpb"]) == 2 and all(0 < b < 20 for b in held_out["bpb"])

    out = export(checkpoint, tmp_path / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    # bits per byte through transformers on the validation text, tokenized by the export's tokenizer
    val = corpus.read_bytes()[-math.ceil(corpus.stat().st_size * 0.05):].decode(errors="ignore")
    ids = torch.tensor(hf_tokenizer.encode(val))
    assert ids.tolist() == tokenizer.encode(val.encode()).tolist()
    T, nll, n_bytes = model.config.seq_len, 0.0, 0
    with torch.no_grad():
        for start in range(0, (len(ids) - 1) // T * T, T):
            x, y = ids[start:start + T], ids[start + 1:start + T + 1]
            nll += float(F.cross_entropy(hf_model(x[None]).logits[0].double(), y, reduction="sum"))
            n_bytes += len(hf_tokenizer.decode(y).encode())
    assert nll / (LN2 * n_bytes) == pytest.approx(results["val_bpb"], rel=0.03)
    import lm_eval
    from lm_eval.tasks import TaskManager

    from vqattn.hf.eval import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # lm-eval's own tasks: seconds to index
    heldout = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},backend=causal", device="cpu", limit=1,
                                      tasks=["vqattn_heldout"], task_manager=manager)
    assert 0 < heldout["results"]["vqattn_heldout"]["bits_per_byte,none"] < 20


@pytest.mark.parametrize("kind", KINDS)
def test_token_files_made_with_a_sentencepiece_model_start_documents_at_its_eos(models, kind):
    from vqattn.train.token_files import end_of_text

    tokenizer = load_tokenizer(str(models[1][kind]))
    eos = end_of_text(tokenizer, str(models[1][kind]))
    assert eos == tokenizer.processor.piece_to_id("</s>") and eos >= 0  # data=tokens packs at it, no data.eos_id
