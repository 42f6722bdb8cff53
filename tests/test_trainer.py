"""fedfast.sim.trainer.ChunkTrainer alone, against a literal per-client loop: one chunk of a round's clients
trained at once from the global model (torch.optim.SGD with momentum per client, each client's own data order,
the clients with fewer minibatches stopping early), the clients' gradients at their trained weights, and a bad
loss named (issue 37)."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from sequential_loop import flat, setup_data

import fedfast
from fedfast.methods.hooks import HookError
from fedfast.sim.plan import PlanSettings, RoundPlan
from fedfast.sim.runtime import ModelRuntime, RuntimeSettings
from fedfast.sim.trainer import ChunkTrainer, TrainerSettings


def _parts(loss_fn=None, **kw):
    train, _, part, model = setup_data()
    cfg = fedfast.SimConfig(clients_per_round=4, local_epochs=2, batch_size=16, lr=0.1, momentum=0.5, seed=2, **kw)
    method = cfg.method()
    method.bind(SimpleNamespace(backend=None, device=torch.device("cpu")))  # FedAvg reads the backend only
    dev = torch.device("cpu")
    plan = RoundPlan(PlanSettings.of(cfg), train, part, method, device=dev)
    rt = ModelRuntime(RuntimeSettings.of(cfg), model, train, dev)
    trainer = ChunkTrainer(TrainerSettings.of(cfg), method, rt, plan, chunk=4, device=dev, loss_fn=loss_fn)
    return cfg, train, part, model, plan, rt, trainer


def test_a_chunk_equals_the_literal_loop():
    cfg, train, part, model, plan, rt, trainer = _parts()
    ctx, totals, rows = plan.sample(0)
    assert len(set(ctx.steps.tolist())) > 1  # unequal clients: some stop before others
    loss_sum = torch.zeros(())
    trainer.train_chunk(ctx, 0, 4, None, loss_sum, start=rt.initial, step_rows=rows, gen=torch.Generator())
    want_loss = 0.0
    for j, k in enumerate(ctx.sampled):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        for e in range(cfg.local_epochs):
            idx = part.indices[k][torch.from_numpy(plan.order(0, int(k), e, len(part.indices[k])))]
            for b in range(0, len(idx), cfg.batch_size):
                x, y = train.batch(idx[b : b + cfg.batch_size])
                loss = F.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                want_loss += loss.item()
        torch.testing.assert_close(trainer.stack.params[j], flat(m), rtol=1e-5, atol=1e-6)
    assert abs(float(loss_sum) - want_loss) <= 1e-4 * want_loss
    assert totals["steps"] == int(ctx.steps.sum()) * cfg.local_epochs


def test_local_gradients_are_each_clients_minibatch_gradient():
    cfg, train, part, model, plan, rt, trainer = _parts()
    ctx, _, _ = plan.sample(0)
    trainer.train_chunk(ctx, 0, 4, None, torch.zeros(()), start=rt.initial, step_rows=None, gen=torch.Generator())
    trained = trainer.stack.params.clone()
    got = [
        (s, n, g.clone())
        for s, n, g in trainer.local_gradients(ctx, 0, 4, [2, 2, 1, 1], epoch=0, gen=torch.Generator())
    ]
    assert [(s, n) for s, n, _ in got] == [(0, 4), (1, 2)]
    table = plan.batch_table(ctx, 0, 4, 0, 2 * cfg.batch_size)
    for s, n, g in got:
        for j in range(n):
            m = copy.deepcopy(model)
            with torch.no_grad():
                for p, v in zip(m.parameters(), rt.layout.param_views(trained[j]).values(), strict=True):
                    p.copy_(v)
            r = torch.from_numpy(table[j, s * cfg.batch_size : (s + 1) * cfg.batch_size])
            x, y = train.batch(r[r >= 0])
            F.cross_entropy(m(x), y).backward()
            torch.testing.assert_close(
                g[j], torch.cat([p.grad.reshape(-1) for p in m.parameters()]), rtol=1e-5, atol=1e-7
            )
    assert torch.equal(trainer.stack.params, trained)  # gradients only: the weights are left as they were
    with pytest.raises(ValueError, match="batches: 4 non-increasing counts"):
        next(trainer.local_gradients(ctx, 0, 4, [1, 2, 1, 1], epoch=0, gen=torch.Generator()))


def test_a_loss_without_gradient_is_named():
    _, _, _, _, plan, rt, trainer = _parts(loss_fn=lambda z, t, y, seg, n: z.detach().sum())
    ctx, _, _ = plan.sample(0)
    with pytest.raises(
        HookError, match=r"loss_fn \(.*test_trainer.py, line \d+\): must return one number.*no gradient"
    ):
        trainer.train_chunk(ctx, 0, 4, None, torch.zeros(()), start=rt.initial, step_rows=None, gen=torch.Generator())
