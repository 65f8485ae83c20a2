"""The suite's own worker count: ``-n auto`` follows the idle cores, as the trainer's ``threads: auto`` does."""

from __future__ import annotations

import conftest

import vqattn.utils


def test_auto_workers_follow_the_idle_cores(monkeypatch):
    for idle in (1, 3):
        monkeypatch.setattr(vqattn.utils, "idle_cores", lambda idle=idle: idle)
        assert conftest.pytest_xdist_auto_num_workers(None) == idle
