"""The far-recall figure of docs/far_recall.md, drawn from the runs' measured recalls kept in a CSV:
``python benchmarks/far_recall_figure.py docs/far_recall_points.csv docs/far_recall_frontier.png``.

The runs behind the page's tables were trained on several machines and days, so their run dirs are not in one
place for ``python -m vqattn.train.report`` to read; each CSV row is one run as those tables give it (attention,
state floats per layer, learning rate, seed, recall at the last step, date, commit, machine). The figure is the
report's own (:func:`vqattn.train.report.draw_recall_vs_state`): per (attention, state) cell the best rate's mean
over its seeds, bars spanning the seeds.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

COLUMNS = ("attention", "state_floats", "lr", "seed", "recall", "date", "commit", "machine")


def read_points(path: Path) -> list[dict]:
    """The CSV's rows as the report's runs ({"attention", "state_floats", "lr", "seed", "recall_acc"}); ValueError
    naming the row for a missing column or a value out of range."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing columns {', '.join(missing)} (needs {', '.join(COLUMNS)})")
        runs = []
        for line, row in enumerate(reader, start=2):
            recall, state = float(row["recall"]), int(row["state_floats"])
            if not 0.0 <= recall <= 1.0 or state <= 0:
                raise ValueError(f"{path}, line {line}: recall must be in [0, 1] and state_floats positive, got "
                                 f"{row['recall']} and {row['state_floats']}")
            runs.append({"attention": row["attention"], "state_floats": state, "lr": float(row["lr"]),
                         "seed": int(row["seed"]), "recall_acc": recall})
    return runs


def main(argv: list[str] | None = None) -> None:
    from vqattn.train.report import draw_recall_vs_state, recall_cells, save_figure

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", type=Path, help="the CSV of measured runs")
    parser.add_argument("figure", type=Path, help="the PNG to write")
    args = parser.parse_args(argv)
    save_figure(draw_recall_vs_state, recall_cells(read_points(args.points)), args.figure)
    print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
