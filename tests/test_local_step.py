"""fedfast.local_step alone: the client optimisers against torch.optim per client (fresh at every reset, the
inactive rows untouched), SAM's gradient against its formula, and the rows each keeps (issue 37)."""

import pytest
import torch
from torch import nn

import fedfast
from fedfast.flat import ClientStack
from fedfast.local_step import (
    OPTIMIZERS,
    SAM_EPS,
    SGD,
    Adam,
    OptimizerSettings,
    PlainGradient,
    SAMGradient,
    client_optimizer,
)


def _grads(n, P, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, P, generator=g) for _ in range(steps)]


@pytest.mark.parametrize(
    "opt,kw",
    [
        ("sgd", dict(momentum=0.9, weight_decay=0.01)),
        ("adam", dict(weight_decay=0.01)),
        ("adamw", dict(weight_decay=0.01, adam_betas=(0.8, 0.99))),
    ],
)
def test_fused_optimiser_equals_torch_optim_per_client(opt, kw):
    cfg = fedfast.SimConfig(client_optimizer=opt, lr=0.05, **kw)
    n, P = 3, 7
    theta = torch.randn(n, P)
    start = theta.clone()
    s = OptimizerSettings.of(cfg)
    o = client_optimizer(s, theta)
    assert isinstance(o, OPTIMIZERS[opt]) and OPTIMIZERS[opt].rows(s) == (2 if opt != "sgd" else 1)
    grads = _grads(n, P, 4)
    actives = [3, 3, 2, 1]  # clients drop out as their data ends: the active rows are a prefix
    for _round in range(2):  # a reset makes every client's optimiser fresh, as a new torch.optim per round
        theta.copy_(start)
        o.reset(n)
        for g, a in zip(grads, actives, strict=True):
            o.step(theta, g[:a], a, dict(lr=cfg.lr, weight_decay=cfg.weight_decay, max_norm=None, backend=None))
    for k in range(n):
        w = nn.Parameter(start[k].clone())
        ref = {
            "sgd": lambda p: torch.optim.SGD(p, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay),
            "adam": lambda p: torch.optim.Adam(
                p, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
            ),
            "adamw": lambda p: torch.optim.AdamW(
                p, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
            ),
        }[opt]([w])
        for g, a in zip(grads, actives, strict=True):
            if k < a:
                w.grad = g[k].clone()
                ref.step()
        torch.testing.assert_close(theta[k], w.detach(), rtol=1e-5, atol=1e-6)


def test_sgd_without_momentum_keeps_no_rows():
    s = OptimizerSettings.of(fedfast.SimConfig())
    o = SGD(s, torch.zeros(2, 3))
    assert o.buf is None and SGD.rows(s) == 0 and Adam.rows(s) == 2


def test_sam_gradient_is_the_gradient_at_the_perturbed_weights():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    stack = ClientStack(model, 2, device="cpu", use_executor=False)
    stack.params.copy_(torch.randn(2, stack.P))
    x = torch.randn(2, 5, 3)

    def loss_at(pv):
        return (stack.vmap_forward(x, params=pv) ** 2).sum()

    pv = stack.leaf_views(slice(0, 2))
    plain = PlainGradient().gradient(stack, loss_at(pv), pv, 2, None, torch.empty(2, stack.P))
    sam = SAMGradient(stack.params)
    sam.rho = 0.3
    pv = stack.leaf_views(slice(0, 2))
    got = sam.gradient(stack, loss_at(pv), pv, 2, loss_at, torch.empty(2, stack.P))
    for k in range(2):  # by hand: w + rho g / (||g|| + eps), the loss's gradient there
        w = (stack.params[k] + 0.3 * plain[k] / (plain[k].norm() + SAM_EPS)).requires_grad_(True)
        W, b = w[:6].reshape(2, 3), w[6:]
        (g,) = torch.autograd.grad(((x[k] @ W.T + b) ** 2).sum(), w)
        torch.testing.assert_close(got[k], g, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, plain) and SAMGradient.rows == 2 and PlainGradient.rows == 0
