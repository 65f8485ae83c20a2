"""Multi-query associative recall (MQAR, Zoology: Arora et al. 2023) as a LightningDataModule (``data=mqar``).

Labels exist only at the answers (``IGNORE_INDEX`` elsewhere), so the validation accuracy is the recall accuracy.
"""

from __future__ import annotations

import numpy as np
import torch

from ..model import IGNORE_INDEX
from .data import _LMDataModule


def mqar_example(rng: np.random.Generator, n: int, seq_len: int, num_kv_pairs: int, vocab_size: int = 256,
                 power_a: float = 0.01, random_non_queries: bool = True,
                 min_query_gap: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` multi-query associative recall sequences as defined by Zoology (Arora et al. 2023).

    Layout of each length-(seq_len + 1) sequence before the one-token shift:

        k_1 v_1 k_2 v_2 ... k_P v_P | min_query_gap filler tokens | query region of seq_len + 1 - 2P - gap tokens

    Keys are distinct per sequence, drawn from [1, V/2); values distinct, from [V/2, V). Every key is queried once,
    at an even offset 2 g of the query region, where the gap indices g are distinct and drawn with
    p(g) proportional to g^(power_a - 1), g = 1..(seq_len - 2P - gap)/2 (so recent-looking gaps are more likely);
    the token after a query is its value. Every query then sits more than min_query_gap tokens after its key and
    value (with min_query_gap >= 2·block_len: outside a vq layer's raw window). Filler and other query-region tokens
    are 0, or, if random_non_queries, uniform random tokens other than the sequence's own keys. Zoology draws them
    from the whole vocabulary, where with its 8192 tokens a key rarely recurs; with 256 a random token is a key half
    of the time and the token after it a fake value, nearer to the query than the real pair (at T = 1024 each key
    would recur about 3 times), which makes recall ambiguous. Returns x (n, seq_len) and y (n, seq_len) with y = the
    value at the position of each queried key and IGNORE_INDEX elsewhere: loss and recall accuracy count only the P
    answer positions.
    """
    context = 2 * num_kv_pairs
    space = (seq_len - context - min_query_gap) // 2
    half = vocab_size // 2
    keys = np.stack([rng.choice(np.arange(1, half), num_kv_pairs, replace=False) for _ in range(n)])  # (n, P)
    values = np.stack([rng.choice(np.arange(half, vocab_size), num_kv_pairs, replace=False) for _ in range(n)])
    seq = np.zeros((n, seq_len + 1), dtype=np.int64)
    seq[:, 0:context:2], seq[:, 1:context:2] = keys, values
    p = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    gaps = np.stack([rng.choice(space, num_kv_pairs, replace=False, p=p / p.sum()) for _ in range(n)])  # (n, P)
    query_pos = context + min_query_gap + 2 * gaps  # (n, P): position of the queried key; its answer follows it
    np.put_along_axis(seq, query_pos, keys, axis=1)
    labels = np.full((n, seq_len + 1), IGNORE_INDEX, dtype=np.int64)
    np.put_along_axis(labels, query_pos + 1, values, axis=1)
    x, y = seq[:, :-1], labels[:, 1:]
    if random_non_queries:
        filler = x == 0
        tokens = rng.integers(0, vocab_size - num_kv_pairs, size=x.shape)  # an index into the non-keys of the row
        for key in np.sort(keys, axis=1).T:  # (n,): the j-th smallest key of every row, ascending
            tokens += tokens >= key[:, None]  # skip it: the index becomes a token that is not a key
        x[filler] = tokens[filler]
    return torch.from_numpy(x), torch.from_numpy(y)


class MQARDataModule(_LMDataModule):
    """Synthetic multi-query associative recall (``data=mqar``); metric: recall accuracy on the answers.

    Training batches are fresh draws (seeded by batch index); validation is ``num_val_examples`` fixed
    sequences from a different seed. ``min_query_gap``: filler tokens between the key-value pairs and the first
    query; ``val_min_query_gap`` (None = the same): that gap in the validation sequences only. experiment=mqar_long
    trains on queries at every distance and validates on far ones only, so that its recall accuracy is long-range
    recall while the recall circuit can still form where a window sees the pairs.
    """

    name = "mqar"

    def __init__(self, *, num_kv_pairs: int = 8, vocab_size: int = 256, num_val_examples: int = 512,
                 power_a: float = 0.01, random_non_queries: bool = True, min_query_gap: int = 0,
                 val_min_query_gap: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if self.stream or self.val_carried:
            raise ValueError("data=mqar: MQAR sequences are independent, so data.stream and data.val_carried "
                             "(carry_state) need a byte corpus (data=default, text, enwik8, wikitext103)")
        if val_min_query_gap is None:
            val_min_query_gap = min_query_gap
        for name, gap in (("min_query_gap", min_query_gap), ("val_min_query_gap", val_min_query_gap)):
            if isinstance(gap, bool) or not isinstance(gap, int) or gap < 0:
                raise ValueError(f"data.{name} must be an int >= 0, got {gap!r}")
            if num_kv_pairs < 1 or 4 * num_kv_pairs + gap > self.seq_len:
                raise ValueError(
                    f"data=mqar: num_kv_pairs={num_kv_pairs} and {name}={gap} need seq_len >= "
                    f"4 * num_kv_pairs + {name} = {4 * num_kv_pairs + gap} (P pairs, the gap, then room "
                    f"to query each key once), got seq_len={self.seq_len}"
                )
        if num_kv_pairs >= vocab_size // 2:
            raise ValueError(f"data=mqar: num_kv_pairs={num_kv_pairs} needs more than {num_kv_pairs} distinct keys; "
                             f"vocab_size={vocab_size} has only {vocab_size // 2 - 1}")
        self.kw = dict(seq_len=self.seq_len, num_kv_pairs=num_kv_pairs, vocab_size=vocab_size, power_a=power_a,
                       random_non_queries=random_non_queries)
        self.min_query_gap, self.val_min_query_gap = min_query_gap, val_min_query_gap
        self.num_val_examples = num_val_examples

    def _source(self) -> str:
        return f"synthetic, {self.kw['num_kv_pairs']} key-value pairs in {self.seq_len} tokens"

    def setup(self, stage: str | None = None) -> None:
        if self.val_set is None:
            x, y = mqar_example(np.random.default_rng([self.seed, 2**31]), self.num_val_examples,
                                min_query_gap=self.val_min_query_gap, **self.kw)
            self.val_set = torch.utils.data.TensorDataset(x, y)

    def _train_batch(self, rng):
        return mqar_example(rng, self.batch_size, min_query_gap=self.min_query_gap, **self.kw)
