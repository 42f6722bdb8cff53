"""Studies: every paper preset parses and names its cell; sweeps (skip complete runs, resume, refuse a changed
study); report arithmetic against hand-computed values; plots (headless PNG with the expected curves); presets
and doctor from the command line."""

import json
import math
import os

import pytest
import torch

import fedfast
from fedfast import methods, presets
from fedfast.cli import main
from fedfast.config import build_config
from fedfast.study import mean_std, report, sweep


def test_every_preset_parses_and_names_its_paper_cell():
    allp = presets.load_all()
    assert len(allp) >= 30
    for name, p in allp.items():
        assert name == f"{name.split('/')[0]}/{p.cell}" and p.metric in ("final", "best") and p.seeds
        assert p.paper and p.table and p.methods, name
        if not name.startswith("demo/"):
            assert p.reported and all(1 <= len(v) <= 2 and 0 < v[0] < 100 for v in p.reported.values()), name
        for m in p.methods:
            methods.get(m)
            cfg = build_config(None, [], base=p.config(m))  # every option and key is valid
            assert cfg["algorithm"] == m
    p = allp["fedntd-table1/mnist-shards"]
    assert p.reported["fedntd"] == [84.44, 0.43] and p.keys["local_epochs"] == 3
    c = build_config(None, [], base=allp["asd-cifar100/delta0.3"].config("feddyn+asd")).to_json()
    assert c["asd"]["lam"] == 30.0 and c["feddyn"]["alpha_scaling"] == "minibatches" and c["local_epochs"] == 10
    assert allp["fedgkd-cifar10/alpha0.1"].metric == "best"
    ag = build_config(None, [], base=allp["fedgkd-table4/ag_news"].config("fedgkd")).to_json()  # FedGKD Table 4
    assert (ag["dataset"], ag["num_clients"], ag["local_epochs"], ag["train_fraction"]) == ("ag_news", 20, 1, 0.5)
    assert (ag["client_optimizer"], ag["lr"], ag["max_length"], ag["fedgkd"]["buffer"]) == ("adam", 1e-5, 128, 1)
    sst = build_config(None, [], base=allp["fedgkd-table4/sst5"].config("fedgkd_vote")).to_json()
    assert (sst["num_clients"], sst["local_epochs"], sst["fedgkd_vote"]["buffer"]) == (10, 3, 3)
    tiny = allp["fedgkd-tiny-imagenet/alpha0.1"]
    assert build_config(None, [], base=tiny.config("moon"))["model"] == "resnet50_bn"
    assert build_config(None, [], base=tiny.config("fedgkd")).to_json()["fedgkd"]["gamma"] == 0.1


def _fake_run(root, alg, seed, final, best, last10, forgetting, wall, accs=None):
    d = os.path.join(root, alg, f"seed{seed}")
    os.makedirs(d)
    json.dump({"algorithm": alg, "seed": seed}, open(os.path.join(d, "config.json"), "w"))
    json.dump(
        {
            "complete": True,
            "rounds": 50,
            "final_test_accuracy": final,
            "best_test_accuracy": best,
            "mean_last10_test_accuracy": last10,
            "final_forgetting": forgetting,
            "wall_seconds": wall,
            "device": "cpu",
        },
        open(os.path.join(d, "summary.json"), "w"),
    )
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for r, a in enumerate(accs or [final], 1):
            f.write(json.dumps({"round": r, "test_accuracy": a}) + "\n")


def test_every_row_of_the_tables_runs_with_its_papers_settings():
    """Issue 18: every method row of the presets' tables is a registered method (no 'rows not in fedfast'); rows a
    column lacks say why; the new rows carry their papers' (codes') settings."""
    allp = presets.load_all()
    for name, p in allp.items():
        assert "not in fedfast" not in p.notes, name
        for m in list(p.reported) + list(p.missing):
            methods.get(m)
        assert not set(p.reported) & set(p.missing), name

    def cfg(cell, m):
        return build_config(None, [], base=allp[cell].config(m)).to_json()

    ntd = cfg("fedntd-table1/cifar10-shards-s2", "fedcurv")
    assert (ntd["client_sampling"], ntd["fedcurv"]) == ("round_seeded", {"lam": 1.0, "samples": 500})
    assert cfg("fedntd-table1/mnist-lda", "moon")["moon"]["projection_dim"] == 0  # FedNTD's MOON has no head
    assert allp["fedntd-table1/cifar10-lda-a0.05"].reported["fednova"] == [10.0]  # 'failed'
    sp = cfg("asd-cifar100/delta0.3", "fedspeed+asd")
    assert sp["client_sampling"] == "bernoulli" and sp["asd"]["lam"] == 30.0
    assert sp["fedspeed"] == {"lam": 0.01, "rho": 0.0, "alpha_scaling": "minibatches", "evaluated": "all_clients"}
    assert cfg("asd-tiny-imagenet/iid", "fedsam+asd")["fedsam"]["rho"] == 0.03  # a cell's own option
    assert cfg("asd-tiny-imagenet/delta0.3", "fedsam")["fedsam"]["rho"] == 0.1
    assert (
        cfg("asd-cifar10/iid", "feddisco")["feddisco"]["scope"] == "all"
        and "fedsam" not in allp["asd-cifar10/iid"].reported
    )  # Table 13 has no FedSAM rows
    g = cfg("fedgkd-cifar100/alpha0.1", "fedgen")
    assert (g["fedgen"]["alpha"], g["fedgen"]["beta"], g["fedgen"]["available_labels"], g["max_grad_norm"]) == (
        1.0,
        0.0,
        False,
        10.0,
    )
    assert cfg("fedgkd-tiny-imagenet/alpha1", "fedgkd_plus")["model"] == "resnet50_bn"
    assert cfg("fedgkd-table4/sst5", "feddistill_plus")["feddistill_plus"]["coef"] == 0.1
    assert cfg("fedcad-table1/femnist", "fedlsd")["fedlsd"] == {"alpha": 0.3, "tau": 2.0, "tau_squared": False}
    rs = cfg("fedadc-table1/cifar10-s2-c0.1", "fedrs")
    assert (rs["fedrs"]["alpha"], rs["momentum"]) == (0.5, 0.9)
    assert "fedrs" in allp["fedadc-table1/cifar100-a0.1-c0.1"].missing
    assert cfg("fedadc-table1/cifar10-s2-c0.2", "fedls_ntd")["fedls_ntd"]["beta"] == 0.3


