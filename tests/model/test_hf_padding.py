"""Padded batches in VQAttnForCausalLM: left- or right-padded rows run as packed sequences, each exactly as alone,
in forward, in generate (the cache holds one state per row) and in lm-eval's generation tasks."""

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import hf_model  # noqa: E402

from vqattn.hf import VQAttnByteTokenizer  # noqa: E402

from model_helpers import NAMES  # noqa: E402

PROMPTS = (3, 7, 1, 5)
NEW = 6


def _padded(prompts, side):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, cols], mask[i, cols] = p, 1
    return ids, mask


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g) for n in PROMPTS]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", NAMES)
def test_batched_greedy_generate_equals_each_prompt_alone(name, side):
    model = hf_model(name)
    prompts = _prompts()
    ids, mask = _padded(prompts, side)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, len(p):]
        assert torch.equal(out[i, ids.shape[1]:], alone), f"row {i}"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["softmax", "vq_hard", "ovq", "performer"])
def test_padded_forward_equals_each_row_alone(name, side):
    model = hf_model(name)
    prompts = _prompts(1)
    ids, mask = _padded(prompts, side)
    logits = model(ids, attention_mask=mask).logits
    for i, p in enumerate(prompts):
        real = mask[i].bool()
        alone = model(p[None]).logits[0]
        torch.testing.assert_close(logits[i, real], alone, rtol=1e-5, atol=1e-5)
        if side == "left":
            assert not logits[i, ~real].any()  # left pads: zero logits
        else:  # right pads: the last real token's, where generate reads the next token
            torch.testing.assert_close(logits[i, ~real], alone[-1:].expand(int((~real).sum()), -1))


def test_bad_masks_are_value_errors():
    model = hf_model("window")
    ids = torch.randint(0, 256, (2, 5))
    with pytest.raises(ValueError, match="attention_mask row 1 has a pad between real tokens"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask row 0 has no token"):
        model(ids, attention_mask=torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(ids, attention_mask=torch.ones(3, 5, dtype=torch.long))


def test_cache_rows_follow_beam_reordering():
    model = hf_model("vq_soft")
    ids, mask = _padded(_prompts(2), "left")
    out = model(ids, attention_mask=mask, use_cache=True)
    cache = out.cache
    assert cache.per_row and cache.batch_size == len(PROMPTS) and cache.get_seq_length() == ids.shape[1]
    rows = list(cache.state)
    cache.reorder_cache(torch.tensor([3, 0, 0, 1]))
    assert cache.state == [rows[3], rows[0], rows[0], rows[1]]
    cache.batch_repeat_interleave(2)
    assert len(cache.state) == 8 and cache.state[0] is cache.state[1]


@pytest.mark.slow
def test_lm_eval_generation_at_batch_size_4_equals_batch_size_1(tmp_path):
    """A generate_until task over prompts of different lengths: the same generations at batch sizes 1 and 4."""
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = hf_model("vq_hard", seq_len=64)
    model.save_pretrained(tmp_path / "model")
    VQAttnByteTokenizer().save_pretrained(tmp_path / "model")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "lengths.py").write_text(
        "import datasets\n"
        "def docs(**kwargs):\n"
        "    rows = [{'prompt': 'def f(x):\\n    return ' * (1 + i % 3) + 'x' * i, 'target': 'x'} for i in range(8)]\n"
        "    return datasets.DatasetDict({'test': datasets.Dataset.from_list(rows)})\n")
    (tasks / "lengths.yaml").write_text(
        "task: vqattn_test_lengths\ndataset_path: ''\ncustom_dataset: !function lengths.docs\n"
        "output_type: generate_until\ntest_split: test\ndoc_to_text: prompt\ndoc_to_target: target\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n")
    manager = TaskManager(include_path=str(tasks), include_defaults=False)  # lm-eval's own tasks: seconds to index
    generations = {}
    for batch_size in (1, 4):
        result = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'model'}", device="cpu",
                                         tasks=["vqattn_test_lengths"], batch_size=batch_size, log_samples=True,
                                         task_manager=manager)
        generations[batch_size] = [s["resps"] for s in result["samples"]["vqattn_test_lengths"]]
    assert len(generations[1]) == 8 and generations[1] == generations[4]
