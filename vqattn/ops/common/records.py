"""Copies of the ops' NamedTuple records (their validated inputs) that torch.compile can carry across a graph break."""

from __future__ import annotations

from typing import NamedTuple, TypeVar

Record = TypeVar("Record", bound=NamedTuple)


def replaced(record: Record, **changes) -> Record:
    """``record._replace(**changes)``, built by calling the record's class. ``_replace`` builds its copy with
    ``tuple.__new__``, which dynamo (torch 2.11) cannot rebuild when a graph break leaves the copy alive, as every
    launch of a Triton kernel does: compiling the layer then fails with an AssertionError in ``side_effects``."""
    return type(record)(**{**record._asdict(), **changes})
