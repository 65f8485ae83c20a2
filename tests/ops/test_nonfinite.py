"""A NaN or infinite key makes NaN exactly the outputs that see it, as in softmax attention: for every assignment,
every schedule of the block algorithm, decoding states and the layers (whose codebook computes the assignment)."""

from __future__ import annotations

import pytest
import torch

from vqattn.functional import softmax_attention, vq_assign, vq_attention, window_attention
from vqattn.layers import build_attention

from model_helpers import SMALL_KWARGS

F64 = torch.float64
ASSIGN_WINDOW = [("hard", False), ("hard", True), ("soft", False), ("soft", True)]
T, J = 21, 9  # the bad key sits inside a block of 4, so earlier queries of its block must stay finite


def _inputs(bad=float("nan")):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, 8, generator=g, dtype=F64) for _ in range(3))
    c = torch.randn(3, 6, 8, generator=g, dtype=F64)
    k_bad = k.clone()
    k_bad[1, 2, J, 5] = bad  # one key of one batch element and head
    return q, k, k_bad, v, c


def _check_poisoned(out, clean, *, causal, seen_until=None):
    """NaN exactly where the bad key (batch 1, head 2, position J) is visible (up to query ``seen_until``, excluded,
    for a window); everything else equals ``clean``."""
    seen = torch.zeros(out.shape[:3], dtype=torch.bool)
    seen[1, 2, J if causal else 0 : seen_until] = True
    assert torch.equal(out.isnan().any(-1), seen)
    assert out.isnan().all(-1)[seen].all()
    torch.testing.assert_close(out[~seen], clean[~seen], rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("assign,exact_window", ASSIGN_WINDOW)
def test_op_propagates_a_nonfinite_key_causally(assign, exact_window, bad, block_grouping):
    q, k, k_bad, v, c = _inputs(bad)
    kw = dict(causal=True, assign=assign, block_len=4, exact_window=exact_window, schedule=block_grouping)
    _check_poisoned(vq_attention(q, k_bad, v, c, **kw), vq_attention(q, k, v, c, **kw), causal=True)
    # the same with the assignment computed beforehand (soft weights of the bad key are NaN)
    a = vq_assign(k_bad, c, assign=assign)
    _check_poisoned(vq_attention(q, k_bad, v, c, assignment=a, **kw), vq_attention(q, k, v, c, **kw), causal=True)


@pytest.mark.parametrize("assign", ["hard", "soft"])
def test_op_non_causal_poisons_every_query_of_that_head(assign):
    q, k, k_bad, v, c = _inputs()
    _check_poisoned(vq_attention(q, k_bad, v, c, causal=False, assign=assign),
                    vq_attention(q, k, v, c, causal=False, assign=assign), causal=False)


def test_softmax_attention_is_what_the_codebook_ops_match():
    q, k, k_bad, v, _ = _inputs()
    _check_poisoned(softmax_attention(q, k_bad, v, causal=True), softmax_attention(q, k, v, causal=True), causal=True)


@pytest.mark.parametrize("assign,exact_window", ASSIGN_WINDOW)
@pytest.mark.parametrize("sizes", [[5, 1, 1, 1, 2, 11], [12, 9], [9, 12], [6, 15]])
@pytest.mark.parametrize("given", [False, True], ids=["assigned_by_op", "assignment_given"])
def test_decoding_state_carries_the_poison(assign, exact_window, sizes, given):
    """The poison outlives the bad key's window: chunks after it (recurrent or block form) stay NaN, also when the
    caller hands over the (NaN) assignment of the bad key."""
    q, k, k_bad, v, c = _inputs()
    kw = dict(causal=True, assign=assign, block_len=4, exact_window=exact_window)
    a = vq_assign(k_bad, c, assign=assign)
    outs, state, start = [], None, 0
    for size in sizes:
        part = slice(start, start + size)
        assignment = type(a)(*(None if x is None else x[:, :, part] for x in a)) if given else None
        out, state = vq_attention(q[:, :, part], k_bad[:, :, part], v[:, :, part], c, state=state, return_state=True,
                                  assignment=assignment, **kw)
        outs.append(out)
        start += size
    _check_poisoned(torch.cat(outs, 2), vq_attention(q, k, v, c, **kw), causal=True)


WINDOW_SEES_J_UNTIL = 16  # block_len 4: J = 9 lies in block 2, in the window of blocks 2 and 3 (queries 9..15)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_window_attention_propagates_a_nonfinite_key_within_its_window_only(bad, block_grouping):
    q, k, k_bad, v, _ = _inputs(bad)
    out = window_attention(q, k_bad, v, block_len=4, schedule=block_grouping)
    _check_poisoned(out, window_attention(q, k, v, block_len=4), causal=True, seen_until=WINDOW_SEES_J_UNTIL)


@pytest.mark.parametrize("sizes", [[5, 1, 1, 1, 2, 11], [12, 9], [9, 12], [10, 2, 9]])
def test_window_decoding_drops_the_poison_with_the_key(sizes):
    q, k, k_bad, v, _ = _inputs()
    outs, state, start = [], None, 0
    for size in sizes:
        part = slice(start, start + size)
        out, state = window_attention(q[:, :, part], k_bad[:, :, part], v[:, :, part], block_len=4, state=state,
                                      return_state=True)
        outs.append(out)
        start += size
    _check_poisoned(torch.cat(outs, 2), window_attention(q, k, v, block_len=4), causal=True,
                    seen_until=WINDOW_SEES_J_UNTIL)


def test_vq_assign_weights_of_a_nan_key_are_nan():
    _, _, k_bad, _, c = _inputs()
    weights = vq_assign(k_bad, c, assign="soft").weights
    assert weights[1, 2, J].isnan().all() and weights.isnan().sum() == weights.shape[-1]


@pytest.mark.parametrize("name", ["softmax", "vq_hard", "vq_soft", "window"])
@pytest.mark.parametrize("training", [True, False])
def test_layers_propagate_a_nan_key_causally(name, training):
    torch.manual_seed(0)
    kwargs = dict(SMALL_KWARGS[name], exact_window=True) if name.startswith("vq_") else {}
    layer = build_attention(name, dim=16, num_heads=2, rope=True, **kwargs).double().train(training)
    x = torch.randn(1, 13, 16, dtype=F64)

    def nan_key(module, inputs, k):  # k (B, H, T, Dh) after projection: the key of head 1 at position 6
        k = k.clone()
        k[0, 1, 6, 0] = float("nan")
        return k

    layer.k_norm.register_forward_hook(nan_key)
    out, aux_loss, _ = layer(x)
    nan_rows = out.isnan().any(-1)[0]  # the output projection mixes the heads
    assert nan_rows.tolist() == [False] * 6 + [True] * 7


@pytest.mark.slow  # seconds a case
def test_the_mask_is_skipped_only_where_reading_the_flag_is_free():
    from vqattn.ops.nonfinite import may_be_nonfinite

    clean, bad = torch.zeros(2, 3, 5, dtype=torch.bool), torch.zeros(2, 3, 5, dtype=torch.bool)
    bad[1, 2, 4] = True
    assert not may_be_nonfinite(clean) and may_be_nonfinite(bad)
    assert may_be_nonfinite(clean.to("meta"))  # not a CPU tensor: never read, the mask always runs
    assert torch.compile(lambda x: torch.tensor(may_be_nonfinite(x)), fullgraph=True)(clean)  # nor in a graph


@pytest.mark.parametrize("op", ["vq_hard", "vq_soft_exact", "vq_non_causal", "window"])
def test_clean_keys_give_the_same_output_and_gradients_with_the_mask_skipped(op, monkeypatch):
    """The CPU path that skips the mask for clean keys against the path every other device runs (the same to float64
    rounding: the gradients accumulate in another order)."""
    from vqattn.ops import utils as op_utils

    q, k, _, v, c = _inputs()
    calls = {
        "vq_hard": lambda q, k, v: vq_attention(q, k, v, c, causal=True, assign="hard", block_len=4),
        "vq_soft_exact": lambda q, k, v: vq_attention(q, k, v, c, causal=True, assign="soft", block_len=4,
                                                      exact_window=True, return_state=True)[0],
        "vq_non_causal": lambda q, k, v: vq_attention(q, k, v, c, causal=False, assign="soft"),
        "window": lambda q, k, v: window_attention(q, k, v, block_len=4),
    }

    def run():
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = calls[op](*x)
        out.backward(torch.ones_like(out))
        return out, *(t.grad for t in x)

    skipped = run()
    monkeypatch.setattr(op_utils, "host_read_is_free", lambda x: False)  # as on a GPU
    masked = run()
    for a, b in zip(skipped, masked):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
