"""The measured tables of README.md and docs/benchmarks.md are generated from the committed benchmark JSON
(benchmarks/tables.py): a hand edit of a generated number, or a new JSON without regenerating, fails here."""

import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def tables(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import tables

    return tables


def test_generated_tables_are_up_to_date(tables):
    assert tables.main(["--check"]) == 0, "run: python benchmarks/tables.py"


def test_a_hand_edited_table_is_caught_and_regenerated(tables, tmp_path, monkeypatch, capsys):
    for rel in tables.FILES:
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), tmp_path / rel)
    monkeypatch.setattr(tables, "DOC_ROOT", str(tmp_path))
    path = tmp_path / "README.md"
    text = path.read_text()
    start = text.index("<!-- table:rounds-cpu-short -->")
    end = text.index("<!-- /table:rounds-cpu-short -->")
    assert "| x loop |" in text[start:end]  # the CPU run is committed: the table has numbers
    path.write_text(text[:start] + text[start:end].replace("|", "| 9.99 ", 1) + text[end:])
    assert tables.main(["--check"]) == 1 and "README.md" in capsys.readouterr().err
    assert tables.main([]) == 0 and path.read_text() == text


def test_missing_results_say_so(tables, monkeypatch):
    monkeypatch.setattr(tables, "RESULTS", "/nonexistent")
    assert "No GPU run of the round benchmark is committed yet" in tables.TABLES["rounds-gpu"]()
    assert "Not measured yet" in tables.TABLES["rounds-gpu-short"]()
    with pytest.raises(SystemExit, match="unknown table"):
        tables.render("<!-- table:nope -->\n<!-- /table:nope -->")
