"""Issue 61: one door per fused op. Each op's argument record is the Python twin of its ``FEDFAST_<OP>`` signature in
csrc/op_signatures.h (the same parameters, in the same order, without the C++ ``_in`` / ``_opt`` suffixes), each op
has one backend table (every backend, the reference included), and its entry point holds no backend if-chain."""

import ast
import dataclasses
import importlib
import inspect
import os
import re

import pytest
import torch

from fedfast.ops import _backend
from fedfast.ops._door import Backends, OpArgs

# the op modules (fedfast.ops.<op> names the op's function: the package exports it under the module's name)
client_step, client_adam, aggregate, update_norms, distill, teacher_mixture, asd_weights = (
    importlib.import_module(f"fedfast.ops.{m}")
    for m in ("client_step", "client_adam", "aggregate", "update_norms", "distill", "teacher_mixture", "asd_weights")
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "csrc", "op_signatures.h")

DOORS = [  # (record, table, entry point)
    (client_step.ClientStepArgs, client_step.CLIENT_STEP, client_step.client_step),
    (client_adam.ClientAdamArgs, client_adam.CLIENT_ADAM, client_adam.client_adam),
    (aggregate.AggregateArgs, aggregate.AGGREGATE, aggregate.aggregate),
    (update_norms.UpdateNormsArgs, update_norms.UPDATE_NORMS, update_norms.update_norms),
    (distill.DistillRowsArgs, distill.DISTILL_ROWS, distill._backend_rows),
    (teacher_mixture.TeacherMixtureArgs, teacher_mixture.TEACHER_MIXTURE, teacher_mixture._mixture_rows),
    (asd_weights.AsdWeightsArgs, asd_weights.ASD_WEIGHTS, asd_weights._asd_weights_rows),
    (distill.ScaleRowsArgs, distill.SCALE_ROWS, distill.scale_rows),
    (distill.RowScaleArgs, distill.ROW_SCALE, distill.device_row_scale),
]


def signatures(text: str) -> dict:
    """``{macro: [parameter names]}`` of the header's ``#define FEDFAST_<OP>(name) ... name(<parameters>)``, the
    C++ suffixes ``_in`` / ``_opt`` dropped."""
    text = text.replace("\\\n", " ")
    out = {}
    for m in re.finditer(r"#define\s+(FEDFAST_\w+)\(name\)(.*)", text):
        body = m.group(2)
        start = body.index(" name(") + len(" name(")
        depth, end = 1, start
        while depth:
            depth += {"(": 1, ")": -1}.get(body[end], 0)
            end += 1
        params, depth, cur = [], 0, ""
        for ch in body[start : end - 1]:
            depth += {"<": 1, ">": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                params.append(cur)
                cur = ""
            else:
                cur += ch
        params.append(cur)
        names = [re.findall(r"\w+", p)[-1] for p in params]
        out[m.group(1)] = [re.sub(r"_(in|opt)$", "", n) for n in names]
    return out


def test_each_record_is_its_signatures_twin():
    sigs = signatures(open(HEADER, encoding="utf-8").read())
    assert len(sigs) >= 10, sorted(sigs)
    for record, _, _ in DOORS:
        assert issubclass(record, OpArgs) and record.SIGNATURE in sigs, record
        assert [f.name for f in dataclasses.fields(record)] == sigs[record.SIGNATURE], record.__name__


def test_the_signature_reader_sees_an_order_change():
    probe = (
        "#define FEDFAST_PROBE(name)   \\\n  std::tuple<at::Tensor, at::Tensor> name(const at::Tensor& X_in, \\\n"
        "     const c10::optional<at::Tensor>& rows_opt, double beta, const std::vector<at::Tensor>& grad_in)\n"
    )
    assert signatures(probe) == {"FEDFAST_PROBE": ["X", "rows", "beta", "grad"]}

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Swapped(OpArgs):
        SIGNATURE = "FEDFAST_PROBE"
        rows: object
        X: object
        beta: float
        grad: object

    assert [f.name for f in dataclasses.fields(Swapped)] != signatures(probe)["FEDFAST_PROBE"]


def test_each_table_has_every_backend_and_refuses_another_by_name():
    for _, table, _ in DOORS:
        assert isinstance(table, Backends) and set(table.impls) == set(_backend.BACKENDS), table
    with pytest.raises(ValueError, match=r"backend: client_step has no 'tpu' backend"):
        client_step.CLIENT_STEP("tpu", None)
    with pytest.raises(ValueError, match="the reference included"):
        Backends("probe", cpu=print)


def _backend_branches(fn) -> list:
    """Comparisons of anything with a backend's name inside ``fn`` (an if-chain over backends)."""
    tree = ast.parse(inspect.getsource(fn).lstrip())
    names = set(_backend.BACKENDS)
    return [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare)
        and any(isinstance(c, ast.Constant) and c.value in names for c in [n.left, *n.comparators])
    ]


