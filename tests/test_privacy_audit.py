"""The privacy guarantee checked from outside its formulas (issue 58): epsilon recomputed from what each release
actually adds, never below what a run reports.

A private round releases the noised average (and, with adaptive clipping, the next clip). The audit drives the
round's server side as the engine calls it (the mechanism's bound step inside ``ops.aggregate``, its noise step) as a
black box, with chosen client updates:

* **noise**: the same cohort through many rounds (each round's own noise stream): the standard deviation of every
  released value (each coordinate of the average; ``log`` of the next clip);
* **sensitivity**: neighbouring cohorts through the same round (the same noise): one client added or removed
  (Poisson sampling) or replaced (fixed-size sampling), over candidate clients of every kind (short, at the clip,
  far past it, opposite in direction); how far each released value moves;
* the release is then one Gaussian mechanism of multiplier ``1 / max sqrt(sum_v (moved_v / std_v)^2)``, and
  epsilon is dp-accounting's for it under the run's sampling and neighbouring relation, composed over the rounds.

Nothing here uses the mechanism's noise formulas (z_update, the count's centring, z / 2): a mechanism whose count
moved by 1 where its noise assumed 1/2 (the pre-issue-58 code, checked below) is caught by the same measurement.
"""

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fedfast
from fedfast.methods import UploadSpec
from fedfast.privacy import DPFedAvg, PrivacySettings, Secret

dpa = pytest.importorskip("dp_accounting")

P, K, M, T = 48, 200, 10, 12  # parameters, clients, clients per round (E), rounds accounted
UPLOAD = 16  # values a client uploads beside its update, in the upload cases
DRAWS = 1500  # rounds of noise measured per configuration


def _mechanism(sampling, adaptive, accountant="rdp", z=0.9, uploads=False):
    cfg = fedfast.SimConfig(
        algorithm="fedavg",
        clients_per_round=M,
        rounds=T,
        client_sampling=sampling,
        dp_clip=1.0,
        dp_noise_multiplier=z,
        dp_accountant=accountant,
        **(dict(dp_clip_quantile=0.5) if adaptive else {}),  # count noise: the default E / 20 = 0.5
    )
    with pytest.warns(UserWarning) if sampling == "uniform" else _nothing():
        # a fixed secret: the measured noise is the same in every run of the test
        ups = {"s": UploadSpec(cols=UPLOAD)} if uploads else None
        return DPFedAvg(PrivacySettings.of(cfg), num_clients=K, device="cpu", secret=Secret(2026), uploads=ups)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Uploader:
    """A method whose clients upload a D-vector beside their update (the audit's uploads: the last D columns of
    each client's row in ``U``)."""

    def __init__(self, D):
        self.D = D

    def upload_rows(self, ctx, lo, hi):
        return {"s": ctx.uploads[lo:hi]}


def _release(mech, g, U, rnd):
    """One round's server side as the engine runs it, on a copy of ``mech`` (its state before the round): the
    released values (the average's coordinates, the noised upload sum where the mechanism takes uploads, and log of
    the next clip when the clip adapts). With uploads, ``U``'s last D columns are each client's upload."""
    m = copy.copy(mech)
    D = UPLOAD if m.specs else 0
    ctx = SimpleNamespace(sums={"s": torch.zeros(D)} if D else {}, index=rnd, uploads=U[:, P:])
    m.begin_round(ctx)
    n = U.shape[0]
    w = torch.ones(n)
    if n:
        X = g + U[:, :P]
        ups = m.upload_rows(_Uploader(D), ctx, 0, n)
        out = fedfast.ops.aggregate(X, g, rows=n, **m.bound({}, w, None, ups, X, g))
        total = m.chunk_sum(out, w, g)
    else:
        total = torch.zeros_like(g)
    avg = m.average(g, total, float(n), ctx).double()
    if D:
        avg = torch.cat([avg, m.released()["s"].double()])
    y = torch.tensor([math.log(m.clip)], dtype=torch.float64) if m.adaptive else torch.zeros(0, dtype=torch.float64)
    return avg, y


def _cohort(width=P, seed=0):
    """Ten clients' rows (the update, then the uploads where ``width > P``): four short (0.3 C), three just inside
    the clip (0.999 C), three far past it (5 C), in one norm over the whole row."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(10, width, generator=gen, dtype=torch.float64)
    d = d / d.norm(dim=1, keepdim=True)
    scale = torch.tensor([0.3] * 4 + [0.999] * 3 + [5.0] * 3, dtype=torch.float64)
    return (d * scale[:, None]).float()


def _candidates(width=P):
    """Neighbours: a zero row, short, at the clip, far past it, opposite; with uploads also all in the update or
    all in the upload."""
    gen = torch.Generator().manual_seed(7)
    d = torch.randn(width, generator=gen)
    d = d / d.norm()
    out = [d * 0.0, d * 0.3, d * 0.999, d * 5.0, -d * 0.999, -d * 50.0]
    if width > P:
        only_update, only_upload = d.clone(), d.clone()
        only_update[P:], only_upload[:P] = 0, 0
        out += [only_update / only_update.norm() * 50.0, only_upload / only_upload.norm() * 50.0]
    return out


def _blocks(mech):
    """The released vector's blocks whose noise is isotropic within: the average's P coordinates, and the upload
    sum's UPLOAD coordinates (their noise has another scale)."""
    return [(0, P)] + ([(P, P + UPLOAD)] if mech.specs else [])


