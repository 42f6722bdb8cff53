"""Studies of one's own (issue 20): study files from any path (with plug-ins beside them), option grids with a
validation split and selection, --jobs and --shard (interrupted, then finished by two shard processes, no run
twice), the Slurm array script as Slurm runs each task, and report in md, csv and LaTeX (compiled with pdflatex
where installed), several studies merged."""

import csv
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from fedfast import presets
from fedfast.cli import main
from fedfast.study import parse_grid, parse_shard, report, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "study", "fedlc-mnist.toml")
TINY = ["dataset=synthetic", "num_clients=10", "clients_per_round=3", "model=mlp"]


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


STUDY = """
[preset]
paper = "own"
table = "T1"
metric = "final"
seeds = [0, 1]
methods = ["fedavg", "myavg"]
plugins = ["plug/mine.py"]

[protocol]
dataset = "synthetic"
num_clients = 10
clients_per_round = 3
rounds = 2
model = "mlp"

[options.fedprox]
mu = 0.01

[cells.a]
partition = "iid"
reported = {fedavg = [50.0, 1.0], myavg = [51.0]}
reported_note = "numbers from a preprint"

[cells.b]
partition = "shards"
"""

PLUGIN = '''
from fedfast.methods import FedAvg, register


@register("myavg")
class MyAvg(FedAvg):
    """FedAvg under a name of its own (a plug-in beside the study file)."""
'''


@pytest.fixture
def study_file(tmp_path):
    d = tmp_path / "mine"
    (d / "plug").mkdir(parents=True)
    (d / "plug" / "mine.py").write_text(PLUGIN)
    (d / "study.toml").write_text(STUDY)
    return d / "study.toml"


def test_study_file_from_any_path(study_file, tmp_path, capsys):
    cells = presets.resolve(str(study_file))
    assert [c.name for c in cells] == ["study/a", "study/b"] and cells[0].source == str(study_file)
    assert cells[0].plugins == (str(study_file.parent / "plug" / "mine.py"),) and not cells[0].packaged
    assert cells[0].reported == {"fedavg": [50.0, 1.0], "myavg": [51.0]} and cells[1].methods == ["fedavg", "myavg"]
    assert cells[0].methods == ["fedavg", "myavg"]
    assert presets.load_all()["demo/mnist-shards"].packaged  # the package's presets: the same format, shipped
    code, out, _ = cli(capsys, "presets", study_file)
    assert code == 0 and "study/a" in out and "study/b" in out and "2 cells of" in out
    code, out, _ = cli(capsys, "presets", f"{study_file}/a")
    assert code == 0 and "50.00 ± 1.00" in out and "note on the reported numbers: numbers from a preprint" in out
    # run --preset STUDY.toml/CELL, and `run STUDY.toml/CELL`, with the plug-in method the file names
    code, _, err = cli(
        capsys, "run", "--preset", f"{study_file}/a", "--set", "algorithm=myavg", "--out", tmp_path / "r1", "--quiet"
    )
    assert code == 0, err
    c = json.load(open(tmp_path / "r1" / "config.json"))
    assert c["algorithm"] == "myavg" and c["partition"] == "iid" and c["plugins"] == [cells[0].plugins[0]]
    code, _, err = cli(capsys, "run", f"{study_file}/b", "--out", tmp_path / "r2", "--quiet")
    assert code == 0, err
    assert json.load(open(tmp_path / "r2" / "config.json"))["partition"] == "shards"
    # sweep STUDY.toml: every cell a part of the study; the report merges them
    out = tmp_path / "s"
    dirs = sweep(str(out), [], [], config=str(study_file), quiet=True)
    assert (
        len(dirs) == 8
        and os.path.isdir(out / "a" / "myavg" / "seed1")
        and os.path.isdir(out / "b" / "fedavg" / "seed0")
    )
    meta = json.load(open(out / "a" / "study.json"))
    assert meta["study"] == str(study_file) and meta["cell"]["reported"]["myavg"] == [51.0]
    assert json.load(open(out / "study.json"))["parts"] == ["a", "b"]
    # the report needs no study file: its cell (numbers, note) is in study.json
    study_file.rename(study_file.parent / "moved.toml")
    text, rows = report(str(out))
    assert "| fedavg |" in text and "+" in text and "† a: numbers from a preprint" in text
    # the file back with a changed protocol: the study refuses it instead of mixing protocols
    (study_file.parent / "moved.toml").rename(study_file)
    study_file.write_text(STUDY.replace("rounds = 2", "rounds = 3"))
    with pytest.raises(ValueError, match=r"protocol changed since it ran \(rounds differ"):
        sweep(str(out), [], [], config=str(study_file), quiet=True)


