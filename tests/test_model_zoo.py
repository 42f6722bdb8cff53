"""torchvision's classification models on the batched executor (issue 60): ResNet-18/34/50, VGG-11-BN, MobileNetV2
(ReLU6, depthwise convolutions, the functional ``F.adaptive_avg_pool2d``), MobileNetV3-small (Hardswish, squeeze-
excitation gates with Hardsigmoid) and EfficientNet-B0 (SiLU, Sigmoid gates, stochastic depth), built from
torchvision's own layout (``torchvision_layouts``; torchvision does not import on the CPU build of torch), each run
by the engine's traced program (no vmap fallback) and compared with the literal per-client loop over whole runs
(every parameter and running statistic against a float64 loop, within a few times the fp32 loop's own distance).
Stochastic depth's draws are checked by what they must be (each client's sample kept and scaled, or dropped). A
layer or function without a batched form runs per client inside the program (tests/test_torchvision_builders.py,
which also runs torchvision's own builders)."""

import copy
import warnings

import numpy as np
import pytest
import torch
import torchvision_layouts as tv
from torch import nn

import fedfast
from fedfast import batched, data

SIZES = [40, 36, 44, 30]  # batch 16: partial last batches of 8, 4, 12 and 14 rows

SMALL = {  # the layouts at test size (every block kind present; dropout and stochastic depth off for the loop)
    "resnet18": dict(width=8),
    "resnet34": dict(width=4),
    "resnet50": dict(width=4),
    "vgg11_bn": dict(width_mult=0.125, hidden=32, pool=2, dropout=0.0),
    "mobilenet_v2": dict(width_mult=0.25, dropout=0.0, max_blocks=8),
    "mobilenet_v3_small": dict(width_mult=0.25, dropout=0.0, max_blocks=6),
    "efficientnet_b0": dict(width_mult=0.25, dropout=0.0, stochastic_depth_prob=0.0, max_layers=2),
}


def _run(name, seed=0, **cfg_kw):
    train, test = data.synthetic(5, sum(SIZES), 40, (3, 32, 32), separation=0.8, seed=seed)
    perm = np.random.default_rng(seed).permutation(sum(SIZES))
    part = data.Partition(np.split(perm, np.cumsum(SIZES)[:-1]))
    torch.manual_seed(seed)
    model = tv.ZOO[name](num_classes=5, **SMALL[name])
    kw = dict(
        algorithm="fedavg",
        clients_per_round=3,
        rounds=2,
        local_epochs=1,
        batch_size=16,
        lr=0.02,
        momentum=0.5,
        seed=seed,
    )
    kw.update(cfg_kw)
    return fedfast.SimConfig(**kw), model, train, test, part


def _module_step(model, params, buffers, x, y, valid):
    """The literal loop's step for one client (float64): its module with ``params`` / ``buffers`` in training mode
    on its valid rows; returns (logits, {name: grad}, buffers after)."""
    m = copy.deepcopy(model).double().train()
    m.load_state_dict({**params, **buffers})
    out = m(x[valid])
    torch.nn.functional.cross_entropy(out, y[valid], reduction="sum").backward()
    return out.detach(), {k: p.grad for k, p in m.named_parameters()}, dict(m.named_buffers())


@pytest.mark.parametrize("name", list(SMALL))
def test_the_model_runs_on_the_traced_program_and_equals_the_literal_loops_step(name):
    """The engine builds the traced program for the model (no vmap fallback warning), and that program, run in
    float64 for 3 clients with their own weights and BatchNorm statistics and a partial last minibatch (padding rows
    masked), equals each client's own module run on its valid rows: logits, every parameter's gradient and every
    updated running statistic to 1e-9 (relative to the tensor's kind: a BatchNorm bias before another BatchNorm has
    a gradient of zero, up to rounding), counts equal. In float64 no rounding flips a ReLU6 or a max-pool, so every
    op's formula is held exactly (whole fp32 runs of these small models at batch 16 part from the float64 loop by
    O(1) for the fp32 loop itself: BatchNorm over 1x1 maps of a few rows)."""
    cfg, model, train, test, part = _run(name, rounds=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the vmap fallback warns
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    prog = sim.runtime.plan
    assert isinstance(prog, batched.Plan), name
    n, B = 3, 12
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, B, 3, 32, 32, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (n, B), generator=gen)
    valid = torch.ones(n, B, dtype=torch.bool)
    valid[1, 9:] = False  # a partial minibatch: its padding rows stay out of the statistics
    valid[2, 7:] = False
    params = {
        k: torch.stack([v.detach().double() * (1 + 0.05 * torch.randn(v.shape, generator=gen)) for _ in range(n)])
        for k, v in model.named_parameters()
    }
    buffers = {}
    for k, v in model.named_buffers():
        if k.endswith("running_var"):
            buffers[k] = torch.stack([v.double() + 0.5 * torch.rand(v.shape, generator=gen) for _ in range(n)])
        elif k.endswith("running_mean"):
            buffers[k] = torch.stack([v.double() + 0.1 * torch.randn(v.shape, generator=gen) for _ in range(n)])
        else:
            buffers[k] = torch.stack([v + 3 * i for i in range(n)])
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    run = {k: v.clone() for k, v in buffers.items()}
    out = prog.forward(leaves, x, True, buffers=run, valid=valid, update=True)
    loss = torch.nn.functional.cross_entropy(out[valid], y[valid], reduction="sum")
    loss.backward()
    for k in range(n):
        want_out, want_g, want_b = _module_step(
            model,
            {q: v[k] for q, v in params.items()},
            {q: v[k] for q, v in buffers.items()},
            x[k],
            y[k],
            valid[k],
        )
        torch.testing.assert_close(out[k][valid[k]].detach(), want_out, rtol=1e-9, atol=1e-9 * want_out.abs().max())
        gscale = max(float(g.abs().max()) for g in want_g.values())
        for q, g in want_g.items():
            err = float((leaves[q].grad[k] - g).abs().max()) / max(float(g.abs().max()), 1e-6 * gscale)
            assert err <= 1e-9, (name, q, k, err)
        for q, b in want_b.items():
            if not b.is_floating_point():
                assert torch.equal(run[q][k], b), (q, k)
                continue
            err = float((run[q][k] - b).abs().max()) / max(float(b.abs().max()), 1e-12)
            assert err <= 1e-9, (name, q, k, err)