def _noise_std(mech, g, U):
    """Each block's pooled coordinate std (with its number of samples) and the std of log(next clip) (None: a
    fixed clip): the count's is one number a round (``DRAWS`` rounds), a block's many."""
    A, Y = [], []
    for r in range(DRAWS if mech.adaptive else DRAWS // 5):
        a, y = _release(mech, g, U, r)
        A.append(a)
        Y.append(y)
    A, Y = torch.stack(A), torch.stack(Y)
    stds = []
    for lo, hi in _blocks(mech):
        B = A[:, lo:hi]
        sb = float(B.var(0, unbiased=True).mean().sqrt())
        # the noise is isotropic within the block: per-coordinate stds within 20 % of the pooled one
        assert float((B.std(0, unbiased=True) / sb - 1).abs().max()) < 0.2
        stds.append((sb, B.numel()))
    y = (float(Y.std(0, unbiased=True)[0]), Y.shape[0]) if Y.shape[1] else None
    return stds, y


def _shifts(mech, g, U, relation):
    """How far each released value moves between neighbouring cohorts through one round (the same noise on both
    sides): [(|moved average|, |moved log clip|)] over every candidate neighbour."""
    out = []
    rnd = 12345
    for u in _candidates(U.shape[1]):
        if relation == "add_remove":
            pairs = [(U, torch.cat([U, u[None]]))]
        else:  # every client replaced by the candidate, and by its own opposite (short, and far past the clip)
            pairs = []
            for j in range(U.shape[0]):
                away = -U[j] / U[j].norm()
                for v in (u, away * 0.999, away * 50.0):
                    V = U.clone()
                    V[j] = v
                    pairs.append((U, V))
        for A, B in pairs:
            a1, y1 = _release(mech, g, A, rnd)
            a2, y2 = _release(mech, g, B, rnd)
            moved = [float((a1[lo:hi] - a2[lo:hi]).norm()) for lo, hi in _blocks(mech)]
            out.append((moved, float((y1 - y2).abs().sum())))
    return out


def _audit(mech, relation):
    """``mu(sd)``: max over the neighbours of sqrt(sum_v (moved_v / std_v)^2), each measured std taken ``sd``
    standard errors larger (sd > 0: the smallest shift the measurement allows; < 0: the largest); the standard
    error of a std from n normal samples is std / sqrt(2 n)."""
    g, U = torch.zeros(P), _cohort(P + (UPLOAD if mech.specs else 0))
    stds, y = _noise_std(mech, g, U)
    moved = _shifts(mech, g, U, relation)

    def mu(sd):
        a = [s * (1 + sd / math.sqrt(2 * n)) for s, n in stds]
        b = y[0] * (1 + sd / math.sqrt(2 * y[1])) if y is not None else math.inf
        return max(math.sqrt(sum((d / s) ** 2 for d, s in zip(da, a, strict=True)) + (dy / b) ** 2) for da, dy in moved)

    return mu


def _recomputed_epsilon(mu, sampling, accountant, delta=1e-5):
    """dp-accounting's epsilon for T rounds of a Gaussian mechanism of multiplier 1 / mu (relative to the measured
    neighbouring shift), under the sampling the run uses and its neighbouring relation."""
    if sampling == "poisson":
        rel = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        event = dpa.PoissonSampledDpEvent(M / K, dpa.GaussianDpEvent(1 / mu))
    else:
        rel = dpa.NeighboringRelation.REPLACE_ONE
        event = dpa.SampledWithoutReplacementDpEvent(K, M, dpa.GaussianDpEvent(1 / mu))
    acc = dpa.rdp.RdpAccountant(neighboring_relation=rel) if accountant == "rdp" else dpa.pld.PLDAccountant(rel)
    acc.compose(event, T)
    return float(acc.get_epsilon(delta))


CASES = [
    ("poisson", False, "rdp", False),
    ("poisson", True, "rdp", False),
    ("poisson", False, "pld", False),
    ("poisson", True, "pld", False),
    ("uniform", False, "rdp", False),
    ("uniform", True, "rdp", False),
    ("poisson", True, "rdp", True),
    ("uniform", False, "rdp", True),
]


@pytest.mark.parametrize("sampling,adaptive,accountant,uploads", CASES)
def test_reported_epsilon_is_never_below_the_measured_one(sampling, adaptive, accountant, uploads):
    """For each accounted release (fixed and adaptive clip, Poisson and fixed-size sampling, RDP and PLD): the
    epsilon recomputed from the measured noise and shifts is at most the reported one, and the reported one is not
    above the recomputed one either (the accounting is tight). The measured stds are taken 3 standard errors
    larger for the first check and 3 smaller for the second (1500 rounds: 5.5 % for the count's; the secret is
    fixed, so every run measures the same noise). With uploads (a method's values beside its update, clipped
    jointly: SCAFFOLD's control variates, say) the released upload sum is one more released value."""
    mech = _mechanism(sampling, adaptive, accountant, uploads=uploads)
    mu = _audit(mech, "add_remove" if sampling == "poisson" else "replace")
    kind = "poisson" if sampling == "poisson" else "fixed"
    reported = mech.epsilon(T)
    least = _recomputed_epsilon(mu(3.0), kind, accountant)
    most = _recomputed_epsilon(mu(-3.0), kind, accountant)
    assert least <= reported <= most * 1.01, (least, reported, most)


def test_the_audit_catches_an_uncentred_count(monkeypatch):
    """The code before issue 58: the count of unclipped updates summed uncentred (one client moves it by 1) with the
    update noise of Andrew et al.'s Theorem 1 (written for a count of sensitivity 1/2). The same measurement finds
    its true epsilon far above the one it reported."""

    def uncentred(self, out, weights, g):
        self._count += out["dp_unclipped"]
        return out["average"] - g

    mech = _mechanism("poisson", True)
    monkeypatch.setattr(DPFedAvg, "chunk_sum", uncentred)
    # (the clip's step then reads b = (count + noise) / E + 1/2: another offset, the same shift per client)
    least = _recomputed_epsilon(_audit(mech, "add_remove")(3.0), "poisson", "rdp")
    assert least > 1.5 * mech.epsilon(T), (least, mech.epsilon(T))


def test_noise_comes_from_the_secret_not_the_seed():
    """Two runs with the same seed and data draw different noise and cohorts (the secret is fresh OS entropy); a run
    restored from its checkpoint draws the checkpoint's. The secret is in no record or config."""
    from sequential_loop import setup_data

    train, test, part, model = setup_data("mlp")
    cfg = fedfast.SimConfig(
        algorithm="fedavg",
        clients_per_round=4,
        rounds=2,
        batch_size=16,
        lr=0.05,
        seed=3,
        client_sampling="poisson",
        dp_clip=0.5,
        dp_noise_multiplier=1.0,
    )
    sims = [fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part) for _ in range(2)]
    for s in sims:
        s.run()
    assert not torch.equal(sims[0].global_flat, sims[1].global_flat)
    cohorts = [[s.plan.clients(r).tolist() for r in range(20)] for s in sims]
    assert cohorts[0] != cohorts[1]
    key = format(sims[0].privacy.secret.key, "032x")
    assert key not in repr(sims[0].history) and key not in repr(cfg)


