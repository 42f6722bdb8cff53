"""fedfast.nn in other people's code, each in a fresh process started outside the checkout (so the process's first
fedfast call is the one under test and nothing of the checkout's working directory helps): torch.compile on the
first call (fullgraph, default mode with zero graph breaks, dynamic shapes, a whole model + loss + optimizer
step), torch.export, autocast and bf16/fp16 inputs, DistributedDataParallel over gloo (issue 36)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import json, sys, torch
    torch.manual_seed(0)
    R, C = 24, 10
    def data(r=R, dtype=torch.float32):
        g = torch.Generator().manual_seed(r)
        return (torch.randn(r, C, generator=g, dtype=dtype), torch.randn(r, C, generator=g, dtype=dtype),
                torch.randint(0, C, (r,), generator=g))
    def losses(fnn):
        prior = torch.rand(C) + 0.1
        return {"kd": (fnn.KDLoss(tau=3.0), ()), "ntd": (fnn.NTDLoss(tau=2.0), ()),
                "asd": (fnn.ASDLoss(), (prior / prior.sum(),)), "gkd": (fnn.GKDLoss(tau=2.0), ()),
                "cad": (fnn.CADLoss(), (torch.rand(C),)), "adc": (fnn.ADCLoss(), (torch.rand(C) + 0.1,))}
""")


def _child(tmp_path, body: str, timeout=600) -> dict:
    script = tmp_path / "child.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDFAST_BACKEND")}
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["kd", "ntd", "asd", "gkd", "cad", "adc"])
def test_compile_fullgraph_on_the_first_call(tmp_path, name):
    """The process's first fedfast op runs inside torch.compile(fullgraph=True) (this used to fail: the extension
    was imported in traced code); dynamic=True recompiles for nothing at a second batch size."""
    out = _child(
        tmp_path,
        f'''
        import fedfast.nn as fnn
        loss, extra = losses(fnn)["{name}"]
        res = {{}}
        for dyn in (None, True):
            torch._dynamo.reset()
            f = torch.compile(lambda a, b, c: loss(a, b, c, *extra), fullgraph=True, dynamic=dyn,
                              backend="aot_eager")
            for r in (R, 37):
                z, t, y = data(r)
                za, zb = z.clone().requires_grad_(), z.clone().requires_grad_()
                a, b = f(za, t, y), loss(zb, t, y, *extra)
                a.backward(); b.backward()
                res[f"{{dyn}}-{{r}}"] = [abs(float(a - b)), float((za.grad - zb.grad).abs().max())]
        print(json.dumps(res))
    ''',
    )
    for key, (dl, dg) in out.items():
        assert dl <= 1e-5 and dg <= 1e-6, (key, dl, dg)


def test_default_compile_has_no_graph_break(tmp_path):
    out = _child(
        tmp_path,
        """
        import fedfast.nn as fnn
        res = {}
        for name, (loss, extra) in losses(fnn).items():
            torch._dynamo.reset()
            z, t, y = data()
            ex = torch._dynamo.explain(lambda a, b, c: loss(a, b, c, *extra))(z.requires_grad_(), t, y)
            res[name] = [ex.graph_break_count, [str(r.reason)[:200] for r in ex.break_reasons]]
        print(json.dumps(res))
    """,
    )
    assert all(n == 0 for n, _ in out.values()), out


def test_compiled_model_loss_and_optimizer_step_equal_eager(tmp_path):
    """A model + NTD loss compiled with inductor (the default backend) and a compiled SGD step, three steps, against
    the same in eager mode."""
    out = _child(
        tmp_path,
        """
        import copy
        import fedfast.nn as fnn
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, C))
        twin = copy.deepcopy(model)
        loss = fnn.NTDLoss(tau=2.0, beta=1.0)
        opt, opt2 = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
        fwd = torch.compile(lambda x, t, y: loss(model(x), t, y))
        step = torch.compile(opt.step)
        diffs = []
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            x, t = torch.randn(R, 16, generator=g), torch.randn(R, C, generator=g)
            y = torch.randint(0, C, (R,), generator=g)
            opt.zero_grad(); a = fwd(x, t, y); a.backward(); step()
            opt2.zero_grad(); b = loss(twin(x), t, y); b.backward(); opt2.step()
            diffs.append(abs(float(a - b)))
        w = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), twin.parameters()))
        print(json.dumps({"loss": max(diffs), "weights": w}))
    """,
    )
    assert out["loss"] <= 1e-5 and out["weights"] <= 1e-5, out


