"""Text classification data of FedGKD's NLP table (Table 4): AG News and SST-5, tokenised once into id tensors.

* ``read_ag_news`` / ``read_sst5`` return ``(texts, labels)`` (a list of str and an int64 tensor) from the common
  distribution formats, parsed with the standard ``csv`` / ``json`` modules (no pickle).
* :func:`tokenize` turns them into a :class:`TokenDataset` with the model's tokenizer (any Hugging Face tokenizer:
  truncation to ``max_length`` tokens, special tokens included, padded to one length), and
  ``load_ag_news`` / ``load_sst5`` do both for a data directory, caching the token tensors beside the data (an
  ``.npz`` read without pickle, keyed by the file's contents, the tokenizer and ``max_length``), so a run
  tokenises each file once. The engine then batches token rows by index, as it batches images.

The sequences are padded to the longest tokenised text of the file (at most ``max_length``): the attention mask
excludes the padding, so a shorter padded length gives the same logits as padding to ``max_length`` (up to
floating-point summation order) at less cost (SST-5's longest sentence is far shorter than FedGKD's 128).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._io import not_data, write_atomic
from .datasets import ArrayDataset, _cache_dir

_FORMAT = "fedfast-tokens-1"  # bump when the cached layout changes

AG_NEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")
SST5_CLASSES = ("very negative", "negative", "neutral", "positive", "very positive")


def _missing(path: str, how: str) -> FileNotFoundError:
    return FileNotFoundError(f"{path}: not found. {how}")


def read_ag_news(path: str) -> tuple[list, torch.Tensor]:
    """AG News in its common CSV (``train.csv`` / ``test.csv`` of Zhang et al. 2015's ``ag_news_csv``): rows
    ``"class index","title","description"`` with class index 1..4, no header. Text = title + " " + description
    (backslashes, the files' escaped newlines, become spaces); labels 0..3 (World, Sports, Business, Sci/Tech)."""
    if not os.path.isfile(path):
        raise _missing(
            path,
            "Get ag_news_csv (train.csv, test.csv; Zhang et al. 2015, e.g. from the Hugging Face "
            "hub dataset 'fancyzhx/ag_news' or the original ag_news_csv.tgz).",
        )
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
        raise _missing(
            path,
            "Get SST-5 as JSONL (e.g. the Hugging Face hub dataset 'SetFit/sst5': train.jsonl, "
            "test.jsonl) or a TSV with sentence and label columns.",
        )
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
                raise ValueError(
                    f"{path}: the TSV header must name a 'sentence' (or 'text') and a 'label' column, got {header}"
                )
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


@dataclass
class TokenDataset(ArrayDataset):
    """Tokenised texts: ``x`` [N, 2, L] int32 (row 0 the token ids, row 1 the attention mask, 1 = a token, 0 =
    padding) and labels ``y`` [N]. ``batch(idx)`` returns the rows as stored (no normalisation); models take the
    ``[B, 2, L]`` tensor (:class:`fedfast.models.hf.HFClassifier`)."""

    is_image = False
    kind = "tokens"

    def __post_init__(self):
        super().__post_init__()
        if self.x.dim() != 3 or self.x.shape[1] != 2 or self.x.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"x: token data is an int32 tensor [N, 2, L] (ids, attention mask), got {self.x.dtype} "
                f"{tuple(self.x.shape)}"
            )

    @property
    def seq_len(self) -> int:
        return self.x.shape[2]

    def normalize(self, xb: Tensor, dtype=torch.float32) -> Tensor:
        return xb


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of what decides a tokenizer's output: its class, its full serialisation (a fast tokenizer's
    normaliser, pre-tokeniser, vocabulary and post-processor) or vocabulary, and its special tokens."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # without the truncation / padding settings, which every call of the tokenizer sets
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        h.update(json.dumps(state, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "pad_token_id", None)).encode())
    return h.hexdigest()[:16]


def tokenize(
    texts: list, labels: Tensor, tokenizer, num_classes: int, max_length: int = 128, name: str = ""
) -> TokenDataset:
    """``texts`` through ``tokenizer`` (truncated to ``max_length`` tokens with its special tokens), padded with
    its pad token to the longest result, as a :class:`TokenDataset`."""
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise ValueError(f"max_length: must be an integer >= 2, got {max_length!r}")
    if len(texts) != len(labels):
        raise ValueError(f"texts and labels: {len(texts)} texts but {len(labels)} labels")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        raise ValueError(
            f"tokenizer: {type(tokenizer).__name__} has no pad token (pad_token_id is None); set one, "
            f"e.g. tokenizer.pad_token = tokenizer.eos_token"
        )
    enc = tokenizer(list(texts), truncation=True, max_length=max_length, padding=False)
    ids = enc["input_ids"]
    L = max((len(r) for r in ids), default=0)
    if L == 0:
        raise ValueError("texts: every text tokenised to nothing")
    x = np.zeros((len(ids), 2, L), dtype=np.int32)
    x[:, 0] = pad
    for i, r in enumerate(ids):
        x[i, 0, : len(r)] = r
        x[i, 1, : len(r)] = 1
    return TokenDataset(torch.from_numpy(x), torch.as_tensor(labels, dtype=torch.int64), num_classes, name=name)