@pytest.mark.parametrize("sampling", ["poisson", "uniform"])
def test_cohorts_follow_the_accounted_sampling(sampling):
    """The engine's private cohorts, 400 rounds, read off its round plan: Poisson sampling includes each client
    independently at rate q (cohort sizes Binomial(K, q): their mean and variance; each client's inclusion rate);
    fixed-size sampling exactly m distinct clients, each included at rate m / K."""
    from sequential_loop import setup_data

    train, test, part, model = setup_data("mlp")
    Kc, m, R = part.num_clients, 5, 400
    cfg = fedfast.SimConfig(
        algorithm="fedavg",
        clients_per_round=m,
        rounds=1,
        client_sampling=sampling,
        dp_clip=0.5,
        dp_noise_multiplier=1.0,
    )
    with pytest.warns(UserWarning) if sampling == "uniform" else _nothing():
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    sim.privacy.secret.key = 12345  # a fixed secret: the same cohorts in every run of the test
    cohorts = [sim.plan.clients(r) for r in range(R)]
    sizes = np.array([len(c) for c in cohorts])
    counts = np.bincount(np.concatenate(cohorts), minlength=Kc)
    q = m / Kc
    assert abs(counts.mean() / R - q) < 4 * math.sqrt(q * (1 - q) / (R * Kc))
    if sampling == "poisson":
        var = Kc * q * (1 - q)
        assert abs(sizes.mean() - Kc * q) < 4 * math.sqrt(var / R)
        assert 0.6 * var < sizes.var() < 1.5 * var
    else:
        assert (sizes == m).all() and all(len(set(c.tolist())) == m for c in cohorts)
