"""Small text tasks for the transformer tests, built without any download: class-dependent synthetic sentences, a
WordLevel tokenizer trained on them (``tokenizers``) and tiny randomly initialised transformer configs."""

import numpy as np
import torch

WORDS = [f"w{i}" for i in range(40)]


def sentences(n: int, num_classes: int, seed: int = 0, max_words: int = 14):
    """``n`` sentences of 2..max_words words; class c favours words c*6..c*6+5, so the task is learnable."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        c = int(rng.integers(num_classes))
        k = int(rng.integers(2, max_words + 1))
        own = rng.random(k) < 0.5
        w = np.where(own, rng.integers(c * 6, c * 6 + 6, k), rng.integers(0, len(WORDS), k))
        texts.append(" ".join(WORDS[i] for i in w))
        labels.append(c)
    return texts, torch.tensor(labels)


def tokenizer(texts):
    """A fast tokenizer (WordLevel, lower case, whitespace split, [CLS] ... [SEP]) trained on ``texts``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def distilbert_config(
    num_labels: int,
    vocab_size: int = 48,
    dim: int = 16,
    layers: int = 2,
    dropout: float = 0.0,
    attn: str = "sdpa",
    max_positions: int = 32,
):
    from transformers import DistilBertConfig

    return DistilBertConfig(
        vocab_size=vocab_size,
        dim=dim,
        n_layers=layers,
        n_heads=2,
        hidden_dim=2 * dim,
        max_position_embeddings=max_positions,
        num_labels=num_labels,
        dropout=dropout,
        attention_dropout=dropout,
        seq_classif_dropout=dropout,
        pad_token_id=0,
        attn_implementation=attn,
    )


def bert_config(num_labels: int, vocab_size: int = 48, dim: int = 16):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=dim,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * dim,
        max_position_embeddings=32,
        num_labels=num_labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
