"""Each part of the engine is given the settings it reads (fedfast._settings), not the run's whole SimConfig."""

import ast
import dataclasses
import inspect
import pathlib
import typing

import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast._settings import Settings
from fedfast.local_step import OptimizerSettings
from fedfast.privacy import DPFedAvg, PrivacySettings
from fedfast.sim.evaluation import EvalSettings, Evaluator
from fedfast.sim.plan import PlanSettings, RoundPlan
from fedfast.sim.runtime import ModelRuntime, RuntimeSettings
from fedfast.sim.sizing import BudgetSettings, MemoryBudget
from fedfast.sim.stores import StateStores, StoreSettings
from fedfast.sim.trainer import ChunkTrainer, TrainerSettings

PARTS = {
    RoundPlan: PlanSettings,
    ModelRuntime: RuntimeSettings,
    MemoryBudget: BudgetSettings,
    StateStores: StoreSettings,
    Evaluator: EvalSettings,
    ChunkTrainer: TrainerSettings,
    DPFedAvg: PrivacySettings,
}
SIM = pathlib.Path(fedfast.__file__).parent / "sim"


def _all_settings():
    out, todo = [], list(Settings.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def test_every_settings_field_is_the_configs_of_the_same_name_and_type():
    config = typing.get_type_hints(fedfast.SimConfig)
    classes = _all_settings()
    assert set(PARTS.values()) | {OptimizerSettings} <= set(classes)
    for cls in classes:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls
        for name, t in typing.get_type_hints(cls).items():
            if isinstance(t, type) and issubclass(t, Settings):
                continue  # a group, made from the same config
            assert name in config, f"{cls.__name__}.{name} is no SimConfig field"
            assert t == config[name], f"{cls.__name__}.{name}: {t} against SimConfig's {config[name]}"


def test_of_reads_the_config_and_its_groups():
    cfg = fedfast.SimConfig(
        batch_size=7,
        momentum=0.5,
        client_optimizer="sgd",
        weight_decay=0.01,
        dp_clip=0.3,
        dp_noise_multiplier=0.0,
        max_grad_norm=3.0,
        profile=True,
        backend="torch",
    )
    s = TrainerSettings.of(cfg)
    assert (s.batch_size, s.dp_clip, s.profile, s.backend) == (7, 0.3, True, "torch")
    assert s.optimizer == OptimizerSettings.of(cfg)
    assert (s.optimizer.momentum, s.optimizer.weight_decay, s.optimizer.max_grad_norm) == (0.5, 0.01, 3.0)
    assert TrainerSettings.of(s) is s
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.batch_size = 8


def test_parts_take_their_settings_and_refuse_the_config_by_name():
    for part, settings in PARTS.items():
        assert list(inspect.signature(part.__init__).parameters)[1] == "settings", part
        assert typing.get_type_hints(part.__init__)["settings"] is settings, part
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(clients_per_round=4)
    with pytest.raises(TypeError, match=r"settings: expected a fedfast\.sim\.plan\.PlanSettings .*PlanSettings\.of"):
        RoundPlan(cfg, train, part, cfg.method(), device=torch.device("cpu"))
    with pytest.raises(TypeError, match="settings: expected a fedfast.sim.runtime.RuntimeSettings"):
        ModelRuntime(PlanSettings.of(cfg), model, train, torch.device("cpu"))


def test_no_part_in_sim_holds_the_whole_config():
    """Only the EngineView (the method's window, facade.py) hands on the SimConfig, and only the builder (build.py,
    Simulation.__init__'s construction order) reads it, to make each part's settings; every other module of sim/ and
    of the privacy package neither takes nor keeps a ``cfg`` / ``config``."""
    for path in sorted(SIM.glob("*.py")) + sorted((SIM.parent / "privacy").glob("*.py")):
        if path.name in ("facade.py", "build.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.arg):
                assert node.arg not in ("cfg", "config"), f"{path.name}: parameter {node.arg!r}"
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("cfg", "config"), f"{path.name}:{node.lineno}: .{node.attr}"
