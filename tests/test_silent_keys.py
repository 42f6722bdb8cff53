"""What used to be silently dropped or truncated is refused by name (issue 46): fractional float labels; a study
grid key of a method the study does not run, or of no method at all; ``--set algorithm`` / ``--set seed`` on a
sweep; a run config's algorithm outside ``--methods``."""

import numpy as np
import pytest
import torch
from test_study_files import cli as study_cli

from fedfast import data

STUDY = """
[preset]
paper = "own"
table = "T1"
metric = "final"
seeds = [0]
methods = {methods}

[protocol]
dataset = "synthetic"
num_clients = 6
partition = "iid"
clients_per_round = 2
rounds = 1
model = "mlp"

[grid]
"{key}" = [0.01, 0.1]
"""


def cli(capsys, *argv):
    code, out, err = study_cli(capsys, *argv)
    return code, out + err


def test_fractional_labels_are_refused_and_whole_float_labels_read():
    """Labels 0.5, 1.5 were truncated to the classes 0 and 1 (a run bit-identical to integer labels); now a
    ValueError naming y, the sample and its value. Floats holding whole numbers (a CSV read as floats) are class
    ids as before; the partitioners and Partition's labels take the same rule."""
    x = torch.randn(6, 3)
    with pytest.raises(ValueError, match=r"y: class ids must be whole numbers, but sample 1 has the label 1\.5"):
        data.ArrayDataset(x, torch.tensor([0.0, 1.5, 2.0, 1.0, 0.0, 2.0]), 3)
    with pytest.raises(ValueError, match="y: class ids must be whole numbers.*nan"):
        data.ArrayDataset(x, torch.tensor([0.0, float("nan"), 2.0, 1.0, 0.0, 2.0]), 3)
    ok = data.ArrayDataset(x, torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0, 2.0]), 3)
    assert ok.y.dtype == torch.int64 and ok.y.tolist() == [0, 1, 2, 1, 0, 2]
    with pytest.raises(ValueError, match="labels: class ids must be whole numbers"):
        data.dirichlet_lda(np.array([0.5, 1.5, 0.0, 1.0] * 5), 2, alpha=1.0, seed=0)
    with pytest.raises(ValueError, match="labels: class ids must be whole numbers"):
        data.Partition([np.arange(3), np.arange(3, 6)], labels=np.array([0.0, 1.0, 0.25, 1.0, 0.0, 1.0]))


@pytest.mark.parametrize(
    "methods,key,msg",
    [
        ('["fedavg"]', "fedprox.mu", "none of the study's methods (fedavg) reads the table 'fedprox'"),
        ('["fedavg", "fedprox"]', "fedprx.mu", "no method reads an option table 'fedprx' (misspelled?"),
    ],
)
def test_a_grid_over_nothing_the_study_runs_is_refused(methods, key, msg, tmp_path, capsys):
    """A study file's grid key that varies none of its methods, or names no method's table, was dropped without a
    word and the report showed the plain runs as the grid; now the sweep stops before any run, naming the file and
    the key."""
    f = tmp_path / "study.toml"
    f.write_text(STUDY.format(methods=methods, key=key))
    code, out = cli(capsys, "sweep", f, "--out", tmp_path / "s", "--quiet")
    assert code == 2 and f"{f}: [grid] {key}: {msg}" in out, out
    assert not (tmp_path / "s" / "fedavg").exists()


def test_a_grid_the_chosen_methods_do_not_read_is_named(tmp_path, capsys):
    """--methods choosing a study's rows that its grid does not vary: the sweep runs them and says the grid key is
    not swept (the study itself is right: its fedprox row reads the key)."""
    f = tmp_path / "study.toml"
    f.write_text(STUDY.format(methods='["fedavg", "fedprox"]', key="fedprox.mu"))
    code, out = cli(capsys, "sweep", f, "--methods", "fedavg", "--out", tmp_path / "s")
    assert code == 0, out
    assert f"grid: fedprox.mu of {f} vary no method of --methods fedavg: not swept" in out, out
    assert (tmp_path / "s" / "fedavg" / "seed0" / "summary.json").exists()


@pytest.mark.parametrize(
    "setting,named", [("algorithm=scaffold", "use --methods scaffold"), ("seed=3", "use --seeds 3")]
)
def test_sweep_refuses_set_algorithm_and_seed(setting, named, tmp_path, capsys):
    """`fedfast sweep --preset P --set algorithm=scaffold` ran the study's own rows and ignored the key; a sweep's
    methods and seeds are --methods and --seeds, and the refusal says so."""
    code, out = cli(
        capsys, "sweep", "--preset", "demo/mnist-shards", "--set", setting, "--out", tmp_path / "s", "--quiet"
    )
    assert code == 2 and f"--set {setting.split('=')[0]}: a sweep runs the" in out and named in out, out
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_a_config_files_algorithm_is_the_sweeps_method_or_refused(tmp_path, capsys):
    """A run config swept: its algorithm (and seed) are the sweep's defaults; an algorithm outside --methods is
    refused rather than silently replaced."""
    f = tmp_path / "run.toml"
    f.write_text(
        'algorithm = "fedprox"\nseed = 2\ndataset = "synthetic"\nnum_clients = 6\npartition = "iid"\n'
        'clients_per_round = 2\nrounds = 1\nmodel = "mlp"\n'
    )
    code, out = cli(capsys, "sweep", f, "--out", tmp_path / "s", "--quiet")
    assert code == 0, out
    assert (tmp_path / "s" / "fedprox" / "seed2" / "summary.json").exists()
    code, out = cli(capsys, "sweep", f, "--methods", "fedavg", "--out", tmp_path / "t", "--quiet")
    assert code == 2 and "algorithm = 'fedprox' is not among --methods fedavg" in out, out
