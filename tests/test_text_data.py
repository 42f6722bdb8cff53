"""AG News and SST-5 readers on small files in their common formats, written by the test."""

import json

import pytest
import torch

from fedfast.data import text


def test_ag_news_csv(tmp_path):
    p = tmp_path / "train.csv"
    p.write_text(
        '"3","Wall St. Bears Claw Back","Reuters - Short-sellers, \\\\band of ultra-cynics, are seeing green."\n'
        '"1","Title, with comma","A ""quoted"" word"\n\n"4","Tech","Chips"\n',
        encoding="utf-8",
    )
    texts, y = text.read_ag_news(str(p))
    assert y.tolist() == [2, 0, 3] and y.dtype == torch.int64
    assert texts[0].startswith("Wall St. Bears Claw Back Reuters - Short-sellers,") and "\\" not in texts[0]
    assert texts[1] == 'Title, with comma A "quoted" word'
    p.write_text('"5","x","y"\n')
    with pytest.raises(ValueError, match=r"train.csv:1: the class index must be in 1..4, got 5"):
        text.read_ag_news(str(p))
    p.write_text('"1","only title"\n')
    with pytest.raises(ValueError, match="train.csv:1: expected 3 columns"):
        text.read_ag_news(str(p))
    with pytest.raises(FileNotFoundError, match="ag_news"):
        text.read_ag_news(str(tmp_path / "missing.csv"))


def test_sst5_jsonl_and_tsv(tmp_path):
    j = tmp_path / "train.jsonl"
    j.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"text": "a gripping film", "label": 4, "label_text": "very positive"},
                {"sentence": " dull ", "label": 1},
            ]
        )
        + "\n"
    )
    texts, y = text.read_sst5(str(j))
    assert texts == ["a gripping film", "dull"] and y.tolist() == [4, 1]
    t = tmp_path / "dev.tsv"
    t.write_text("label\tsentence\n2\tit is a movie\n0\tawful\n")
    texts, y = text.read_sst5(str(t))
    assert texts == ["it is a movie", "awful"] and y.tolist() == [2, 0]
    j.write_text(json.dumps({"text": "x", "label": 7}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl:1: the label must be in 0..4, got 7"):
        text.read_sst5(str(j))
    j.write_text("{broken\n")
    with pytest.raises(ValueError, match="train.jsonl:1: not valid JSON"):
        text.read_sst5(str(j))
    t.write_text("sentence\tscore\nx\t1\n")
    with pytest.raises(ValueError, match="header must name"):
        text.read_sst5(str(t))
    t.write_text("sentence\tlabel\nx\ty\tz\n")
    with pytest.raises(ValueError, match="dev.tsv:2: expected 2 tab-separated columns"):
        text.read_sst5(str(t))
    with pytest.raises(FileNotFoundError, match="SST-5"):
        text.read_sst5(str(tmp_path / "none.jsonl"))
