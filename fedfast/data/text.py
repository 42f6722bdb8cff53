"""Text classification data of FedGKD's NLP table (Table 4): the raw readers of AG News and SST-5.

These return ``(texts, labels)`` (a list of str and an int64 tensor) from the common distribution formats, parsed
with the standard ``csv`` / ``json`` modules (no pickle). Tokenisation into fixed-length id tensors is a separate
step (it needs the model's tokenizer, an optional dependency).
"""
from __future__ import annotations

import csv
import json
import os

import torch

AG_NEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")
SST5_CLASSES = ("very negative", "negative", "neutral", "positive", "very positive")


def _missing(path: str, how: str) -> FileNotFoundError:
    return FileNotFoundError(f"{path}: not found. {how}")


def read_ag_news(path: str) -> tuple[list, torch.Tensor]:
    """AG News in its common CSV (``train.csv`` / ``test.csv`` of Zhang et al. 2015's ``ag_news_csv``): rows
    ``"class index","title","description"`` with class index 1..4, no header. Text = title + " " + description
    (backslashes, the files' escaped newlines, become spaces); labels 0..3 (World, Sports, Business, Sci/Tech)."""
    if not os.path.isfile(path):
        raise _missing(path, "Get ag_news_csv (train.csv, test.csv; Zhang et al. 2015, e.g. from the Hugging Face "
                             "hub dataset 'fancyzhx/ag_news' or the original ag_news_csv.tgz).")
    texts, labels = [], []
    with open(path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            if len(row) < 3:
                raise ValueError(f"{path}:{i}: expected 3 columns (class index, title, description), got {len(row)}")
            try:
                c = int(row[0])
            except ValueError:
                raise ValueError(f"{path}:{i}: the class index must be an integer 1..4, got {row[0]!r}") from None
            if not 1 <= c <= 4:
                raise ValueError(f"{path}:{i}: the class index must be in 1..4, got {c}")
            texts.append(f"{row[1]} {' '.join(row[2:])}".replace("\\", " ").strip())
            labels.append(c - 1)
    if not texts:
        raise ValueError(f"{path}: no rows")
    return texts, torch.tensor(labels, dtype=torch.int64)


def read_sst5(path: str) -> tuple[list, torch.Tensor]:
    """SST-5 (Socher et al. 2013, fine-grained) as JSONL (one ``{"text" | "sentence": ..., "label": 0..4}`` per line,
    e.g. ``SetFit/sst5``) or TSV with a header naming a ``sentence`` / ``text`` column and a ``label`` column (any
    order). Labels 0..4 (very negative .. very positive)."""
    if not os.path.isfile(path):
        raise _missing(path, "Get SST-5 as JSONL (e.g. the Hugging Face hub dataset 'SetFit/sst5': train.jsonl, "
                             "test.jsonl) or a TSV with sentence and label columns.")
    texts, labels = [], []

    def add(where, text, label):
        if not isinstance(text, str):
            raise ValueError(f"{where}: the sentence must be a string, got {type(text).__name__}")
        try:
            y = int(label)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: the label must be an integer 0..4, got {label!r}") from None
        if not 0 <= y <= 4 or (isinstance(label, float) and label != y):
            raise ValueError(f"{where}: the label must be in 0..4, got {label!r}")
        texts.append(text.strip())
        labels.append(y)

    with open(path, newline="", encoding="utf-8") as f:
        if path.endswith((".jsonl", ".json")):
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
                if not isinstance(rec, dict) or "label" not in rec or not ({"text", "sentence"} & set(rec)):
                    raise ValueError(f"{path}:{i}: expected an object with 'text' (or 'sentence') and 'label'")
                add(f"{path}:{i}", rec.get("text", rec.get("sentence")), rec["label"])
        else:
            rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = [h.strip().lower() for h in next(rows, [])]
            col = next((header.index(k) for k in ("sentence", "text") if k in header), None)
            if col is None or "label" not in header:
                raise ValueError(f"{path}: the TSV header must name a 'sentence' (or 'text') and a 'label' column, "
                                 f"got {header}")
            lab = header.index("label")
            for i, row in enumerate(rows, 2):
                if not row:
                    continue
                if len(row) != len(header):
                    raise ValueError(f"{path}:{i}: expected {len(header)} tab-separated columns, got {len(row)}")
                add(f"{path}:{i}", row[col], row[lab])
    if not texts:
        raise ValueError(f"{path}: no rows")
    return texts, torch.tensor(labels, dtype=torch.int64)