@pytest.mark.parametrize(
    "text, words",
    [
        ("[preset]\npaper = 'x'\n[protocl]\nrounds = 2\n", "protocl: unknown table"),
        ("[preset]\npapers = 'x'\n", "preset.papers: unknown key"),
        ("[preset]\nmetric = 'mean'\n", "preset.metric"),
        ("[preset]\nseeds = [0, -1]\n", "preset.seeds"),
        ("[preset]\nplugins = ['nope.py']\n", "preset.plugins: nope.py: no such file"),
        ("[cells.a]\nreported = {fedavg = [1, 2, 3]}\n", "cells.a.reported.fedavg"),
        ("[cells.a]\nreported = {fedavg = 'x'}\n", "cells.a.reported.fedavg"),
        ("[grid]\nlr = []\n", "grid.lr"),
        ("[protocol]\nrounds = 'many'\n", "rounds"),
    ],
)
def test_bad_study_files_name_file_and_key(tmp_path, capsys, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    code, _, err = cli(capsys, "sweep", f, "--methods", "fedavg", "--out", tmp_path / "o")
    assert code == 2 and words in err and "bad.toml" in err, err
    assert not (tmp_path / "o").exists()  # nothing written for a refused study


def test_study_names_that_do_not_resolve(tmp_path, study_file, capsys):
    for spec, words in (
        (f"{study_file}/c", "has no cell 'c' (its cells: a, b)"),
        (str(tmp_path / "none.toml"), "no such file"),
        ("nosuch", "no preset 'nosuch'"),
        (str(study_file), "has 2 cells; name one"),
    ):
        code, _, err = cli(capsys, "run", "--preset", spec, "--out", tmp_path / "x")
        assert code == 2 and words in err, (spec, err)


def test_grid_runs_the_cross_product_in_named_directories(tmp_path, capsys):
    out = tmp_path / "g"
    grid = ["fedprox.mu=0.01,1.0,0.010", "lr=0.05,0.1"]
    dirs = sweep(str(out), ["fedavg", "fedprox"], [0, 1], overrides=[*TINY, "rounds=2"], grid=grid, quiet=True)
    rel = sorted(os.path.relpath(d, out) for d in dirs)
    assert rel == sorted(
        [f"fedavg/lr={lr}/seed{s}" for lr in ("0.05", "0.1") for s in (0, 1)]
        + [f"fedprox/fedprox.mu={mu},lr={lr}/seed{s}" for mu in ("0.01", "1") for lr in ("0.05", "0.1") for s in (0, 1)]
    )  # 0.010 is 0.01: one run
    c = json.load(open(out / "fedprox" / "fedprox.mu=1,lr=0.1" / "seed1" / "config.json"))
    assert c["fedprox"]["mu"] == 1.0 and c["lr"] == 0.1 and c["seed"] == 1 and c["val_fraction"] == 0.1
    assert json.load(open(out / "study.json"))["grid"] == {
        "fedprox.mu": ["0.01", "1.0", "0.010"],
        "lr": ["0.05", "0.1"],
    }
    text, rows = report(str(out))
    assert len(rows) == 6 and "| fedprox [fedprox.mu=0.01,lr=0.05] |" in text
    assert sum(r["selected"] for r in rows) == 2 and "(selected: " in text and "val_fraction = 0.1" in text
    from fedfast.plot import curves  # a line per method and grid point

    assert sorted(curves([str(out)])) == sorted(
        f"{r['method']}{' [' + r['point'] + ']' if r['point'] else ''}" for r in rows
    )
    # a grid value added later: only the new points run; a grid over other keys is another study
    dirs2 = sweep(
        str(out), ["fedprox"], [0], overrides=[*TINY, "rounds=2"], grid=["fedprox.mu=0.1", "lr=0.05"], quiet=True
    )
    assert json.load(open(out / "study.json"))["grid"]["fedprox.mu"] == ["0.01", "1.0", "0.010", "0.1"]
    assert [os.path.relpath(d, out) for d in dirs2] == ["fedprox/fedprox.mu=0.1,lr=0.05/seed0"]
    with pytest.raises(ValueError, match="a grid over fedprox.mu, lr, not fedprox.mu"):
        sweep(str(out), ["fedprox"], [0], overrides=[*TINY, "rounds=2"], grid=["fedprox.mu=0.1"], quiet=True)
    for g, words in (
        (["lrr=1,2"], "--grid lrr: unknown config key"),
        (["algorithm=fedavg"], "--methods"),
        (["fedntd.beta=1"], "no method of the study reads the table 'fedntd'"),
        (["fedprox.mu=-1"], "--grid fedprox.mu"),
        (["lr"], "KEY=v1,v2"),
        (["lr=1", "lr=2"], "given twice"),
    ):
        code, _, err = cli(
            capsys,
            "sweep",
            "--methods",
            "fedavg,fedprox",
            "--out",
            tmp_path / "bad",
            *sum([["--set", x] for x in TINY], []),
            *sum([["--grid", x] for x in g], []),
        )
        assert code == 2 and words in err, (g, err)
    assert parse_grid(["adam_betas=[0.9,0.99],[0.8,0.9]"]) == {"adam_betas": ["[0.9,0.99]", "[0.8,0.9]"]}


def _fake(root, method, point, seed, val, test, diverged=False, mu=None):
    d = os.path.join(root, method, point, f"seed{seed}") if point else os.path.join(root, method, f"seed{seed}")
    os.makedirs(d)
    c = {"algorithm": method, "seed": seed, "val_fraction": 0.1}
    if mu is not None:
        c["fedprox"] = {"mu": mu}
    json.dump(c, open(os.path.join(d, "config.json"), "w"))
    s = {
        "complete": not diverged,
        "status": "diverged" if diverged else "complete",
        "rounds": 10,
        "final_test_accuracy": test,
        "best_test_accuracy": test,
        "mean_last10_test_accuracy": test,
        "final_forgetting": 0.1,
        "final_val_accuracy": val,
        "best_val_accuracy": val,
        "mean_last10_val_accuracy": val,
        "wall_seconds": 1.0,
        "device": "cpu",
    }
    if diverged:
        s["diverged_round"] = 7
    json.dump(s, open(os.path.join(d, "summary.json"), "w"))


def test_selection_is_on_validation_not_test(tmp_path, capsys):
    """mu=0.1 is best on validation, mu=1 on test, mu=10 best on both but one seed diverged: mu=0.1 is selected;
    --select final_test_accuracy selects mu=1 and says it selects on the test set."""
    root = str(tmp_path / "s")
    vals = {"0.1": ([0.80, 0.84], [0.70, 0.72]), "1": ([0.78, 0.79], [0.75, 0.77]), "10": ([0.95, 0.9], [0.9, 0.9])}
    for mu, (v, t) in vals.items():
        for seed in (0, 1):
            _fake(
                root,
                "fedprox",
                f"fedprox.mu={mu}",
                seed,
                v[seed],
                t[seed],
                diverged=(mu == "10" and seed == 1),
                mu=float(mu),
            )
    _fake(root, "fedavg", "", 0, 0.5, 0.5)
    json.dump(
        {"methods": ["fedavg", "fedprox"], "grid": {"fedprox.mu": ["0.1", "1", "10"]}},
        open(os.path.join(root, "study.json"), "w"),
    )
    text, rows = report(root)
    sel = [r for r in rows if r["selected"]]
    assert [r["point"] for r in sel] == ["fedprox.mu=0.1"] and sel[0]["final_val_accuracy"][0] == pytest.approx(0.82)
    assert "- fedprox: fedprox.mu=0.1 (82.00 ± 2.83)" in text and "not the test set" in text
    assert "| fedprox (selected: fedprox.mu=0.1) |" in text and "fedavg (selected" not in text
    assert "1 of 2 diverged: seed 1 at round 7" in text
    text, rows = report(root, select_on="final_test_accuracy")
    assert [r["point"] for r in rows if r["selected"]] == ["fedprox.mu=1"] and "optimistic" in text
    text, _ = report(root, select_on="final_forgetting")  # lower is better: the first of equals, grid order
    assert "- fedprox: fedprox.mu=0.1" in text and "lowest" in text
    code, _, err = cli(capsys, "report", root, "--select", "accuracy")
    assert code == 2 and "--select: 'accuracy' is not a metric" in err
    for r in os.listdir(os.path.join(root, "fedprox")):  # no validation split: nothing selected, and why
        for s in ("seed0", "seed1"):
            p = os.path.join(root, "fedprox", r, s, "config.json")
            json.dump({**json.load(open(p)), "val_fraction": 0.0}, open(p, "w"))
            q = os.path.join(root, "fedprox", r, s, "summary.json")
            json.dump({k: v for k, v in json.load(open(q)).items() if "val" not in k}, open(q, "w"))
    text, rows = report(root)
    assert not any(r["selected"] for r in rows) and "Selection: none" in text and "val_fraction=0.1" in text


def test_val_fraction_holds_out_a_validation_split(tmp_path):
    from fedfast.assemble import build
    from fedfast.config import build_config

    base = [*TINY, "rounds=2", "algorithm=fedavg"]
    plain = build(build_config(None, base))
    sim = build(build_config(None, [*base, "val_fraction=0.2"]))
    n = len(plain.train)
    assert len(sim.validation) == round(0.2 * n) and len(sim.train) == n - len(sim.validation)
    assert torch.equal(sim.test.x, plain.test.x)  # the test set is not touched
    rows = {tuple(r.tolist()) for r in sim.train.x.flatten(1)}
    assert not any(tuple(r.tolist()) in rows for r in sim.validation.x.flatten(1)[:50])  # disjoint from training
    again = build(build_config(None, [*base, "val_fraction=0.2"]))
    assert torch.equal(again.validation.y, sim.validation.y)  # seeded
    other = build(build_config(None, [*base, "val_fraction=0.2", "seed=1"]))
    assert not torch.equal(other.validation.x, sim.validation.x)
    rec = sim.round()
    with torch.no_grad():  # the record's val_accuracy is the evaluated model's accuracy on the split
        sim.model.eval()
        pred = torch.cat(
            [
                sim.model(sim.validation.batch(torch.arange(i, min(i + 500, len(sim.validation))))[0]).argmax(1)
                for i in range(0, len(sim.validation), 500)
            ]
        )
    assert rec["val_accuracy"] == pytest.approx(float((pred == sim.validation.y).float().mean()))
    assert "val_accuracy" not in plain.round()
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ValueError, match="val_fraction"):
            build_config(None, [*base, f"val_fraction={bad}"])