def test_the_entry_points_are_validation_and_one_table_call():
    for _, table, entry in DOORS:
        assert _backend_branches(entry) == [], entry.__name__
        src = inspect.getsource(entry)
        assert src.count(table_name(table, entry)) == 1, entry.__name__

    def chain(be):
        if be == "cpu":
            return 1
        return 2

    assert _backend_branches(chain) == ["be == 'cpu'"]


def table_name(table, entry) -> str:
    return next(k for k, v in vars(inspect.getmodule(entry)).items() if v is table)


def test_the_record_reaches_every_backend_in_the_signatures_order(monkeypatch):
    """What a compiled backend receives is the record's fields in order: a client step through a stand-in CPU
    extension sees theta first, the gradient as a list, the scalars converted, and the norms' output last."""
    got = {}

    class Ext:
        def client_step(self, *args):
            got["args"] = args

    monkeypatch.setattr(_backend, "cpu_ext", lambda: Ext())
    theta, g = torch.zeros(2, 3), torch.ones(2, 3)
    norms = torch.zeros(2)
    client_step.CLIENT_STEP(
        "cpu",
        client_step.ClientStepArgs(
            theta=theta,
            grad=g,
            lr=torch.ones(1),
            momentum=0.5,
            buf=None,
            wd=torch.zeros(1),
            prox_mu=0.0,
            anchor=None,
            loss_rows=None,
            corr_vec=None,
            corr_vec_scale=None,
            corr_rows=None,
            corr_rows_coef=1.0,
            step_vec=None,
            step_vec_scale=None,
            max_norm=0.0,
            active=None,
            delta_from=torch.zeros(3),
            delta_norm=norms,
        ),
    )
    a = got["args"]
    assert len(a) == 19 and a[0] is theta and isinstance(a[1], list) and a[1][0] is g and a[3] == 0.5
    assert a[-1] is norms


def test_the_row_scale_reference_is_the_cpu_pass():
    """ROW_SCALE's reference (PyTorch) gives what the C++ pass gives: the weights of each mode and the flags (bit 0
    a target, bit 1 the segments), on valid and invalid rows; with a status tensor the flags go there."""
    if not _backend.available("cpu", "cpu"):
        pytest.skip("the C++ extension is not built")
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (40,), generator=g)
    y[3] = -100
    seg = torch.sort(torch.randint(0, 6, (40,), generator=g)).values
    cases = [(y, None), (y, seg), (torch.where(y == 2, 7, y), seg), (y, seg.flip(0)), (y, seg + 4)]
    for target, segments in cases:
        for mode in (0, 1, 2):
            a = distill.row_scale_args(target, segments, 5, -100, mode, 8, None)
            want, got = distill.ROW_SCALE("cpu", a), distill.ROW_SCALE("reference", a)
            assert got[1] == want[1], (mode, got[1], want[1])
            if want[0] is None or want[1]:
                assert got[0] is None or want[1], mode
                continue
            assert torch.allclose(got[0], want[0], rtol=0, atol=0), mode
    st = torch.zeros(7, dtype=torch.int32)
    distill.ROW_SCALE("reference", distill.row_scale_args(torch.where(y == 2, 7, y), seg.flip(0), 5, -100, 1, 8, st))
    assert st[:2].tolist() == [1, 1]
