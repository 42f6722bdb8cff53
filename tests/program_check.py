"""One training step of the batched program against each client's own module (the literal loop's step): 3 clients
with their own weights and BatchNorm statistics, a partial last minibatch (padding rows masked)."""

import copy

import torch
import torch.nn.functional as F


def client_params(model, n: int, gen, dtype=torch.float64) -> tuple[dict, dict]:
    """``({name: [n, *shape]}, {name: [n, *shape]})``: each client's parameters (the model's, perturbed, and a little
    noise where the model's are zero, as a zero-initialised head) and buffers (running statistics moved)."""
    params = {
        k: torch.stack(
            [
                v.detach().to(dtype) * (1 + 0.05 * torch.randn(v.shape, generator=gen, dtype=dtype))
                + 0.02 * torch.randn(v.shape, generator=gen, dtype=dtype)
                for _ in range(n)
            ]
        )
        for k, v in model.named_parameters()
    }
    buffers = {}
    for k, v in model.named_buffers():
        if k.endswith("running_var"):
            buffers[k] = torch.stack(
                [v.to(dtype) + 0.5 * torch.rand(v.shape, generator=gen, dtype=dtype) for _ in range(n)]
            )
        elif k.endswith("running_mean"):
            buffers[k] = torch.stack(
                [v.to(dtype) + 0.1 * torch.randn(v.shape, generator=gen, dtype=dtype) for _ in range(n)]
            )
        elif v.is_floating_point():
            buffers[k] = torch.stack([v.to(dtype)] * n)
        elif k.endswith("num_batches_tracked"):
            buffers[k] = torch.stack([v + 3 * i for i in range(n)])
        else:  # an index table (Swin's, MaxViT's relative positions): the same for every client
            buffers[k] = torch.stack([v] * n)
    return params, buffers


def module_step(model, params: dict, buffers: dict, x, y, valid, dtype):
    """The literal loop's step for one client: its module with ``params`` / ``buffers`` in training mode on its
    valid rows; returns (logits, {name: grad}, buffers after)."""
    m = copy.deepcopy(model).to(dtype).train()
    state = m.state_dict()  # keeps _metadata: MNASNet's load hook reads its version there
    state.update({**params, **buffers})
    m.load_state_dict(state)
    out = m(x[valid])
    F.cross_entropy(out, y[valid], reduction="sum").backward()
    return out.detach(), {k: p.grad for k, p in m.named_parameters()}, dict(m.named_buffers())


def program_step(prog, model, x, y, valid, params, buffers, dtype):
    """The program's step for every client: (logits [n, B, C], {name: grad [n, ...]}, buffers after)."""
    leaves = {k: v.to(dtype).clone().requires_grad_() for k, v in params.items()}
    run = {k: v.to(dtype).clone() if v.is_floating_point() else v.clone() for k, v in buffers.items()}
    out = prog.forward(leaves, x.to(dtype), True, buffers=run, valid=valid, update=True)
    F.cross_entropy(out[valid], y[valid], reduction="sum").backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}, run


def _rel(a, b, scale) -> float:
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), scale)


def step_errors(prog, model, side: int, *, n: int = 3, B: int = 12, seed: int = 1, dtype=torch.float64) -> dict:
    """The program's step in ``dtype`` against each client's module in float64 and in ``dtype``: ``{"program":
    worst relative error, "loop": the dtype module's own worst relative error}`` over the logits, every gradient
    (relative to the largest gradient of the model where a tensor's own is ~0: a bias before a BatchNorm) and every
    updated floating-point running statistic. Integer buffers must be equal (AssertionError otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, B, 3, side, side, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (n, B), generator=gen)
    valid = torch.ones(n, B, dtype=torch.bool)
    valid[1, B - 3 :] = False
    valid[2, B - 5 :] = False
    params, buffers = client_params(model, n, gen)
    out, grads, run = program_step(prog, model, x, y, valid, params, buffers, dtype)
    worst = {"program": 0.0, "loop": 0.0}
    for k in range(n):
        mine = ({q: v[k] for q, v in params.items()}, {q: v[k] for q, v in buffers.items()})
        want = module_step(model, *mine, x[k], y[k], valid[k], torch.float64)
        own = (
            want
            if dtype == torch.float64
            else module_step(
                model,
                {q: v.to(dtype) for q, v in mine[0].items()},
                {q: v.to(dtype) if v.is_floating_point() else v for q, v in mine[1].items()},
                x[k].to(dtype),
                y[k],
                valid[k],
                dtype,
            )
        )
        gscale = 1e-6 * max(float(g.abs().max()) for g in want[1].values())
        for key, got in (
            ("program", (out[k][valid[k]], {q: g[k] for q, g in grads.items()}, {q: b[k] for q, b in run.items()})),
            ("loop", own),
        ):
            errs = [_rel(got[0], want[0], 1e-12)]
            errs += [_rel(got[1][q], g, gscale) for q, g in want[1].items()]
            for q, b in want[2].items():
                if b.is_floating_point():
                    errs.append(_rel(got[2][q], b, 1e-12))
                else:
                    assert torch.equal(got[2][q].to(b.dtype), b), (q, k)
            worst[key] = max(worst[key], *errs)
    return worst
