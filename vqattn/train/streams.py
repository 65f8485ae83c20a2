"""Consecutive segments of byte streams: the batches of carried-state training and validation (``vqattn.train.carry``).

Training (``data.stream=true``). With R = batch_size · world_size rows and G = ``stream_groups``, the training bytes
are cut into G·R equal streams of L = len // (G·R) bytes (the last len mod G·R bytes are not used). Batch i reads
group g = i mod G, and its global row r = rank · batch_size + (row on this rank) reads stream r·G + g as a ring:
that stream's j-th segment, j = i div G, covers positions

    (phase_{g,r} + j·T + [0, 1, ..., T]) mod L      x = those bytes [:-1],  y = [1:]

so x of batch i + G starts with the byte that ended y of batch i (row r continues row r of the same group), and a
stream wraps from its last byte to its first (one document boundary per pass). With G > 1 consecutive batches come
from different text: each stream advances every G-th batch, and an optimizer step no longer follows the same R
documents step after step (G = 1: batch i + 1 continues batch i). A group's rows read streams G apart, spread over
the whole text as random windows are: with adjacent streams (g·R + r) every batch came from one stretch of the
corpus, 1/G of it, which cost the window 0.08 bpb against random windows at G = 8 and 0.57 at G = 50
(docs/evaluation.md). The phases phase_{g,r} ~ U[0, L) come from the
data seed, so seeds read different text at each step. Rank k holds rows [k·B, (k+1)·B) of every group: its bytes
are disjoint from every other rank's. Batch i is a pure function of (seed, i, rank, world_size, G): a run resumed
at batch i reads what an uninterrupted run reads.

Validation (``data.val_carried=true``). The N validation windows (the independent pass's own windows, each
(x, y) of T tokens, consecutive in the text) are dealt in order to R rows, row g taking a run of N // R or
N // R + 1 consecutive windows. Step s of the carried pass feeds every row its s-th window; a row that has run
out gets a padding window (x = 0, y = IGNORE_INDEX, which no metric counts). Every labelled byte of the
independent pass is thus predicted exactly once, with the state carried from the row's earlier windows.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from ..model import IGNORE_INDEX


class StreamBatches(Dataset):
    """Item i: (x, y) (B, T) long, the (i div G)-th consecutive segment of this rank's B streams of group i mod G
    (module docstring)."""

    def __init__(self, data: torch.Tensor, *, seq_len: int, batch_size: int, rank: int, world_size: int,
                 seed: int, num_batches: int, groups: int = 1):
        rows = batch_size * world_size
        self.length = len(data) // (rows * groups)
        if self.length < seq_len + 1:
            raise ValueError(
                f"data.stream: {len(data)} training bytes cut into batch_size x world_size x stream_groups = "
                f"{rows * groups} streams give {self.length} bytes per stream, fewer than seq_len + 1 = {seq_len + 1}; "
                f"lower data.batch_size, data.stream_groups or model.seq_len, or give more text"
            )
        mine = torch.arange(rank * batch_size, (rank + 1) * batch_size)  # (B,) this rank's global rows
        streams = mine * groups + torch.arange(groups)[:, None]  # (G, B) the stream of each group and row
        phases = torch.from_numpy(np.random.default_rng(seed).integers(0, self.length, size=rows * groups))
        self.data, self.seq_len, self.num_batches, self.groups = data, seq_len, num_batches, groups
        self.starts = streams * self.length  # (G, B) first byte of each stream
        self.phases = phases[streams]  # (G, B)

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        group, segment = i % self.groups, i // self.groups
        offsets = segment * self.seq_len + torch.arange(self.seq_len + 1)  # (T+1,)
        pos = (self.phases[group, :, None] + offsets) % self.length  # (B, T+1)
        chunk = self.data[self.starts[group, :, None] + pos].long()
        return chunk[:, :-1], chunk[:, 1:]


class CarriedValBatches(Dataset):
    """Item s: (x, y) (B, T), step s of the carried validation pass over ``windows`` (module docstring).

    windows: a dataset of (x, y) pairs of T tokens each, window j + 1 following window j in the text.
    Every rank gets the same number of steps, ceil(N / R).
    """

    def __init__(self, windows: Dataset, *, batch_size: int, rank: int, world_size: int):
        n, rows = len(windows), batch_size * world_size
        if n == 0:
            raise ValueError("data.val_carried: the validation set holds no window")
        per_row, extra = divmod(n, rows)
        lens = [per_row + (g < extra) for g in range(rows)]
        starts = np.cumsum([0, *lens[:-1]])
        mine = range(rank * batch_size, (rank + 1) * batch_size)
        self.rows = [(int(starts[g]), lens[g]) for g in mine]  # (first window, number of windows) per row
        self.windows, self.steps = windows, per_row + (extra > 0)

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for start, count in self.rows:
            if s < count:
                x, y = self.windows[start + s]
            else:
                x, _ = self.windows[0]
                x, y = torch.zeros_like(x), torch.full_like(x, IGNORE_INDEX)
            xs.append(x)
            ys.append(y)
        return torch.stack(xs), torch.stack(ys)
