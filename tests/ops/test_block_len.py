"""One rule for the block length a call runs and one check of it, which every op and layer reads; one rule for
the default scale."""

from __future__ import annotations

import pytest
import torch

from vqattn.functional import vq_attention, window_attention
from vqattn.ops.blocks import DEFAULT_BLOCK_LEN, check_block_len, resolve_block_len
from vqattn.ops.utils import resolve_scale


class _State:
    block_len = 16


def test_the_argument_then_the_state_then_the_default():
    assert resolve_block_len(32, _State()) == 32
    assert resolve_block_len(None, _State()) == 16
    assert resolve_block_len(None) == DEFAULT_BLOCK_LEN == 64
    assert resolve_block_len(None, object()) == DEFAULT_BLOCK_LEN  # a state without one


def test_a_continued_state_keeps_its_block_length():
    """A call that continues a state without naming block_len runs the state's, not the default: the state
    it returns keeps it, for vq and window attention."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    c = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    _, state = vq_attention(q[:, :, :30], k[:, :, :30], v[:, :, :30], c, causal=True, block_len=8, return_state=True)
    _, after = vq_attention(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], c, causal=True, state=state, return_state=True)
    assert state.block_len == after.block_len == 8
    _, state = window_attention(q[:, :, :30], k[:, :, :30], v[:, :, :30], block_len=8, return_state=True)
    _, after = window_attention(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], state=state, return_state=True)
    assert after.block_len == 8


@pytest.mark.parametrize("bad", [0, -8, 2.5, "64", True])
def test_block_len_is_none_or_a_positive_int(bad):
    check_block_len(None)
    check_block_len(16)
    with pytest.raises(ValueError, match="block_len must be a positive int"):
        check_block_len(bad)


def test_the_scale_defaults_to_one_over_the_root_of_the_head_dim():
    assert resolve_scale(None, 16) == 16**-0.5 == 0.25
    assert resolve_scale(0.3, 16) == 0.3


def test_a_schedule_names_its_kernel_design_and_checks_it():
    """The Triton kernels' one design choice, hard keys' superblocks, is a field of the Schedule a call passes (no
    module global): checked like the schedule's other fields, with the argument named."""
    from vqattn.ops.blocks import Schedule, as_schedule

    assert as_schedule("auto").superblocks == Schedule().superblocks == 8
    assert as_schedule(Schedule(superblocks=0)).superblocks == 0
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match=r"schedule.superblocks must be an int ≥ 0 \(0: every block's cache\), got "):
            as_schedule(Schedule(superblocks=bad))
