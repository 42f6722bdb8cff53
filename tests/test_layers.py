"""fedfast's layers, one way: a module may import its own layer and the layers below, never one above, at module
level or inside a function (optional third-party packages aside; the package's ``__init__`` facade aside).

    0 kernels     fedfast.ops, fedfast.triton, fedfast._version, fedfast._io, fedfast._registry
    1 parts       fedfast.flat, batched, grouped, cpu_alloc, flops, nn, data, models
    2 methods     fedfast.methods
    3 engine      fedfast.engine, sim (its parts), simconfig, local_step, collectives, sampling, teachers,
                  checkpoint
    4 config      fedfast.config, presets
    5 runs        fedfast.runner, rundir, assemble (a run built from its config), jobs (runs run), fingerprint
    6 studies     fedfast.study
    7 front ends  fedfast.cli, plot, doctor, bench, __main__

``KNOWN_UPWARD`` lists the upward imports main has (none since issue 29's step 2). A new one fails this test; so
does a listed one that is gone (the list only shrinks).
"""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "fedfast")

LAYERS = [
    ("ops", "triton", "_version", "_io", "_registry"),
    ("flat", "batched", "grouped", "cpu_alloc", "flops", "nn", "data", "models"),
    ("methods",),
    ("engine", "checkpoint", "simconfig", "local_step", "collectives", "sampling", "teachers", "sim"),
    ("config", "presets"),
    ("runner", "rundir", "assemble", "jobs", "fingerprint"),
    ("study",),
    ("cli", "plot", "doctor", "bench", "__main__"),
]

# (importer, imported): the upward edges of main at this commit, each to be removed, never added to.
KNOWN_UPWARD: set = set()


# names the package root re-exports, and the module each comes from
FACADE = {"__version__": "_version", "SimConfig": "engine", "Simulation": "engine", "Diverged": "engine",
          "OutOfMemory": "engine", "tune_cpu_allocator": "cpu_alloc"}


def layer_of(top: str) -> int:
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"fedfast.{top}: not placed in a layer (add it to LAYERS in {__file__})")


def _modules():
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield path, rel


def _imports(path: str, rel: str):
    """The fedfast top-level names (``engine``, ``ops``, ...) this file imports, anywhere in it."""
    pkg = rel.split(".")[:-1] if not rel.endswith("__init__") else rel.split(".")[:-1]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "fedfast" and len(parts) > 1:
                    yield FACADE.get(parts[1], parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "fedfast":
                    continue
                base = parts[1:]
            else:
                base = (pkg[:len(pkg) - node.level + 1] if node.level > 1 else pkg) + \
                    (node.module.split(".") if node.module else [])
            if base:
                yield base[0]
            else:  # "from . import x, y" at the package root
                for a in node.names:
                    yield FACADE.get(a.name, a.name)


def upward_edges():
    edges = set()
    for path, rel in _modules():
        top = rel.split(".")[0]
        if rel == "__init__":
            continue  # the public facade re-exports every layer
        me = layer_of(top)
        for imp in _imports(path, rel):
            if imp == top or imp.startswith("_C"):
                continue
            if layer_of(imp) > me:
                edges.add((top, imp))
    return edges


def test_every_module_has_a_layer():
    for _, rel in _modules():
        if rel != "__init__":
            layer_of(rel.split(".")[0])


def test_no_new_upward_import():
    found = upward_edges()
    new = sorted(found - KNOWN_UPWARD)
    assert not new, (f"imports from a lower layer to a higher one: {new}. Move the code down (or the import "
                     f"into the caller); see the layers in {__file__}")


def test_the_known_list_only_shrinks():
    gone = sorted(KNOWN_UPWARD - upward_edges())
    assert not gone, f"these upward imports are gone: delete them from KNOWN_UPWARD: {gone}"


@pytest.mark.parametrize("src,imp", [("ops", "engine"), ("methods", "cli")])
def test_the_check_sees_an_upward_import(tmp_path, monkeypatch, src, imp):
    """The scanner finds a function-level upward import (so the test above can fail)."""
    f = tmp_path / "x.py"
    f.write_text(f"def f():\n    from ..{imp} import thing\n")
    assert list(_imports(str(f), f"{src}.x")) == [imp]
    assert layer_of(imp) > layer_of(src)


def test_a_dataset_partition_and_model_of_your_own(tmp_path):
    """The run's building blocks come from registries: a plug-in's own dataset, partition and model run through
    ``fedfast run`` with no edit of the CLI or the config (and an unknown name is refused, naming the key)."""
    import json

    from fedfast import data, models
    from fedfast.cli import main
    plugin = tmp_path / "mine.py"
    plugin.write_text(
        "import torch\n"
        "from fedfast import data, models\n"
        "def load(spec):\n"
        "    return data.synthetic(3, 300, 60, (1, 4, 4), seed=spec['seed'])\n"
        "data.register_dataset('tiny_vectors', load)\n"
        "data.register_partition('round_robin', lambda train, s: data.Partition(\n"
        "    [torch.arange(k, len(train), s['num_clients']) for k in range(s['num_clients'])], 3, train.y,\n"
        "    'round_robin'))\n"
        "models.register_model('linear', lambda C, shape: torch.nn.Sequential(torch.nn.Flatten(),\n"
        "    torch.nn.Linear(shape[0] * shape[1] * shape[2], C)))\n")
    out = tmp_path / "run"
    try:
        assert main(["run", "--plugin", str(plugin), "--set", "dataset=tiny_vectors", "--set", "partition=round_robin",
                     "--set", "model=linear", "--set", "num_clients=6", "--set", "clients_per_round=3", "--set",
                     "rounds=2", "--out", str(out), "--quiet"]) == 0
        lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == 2 and lines[-1]["test_accuracy"] is not None
        with pytest.raises(ValueError, match="partition: must be one of"):
            from fedfast.config import build_config
            build_config(None, ["dataset=tiny_vectors", "partition=nope"])
    finally:
        data.DATASETS.remove("tiny_vectors")
        data.PARTITIONS.remove("round_robin")
        models.REGISTRY.remove("linear")


def test_the_method_is_built_once_per_run(tmp_path, monkeypatch):
    """fedfast run builds the method once: config validation, the held-out splits, the Simulation and config.json
    share one instance."""
    from fedfast import methods
    from fedfast.cli import main
    built = []
    real = methods.build

    def counting(name, options=None):
        m = real(name, options)
        built.append(name)
        return m
    monkeypatch.setattr(methods, "build", counting)
    assert main(["run", "--set", "dataset=synthetic", "--set", "num_clients=10", "--set", "clients_per_round=3",
                 "--set", "rounds=2", "--set", "algorithm=fedgkd_vote", "--out", str(tmp_path / "r"), "--quiet"]) == 0
    assert built == ["fedgkd_vote"], built
