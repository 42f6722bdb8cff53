"""Plug-ins that cannot go silently wrong: a name another class holds is refused (or replaced on purpose and
recorded), the same file loads twice harmlessly, config.json records each plug-in's content hash and a changed
file is refused on resume and rerun, a method's state is checkpointed without a list (resume equals the straight
run for a plug-in that declares nothing), errors inside a plug-in name its file and line, an unknown algorithm
suggests --plugin, and a method adds its own values to each round's metrics."""

import json
import textwrap

import pytest
import torch

import fedfast
from fedfast import methods
from fedfast.cli import main

FEDADAM = '''
import torch
from dataclasses import dataclass
from fedfast.methods import FedAvg, opt, register


@register("{name}"{extra})
class FedAdam(FedAvg):
    """FedAdam (Reddi et al., ICLR 2021): Adam on the server over the pseudo-gradient avg - global."""

    @dataclass
    class Options:
        server_lr: float = opt(0.05, "server learning rate", check=">0")
        beta1: float = opt(0.9, "first moment", check="[0,1)")
        beta2: float = opt(0.99, "second moment", check="[0,1)")
        eps: float = opt(1e-3, "adaptivity", check=">0")

    def setup(self):
        P = self.engine.num_params
        self.m = torch.zeros(P, device=self.engine.device)   # no `state` list: found by the checkpoint
        self.v = torch.zeros(P, device=self.engine.device)
        self.t = 0
        self.last_step = 0.0

    def server(self, ctx, avg):
        o, g = self.opts, self.engine.global_flat
        d = avg - g
        self.t += 1
        self.m = o.beta1 * self.m + (1 - o.beta1) * d
        self.v = o.beta2 * self.v + (1 - o.beta2) * d * d
        step = o.server_lr * self.m / (self.v.sqrt() + o.eps)
        self.last_step = float(step.norm())
        return g + step

    def round_metrics(self, ctx):
        return {{"step_norm": self.last_step, "t": torch.tensor(self.t)}}
'''


def _plugin(tmp_path, name="fedadam", extra="", file="fedadam.py"):
    p = tmp_path / file
    p.write_text(FEDADAM.format(name=name, extra=extra))
    return str(p)


@pytest.fixture(autouse=True)
def _clean():
    yield
    for n in ("fedadam", "fedavg"):
        methods.unregister(n)
    methods.PLUGINS.clear()


SETS = [
    "--set",
    "dataset=synthetic",
    "--set",
    "num_clients=8",
    "--set",
    "clients_per_round=3",
    "--set",
    "partition=iid",
    "--set",
    "model=mlp",
    "--set",
    "algorithm=fedadam",
    "--quiet",
]


def test_a_taken_name_is_refused_naming_both_classes_and_files(tmp_path):
    path = _plugin(tmp_path, name="fedavg")
    with pytest.raises(
        ValueError,
        match=r"line \d+: ValueError: register\('fedavg'\): the name 'fedavg' is taken by "
        r"fedfast\.methods\.fedavg\.FedAvg .*fedavg\.py.*FedAdam.*fedadam\.py.*"
        r"replace=True",
    ):
        methods.load_plugin(path)
    assert methods.REGISTRY["fedavg"] is methods.BUILTIN["fedavg"]  # untouched


def test_loading_the_same_plugin_twice_is_harmless(tmp_path):
    path = _plugin(tmp_path)
    methods.load_plugin(path)
    first = methods.REGISTRY["fedadam"]
    methods.load_plugin(path)  # resume, sweeps, workers
    copy = tmp_path / "copy"
    copy.mkdir()
    methods.load_plugin(_plugin(copy))  # a copied study directory: the same content
    assert methods.REGISTRY["fedadam"] is not first and methods.REGISTRY["fedadam"].__qualname__ == "FedAdam"
    other = tmp_path / "other"
    other.mkdir()
    (other / "fedadam.py").write_text(FEDADAM.format(name="fedadam", extra="").replace("0.05", "0.5"))
    with pytest.raises(ValueError, match="taken by"):  # another class under the same name
        methods.load_plugin(str(other / "fedadam.py"))


