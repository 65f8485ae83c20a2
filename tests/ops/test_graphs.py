"""CUDA-graph replay of sequential kernel chains (vqattn.ops.graphs): replays equal eager on new data, results
survive later replays, signatures are cached up to a limit. CPU tensors take the eager path."""

import pytest
import torch

from vqattn.ops import graphs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _chain(x: torch.Tensor, y: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):  # each step reads the last: a chain of small kernels
        x = x * 0.5 + y.roll(1, -1)
    return x


def test_cpu_tensors_are_not_graphed():
    assert not graphs.can_graph(torch.zeros(3))


@needs_cuda
def test_replays_equal_eager_on_new_data_and_results_survive_later_replays():
    graphs._GRAPHS.clear()
    results = []
    for _ in range(3):
        x, y = torch.randn(4, 5, device="cuda"), torch.randn(4, 5, device="cuda")
        results.append((graphs.replay_graphed(_chain, (x, y), 7), _chain(x, y, 7)))
    for graphed, eager in results:  # the first two were computed before the later replays
        torch.testing.assert_close(graphed, eager)
    assert len(graphs._GRAPHS) == 1


@needs_cuda
def test_signatures_are_kept_up_to_the_limit(monkeypatch):
    graphs._GRAPHS.clear()
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    x, y = torch.randn(4, 5, device="cuda"), torch.randn(4, 5, device="cuda")
    for steps in (1, 2, 3, 1):
        torch.testing.assert_close(graphs.replay_graphed(_chain, (x, y), steps), _chain(x, y, steps))
    assert [key[2] for key in graphs._GRAPHS] == [(3,), (1,)]  # the oldest signature went first
    graphs.replay_graphed(_chain, (x.double(), y.double()), 3)  # another dtype is another signature
    assert [key[2] for key in graphs._GRAPHS] == [(1,), (3,)]