def test_report_arithmetic(tmp_path):
    root = str(tmp_path)
    _fake_run(root, "fedntd", 0, 0.80, 0.85, 0.79, 0.10, 100.0)
    _fake_run(root, "fedntd", 1, 0.82, 0.86, 0.80, 0.12, 110.0)
    _fake_run(root, "fedntd", 2, 0.87, 0.88, 0.86, 0.08, 120.0)
    _fake_run(root, "fedavg", 0, 0.70, 0.75, 0.69, 0.20, 90.0)
    json.dump(
        {"preset": "fedntd-table1/mnist-shards", "methods": ["fedntd", "fedavg"]}, open(tmp_path / "study.json", "w")
    )
    text, rows = report(root)
    ntd, avg = rows
    assert ntd["method"] == "fedntd" and ntd["seeds"] == [0, 1, 2]
    m, s = ntd["final_test_accuracy"]
    assert m == pytest.approx(0.83) and s == pytest.approx(math.sqrt((0.03**2 + 0.01**2 + 0.04**2) / 2))
    assert ntd["wall_seconds"] == (pytest.approx(110.0), pytest.approx(10.0))
    assert avg["final_test_accuracy"] == (pytest.approx(0.70), None)  # one seed: no std
    assert ntd["paper"] == (84.44, 0.43) and ntd["delta"] == pytest.approx(83.0 - 84.44)
    assert "| fedntd | 0,1,2 | 50 | **83.00 ± 3.61** |" in text and "84.44 ± 0.43" in text and "-1.44" in text
    assert (tmp_path / "report.md").read_text() == text
    assert mean_std([]) == (None, None) and mean_std([None, 2.0]) == (2.0, None)


def test_plot_curves_mean_std_png(tmp_path):
    pytest.importorskip("matplotlib")
    from fedfast.plot import accuracy_curves

    root = str(tmp_path / "s")
    _fake_run(root, "fedavg", 0, 0.6, 0.6, 0.6, 0.1, 1.0, accs=[0.2, 0.4, 0.6])
    _fake_run(root, "fedavg", 1, 0.8, 0.8, 0.8, 0.1, 1.0, accs=[0.4, 0.6, 0.8])
    _fake_run(root, "fedntd", 0, 0.9, 0.9, 0.9, 0.1, 1.0, accs=[0.5, 0.7, 0.9])
    out = tmp_path / "fig.png"
    data = accuracy_curves([root], str(out))
    r, m, s, n = data["fedavg"]
    assert r.tolist() == [1, 2, 3] and m == pytest.approx([0.3, 0.5, 0.7]) and n == 2
    assert s == pytest.approx([math.sqrt(0.02)] * 3)
    assert data["fedntd"][3] == 1 and data["fedntd"][2].tolist() == [0, 0, 0]
    raw = out.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 200 and img.shape[1] > 400
    assert main(["plot", root, "-o", str(tmp_path / "cli.png")]) == 0 and (tmp_path / "cli.png").exists()
    with pytest.raises(ValueError, match="no run"):
        accuracy_curves([str(tmp_path / "empty")], str(out))