def test_torch_export(tmp_path):
    out = _child(
        tmp_path,
        """
        import fedfast.nn as fnn
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin, self.loss = torch.nn.Linear(16, C), fnn.KDLoss(tau=2.0)
            def forward(self, x, t, y):
                return self.loss(self.lin(x), t, y)
        net = Net()
        x, t, y = torch.randn(R, 16), torch.randn(R, C), torch.randint(0, C, (R,))
        ep = torch.export.export(net, (x, t, y))
        x2, t2 = torch.randn(R, 16), torch.randn(R, C)
        print(json.dumps({"diff": abs(float(ep.module()(x2, t2, y) - net(x2, t2, y)))}))
    """,
    )
    assert out["diff"] <= 1e-6, out


def test_autocast_and_half_inputs(tmp_path):
    """Logits from a model under CPU autocast (bf16) and bf16/fp16 inputs: the loss (fp32) and the gradient (in the
    student's dtype) within half-precision rounding of the float64 formula on the same values."""
    out = _child(
        tmp_path,
        """
        import fedfast.nn as fnn
        from fedfast.ops.distill_reference import distill_reference
        res = {}
        lin = torch.nn.Linear(16, C)
        x, t, y = torch.randn(R, 16), torch.randn(R, C), torch.randint(0, C, (R,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = lin(x)
            l = fnn.KDLoss(tau=2.0)(z, t, y)
        res["autocast_dtypes"] = [str(z.dtype), str(l.dtype)]
        ref = distill_reference(z.detach().double(), t.double(), y, tau=2.0, kd_weight=4.0).mean()
        res["autocast_loss"] = abs(float(l.double() - ref)) / abs(float(ref))
        l.backward(); res["autocast_grad_finite"] = bool(torch.isfinite(lin.weight.grad).all())
        for dt in (torch.bfloat16, torch.float16):
            z = torch.randn(R, C).to(dt).requires_grad_()
            l = fnn.NTDLoss(tau=2.0)(z, t.to(dt), y); l.backward()
            zz = z.detach().double().requires_grad_()
            ref = distill_reference(zz, t.to(dt).double(), y, tau=2.0, kd_weight=4.0, not_true=True).mean()
            ref.backward()
            res[str(dt)] = [abs(float(l.double() - ref)) / abs(float(ref)),
                            float((z.grad.double() - zz.grad).norm() / zz.grad.norm()), str(z.grad.dtype)]
        print(json.dumps(res))
    """,
    )
    assert out["autocast_dtypes"] == ["torch.bfloat16", "torch.float32"] and out["autocast_grad_finite"], out
    assert out["autocast_loss"] <= 1e-5, out
    for dt in ("torch.bfloat16", "torch.float16"):
        lrel, grel, gdt = out[dt]
        assert lrel <= 1e-5 and grel <= (1e-2 if dt == "torch.bfloat16" else 2e-3) and gdt == dt, (dt, out[dt])


def test_ddp_gloo_two_processes(tmp_path):
    """DistributedDataParallel (gloo, 2 processes) around a model trained with a fedfast loss: the averaged
    gradient equals the single-process gradient of the whole batch."""
    out = _child(
        tmp_path,
        """
        import os, copy, tempfile
        import torch.distributed as dist
        import torch.multiprocessing as mp
        import fedfast.nn as fnn

        def work(rank, world, init, x, t, y, model, q):
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
            ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
            sl = slice(rank * R // world, (rank + 1) * R // world)
            fnn.KDLoss(tau=2.0)(ddp(x[sl]), t[sl], y[sl]).backward()
            if rank == 0:
                q.put([p.grad.tolist() for p in ddp.parameters()])
            dist.barrier(); dist.destroy_process_group()

        if __name__ == "__main__":
            model = torch.nn.Linear(16, C)
            x, t, y = torch.randn(R, 16), torch.randn(R, C), torch.randint(0, C, (R,))
            init = "file://" + os.path.join(tempfile.mkdtemp(), "rdv")
            ctx = mp.get_context("spawn"); q = ctx.Queue()
            mp.spawn(work, args=(2, init, x, t, y, model, q), nprocs=2, join=False)
            got = [torch.tensor(g) for g in q.get(timeout=300)]
            # each half's mean loss, averaged by DDP = the batch mean (equal halves)
            fnn.KDLoss(tau=2.0)(model(x), t, y).backward()
            print(json.dumps({"diff": max(float((a - p.grad).abs().max()) for a, p in zip(got, model.parameters()))}))
    """,
    )
    assert out["diff"] <= 1e-6, out