def _cached(path: str, read, tokenizer, num_classes: int, max_length: int, name: str, cache: bool) -> TokenDataset:
    """The file ``path`` read by ``read`` and tokenised, from / into a cache file beside it (else in
    ``$FEDFAST_CACHE``): ``<file>.<digest>.tokens.npz``, the digest of the file's bytes, the tokenizer and
    ``max_length``. A cache that is unreadable or of the wrong shape is rebuilt; written atomically."""
    texts, labels = read(path)  # checks the file (and names it) before any cache is used
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(f"{_FORMAT}|{tokenizer_fingerprint(tokenizer)}|{max_length}".encode())
    fname = f"{os.path.basename(path)}.{digest.hexdigest()[:16]}.tokens.npz"
    places = [os.path.join(os.path.dirname(os.path.abspath(path)), fname), os.path.join(_cache_dir(), fname)]
    if cache:
        for p in places:
            try:
                with not_data(), np.load(p, allow_pickle=False) as z:  # derived from `path` (recorded above)
                    x, y = z["x"], z["y"]
                if (
                    x.dtype == np.int32
                    and x.ndim == 3
                    and x.shape[1] == 2
                    and 1 <= x.shape[2] <= max_length
                    and y.dtype == np.int64
                    and y.shape == (len(texts),)
                    and x.shape[0] == len(texts)
                ):
                    return TokenDataset(torch.from_numpy(x), torch.from_numpy(y), num_classes, name=name)
            except (OSError, ValueError, KeyError):  # missing or damaged: rebuilt below
                pass
    ds = tokenize(texts, labels, tokenizer, num_classes, max_length, name)
    if cache:
        buf = io.BytesIO()
        np.savez(buf, x=ds.x.numpy(), y=ds.y.numpy())
        for p in places:
            try:
                os.makedirs(os.path.dirname(p), exist_ok=True)
                write_atomic(p, buf.getvalue())
                break
            except OSError:  # a read-only data directory: the user cache instead
                continue
    return ds


def _find(data_dir: str, stem: str, exts: tuple, how: str) -> str:
    for e in exts:
        p = os.path.join(data_dir, stem + e)
        if os.path.isfile(p):
            return p
    raise _missing(os.path.join(data_dir, stem + exts[0]), how)


def load_ag_news(
    data_dir: str, tokenizer, max_length: int = 128, cache: bool = True
) -> tuple[TokenDataset, TokenDataset]:
    """AG News ``train.csv`` / ``test.csv`` in ``data_dir`` (:func:`read_ag_news`), tokenised (cached beside them).
    120,000 training and 7,600 test texts, 4 classes."""
    how = (
        "Get ag_news_csv (train.csv, test.csv; Zhang et al. 2015, e.g. from the Hugging Face hub dataset "
        "'fancyzhx/ag_news' or the original ag_news_csv.tgz) into this folder."
    )
    return tuple(
        _cached(_find(data_dir, s, (".csv",), how), read_ag_news, tokenizer, 4, max_length, "ag_news", cache)
        for s in ("train", "test")
    )


def load_sst5(data_dir: str, tokenizer, max_length: int = 128, cache: bool = True) -> tuple[TokenDataset, TokenDataset]:
    """SST-5 ``train`` / ``test`` as ``.jsonl`` or ``.tsv`` in ``data_dir`` (:func:`read_sst5`), tokenised (cached
    beside them). 8,544 training and 2,210 test sentences, 5 classes."""
    how = (
        "Get SST-5 as JSONL (e.g. the Hugging Face hub dataset 'SetFit/sst5': train.jsonl, test.jsonl) or as "
        "train.tsv / test.tsv with sentence and label columns, into this folder."
    )
    return tuple(
        _cached(_find(data_dir, s, (".jsonl", ".tsv"), how), read_sst5, tokenizer, 5, max_length, "sst5", cache)
        for s in ("train", "test")
    )