def test_sweep_skips_complete_runs_and_refuses_a_changed_study(tmp_path, capsys):
    out = str(tmp_path / "study")
    sets = ["dataset=synthetic", "num_clients=10", "clients_per_round=3", "rounds=2", "checkpoint_every=1"]
    dirs = sweep(out, ["fedavg", "fedntd"], [0, 1], overrides=sets, quiet=True)
    assert len(dirs) == 4 and all(json.load(open(os.path.join(d, "summary.json")))["complete"] for d in dirs)
    mtimes = [os.path.getmtime(os.path.join(d, "model_final.pt")) for d in dirs]
    s = json.load(open(os.path.join(dirs[0], "summary.json")))  # an interrupted run: resumed, not restarted
    json.dump({**s, "complete": False, "status": "incomplete"}, open(os.path.join(dirs[0], "summary.json"), "w"))
    assert (
        main(
            [
                "sweep",
                "--methods",
                "fedavg,fedntd",
                "--seeds",
                "0,1",
                "--out",
                out,
                *sum([["--set", x] for x in sets], []),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.count("complete, skipped") == 3 and "| fedntd | 0,1 |" in printed
    assert [os.path.getmtime(os.path.join(d, "model_final.pt")) for d in dirs][1:] == mtimes[1:]
    assert json.load(open(os.path.join(dirs[0], "summary.json")))["complete"] is True
    assert len(open(os.path.join(dirs[0], "metrics.jsonl")).read().splitlines()) == 2
    with pytest.raises(ValueError, match="overrides"):
        sweep(out, ["fedavg"], [0], overrides=sets[:-1], quiet=True)
    assert main(["sweep", "--out", out, "--seeds", "x"]) == 2


def test_presets_from_the_command_line(tmp_path, capsys):
    assert main(["presets"]) == 0
    listing = capsys.readouterr().out
    assert "fedntd-table1/cifar10-lda-a0.1" in listing and "asd-cifar100/delta0.3" in listing
    assert main(["presets", "fedgkd-cifar10/alpha0.5"]) == 0
    assert "77.44 ± 0.60" in capsys.readouterr().out
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "--preset",
                "demo/mnist-shards",
                "--set",
                "algorithm=fedntd",
                "--set",
                "rounds=1",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    c = json.load(open(out / "config.json"))
    assert c["dataset"] == "mnist" and c["algorithm"] == "fedntd" and c["momentum"] == 0.9
    assert (
        main(
            [
                "run",
                "--preset",
                "fedntd-table1/cifar10-shards-s2",
                "--set",
                f"data_dir={tmp_path}/none",
                "--out",
                str(tmp_path / "c10"),
            ]
        )
        == 2
    )
    assert "cifar-10" in capsys.readouterr().err.lower()
    assert main(["run", "--preset", "nosuch/cell"]) == 2


def test_doctor_checks_backends(capsys, monkeypatch):
    assert main(["doctor", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "automatic backend on cpu: cpu" in out and " ok " in out
    from importlib import metadata

    assert f"optional: transformers {metadata.version('transformers')}, tokenizers" in out
    import importlib

    d = importlib.import_module("fedfast.ops.distill")
    real = d._backend_rows

    def broken(backend, *a, **kw):  # a backend whose loss is off by 1e-3: the doctor must say so
        loss, grad = real(backend, *a, **kw)
        return (loss + 1e-3, grad) if backend == "cpu" else (loss, grad)

    monkeypatch.setattr(d, "_backend_rows", broken)
    assert main(["doctor", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "FAIL cpu     cpu       distill" in out and "1 check(s) FAILED" in out


def test_fidelity_note_and_provenance_in_the_report(tmp_path, capsys):
    """FedNTD's MNIST cells carry the authors' statement on their reported numbers; report puts a † on Δ and the
    note under the table, and lists each run's fedfast version (and commit from a checkout), torch and device."""
    from fedfast import presets
    from fedfast.callbacks import source_commit

    note = presets.get("fedntd-table1/mnist-shards").reported_note
    assert "Lee-Gihun/FedNTD/issues/4" in note and "CutOut" in note and "95.8" in note
    assert presets.get("fedntd-table1/mnist-lda").reported_note == note
    assert presets.get("fedntd-table1/cifar10-shards-s2").reported_note == ""
    assert main(["presets", "fedntd-table1/mnist-shards"]) == 0
    assert "note on the reported numbers: The authors state" in capsys.readouterr().out
    out = tmp_path / "study"
    assert (
        main(
            [
                "run",
                "--set",
                "dataset=synthetic",
                "--set",
                "num_clients=10",
                "--set",
                "clients_per_round=3",
                "--set",
                "rounds=2",
                "--set",
                "algorithm=fedavg",
                "--out",
                str(out / "fedavg" / "seed0"),
                "--quiet",
            ]
        )
        == 0
    )
    (out / "study.json").write_text(json.dumps({"preset": "fedntd-table1/mnist-shards", "methods": ["fedavg"]}))
    text, _ = report(str(out))
    row = next(line for line in text.splitlines() if line.startswith("| fedavg"))
    assert row.rstrip(" |").endswith("†") and "78.63 ± 0.42" in row
    assert "† On the paper's numbers of this cell: The authors state" in text
    prov = next(line for line in text.splitlines() if line.startswith("- `fedavg/seed0`"))
    assert f"fedfast {fedfast.__version__}" in prov and f"torch {torch.__version__}" in prov and "device cpu" in prov
    c = source_commit()
    assert (f"commit {c}" in prov) if c else "commit" not in prov