class _Gated(nn.Module):
    """A residual block with torchvision's StochasticDepth on the branch (MBConv's form)."""

    def __init__(self, p, mode):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.sd = tv.StochasticDepth(p, mode)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        r = self.sd(self.conv(x))
        r += x
        return self.fc(torch.flatten(r, 1))


@pytest.mark.parametrize("mode", ["row", "batch"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_stochastic_depth_keeps_or_drops_each_clients_sample(mode, channels_last):
    """In training, client k's sample b ("row"; "batch": its whole minibatch) gets the branch scaled by 1 / (1 - p)
    or none of it, the same draw over its channels and pixels; about 1 - p kept; the identity in eval mode; the
    gradient flows through the kept rows only. Checked on the branch's output itself (a hook on the program's
    values would re-derive the code's formula)."""
    torch.manual_seed(0)
    p, n, B = 0.4, 3, 200
    model = _Gated(p, mode)
    prog, why = batched.plan(model)
    assert prog is not None, why
    prog.channels_last = channels_last
    x = torch.randn(n, B, 2, 4, 4)
    pv = {
        k: torch.stack([v.detach() + 0.1 * k2 for k2 in range(n)]).requires_grad_() for k, v in model.named_parameters()
    }
    out = prog.forward(pv, x, True)
    # the branch each client computed, per sample: conv with its own weights
    conv = torch.stack(
        [
            torch.nn.functional.conv2d(x[k], pv["conv.weight"][k], pv["conv.bias"][k], padding=1).detach()
            for k in range(n)
        ]
    )
    r_keep = x + conv / (1 - p)
    kept = torch.zeros(n, B, dtype=torch.bool)
    for k in range(n):
        fc = lambda r: r.flatten(1) @ pv["fc.weight"][k].detach().T + pv["fc.bias"][k].detach()  # noqa: E731
        o_keep, o_drop = fc(r_keep[k]), fc(x[k])
        is_keep = (out[k].detach() - o_keep).abs().amax(1) <= 1e-5
        is_drop = (out[k].detach() - o_drop).abs().amax(1) <= 1e-5
        assert bool((is_keep ^ is_drop).all()), (k, int((~(is_keep | is_drop)).sum()))
        kept[k] = is_keep
    if mode == "batch":
        assert bool((kept.all(1) | (~kept).all(1)).all())
    else:
        frac = float(kept.float().mean())
        assert abs(frac - (1 - p)) < 0.07, frac  # 600 draws: 5 standard deviations
    out.sum().backward()
    g = pv["conv.bias"].grad
    for k in range(n):
        if not bool(kept[k].any()):
            assert float(g[k].abs().max()) == 0.0
    ev = prog.forward({k: v.detach() for k, v in pv.items()}, x, False)
    want = torch.stack(
        [
            torch.nn.functional.linear(
                (x[k] + conv[k]).flatten(1), pv["fc.weight"][k].detach(), pv["fc.bias"][k].detach()
            )
            for k in range(n)
        ]
    )
    torch.testing.assert_close(ev, want, rtol=1e-5, atol=1e-5)


def test_efficientnet_with_stochastic_depth_and_dropout_trains_on_the_program():
    """EfficientNet-B0's layout with its stochastic depth (0.2) and dropout on: the engine stays on the traced
    program (the probe runs in eval mode, where both are the identity) and a round runs and lowers nothing to NaN."""
    cfg, _, train, test, part = _run("efficientnet_b0", rounds=1)
    torch.manual_seed(0)
    model = tv.efficientnet_b0(num_classes=5, width_mult=0.25, max_layers=2)
    sim = fedfast.Simulation(cfg, model, train, test, part)
    assert isinstance(sim.runtime.plan, batched.Plan)
    rec = sim.round()
    assert np.isfinite(rec["train_loss"])


def test_stochastic_depth_on_the_vmap_path_is_refused_by_name():
    """torch.func.vmap cannot give each client its own in-place draw (torchvision's stochastic depth): the first
    training step raised vmap's RuntimeError from deep inside the round; it is a ValueError naming the layer kind
    and the executor that runs it."""
    cfg, _, train, test, part = _run("efficientnet_b0", rounds=1, executor="vmap")
    torch.manual_seed(0)
    model = tv.efficientnet_b0(num_classes=5, width_mult=0.25, max_layers=2)
    sim = fedfast.Simulation(cfg, model, train, test, part)
    with pytest.raises(ValueError, match="StochasticDepth.*executor = 'auto'"):
        sim.round()
