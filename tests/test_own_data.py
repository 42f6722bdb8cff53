"""Your own data, partition and model (docs/own-data.md): the guide's example runs as written; feature rows train
exactly as the literal loop; datasets, partitions and models have option tables of their own, names that cannot be
taken silently, paths relative to the file they are written in, and a partition's own number of clients; bad data
and overlapping partitions are refused when they are made."""

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from sequential_loop import sequential

import fedfast
from fedfast import data, methods, models
from fedfast.cli import main
from fedfast.config import build_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "own-data.md")
EXAMPLE = os.path.join(ROOT, "examples", "own_data")


@pytest.fixture(autouse=True)
def _clean():
    yield
    for reg, names in (
        (data.DATASETS, ("csv", "rows", "mnist", "opt_rows")),
        (data.PARTITIONS, ("by_column", "odd", "even")),
        (models.REGISTRY, ("tabular_mlp", "mlp", "tiny")),
    ):
        for n in names:
            reg.remove(n)
    methods.PLUGINS.clear()


def _block(marker: str) -> str:
    text = open(DOC, encoding="utf-8").read()
    m = re.search(rf"<!-- own-data:{marker} -->\n```[a-z]*\n(.*?)```\n<!-- /own-data:{marker} -->", text, re.S)
    assert m, f"docs/own-data.md: no {marker} block"
    return m.group(1)


def _doc_command(line: str) -> list[str]:
    """A command of the guide (from the repository root, with .venv's programs) in this test's Python."""
    line = line.split("#", 1)[0].strip()
    args = line.split()
    if args[0] == ".venv/bin/python":
        return [sys.executable, *args[1:]]
    if args[0] == ".venv/bin/fedfast":
        return [sys.executable, "-m", "fedfast", *args[1:]]
    raise AssertionError(f"unexpected command in docs/own-data.md: {line}")


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def test_the_guides_example_runs_as_written(tmp_path):
    """The page's commands (but `make install`, which made this environment), from a copy of the example's folder
    (the repository is not written): the data, a 30-round FedProx run; then the refusal the page quotes."""
    shutil.copytree(EXAMPLE, tmp_path / "examples" / "own_data", ignore=shutil.ignore_patterns("sensors.csv"))
    lines = [x for x in _block("commands").splitlines() if x.strip() and not x.startswith("make ")]
    assert len(lines) == 2
    for line in lines:
        r = subprocess.run(_doc_command(line), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
    out = tmp_path / "runs" / "own-data"
    cfg = json.loads((out / "config.json").read_text())
    rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 30 and cfg["num_clients"] == 24 and cfg["algorithm"] == "fedprox"
    assert cfg["csv"]["path"] == str(tmp_path / "examples" / "own_data" / "sensors.csv")  # relative to run.toml
    assert cfg["by_column"] == {"min_samples": 20} and cfg["tabular_mlp"] == {"hidden": 64, "layers": 2}
    assert rounds[-1]["test_accuracy"] > 0.4  # 4 classes: well above chance
    cmd, expected = _block("refused").strip().splitlines()
    r = subprocess.run(
        _doc_command(cmd.lstrip("$ ")), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2 and r.stderr.strip() == expected, r.stderr


def test_the_guides_python_snippet_runs(tmp_path, monkeypatch):
    text = open(DOC, encoding="utf-8").read()
    snippet = text[text.index("## From Python") :].split("```python\n", 1)[1].split("```", 1)[0]
    shutil.copy(os.path.join(EXAMPLE, "tabular.py"), tmp_path)
    subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, "make_sensors_csv.py"), str(tmp_path / "sensors.csv")],
        check=True,
        capture_output=True,
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    ns = {}
    exec(compile(snippet.replace("rounds=30", "rounds=2"), "own-data.md", "exec"), ns)  # noqa: S102
    assert len(ns["history"]) == 2 and ns["part"].num_clients == 24
    sys.modules.pop("tabular", None)