def _two_studies(tmp_path):
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    for root, cell, rep, note, metric in (
        (a, "mnist-shards", {"fedavg": [80.0, 1.0], "fedntd": [84.0]}, "the authors ran other code_100%", "final"),
        (b, "cifar10", {"fedavg": [60.0]}, "", "best"),
    ):
        for m, accs in (("fedavg", [0.90, 0.92]), ("fedntd", [0.95, 0.93])):
            for s, acc in enumerate(accs):
                _fake(root, m, "", s, None, acc if root == a else acc - 0.3)
        json.dump(
            {
                "preset": f"t/{cell}",
                "methods": ["fedavg", "fedntd"],
                "cell": {
                    "name": f"t/{cell}",
                    "paper": "P",
                    "table": "T",
                    "metric": metric,
                    "reported": rep,
                    "reported_note": note,
                    "notes": "",
                },
            },
            open(os.path.join(root, "study.json"), "w"),
        )
    return a, b


def test_report_formats_and_merged_studies(tmp_path, capsys):
    a, b = _two_studies(tmp_path)
    code, out, err = cli(capsys, "report", a, b, "-o", tmp_path / "merged.md")
    assert code == 0, err
    assert (
        "| method | mnist-shards | mnist-shards paper | mnist-shards Δ | cifar10 (best) | cifar10 (best) paper |" in out
    )
    assert "| fedavg | 91.00 ± 1.41 | 80.00 ± 1.00 | +11.00 † | 61.00 ± 1.41 | 60.00 | +1.00 |" in out
    assert "| fedntd | **94.00 ± 1.41** | 84.00 | +10.00 † | **64.00 ± 1.41** | – | – |" in out
    assert "† mnist-shards: the authors ran other code_100%" in out
    assert (tmp_path / "merged.md").read_text() == out
    code, out, _ = cli(capsys, "report", a, b, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["study"], r["method"]) for r in rows] == [
        ("t/mnist-shards", "fedavg"),
        ("t/mnist-shards", "fedntd"),
        ("t/cifar10", "fedavg"),
        ("t/cifar10", "fedntd"),
    ]
    r = rows[0]
    assert (
        float(r["final_test_acc_mean"]) == pytest.approx(91.0)
        and float(r["final_test_acc_std"]) == pytest.approx(math.sqrt(2))
        and r["paper_mean"] == "80.0"
        and float(r["delta"]) == pytest.approx(11.0)
        and r["n"] == "2"
    )
    assert rows[3]["paper_mean"] == "" and rows[2]["paper_metric"] == "best"
    code, tex, _ = cli(capsys, "report", a, b, "--format", "latex", "-o", tmp_path / "t.tex")
    assert code == 0 and r"\toprule" in tex and r"\multicolumn{3}{c}{mnist-shards}" in tex
    assert r"fedntd & \textbf{94.00}{\scriptsize$\pm$1.41} & 84.00 & +10.00 $^\dagger$" in tex
    assert r"code\_100\%" in tex and "±" not in tex and "Δ" not in tex
    code, one, _ = cli(capsys, "report", a, "--format", "latex")
    assert code == 0 and os.path.isfile(os.path.join(a, "report.tex")) and "% Runs (provenance):" in one
    _compile(tmp_path / "t.tex")
    _compile(os.path.join(a, "report.tex"))


