"""Hugging Face ``transformers`` sequence-classification models (DistilBERT first) as fedfast models.

The optional extra ``pip install 'fedfast[text]'`` (``transformers``, ``tokenizers``) is needed to *load* one;
this module imports ``transformers`` only inside :func:`load`, so ``import fedfast`` never does.

:class:`HFClassifier` wraps the model so that it takes fedfast's token rows, ``x`` ``[B, 2, L]`` (ids, attention
mask; :class:`fedfast.data.text.TokenDataset`), and returns logits ``[B, C]``. It passes the attention mask in
the 4-D form the model's attention implementation uses (SDPA: a boolean ``[B, 1, 1, L]``, True where a token may
be attended; eager: 0 / the float32 minimum, added to the scores), which Hugging Face uses as given: its own 2-D
mask handling tests whether the batch has padding (``mask.all()``), data-dependent control flow that ``vmap``
cannot run and that would cost a host sync every step. Other implementations (flash attention) get the 2-D mask.

In the engine such a model trains through the grouped executor (:mod:`fedfast.grouped`): its parameters all
belong to Linear, LayerNorm and Embedding layers, and its other operations act on each sequence alone.

``model = "hf:distilbert-base-uncased"`` (a hub id, where the machine has internet and the weights are not cached
yet) or ``"hf:/path/to/dir"`` (a directory written by ``save_pretrained``, with the tokenizer's files beside the
model's) in a run config loads the pretrained encoder with a new classification head of the dataset's classes
(initialised from the run's seed), and the tokenizer the texts are tokenised with.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn


class HFClassifier(nn.Module):
    """A Hugging Face ``...ForSequenceClassification`` model on ``[B, 2, L]`` token rows -> logits ``[B, C]``.
    The wrapped model is ``self.hf``; MOON's representation is the input of its last Linear (DistilBERT: the
    pooled first-token feature after ``pre_classifier``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "num_labels"):
            raise TypeError(f"model: expected a transformers sequence-classification model, got {type(model).__name__}")
        self.hf = model

    @property
    def num_labels(self) -> int:
        return int(self.hf.config.num_labels)

    @property
    def vocab_size(self) -> int:
        return int(self.hf.config.vocab_size)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.hf.config, "max_position_embeddings", None)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[1] != 2:
            raise ValueError(f"x: expected token rows [batch, 2, length] (ids, attention mask), got {tuple(x.shape)}")
        ids, mask = x[:, 0].long(), x[:, 1]
        impl = getattr(self.hf.config, "_attn_implementation", None)
        if impl == "sdpa":
            mask = mask.bool()[:, None, None, :]
        elif impl == "eager":
            keep = mask.bool()[:, None, None, :]
            mask = torch.zeros(keep.shape, dtype=torch.float32, device=x.device).masked_fill(
                ~keep, torch.finfo(torch.float32).min
            )
        return self.hf(input_ids=ids, attention_mask=mask).logits

    def check_data(self, dataset, name: str = "train") -> None:
        """Errors naming the mismatch when ``dataset`` (a TokenDataset) was not made for this model: token ids
        beyond its vocabulary (a tokenizer of another checkpoint), sequences longer than its position table,
        other classes than its head."""
        if getattr(dataset, "kind", "images") != "tokens":
            raise ValueError(
                f"{name}: a text model takes tokenised texts (fedfast.data.text), not "
                f"{getattr(dataset, 'kind', 'images')}"
            )
        top = int(dataset.x[:, 0].max()) if len(dataset) else -1
        if top >= self.vocab_size:
            raise ValueError(
                f"{name}: token id {top} is beyond the model's vocabulary of {self.vocab_size}: the "
                f"texts were tokenised with another model's tokenizer"
            )
        if self.max_positions is not None and dataset.x.shape[2] > self.max_positions:
            raise ValueError(
                f"max_length: sequences of {dataset.x.shape[2]} tokens exceed the model's "
                f"{self.max_positions} positions"
            )
        if dataset.num_classes != self.num_labels:
            raise ValueError(f"{name}: {dataset.num_classes} classes, but the model's head has {self.num_labels}")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "model: Hugging Face models need the optional packages transformers and tokenizers: "
            "pip install 'fedfast[text]' (or pip install transformers tokenizers)"
        ) from None
    return transformers


def load(
    source: str, num_classes: int, *, seed: int = 0, attn_implementation: str | None = None
) -> tuple[HFClassifier, object]:
    """``(HFClassifier, tokenizer)`` from ``source``: ``"hf:<hub id or directory>"`` or a directory. The
    encoder's weights are the checkpoint's; the classification head is new for ``num_classes`` classes
    (initialised under ``torch.manual_seed(seed)``) unless the checkpoint's own head already has that many.
    ``attn_implementation``: "sdpa" (default where available) or "eager"."""
    tf = _transformers()
    src = source[3:] if source.startswith("hf:") else source
    if not src:
        raise ValueError("model: 'hf:' needs a hub id or a directory, e.g. hf:distilbert-base-uncased")
    local = os.path.isdir(src)
    if not local and (src.startswith((".", "/", "~")) or src.count("/") > 1):  # a path, not "name" / "org/name"
        raise FileNotFoundError(
            f"model: {src}: no such directory (a saved model: save_pretrained's config.json "
            f"and weights, with the tokenizer's files)"
        )
    how = (
        f'where the machine has internet, save it once (python -c "from transformers import AutoTokenizer, '
        f"AutoModelForSequenceClassification as M; [c.from_pretrained('{src}').save_pretrained('DIR') for c in "
        f'(AutoTokenizer, M)]") and set model = "hf:DIR"'
    )
    try:
        config = tf.AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"model: cannot load the configuration of {src!r} ({str(e).splitlines()[0][:160]}); "
            + ("is it a directory written by save_pretrained?" if local else how)
        ) from None
    head = int(getattr(config, "num_labels", 0))
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in archs) and head != num_classes:
        raise ValueError(
            f"model: {src!r} is a classifier of {head} classes, the dataset has {num_classes}; start "
            f"from its base model instead"
        )
    config.num_labels = num_classes
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = tf.AutoModelForSequenceClassification.from_pretrained(src, config=config, **kw)
            tok = tf.AutoTokenizer.from_pretrained(src)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(
                f"model: cannot load {src!r} ({str(e).splitlines()[0][:160]}); "
                + ("does the directory hold the weights and the tokenizer?" if local else how)
            ) from None
    model.float()
    wrapped = HFClassifier(model)
    if len(tok) > wrapped.vocab_size:
        raise ValueError(
            f"model: the tokenizer of {src!r} has {len(tok)} tokens but the model's embedding table "
            f"{wrapped.vocab_size} rows: tokenizer and weights come from different checkpoints"
        )
    return wrapped, tok


def from_config(config, seed: int = 0) -> HFClassifier:
    """A randomly initialised model of a ``transformers`` config (e.g. a small ``DistilBertConfig`` for tests and
    benchmarks), initialised under ``torch.manual_seed(seed)``."""
    tf = _transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForSequenceClassification.from_config(config)
    return HFClassifier(model.float())
