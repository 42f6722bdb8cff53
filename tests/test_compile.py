"""torch.compile: the ops are torch.library custom ops with fake impls, so fullgraph compiles (no graph break)."""

import pytest
import torch
from conftest import cpu_backends
from helpers import rel_err

from fedfast import nn as ffnn


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
def test_fullgraph_compile_no_graph_break(backend):
    torch._dynamo.reset()
    R, C = 8, 10
    z = torch.randn(R, C)
    t = torch.randn(R, C)
    y = torch.randint(0, C, (R,))
    seg = torch.tensor([0] * 3 + [1] * 5)
    prior = torch.full((C,), 0.1)
    ntd = ffnn.NTDLoss(tau=2.0, backend=backend, validate="off")
    asd = ffnn.ASDLoss(backend=backend, validate="off")

    def step(zz):
        return ntd(zz, t, y, segments=seg) + asd(zz, t, y, prior, segments=seg)

    comp = torch.compile(step, fullgraph=True, backend="aot_eager")
    z1 = z.clone().requires_grad_(True)
    z2 = z.clone().requires_grad_(True)
    a = comp(z1)
    b = step(z2)
    a.backward()
    b.backward()
    assert rel_err(a.detach(), b.detach()) <= 1e-6 and rel_err(z1.grad, z2.grad) <= 1e-6


def test_opcheck_distill_rows():
    """torch.library.opcheck: schema, fake impl and autograd registration are consistent."""
    from fedfast.ops.distill import distill_rows_op

    R, C = 5, 4
    z = torch.randn(R, C, requires_grad=True)
    t = torch.randn(R, C)
    y = torch.randint(0, C, (R,))
    torch.library.opcheck(
        distill_rows_op,
        (z, t, y, None, None, None, None, None, torch.rand(R), 2.0, 1.0, 1.0, -100, True, False, "reference"),
    )