def _compile(table) -> None:
    """pdflatex (Debian's texlive-latex-base and -recommended, for booktabs) on a document holding the table."""
    if shutil.which("pdflatex") is None:
        pytest.skip(
            "pdflatex is not installed (apt-get install texlive-latex-base texlive-latex-recommended): "
            "the LaTeX table was written and checked as text, not compiled"
        )
    d = os.path.dirname(str(table))
    doc = os.path.join(d, "doc.tex")
    with open(doc, "w") as f:
        f.write(
            "\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n"
            f"\\input{{{os.path.basename(str(table))}}}\n\\end{{document}}\n"
        )
    r = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"],
        cwd=d,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and os.path.getsize(os.path.join(d, "doc.pdf")) > 1000, r.stdout[-3000:]


def test_shard_and_jobs_arguments(tmp_path, capsys):
    assert parse_shard("0/4") == (0, 4) and parse_shard("3/4") == (3, 4) and parse_shard(None) is None
    for bad, words in (("4/4", "0 <= I < N"), ("x", "I/N"), ("1/0", "0 <= I < N")):
        code, _, err = cli(capsys, "sweep", "--methods", "fedavg", "--out", tmp_path / "o", "--shard", bad)
        assert code == 2 and "--shard" in err and words in err, err
    code, _, err = cli(capsys, "sweep", "--methods", "fedavg", "--out", tmp_path / "o", "--jobs", "0")
    assert code == 2 and "--jobs: must be >= 1" in err
    out = tmp_path / "sh"  # the shards of a study are disjoint and together are the study
    parts = [
        sweep(str(out), ["fedavg", "fedprox"], [0, 1, 2], overrides=[*TINY, "rounds=1"], shard=(i, 3), quiet=True)
        for i in range(3)
    ]
    assert sorted(sum(parts, [])) == sorted(set(sum(parts, []))) and len(sum(parts, [])) == 6