# -- feature rows ----------------------------------------------------------------------------------------------
def _rows(n=600, F=7, C=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(C, F, generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    x = centers[y] + torch.randn(n, F, generator=g)
    mean, std = tuple(x.mean(0).tolist()), tuple(x.std(0).tolist())
    return data.ArrayDataset(x, y, C, mean, std, name="rows")


@pytest.mark.parametrize(
    "algorithm,options",
    [
        ("fedavg", {}),
        ("fedprox", {"mu": 0.1}),
        ("fedntd", {}),
        ("moon", {"projection_dim": 0, "mu": 0.1}),
        ("scaffold", {}),
    ],
)
@pytest.mark.parametrize("executor", ["auto", "vmap"])
def test_feature_rows_equal_the_literal_loop(algorithm, options, executor):
    """Tabular rows [N, F] (per-feature normalisation) through the batched executor and vmap: the engine equals
    the per-client nn.Module loop."""
    train, test = _rows(), _rows(200, seed=1)
    part = data.dirichlet_lda(train.y, 8, alpha=0.5, seed=1, min_size=5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = fedfast.SimConfig(
        algorithm=algorithm,
        options=options,
        clients_per_round=4,
        rounds=2,
        local_epochs=2,
        batch_size=16,
        lr=0.05,
        momentum=0.9,
        weight_decay=1e-4,
        seed=3,
        executor=executor,
    )
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    assert (sim.runtime.plan is not None) == (executor == "auto")
    ref = sequential(cfg, copy.deepcopy(sim.model), train, part, 2)
    sim.run()
    assert float((sim.global_flat - ref).abs().max() / ref.abs().max()) <= 1e-5
    x, _ = train.batch(torch.arange(3))
    want = (train.x[:3] - torch.tensor(train.mean)) / torch.tensor(train.std)
    assert torch.allclose(x, want)  # per-feature normalisation


def test_feature_rows_are_refused_where_images_are_needed():
    train = _rows()
    cfg = fedfast.SimConfig(algorithm="fedavg", augment="fedntd")
    with pytest.raises(ValueError, match="augment: 'fedntd' augments images"):
        fedfast.Simulation(cfg, torch.nn.Linear(7, 4), train, train, data.iid(train.y, 4))
    assert train.kind == "rows" and not train.is_image


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_in_the_data_is_refused_naming_the_rows(bad):
    x = torch.randn(50, 3)
    x[7, 1] = bad
    x[31, 0] = bad
    with pytest.raises(ValueError, match=r"x: demo 2 of 50 samples hold NaN or inf \(rows \[7, 31\]\)"):
        data.ArrayDataset(x, torch.zeros(50, dtype=torch.long), 2, name="demo")
    with pytest.raises(ValueError, match="std: must be > 0"):
        data.ArrayDataset(torch.randn(5, 3), torch.zeros(5, dtype=torch.long), 2, std=(1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="mean: one finite number or 3"):
        data.ArrayDataset(torch.randn(5, 3), torch.zeros(5, dtype=torch.long), 2, mean=(0.0, 0.0))


def test_nan_data_from_a_plugin_is_an_error_at_load_not_a_divergence(tmp_path, capsys):
    plugin = tmp_path / "nanrows.py"
    plugin.write_text(
        "import torch\nfrom fedfast import data\n"
        "def load(spec):\n"
        "    x = torch.randn(300, 5); y = torch.arange(300) % 3\n"
        "    x[123, 2] = float('nan')\n"
        "    return data.ArrayDataset(x, y, 3, name='rows'), data.ArrayDataset(x[:50].nan_to_num(), y[:50], 3)\n"
        "data.register_dataset('rows', load)\n"
    )
    code = main(
        [
            "run",
            "--plugin",
            str(plugin),
            "--set",
            "dataset=rows",
            "--set",
            "partition=iid",
            "--set",
            "num_clients=5",
            "--set",
            "clients_per_round=2",
            "--set",
            "rounds=1",
            "--out",
            str(tmp_path / "r"),
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "rows [123]" in err and "NaN" in err and "lr" not in err, err
    assert not (tmp_path / "r").exists()


def test_a_model_builder_with_the_wrong_signature_is_named_with_its_file_and_line(tmp_path, capsys):
    """Issue 60: a builder taking ``(C, shape, o)`` without ``options`` failed at the first run with
    "<lambda>() missing 1 required positional argument: 'o'" and no name, file or expected call."""
    plugin = tmp_path / "badmodel.py"
    plugin.write_text("from fedfast import models\n\nmodels.register_model('badsig', lambda C, shape, o: None)\n")
    code = main(["run", "--plugin", str(plugin), "--set", "model=badsig", "--out", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "register_model('badsig')" in err and f"{plugin}, line 3" in err, err
    assert "build(num_classes, input_shape)" in err and "'o'" in err, err
    try:
        with pytest.raises(TypeError, match=r"build\(num_classes, input_shape, options\); its signature is \(C, s\)"):
            models.register_model("badopts", lambda C, s: None, options=TinyOpts)
        models.register_model("okdefault", lambda C, s=None, *rest: None)  # callable as build(C, shape): taken
        models.register_model("okcallable", type("B", (), {"__call__": lambda self, C, s: None})())
    finally:
        for n in ("badsig", "okdefault", "okcallable"):
            models.REGISTRY.remove(n) if n in models.REGISTRY else None


@dataclasses.dataclass
class TinyOpts:
    hidden: int = 8


# -- partitions ------------------------------------------------------------------------------------------------
def test_overlapping_partitions_are_refused_unless_declared():
    with pytest.raises(
        ValueError,
        match=r"sample 3 is held by clients 0 and 1 \(1 sample\(s\) held more than once\)"
        r".*overlapping=True",
    ):
        data.Partition([[0, 1, 3], [3, 4]])
    with pytest.raises(ValueError, match="sample 2 is held by client 0 twice"):
        data.Partition([[2, 5, 2], [4]])
    p = data.Partition([[0, 1, 3], [3, 4]], overlapping=True)  # on purpose: accepted, and it trains
    train, _ = _rows(10), None
    sim = fedfast.Simulation(
        fedfast.SimConfig(clients_per_round=2), torch.nn.Sequential(torch.nn.Linear(7, 4)), train, train, p
    )
    assert sim.run()[-1]["round"] == 1


def _plugin(tmp_path, body: str, name="mine.py"):
    f = tmp_path / name
    f.write_text(
        "import torch\nfrom dataclasses import dataclass\nfrom fedfast import data, models\n"
        "from fedfast.methods import opt\n" + body
    )
    return str(f)


ROWS_PLUGIN = """
@dataclass
class RowsOptions:
    n: int = opt(300, "rows", check=">=10")
    path: str = opt("", "a file", path=True)

def load(spec):
    o = spec["options"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(o.n, 6, generator=g); y = torch.randint(0, 3, (o.n,), generator=g)
    return (data.ArrayDataset(x, y, 3, groups=torch.arange(o.n) % 5),
            data.ArrayDataset(x[:60], y[:60], 3))

data.register_dataset("opt_rows", load, options=RowsOptions)

def odd(train, spec):  # one client per group, the number of clients the data's
    g = train.groups
    return data.Partition([torch.nonzero(g == k).flatten() for k in range(int(g.max()) + 1)], 3, train.y)

data.register_partition("odd", odd, sets_num_clients=True)

@dataclass
class TinyOptions:
    hidden: int = opt(8, "width", check=">=1")

def tiny(C, shape, o):
    return torch.nn.Sequential(torch.nn.Linear(shape[0], o.hidden), torch.nn.ReLU(), torch.nn.Linear(o.hidden, C))

models.register_model("tiny", tiny, options=TinyOptions)
"""


def test_entry_option_tables_are_validated_recorded_and_resolved(tmp_path):
    plugin = _plugin(tmp_path, ROWS_PLUGIN)
    methods.load_plugin(plugin)
    cfg_file = tmp_path / "sub" / "run.toml"
    cfg_file.parent.mkdir()
    cfg_file.write_text(
        'dataset = "opt_rows"\npartition = "odd"\nmodel = "tiny"\nclients_per_round = 3\n'
        'rounds = 2\n[opt_rows]\nn = 400\npath = "rel/file.bin"\n[tiny]\nhidden = 5\n'
    )
    cfg = build_config(str(cfg_file), ["data_dir=dd"])
    assert cfg.entries == {
        "opt_rows": {"n": 400, "path": str(tmp_path / "sub" / "rel" / "file.bin")},
        "tiny": {"hidden": 5},
    }  # a path of the file: relative to the file
    assert cfg["data_dir"] == os.path.abspath("dd")  # a path of --set: relative to the working directory
    j = cfg.to_json()
    assert j["opt_rows"]["n"] == 400 and j["tiny"] == {"hidden": 5}
    assert build_config(base=j).entries == cfg.entries  # config.json runs again as it is
    for sets, msg in (
        (["opt_rows.n=3"], r"opt_rows.n: must be >= 10"),
        (["opt_rows.m=3"], r"opt_rows.m: not an option of dataset 'opt_rows' \(its options: n, path\)"),
        (["tiny.hidden=x"], r"tiny.hidden: expected an integer"),
        (
            ["dataset=synthetic", "model=mlp"],
            r"opt_rows: the option table of dataset 'opt_rows', but "
            r"the run's dataset is 'synthetic'",
        ),
    ):
        with pytest.raises(ValueError, match=msg):
            build_config(str(cfg_file), sets)
    out = tmp_path / "r"
    assert main(["run", str(cfg_file), "--plugin", plugin, "--out", str(out), "--quiet"]) == 0
    rec = json.loads((out / "config.json").read_text())
    assert rec["num_clients"] == 5 and rec["tiny"] == {"hidden": 5}  # the partition's own number of clients


def test_a_partitions_own_number_of_clients(tmp_path, capsys):
    plugin = _plugin(tmp_path, ROWS_PLUGIN)
    base = [
        "run",
        "--plugin",
        plugin,
        "--set",
        "dataset=opt_rows",
        "--set",
        "model=tiny",
        "--set",
        "clients_per_round=2",
        "--set",
        "rounds=1",
        "--quiet",
    ]
    assert main([*base, "--set", "partition=odd", "--set", "num_clients=9", "--out", str(tmp_path / "a")]) == 2
    assert (
        "num_clients: 9, but partition 'odd' decides the number of clients itself and made 5" in capsys.readouterr().err
    )
    data.register_partition("even", lambda train, s: data.Partition([[0, 1], [2, 3]]))  # ignores num_clients
    assert main([*base, "--set", "partition=even", "--set", "num_clients=3", "--out", str(tmp_path / "b")]) == 2
    assert "partition: 'even' made 2 clients, num_clients is 3" in capsys.readouterr().err


# -- names -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "register,reg",
    [
        (lambda **kw: data.register_dataset("mnist", lambda s: None, **kw), data.DATASETS),
        (lambda **kw: data.register_partition("iid", lambda t, s: None, **kw), data.PARTITIONS),
        (lambda **kw: models.register_model("mlp", lambda C, s: None, **kw), models.REGISTRY),
    ],
)
def test_a_taken_name_is_refused_unless_replaced_on_purpose(register, reg):
    name = next(n for n in ("mnist", "iid", "mlp") if n in reg)
    before = reg[name]
    with pytest.raises(ValueError, match=rf"the name '{name}' is taken by .*replace=True"):
        register()
    assert reg[name] is before
    register(replace=True)
    assert reg[name] is not before and name in reg.replaced
    reg.remove(name)
    assert reg[name] is before and name not in reg.replaced


def test_a_replaced_dataset_is_recorded_and_marked_in_the_report(tmp_path):
    plugin = _plugin(
        tmp_path,
        "def load(spec):\n    return data.synthetic(3, 200, 50, (1, 4, 4), seed=0)\n"
        "data.register_dataset('mnist', load, replace=True)\n",
    )
    out = tmp_path / "r"
    assert (
        main(
            [
                "run",
                "--plugin",
                plugin,
                "--set",
                "partition=iid",
                "--set",
                "num_clients=4",
                "--set",
                "clients_per_round=2",
                "--set",
                "rounds=1",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    assert "mine.load" in cfg["replaced_entries"]["dataset"]["mnist"]["by"]
    assert main(["report", str(out)]) == 0
    assert "‡ dataset mnist here is" in (out / "report.md").read_text()


def test_deprecation_notices_are_shown_once_from_the_command_line(tmp_path):
    """Issue 60: a plug-in's old forms warned with a DeprecationWarning that Python's default filters hide outside
    ``__main__``: the command line now shows each fedfast notice once."""
    plugin = tmp_path / "oldforms.py"
    plugin.write_text(
        "import fedfast.flat, fedfast.engine\n"
        "for _ in range(3):\n"
        "    fedfast.flat.ClientState, fedfast.engine.Diverged\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="")
    r = subprocess.run(
        [sys.executable, "-m", "fedfast", "methods", "--plugin", str(plugin)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.stderr.count("FedfastDeprecationWarning: fedfast.flat.ClientState moved") == 1, r.stderr
    assert r.stderr.count("FedfastDeprecationWarning: fedfast.engine.Diverged moved") == 1, r.stderr
    assert f"{plugin}:3" in r.stderr, r.stderr  # the plug-in's line


def test_deprecation_notices_of_round_hooks_show_once_from_worker_processes(tmp_path):
    """A notice raised in a round hook runs in the worker processes of ``--workers`` (spawned: Python's default
    filters, which hid it): shown once, by rank 0."""
    plugin = tmp_path / "oldround.py"
    plugin.write_text(
        "from fedfast.methods import FedAvg, register\n\n\n@register('old_round_form')\n"
        "class Old(FedAvg):\n    def round_start(self, ctx):\n        ctx.reduce\n"
        "        return super().round_start(ctx)\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedfast",
            "run",
            "--plugin",
            str(plugin),
            *("--set", "algorithm=old_round_form", "--set", "dataset=synthetic", "--set", "model=mlp"),
            *("--set", "num_clients=10", "--set", "clients_per_round=4", "--set", "rounds=2"),
            *("--workers", "2", "--out", str(tmp_path / "r"), "--quiet"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("FedfastDeprecationWarning: Round.reduce is deprecated") == 1, r.stderr


def test_loading_the_same_plugin_twice_is_harmless(tmp_path):
    plugin = _plugin(tmp_path, ROWS_PLUGIN)
    methods.load_plugin(plugin)
    methods.load_plugin(plugin)
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    methods.load_plugin(_plugin(copy_dir, ROWS_PLUGIN))  # a copy of the same content (a copied study directory)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="the name 'opt_rows' is taken"):
        methods.load_plugin(_plugin(other, ROWS_PLUGIN.replace("o.n, 6", "o.n, 7")))


# -- study files: paths relative to the file -------------------------------------------------------------------
def test_a_study_files_paths_resolve_against_the_file(tmp_path, monkeypatch):
    from fedfast import presets

    d = tmp_path / "study"
    d.mkdir()
    (d / "s.toml").write_text(
        '[preset]\nmethods = ["fedavg"]\n[protocol]\ndataset = "synthetic"\n'
        'data_dir = "mydata"\nnum_clients = 10\nclients_per_round = 2\n'
    )
    monkeypatch.chdir(tmp_path)
    cell = presets.get(str(d / "s.toml") + "/default")
    cfg = build_config(base=cell.config("fedavg"), source=cell.source, root=cell.root)
    assert cfg["data_dir"] == str(d / "mydata")
    packaged = presets.get("fedntd-table1/mnist-shards")  # fedfast's own presets: the working directory's data
    cfg = build_config(base=packaged.config("fedavg"), source=packaged.source, root=packaged.root)
    assert cfg["data_dir"] == str(tmp_path / "data")


def test_a_study_file_names_the_plugins_data_and_options_beside_it(tmp_path, monkeypatch):
    """A study of one's own on the example: plug-in, data file and option tables in the study file, relative paths
    to it, swept from another working directory."""
    d = tmp_path / "study"
    d.mkdir()
    shutil.copy(os.path.join(EXAMPLE, "tabular.py"), d)
    subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, "make_sensors_csv.py"), str(d / "sensors.csv")],
        check=True,
        capture_output=True,
    )
    (d / "own.toml").write_text(
        '[preset]\nmethods = ["fedavg"]\nseeds = [0]\nplugins = ["tabular.py"]\n'
        '[protocol]\ndataset = "csv"\npartition = "by_column"\nmodel = "tabular_mlp"\nclients_per_round = 4\n'
        'rounds = 2\nbatch_size = 32\n[protocol.csv]\npath = "sensors.csv"\ntest_fraction = 0.25\n'
        "[protocol.tabular_mlp]\nhidden = 16\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["sweep", str(d / "own.toml"), "--out", "s", "--quiet"]) == 0
    cfgs = [
        json.loads(open(os.path.join(r, "config.json")).read())
        for r, _, files in os.walk(elsewhere / "s")
        if "config.json" in files
    ]
    assert len(cfgs) == 1 and cfgs[0]["csv"]["path"] == str(d / "sensors.csv")
    assert cfgs[0]["csv"]["test_fraction"] == 0.25 and cfgs[0]["tabular_mlp"]["hidden"] == 16
    assert cfgs[0]["num_clients"] == 24 and str(d / "sensors.csv") in cfgs[0]["fingerprint"]["data"]