def test_replace_true_is_recorded_in_config_and_marked_in_the_report(tmp_path, capsys):
    path = _plugin(tmp_path, name="fedavg", extra=", replace=True")
    out = tmp_path / "r"
    sets = [a if a != "algorithm=fedadam" else "algorithm=fedavg" for a in SETS]
    assert main(["run", "--plugin", path, *sets, "--set", "rounds=1", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["replaced_methods"]["fedavg"]["by"].startswith("fedfast_plugin_fedadam.FedAdam (")
    assert "fedfast.methods.fedavg.FedAvg" in cfg["replaced_methods"]["fedavg"]["replaced"]
    assert main(["report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "fedavg ‡" in text and "registered with replace=True" in text


def test_resume_of_a_plugin_that_declares_no_state_equals_the_straight_run(tmp_path):
    """The FedAdam plug-in lists no `state`: its moments and step count are found by the checkpoint, so 2 rounds +
    --resume to 3 equal 3 rounds run straight (it used to restart the moments at zero)."""
    path = _plugin(tmp_path)
    straight, half = tmp_path / "straight", tmp_path / "half"
    assert main(["run", "--plugin", path, *SETS, "--set", "rounds=3", "--out", str(straight)]) == 0
    assert main(["run", "--plugin", path, *SETS, "--set", "rounds=2", "--out", str(half)]) == 0
    assert main(["run", "--resume", str(half), "--set", "rounds=3", "--quiet"]) == 0
    a = [json.loads(s) for s in (straight / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(s) for s in (half / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_loss"] for r in a] == [r["test_loss"] for r in b]
    assert b[-1]["method_metrics"] == {"step_norm": a[-1]["method_metrics"]["step_norm"], "t": 3.0}
    ma = torch.load(straight / "model_final.pt", weights_only=True)
    mb = torch.load(half / "model_final.pt", weights_only=True)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_a_changed_plugin_is_refused_on_resume_and_rerun(tmp_path, capsys):
    path = _plugin(tmp_path)
    out = tmp_path / "r"
    assert main(["run", "--plugin", path, *SETS, "--set", "rounds=1", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["plugin_sha256"] == {path: methods.file_sha256(path)}
    with open(path, "a") as f:
        f.write("\n# edited\n")
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--set", "rounds=2", "--quiet"]) == 2
    assert f"plugins: {path} changed since" in capsys.readouterr().err
    assert main(["run", str(out / "config.json"), "--out", str(tmp_path / "again"), "--quiet"]) == 2
    assert "changed since" in capsys.readouterr().err


def test_errors_inside_a_plugin_name_its_file_and_line(tmp_path, capsys):
    bad_check = tmp_path / "badcheck.py"
    bad_check.write_text(
        textwrap.dedent("""
        from dataclasses import dataclass
        from fedfast.methods import FedAvg, opt, register

        @register("badcheck")
        class BadCheck(FedAvg):
            @dataclass
            class Options:
                lam: float = opt(0.5, "weight", check="[0,1[")
    """)
    )
    with pytest.raises(
        ValueError,
        match=rf"{bad_check}, line 9: opt\(check=...\): check '\[0,1\[': not a check; "
        r"use .*\[a,b\)",
    ):
        methods.load_plugin(str(bad_check))
    name_error = tmp_path / "nameerr.py"
    name_error.write_text(
        textwrap.dedent("""
        from fedfast.methods import FedAvg, register

        @register("nameerr")
        class NameErr(FedAvg):
            def loss(self, ctx, b):
                return undefined_thing(b)
    """)
    )
    code = main(
        [
            "run",
            "--plugin",
            str(name_error),
            *SETS[:-3],
            "--set",
            "algorithm=nameerr",
            "--set",
            "rounds=1",
            "--quiet",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"in plug-in {name_error}, line 7, in loss: NameError" in err and "Traceback" not in err
    methods.unregister("nameerr")
    import_error = tmp_path / "importerr.py"
    import_error.write_text("x = 1\ny = missing_name\n")
    with pytest.raises(ValueError, match=rf"{import_error}, line 2: NameError"):
        methods.load_plugin(str(import_error))


def test_unknown_algorithm_suggests_plugin_and_close_names(capsys):
    assert main(["run", "--set", "algorithm=fedadam", "--set", "dataset=synthetic", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'fedadam' is not a registered method" in err and "--plugin FILE.py" in err and "Did you mean" in err


def test_check_vocabulary_half_open_intervals():
    from fedfast.methods.options import parse_check

    ok, what = parse_check("[0,1)")
    assert ok(0) and ok(0.5) and not ok(1) and what == "in [0, 1)"
    ok, _ = parse_check("(0,inf)")
    assert ok(1e30) and not ok(0)
    with pytest.raises(ValueError, match="empty interval"):
        parse_check("[2,1]")


def test_round_metrics_are_checked(tmp_path):
    from sequential_loop import setup_data

    @methods.register("badmetric")
    class Bad(methods.FedAvg):
        def round_metrics(self, ctx):
            return {"v": torch.ones(3)}

    try:
        train, test, part, model = setup_data()
        sim = fedfast.Simulation(
            fedfast.SimConfig(algorithm="badmetric", clients_per_round=2), model, train, test, part
        )
        with pytest.raises(TypeError, match=r"badmetric.round_metrics \(.*, line \d+\): 'v' must be one number"):
            sim.round()
    finally:
        methods.unregister("badmetric")


def test_a_plugin_method_without_a_docstring_composes_with_asd():
    """ASD's composed class quotes its base's docstring: a plug-in class with none composed (it raised IndexError,
    breaking `fedfast sweep`'s grid check for every method once such a plug-in was loaded)."""

    class NoDoc(methods.FedAvg):
        pass

    NoDoc.__doc__ = None
    NoDoc.name = "nodoc_for_asd"
    composed = methods.asd.with_asd(NoDoc)
    assert composed.name == "nodoc_for_asd+asd" and "The KD term is ASD's" in composed.__doc__