def _fedfast(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "fedfast", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        **kw,
    )


def _runs(out):
    found = {}
    for d, _, files in os.walk(out):
        if "summary.json" in files:
            s = json.load(open(os.path.join(d, "summary.json")))
            # the runs are live: a last line without its newline is an append still under way (a reader can see
            # part of a write), not a record yet
            lines = open(os.path.join(d, "metrics.jsonl")).readlines()
            rounds = [json.loads(x)["round"] for x in lines if x.endswith("\n")]
            found[os.path.relpath(d, out)] = (s["status"], rounds, json.load(open(os.path.join(d, "config.json"))))
    return found


@pytest.mark.slow
def test_jobs_interrupted_then_finished_by_two_shards_and_a_latex_table(tmp_path):
    """The issue's end to end: the example study file (outside the package; FedAvg and the plug-in FedLC, a grid over
    fedlc.tau, three seeds) with --jobs 2, stopped by SIGINT; two --shard processes at once finish it, no run twice
    (finished runs untouched, interrupted ones resumed from their checkpoint, rounds 1..R once each); the report
    as LaTeX compiles."""
    out = tmp_path / "study"
    R = 25
    args = [
        "sweep",
        EXAMPLE,
        "--out",
        out,
        *sum([["--set", x] for x in [*TINY, f"rounds={R}", "checkpoint_every=1"]], []),
    ]
    p = _fedfast(*args, "--jobs", "2", start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:  # stop it once some runs are done and others are under way
        runs = _runs(out) if os.path.isdir(out) else {}
        if sum(s == "complete" for s, _, _ in runs.values()) >= 2 and any(
            s == "incomplete" for s, _, _ in runs.values()
        ):
            break
        if p.poll() is not None:
            break
        time.sleep(0.2)
    assert p.poll() is None, "the sweep ended before it could be interrupted"
    os.killpg(p.pid, signal.SIGINT)
    log = p.communicate(timeout=120)[0]
    assert p.returncode == 130 and "the same `fedfast sweep` command continues the study" in log, log
    assert "Traceback" not in log, log
    before = _runs(out)
    done = {k for k, (s, _, _) in before.items() if s == "complete"}
    cut = {k for k, (s, _, _) in before.items() if s == "incomplete"}
    assert done and cut and len(before) < 12, before
    assert all(c["threads"] == 1 for _, _, c in before.values())  # two runs at once on 2 cores: 1 thread each
    stamps = {k: os.path.getmtime(out / k / "model_final.pt") for k in done}
    head = {k: (out / k / "metrics.jsonl").read_text() for k in cut}  # per-round timings: a restart rewrites them
    shards = [_fedfast(*args, "--shard", f"{i}/2") for i in range(2)]
    logs = [s.communicate(timeout=400)[0] for s in shards]
    assert [s.returncode for s in shards] == [0, 0], logs
    after = _runs(out)
    assert len(after) == 12 and all(s == "complete" and r == list(range(1, R + 1)) for s, r, _ in after.values())
    assert {k: os.path.getmtime(out / k / "model_final.pt") for k in done} == stamps  # finished runs not run again
    assert all(after[k][2]["threads"] == 1 for k in cut)  # resumed with the threads they were checkpointed with
    assert all((out / k / "metrics.jsonl").read_text().startswith(head[k]) for k in cut)  # resumed, not restarted
    assert "shard 0/2: 6 of the study's 12 runs" in logs[0] and "shard 1/2: 6 of the study's 12 runs" in logs[1]
    assert sorted(os.listdir(out / "fedlc")) == ["fedlc.tau=0.1", "fedlc.tau=0.5", "fedlc.tau=1"]
    text, rows = report(str(out), "latex")
    assert sum(r["selected"] for r in rows) == 1 and r"fedlc (selected: fedlc.tau=" in text
    _compile(out / "report.tex")


def test_slurm_array_script_runs_each_task(tmp_path):
    """examples/slurm/sweep-array.sh as Slurm runs it: task I of N with SLURM_ARRAY_TASK_ID/COUNT (and MIN); the
    tasks together run the study once. With a Slurm controller reachable, `sbatch --test-only` accepts it."""
    script = os.path.join(ROOT, "examples", "slurm", "sweep-array.sh")
    out = tmp_path / "slurm"
    env = {
        **os.environ,
        "FEDFAST": f"{sys.executable} -m fedfast",
        "SLURM_ARRAY_TASK_COUNT": "2",
        "SLURM_ARRAY_TASK_MIN": "1",
    }
    sets = sum([["--set", x] for x in [*TINY, "rounds=1"]], [])
    logs = []
    for task in ("1", "2"):
        r = subprocess.run(
            ["bash", script, EXAMPLE, str(out), "--quiet", *sets],
            env={**env, "SLURM_ARRAY_TASK_ID": task},
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        logs.append(r.stdout)
    assert len(_runs(out)) == 12 and all(s == "complete" for s, _, _ in _runs(out).values())
    r = subprocess.run(
        ["bash", script, EXAMPLE],
        env={k: v for k, v in os.environ.items() if "SLURM" not in k},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "usage: sbatch --array" in r.stderr
    if shutil.which("sbatch") is None or subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        pytest.skip(
            "no Slurm controller here (apt-get install slurm-wlm and a slurm.conf): the script ran as each "
            "array task; sbatch --test-only not tried"
        )
    r = subprocess.run(
        ["sbatch", "--test-only", "--array=0-1", script, EXAMPLE, str(out)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "to start at" in r.stderr, r.stderr


def _sweep_rank(rank, world, port, out, result):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    try:
        dirs = sweep(out, ["fedavg"], [0, 1], overrides=[*TINY, "rounds=2", "threads=1"], quiet=True)
        with open(f"{result}-{rank}", "w") as f:
            json.dump(dirs, f)
        import torch.distributed as dist

        dist.destroy_process_group()
    finally:
        os._exit(0)


def test_sweep_under_torch_distributed_skips_a_held_run_on_every_rank(tmp_path):
    """Two ranks sweep a study whose first run another process holds: rank 0's verdict reaches rank 1, both skip
    it and train the second run together."""
    import torch.multiprocessing as mp

    from fedfast.rundir import RunDir

    out = str(tmp_path / "s")
    held = RunDir(os.path.join(out, "fedavg", "seed0"))
    assert held.open("new") == "new"  # this process holds seed0
    try:
        from fedfast.jobs import _free_port

        mp.spawn(_sweep_rank, args=(2, _free_port(), out, str(tmp_path / "done")), nprocs=2, join=True)
    finally:
        held.close(failed=True)
    for rank in (0, 1):
        assert json.load(open(tmp_path / f"done-{rank}")) == [os.path.join(out, "fedavg", f"seed{s}") for s in (0, 1)]
    runs = _runs(out)
    assert list(runs) == ["fedavg/seed1"] and runs["fedavg/seed1"][0] == "complete"


def test_a_cell_runs_its_reported_rows_and_the_studys_methods(tmp_path, capsys):
    """A study listing the paper's baseline numbers (FedAvg only) and its own method (FedProx) runs both; the
    reported rows come first; --methods still narrows the sweep to the rows named."""
    f = tmp_path / "own.toml"
    f.write_text("""
[preset]
paper = "own"
table = "T"
metric = "final"
seeds = [0]
methods = ["fedavg", "fedprox"]

[protocol]
dataset = "synthetic"
num_clients = 6
clients_per_round = 2
rounds = 1
model = "mlp"

[cells.c]
partition = "iid"
reported = {scaffold = [40.0], fedavg = [41.0, 0.5]}
""")
    cell = presets.resolve(str(f))[0]
    assert cell.methods == ["scaffold", "fedavg", "fedprox"]
    code, out, err = cli(capsys, "sweep", f, "--out", tmp_path / "s", "--quiet")
    assert code == 0, err
    assert {d for d in os.listdir(tmp_path / "s") if not d.startswith(".")} == {
        "fedavg",
        "fedprox",
        "scaffold",
        "study.json",
    }
    code, out, err = cli(capsys, "sweep", f, "--methods", "fedprox", "--out", tmp_path / "n", "--quiet")
    assert code == 0, err
    assert "fedprox" in os.listdir(tmp_path / "n") and not {"fedavg", "scaffold"} & set(os.listdir(tmp_path / "n"))
