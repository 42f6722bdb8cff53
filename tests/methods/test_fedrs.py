"""FedRS against a literal per-client loop (the restricted softmax written out), on the batched executor and on
vmap; its defaults (FedADC Table I's alpha, the official code's proportional scaling and clipping)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from sequential_loop import PlainLoop, engine_vs

import fedfast


class RSLoop(PlainLoop):
    """lxcnju/FedRepo algorithms/fedrs.py: logits = s * z, s_c = alpha + (1 - alpha) n_c / max n (proportional) or
    1 / alpha for present / missing classes."""

    def loss(self, local, x, y, k):
        a, n = self.o["alpha"], self.hist[k]
        if self.o["proportional"]:
            s = a + (1 - a) * n / n.max()
        else:
            s = torch.tensor([1.0 if c > 0 else a for c in n.tolist()])
        return F.cross_entropy(local(x) * s[None, :], y)


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize(
    "options,extra",
    [
        ({}, {}),
        (dict(proportional=False, alpha=0.2), {}),
        (dict(alpha=0.0), dict(max_grad_norm=None, client_chunk=3)),
        (dict(alpha=0.5), dict(max_grad_norm=0.3)),
    ],
)
def test_matches_literal_loop(options, extra, executor):
    err, _, _ = engine_vs(RSLoop, "fedrs", options, executor=executor, lr_decay=0.99, **extra)
    assert err <= 1e-4, err


def test_restriction_changes_training_and_alpha_one_is_fedavg():
    """alpha = 1 scales nothing (FedAvg exactly); alpha = 0.5 on the dirichlet split changes the model."""
    _, rs, _ = engine_vs(RSLoop, "fedrs", dict(alpha=1.0))
    _, avg, _ = engine_vs(PlainLoop, "fedavg", {})
    assert torch.equal(rs.global_flat, avg.global_flat)
    _, rs5, _ = engine_vs(RSLoop, "fedrs", dict(alpha=0.5))
    assert float((rs5.global_flat - avg.global_flat).abs().max() / avg.global_flat.abs().max()) > 1e-3


def test_defaults():
    """alpha 0.5 (FedADC Table I, §IV-C), proportional scaling and clipping at 100 (lxcnju/FedRepo @48288a1,
    algorithms/fedrs.py and config.py)."""
    cfg = fedfast.SimConfig(algorithm="fedrs")
    o = cfg.method().opts
    assert (o.alpha, o.proportional, cfg.max_grad_norm) == (0.5, True, 100.0)
    for key, bad in (("alpha", 1.5), ("alpha", -0.1), ("proportional", "sometimes")):
        with pytest.raises(ValueError, match=f"fedrs.{key}"):
            fedfast.SimConfig(algorithm="fedrs", options={key: bad})
    m = copy.deepcopy(cfg.method())
    hist = torch.tensor([[4.0, 0.0, 2.0]])
    assert torch.allclose(m.scale(hist), torch.tensor([[1.0, 0.5, 0.75]]))
