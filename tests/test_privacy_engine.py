"""Private runs (issue 49): DP-FedAvg in the engine against the literal loop (clip each client's delta, sum, add the
same noise, divide by the expected cohort size), Poisson sampling with empty cohorts, the noise's standard
deviation, epsilon against the accountant called directly, calibration, checkpoints, and the refusals by name."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from sequential_loop import sequential, setup_data

import fedfast
from fedfast import privacy
from fedfast.privacy.secret import NOISE
from fedfast.sampling import sample_clients, sample_clients_poisson

pytest.importorskip("dp_accounting")

BASE = dict(clients_per_round=4, rounds=3, local_epochs=1, batch_size=16, lr=0.05, seed=3, max_grad_norm=0.0)


def _run(algorithm="fedavg", options=None, **kw):
    train, test, part, model = setup_data("mlp")
    cfg = fedfast.SimConfig(algorithm=algorithm, options=options or {}, **{**BASE, **kw})
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    return cfg, sim, (train, test, part, model)


def _from_secret(sim, cfg, K):
    """The literal loop's cohorts and noise from the run's secret: the samplers of fedfast.sampling keyed by its
    cohort seed, each round's noise generator keyed by (NOISE, round)."""
    sec = sim.privacy.secret
    m = cfg.clients_per_round
    if cfg.client_sampling == "poisson":
        sampled = lambda r: sample_clients_poisson(sec.cohort_seed(), r, K, m / K)  # noqa: E731
    else:
        sampled = lambda r: sample_clients(sec.cohort_seed(), r, K, m)  # noqa: E731
    return sampled, (lambda r: sec.generator("cpu", NOISE, r))


@pytest.mark.parametrize(
    "algorithm,options,sampling",
    [("fedavg", {}, "uniform"), ("fedavg", {}, "poisson"), ("fedntd", dict(tau=2.0), "uniform")],
)
def test_private_rounds_equal_the_literal_loop(algorithm, options, sampling):
    """Clip 0.05 (every client's delta is longer: clipping acts on each), z = 0.7: the engine's global model after
    three rounds equals the loop's clipped sum + the same noise over E = clients_per_round."""
    cfg, sim, (train, _, part, model) = _run(
        algorithm, options, dp_clip=0.05, dp_noise_multiplier=0.7, client_sampling=sampling
    )
    start = copy.deepcopy(sim.model).cpu()
    hist = sim.run()
    K = part.num_clients
    sampled_fn, gen = _from_secret(sim, cfg, K)
    ref = sequential(
        cfg,
        start,
        train,
        part,
        cfg.rounds,
        sampled_fn=sampled_fn,
        dp=dict(clip=0.05, z=0.7, E=float(cfg.clients_per_round), gen=gen),
    )
    err = float((sim.global_flat.cpu() - ref).abs().max() / ref.abs().max())
    assert err <= 1e-6, err
    # a broken formula would show: without the noise, or without clipping, the loop lands elsewhere
    no_clip = sequential(
        cfg,
        copy.deepcopy(start),
        train,
        part,
        cfg.rounds,
        sampled_fn=sampled_fn,
        dp=dict(clip=1e9, z=0.7 * 0.05 / 1e9, E=float(cfg.clients_per_round), gen=gen),
    )
    assert float((no_clip - ref).abs().max() / ref.abs().max()) > 1e-2
    for r, rec in enumerate(hist, 1):  # epsilon after each round: the accountant, called directly
        want = privacy.epsilon(
            0.7,
            cfg.dp_delta,
            r,
            sampling="poisson" if sampling == "poisson" else "fixed",
            num_clients=K,
            clients_per_round=4 if sampling == "uniform" else None,
            rate=4 / K if sampling == "poisson" else None,
        )
        assert rec["dp_epsilon"] == pytest.approx(want, rel=1e-12)


def test_poisson_rounds_without_a_client():
    """q = 1/K: some rounds draw nobody. Without DP the global model stays; with DP it takes the noise alone."""
    train, test, part, model = setup_data("mlp")
    K = part.num_clients
    for dp in ({}, dict(dp_clip=0.05, dp_noise_multiplier=1.0)):
        cfg = fedfast.SimConfig(
            algorithm="fedavg", **{**BASE, "clients_per_round": 1, "rounds": 40}, client_sampling="poisson", **dp
        )
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
        seed = sim.privacy.secret.cohort_seed() if dp else cfg.seed
        rounds = [r for r in range(40) if len(sample_clients_poisson(seed, r, K, 1 / K)) == 0]
        assert rounds, "no empty cohort in 40 rounds"
        n = rounds[0] + 1
        for _ in range(n - 1):
            sim.round()
        before = sim.global_flat.clone()
        rec = sim.round()
        if not dp:
            assert rec["clients"] == [] and rec["cohort_size"] == 0
            assert torch.equal(sim.global_flat, before)
        else:  # the cohort (and its size) is secret under Poisson sampling: not in the record
            assert rec["clients"] is None and rec["cohort_size"] is None
            xi = torch.randn(before.shape, generator=sim.privacy.secret.generator("cpu", NOISE, n - 1))
            assert torch.allclose(sim.global_flat, before + xi * (1.0 * 0.05 / 1.0), rtol=0, atol=1e-7)


def test_noise_standard_deviation_is_z_clip_over_the_expected_cohort():
    from fedfast.privacy import DPFedAvg, PrivacySettings

    cfg = fedfast.SimConfig(
        algorithm="fedavg",
        clients_per_round=8,
        rounds=1,
        dp_clip=0.5,
        dp_noise_multiplier=1.3,
        client_sampling="poisson",
    )
    p = DPFedAvg(PrivacySettings.of(cfg), num_clients=100, device="cpu", secret=privacy.Secret(1))
    g = torch.zeros(200_000)
    noise = p.average(g, torch.zeros_like(g), 0.0, SimpleNamespace(index=0))
    sd, want = float(noise.std()), 1.3 * 0.5 / 8
    # the sample standard deviation of 2e5 normals: relative standard error 1/sqrt(2n) = 0.16 %; 5 sigma
    assert abs(sd / want - 1) < 5 / math.sqrt(2 * g.numel()), (sd, want)
    assert abs(float(noise.mean())) < 5 * want / math.sqrt(g.numel())


def test_epsilon_calibration_budget_and_resume():
    """dp_epsilon calibrates the noise for the planned rounds; the last round spends at most the budget; a checkpoint
    resumes bit for bit with its noise; more rounds than the budget allows are refused, naming rounds."""
    cfg, sim, (train, test, part, model) = _run(dp_clip=0.1, dp_epsilon=8.0, rounds=3, client_sampling="poisson")
    z = privacy.calibrate(
        8.0, cfg.dp_delta, 3, sampling="poisson", num_clients=part.num_clients, rate=4 / part.num_clients
    )
    assert sim.privacy.z == pytest.approx(z)
    sim.round()
    sim.round()
    ck = sim.checkpoint()
    straight = sim.round()
    g3 = sim.global_flat.clone()
    assert straight["dp_epsilon"] <= 8.0 * (1 + 1e-9) and straight["dp_epsilon"] > 7.0
    again = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    again.restore(ck)
    again.round()
    assert torch.equal(again.global_flat, g3)
    more = fedfast.SimConfig(**{**cfg.__dict__, "rounds": 30})  # calibrated for 30 rounds: less noise per round
    later = fedfast.Simulation(more, copy.deepcopy(model), train, test, part)
    with pytest.raises(ValueError, match="rounds: 30 private rounds spend epsilon"):
        later.restore(ck)  # the checkpoint's noise, for 30 rounds, passes the budget


def test_summary_records_the_final_epsilon():
    from fedfast.callbacks import summarize

    _, sim, _ = _run(dp_clip=0.1, dp_noise_multiplier=1.0, rounds=2)
    hist = sim.run()
    s = summarize(hist, {"algorithm": "fedavg", "seed": 3, "rounds": 2}, "cpu", True)
    assert s["dp_epsilon"] == hist[-1]["dp_epsilon"] and s["dp_epsilon"] > 0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(algorithm="fedgen"), "fedgen is refused in a private run: its server trains the generator"),
        (dict(algorithm="feddisco"), "feddisco is refused in a private run: its aggregation weights"),
        (dict(client_sampling="bernoulli"), "client_sampling: 'bernoulli'"),
        (dict(client_sampling="round_seeded"), "client_sampling: 'round_seeded'"),
        (dict(aggregate_weights="size"), "aggregate_weights"),
        (dict(dp_accountant="pld"), "dp_accountant"),
        (dict(dp_clip_quantile=1.5), "dp_clip_quantile"),
        (dict(dp_clip_count_noise=1.0), "dp_clip_count_noise: an adaptive-clipping key"),
        (dict(dp_clip_quantile=0.5, dp_noise_multiplier=0.0, dp_clip_count_noise=1.0), "nothing is noised"),
        (dict(dp_noise_multiplier=None), "dp_clip: a private run needs"),
        (dict(dp_delta=0.0), "dp_delta"),
    ],
)
def test_refused_by_name(kw, match):
    base = dict(algorithm="fedavg", dp_clip=1.0, dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match=match):
        fedfast.SimConfig(**{**base, **kw})
    with pytest.raises(ValueError, match="dp_noise_multiplier: a private-run key"):
        fedfast.SimConfig(dp_noise_multiplier=1.0)


def test_batch_norm_statistics_and_schedules_are_refused():
    train, test, part, model = setup_data("bn")
    cfg = fedfast.SimConfig(algorithm="fedavg", dp_clip=1.0, dp_noise_multiplier=1.0, **BASE)
    with pytest.raises(ValueError, match="dp_clip: the model's .* buffer values"):
        fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    train, test, part, model = setup_data("mlp")
    with pytest.raises(ValueError, match="schedule"):
        fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, schedule=[[0, 1]] * 3)


def test_a_plugin_summing_over_its_clients_is_refused():
    from fedfast.methods import FedAvg, register

    class Leaky(FedAvg):
        def round_start(self, ctx):
            super().round_start(ctx)
            return {"label_sums": torch.zeros(3)}

    name = "leaky_dp_test"
    register(name)(Leaky)
    try:
        train, test, part, model = setup_data("mlp")
        cfg = fedfast.SimConfig(algorithm=name, dp_clip=1.0, dp_noise_multiplier=1.0, **BASE)
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
        with pytest.raises(ValueError, match=r"sums \['label_sums'\]"):
            sim.round()
    finally:
        fedfast.methods.unregister(name)


def test_a_plugin_declares_its_upload_and_reads_the_noised_sum():
    """The upload contract for a plug-in: declared in upload_spec, its rows from upload_rows, clipped jointly with
    the update; the server reads the noised sum (not the plain one collect added); an increment collect returns
    without declaring it is refused by name."""
    from fedfast.methods import Collected, FedAvg, UploadSpec, register

    seen = {}

    class Histogram(FedAvg):
        def round_start(self, ctx):
            return {"labels": torch.zeros(5)}

        def upload_spec(self):
            return {"labels": UploadSpec(cols=5, scale=0.5)}

        def upload_rows(self, ctx, lo, hi):
            return {"labels": ctx.hist[lo:hi] / 100.0}

        def collect(self, ctx, out, lo, hi):
            return Collected(sums={"labels": (ctx.hist[lo:hi] / 100.0).sum(0)})

        def server(self, ctx, avg):
            seen["labels"] = ctx.sums["labels"].clone()
            seen["plain"] = (ctx.hist / 100.0).sum(0).clone()
            return super().server(ctx, avg)

    class Undeclared(FedAvg):
        def collect(self, ctx, out, lo, hi):
            return Collected(increment=torch.zeros(self.engine.num_params))

    register("hist_dp_test")(Histogram)
    register("undeclared_dp_test")(Undeclared)
    try:
        train, test, part, model = setup_data("mlp")
        kw = dict(dp_clip=1.0, dp_noise_multiplier=1.0, client_sampling="poisson", **BASE)
        sim = fedfast.Simulation(
            fedfast.SimConfig(algorithm="hist_dp_test", **kw), copy.deepcopy(model), train, test, part
        )
        sim.round()
        diff = (seen["labels"] - 0.5 * seen["plain"]).abs()
        assert float(diff.max()) > 0.01  # noised (std 0.5 * z C = 0.5), not the plain sum
        sim = fedfast.Simulation(
            fedfast.SimConfig(algorithm="undeclared_dp_test", **kw), copy.deepcopy(model), train, test, part
        )
        with pytest.raises(ValueError, match="collect returns an increment"):
            sim.run()
    finally:
        fedfast.methods.unregister("hist_dp_test")
        fedfast.methods.unregister("undeclared_dp_test")


def test_adaptive_clipping_equals_the_literal_loop():
    """dp_clip_quantile 0.5: the updates noised with z_update = (z^-2 - (2 sigma_b)^-2)^(-1/2), the centred count of
    unclipped updates with sigma_b, and the clip moved geometrically each round, as the loop does; the records show
    the clip each round used, and epsilon is the accountant's at z (the count's release is inside it)."""
    cfg, sim, (train, _, part, model) = _run(
        dp_clip=0.05,
        dp_noise_multiplier=0.7,
        dp_clip_quantile=0.5,
        dp_clip_count_noise=1.0,
        rounds=4,
        client_sampling="poisson",
    )
    start = copy.deepcopy(sim.model).cpu()
    hist = sim.run()
    K, E = part.num_clients, 4.0
    sigma_b = 1.0
    z_update = (0.7**-2 - (2 * sigma_b) ** -2) ** -0.5
    sampled_fn, gen = _from_secret(sim, cfg, K)
    dp = dict(clip=0.05, z=0.7, z_update=z_update, E=E, gen=gen, quantile=0.5, lr_c=0.2, sigma_b=sigma_b)
    ref = sequential(cfg, start, train, part, cfg.rounds, dp=dp, sampled_fn=sampled_fn)
    err = float((sim.global_flat.cpu() - ref).abs().max() / ref.abs().max())
    assert err <= 1e-6, err
    assert [h["dp_clip"] for h in hist] == pytest.approx([0.05] + dp["clips"][:-1], rel=1e-6)
    assert sim.privacy.clip == pytest.approx(dp["clips"][-1], rel=1e-6)
    assert len(set(round(c, 9) for c in dp["clips"])) > 1  # the clip moved
    assert hist[-1]["dp_epsilon"] == pytest.approx(
        privacy.epsilon(0.7, cfg.dp_delta, 4, sampling="poisson", num_clients=K, rate=4 / K), rel=1e-12
    )
    with pytest.raises(ValueError, match="dp_clip_count_noise: adaptive clipping's count noise"):
        _run(dp_clip=0.05, dp_noise_multiplier=2.0, dp_clip_quantile=0.5, dp_clip_count_noise=0.5)


def test_adaptive_clip_resumes_from_its_checkpoint():
    cfg, sim, (train, test, part, model) = _run(
        dp_clip=0.05, dp_noise_multiplier=0.7, dp_clip_quantile=0.3, dp_clip_count_noise=1.0, rounds=3
    )
    sim.round()
    ck = sim.checkpoint()
    sim.round()
    sim.round()
    again = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    again.restore(ck)
    assert again.privacy.clip == ck["privacy"]["clip"] != 0.05
    again.round()
    again.round()
    assert torch.equal(again.global_flat, sim.global_flat) and again.privacy.clip == sim.privacy.clip


@pytest.mark.filterwarnings("ignore:moon")
@pytest.mark.filterwarnings("ignore:client_sampling")
def test_every_method_runs_a_private_round_or_is_refused_by_name():
    """Issue 58's contract: under dp_clip every registered method trains a private round (its uploads, where it has
    any, clipped with its update: tests/test_privacy_methods.py) or is refused with the reason its upload cannot be
    bounded; an option that makes an upload unboundable is refused naming the option."""
    train, test, part, model = setup_data("mlp")
    ran, refused = [], []
    options = {"feddyn": {"alpha_scaling": "minibatches"}}  # its default (mean_size) is refused: below
    for name in sorted(fedfast.methods.BUILTIN):
        cls = fedfast.methods.get(name)
        try:
            cfg = fedfast.SimConfig(
                algorithm=name,
                options=options.get(name, {}),
                dp_clip=0.5,
                dp_noise_multiplier=1.0,
                **{**BASE, "rounds": 1, "clients_per_round": 3},
            )
        except ValueError as e:
            assert cls.private_refusal and cls.private_refusal in str(e) and "dp_clip" in str(e), (name, e)
            refused.append(name)
            continue
        tr, splits = cfg.method().hold_out(train, cfg.seed)
        sim = fedfast.Simulation(
            cfg,
            copy.deepcopy(model),
            tr,
            test,
            part if len(tr) == len(train) else fedfast.data.iid(tr.y, part.num_clients, seed=0),
            **splits,
        )
        rec = sim.round()
        assert rec["dp_epsilon"] > 0 and torch.isfinite(sim.global_flat).all(), name
        ran.append(name)
    assert set(refused) == {"fedgen", "feddisco"}, refused
    assert {"fedavg", "fedntd", "scaffold", "feddyn", "fednova", "fedcurv", "feddistill_plus", "fedspeed"} <= set(ran)
    with pytest.raises(ValueError, match="feddyn.alpha_scaling: 'mean_size'"):
        fedfast.Simulation(
            fedfast.SimConfig(algorithm="feddyn", dp_clip=0.5, dp_noise_multiplier=1.0, **BASE),
            copy.deepcopy(model),
            train,
            test,
            part,
        )


def test_a_private_run_directory_records_epsilon_and_refuses_a_resume_past_its_budget(tmp_path, capsys):
    """`fedfast run` with dp_epsilon: summary.json's dp_epsilon within the budget, config.json the keys; a resume with
    more rounds (--set rounds=) keeps the checkpoint's noise and is refused, naming rounds; the files unchanged."""
    import json

    from fedfast.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'dataset = "synthetic"\npartition = "iid"\nnum_clients = 20\nclients_per_round = 4\nrounds = 2\n'
        'batch_size = 32\nlr = 0.05\nclient_sampling = "poisson"\ndp_clip = 0.5\ndp_epsilon = 3.0\n'
    )
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert 2.5 < summary["dp_epsilon"] <= 3.0 * (1 + 1e-9)
    assert json.loads((out / "config.json").read_text())["dp_epsilon"] == 3.0
    before = (out / "metrics.jsonl").read_text(), (out / "config.json").read_text()
    capsys.readouterr()
    try:
        code = main(["run", "--resume", str(out), "--set", "rounds=40", "--quiet"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr()
    assert code != 0 and "rounds: 40 private rounds spend epsilon" in err.err + err.out, err
    assert ((out / "metrics.jsonl").read_text(), (out / "config.json").read_text()) == before


def test_diverged_keeps_its_old_address_for_a_release():
    import fedfast.engine
    from fedfast.sim.diverged import Diverged

    with pytest.warns(DeprecationWarning, match="fedfast.sim.diverged.Diverged"):
        assert fedfast.engine.Diverged is Diverged
    assert fedfast.Diverged is Diverged


def test_names_issue_50_moved_keep_their_old_addresses_for_a_release():
    """fedfast.flat.ClientState and fedfast.methods.kd.FedNTD / FedLSNTD (0.1.0 names) resolve to their new homes
    with a DeprecationWarning naming them; other missing names still raise AttributeError."""
    import fedfast.flat
    import fedfast.methods.kd
    from fedfast.methods.fedntd import FedLSNTD, FedNTD
    from fedfast.store.state import ClientState

    with pytest.warns(DeprecationWarning, match="fedfast.store.ClientState"):
        assert fedfast.flat.ClientState is ClientState
    for name, cls in (("FedNTD", FedNTD), ("FedLSNTD", FedLSNTD)):
        with pytest.warns(DeprecationWarning, match=f"fedfast.methods.fedntd.{name}"):
            assert getattr(fedfast.methods.kd, name) is cls
    with pytest.raises(AttributeError):
        _ = fedfast.flat.NoSuchName
    with pytest.raises(AttributeError):
        _ = fedfast.methods.kd.NoSuchName


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # SGD, unequal sizes: rows end at many steps
        dict(momentum=0.9, local_epochs=2, client_chunk=3),  # momentum, two epochs, three chunks
        dict(client_optimizer="adam", lr=0.01),  # Adam's fused step
        dict(local_steps=3, max_grad_norm=1.0),  # fixed local steps, clipped gradients
        dict(algorithm="fedsam", options=dict(rho=0.05)),  # SAM's gradient
    ],
)
def test_update_norms_come_from_each_clients_last_step(monkeypatch, kw):
    """The clip's norms ||X_k - g|| are added up by each client's last local step (ops.client_step's delta_norm)
    and handed to ops.aggregate, which then makes no pass of its own; they equal the rows' norms measured there."""
    import sys

    agg_mod = sys.modules["fedfast.ops.aggregate"]  # the module (fedfast.ops.aggregate is the op)
    measured, given = [], []
    real_norms, real_aggregate = agg_mod.update_norms, fedfast.ops.aggregate

    def counting_norms(*a, **k):
        measured.append(1)
        return real_norms(*a, **k)

    def checking_aggregate(clients, g, **k):
        if "dp_clip" in k:  # a chunk's clients (the server rule's own call has none)
            want = real_norms(clients, g, torch.arange(k["rows"]))
            given.append(float(((k["dp_norms"] - want).abs() / want).max()))
        return real_aggregate(clients, g, **k)

    monkeypatch.setattr(agg_mod, "update_norms", counting_norms)
    monkeypatch.setattr(fedfast.ops, "aggregate", checking_aggregate)
    algorithm = kw.pop("algorithm", "fedavg")
    _, sim, _ = _run(algorithm, kw.pop("options", None), dp_clip=0.05, dp_noise_multiplier=0.5, **kw)
    sim.run()
    assert given and max(given) <= 1e-6, given
    assert not measured  # only checking_aggregate's own calls above, which bypass the counter


def test_rows_written_after_the_last_step_are_measured_again(monkeypatch):
    """FedADC's Nesterov order moves every row by a half-step after the last local step (chunk_end): the norms from
    the steps are stale, the stack's version counter says so, and ops.aggregate measures the rows itself - the
    private round then equals the one whose norms are always measured. A plug-in masking its own steps likewise."""
    import fedfast.sim.trainer as trainer_mod

    opts = dict(order="nesterov")
    _, sim, _ = _run("fedadc", opts, dp_clip=0.05, dp_noise_multiplier=0.5)
    seen = []
    real = trainer_mod.ChunkTrainer.update_norms
    monkeypatch.setattr(
        trainer_mod.ChunkTrainer, "update_norms", lambda self, n: seen.append(real(self, n)) or seen[-1]
    )
    sim.run()
    assert seen and all(s is None for s in seen)
    monkeypatch.setattr(trainer_mod.ChunkTrainer, "update_norms", lambda self, n: None)
    _, sim2, _ = _run("fedadc", opts, dp_clip=0.05, dp_noise_multiplier=0.5)
    sim2.privacy.secret.key = sim.privacy.secret.key  # the same cohorts and noise
    sim2.run()
    assert torch.equal(sim.global_flat, sim2.global_flat)
    monkeypatch.setattr(
        trainer_mod.ChunkTrainer, "update_norms", lambda self, n: seen.append(real(self, n)) or seen[-1]
    )
    # a plug-in masking its clients' steps itself (`active`): a client may skip its last step, so measured too
    from fedfast.methods import FedAvg, register

    class Masked(FedAvg):
        def step_terms(self, ctx, n_act):
            return dict(active=torch.arange(n_act) % 2 == 0)

    register("masked_dp_test")(Masked)
    try:
        seen.clear()
        sim3 = _run("masked_dp_test", None, dp_clip=0.05, dp_noise_multiplier=0.5)[1]
        sim3.run()
        assert seen and all(s is None for s in seen)
    finally:
        fedfast.methods.unregister("masked_dp_test")
    # and without the half-step the norms from the steps are used
    seen.clear()
    _run("fedadc", dict(order="heavy_ball"), dp_clip=0.05, dp_noise_multiplier=0.5)[1].run()
    assert seen and all(s is not None for s in seen)


# -- issue 58: resumes keep the accounting; calibration; what a private run writes --------------------------------
@pytest.mark.parametrize(
    "change",
    [
        dict(clients_per_round=2),
        dict(client_sampling="uniform"),
        dict(dp_delta=1e-6),
        dict(dp_clip=0.2),
        dict(dp_accountant="pld"),
        dict(dp_clip_quantile=0.3),
        dict(dp_clip_lr=0.5),
        dict(dp_clip_count_noise=2.0),
        dict(dp_noise_multiplier=0.8),
    ],
)
def test_a_resume_refuses_another_accounting_setting_by_name(change):
    """Simulation.restore (the door of a sweep and of Python users) with another sampling, cohort size, delta, clip,
    accountant, adaptive-clipping setting or noise: refused naming the key (before issue 58: 5 rounds at q 0.5
    re-accounted at the new q, a new dp_clip ignored without a word)."""
    kw = dict(
        dp_clip=0.1,
        dp_noise_multiplier=1.0,
        client_sampling="poisson",
        dp_clip_quantile=0.5,
        dp_clip_count_noise=1.0,
        rounds=2,
    )
    cfg, sim, (train, test, part, model) = _run(**kw)
    sim.round()
    ck = sim.checkpoint()
    other = fedfast.SimConfig(**{**cfg.__dict__, **change})
    again = fedfast.Simulation(other, copy.deepcopy(model), train, test, part)
    key = next(iter(change))
    with pytest.raises(ValueError, match=f"^{key}: the checkpoint's"):
        again.restore(ck)
    same = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    same.restore(ck)  # the same settings: resumes


def test_pld_calibration_is_bracketed_by_the_rdp_answer():
    """dp_epsilon with the PLD accountant (before issue 58: a search from z = 0.001 allocating 38 GiB, every time):
    the smallest multiplier to 0.1 %, at most the RDP one, and a run calibrates with it."""
    kw = dict(sampling="poisson", num_clients=400, rate=0.05)
    z = privacy.calibrate(0.5, 1e-5, 20, **kw, accountant="pld")
    z_rdp = privacy.calibrate(0.5, 1e-5, 20, **kw)
    assert z < z_rdp
    assert privacy.epsilon(z, 1e-5, 20, **kw, accountant="pld") <= 0.5
    assert privacy.epsilon(z / 1.001, 1e-5, 20, **kw, accountant="pld") > 0.5
    cfg, sim, _ = _run(
        dp_clip=0.1, dp_epsilon=0.3, client_sampling="poisson", dp_accountant="pld", rounds=2, clients_per_round=1
    )
    assert 0.27 < sim.run()[-1]["dp_epsilon"] <= 0.3


def test_a_tiny_budget_gets_the_smallest_multiplier_or_a_named_refusal():
    """dp_epsilon = 1e-9: the smallest z whose epsilon is at most it (to 0.1 %) where the accountant certifies it
    (Poisson, 10 rounds of q = 0.02: (0, delta) from z = 6325 on); below the accountant's floor (100 rounds of
    q = 0.1 of 100 clients: RDP's epsilon stays at 0.0035 for any z from 1e3 to 1e5) a refusal naming dp_epsilon and
    the floor, at once (before issue 58: z = 1e5 returned; with fixed-size sampling 4e5 after 27 s)."""
    import time

    kw = dict(sampling="poisson", num_clients=500, rate=0.02)
    z = privacy.calibrate(1e-9, 1e-5, 10, **kw)
    assert privacy.epsilon(z, 1e-5, 10, **kw) <= 1e-9 < privacy.epsilon(z / 1.001, 1e-5, 10, **kw)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"dp_epsilon: 1e-09 is not reached by any noise multiplier up to 10000 "):
        privacy.calibrate(1e-9, 1e-5, 100, sampling="poisson", num_clients=100, rate=0.1)
    assert time.perf_counter() - t < 10


def test_delta_and_sampling_typos_are_named():
    """dp_delta at or above 1 / num_clients promises nothing (refused naming dp_delta); a misspelt sampling is named
    as such, not explained as another sampling's refusal."""
    with pytest.raises(ValueError, match=r"dp_delta: 0.2 is not below 1 / num_clients = 0.125"):
        _run(dp_clip=0.1, dp_noise_multiplier=1.0, dp_delta=0.2)
    with pytest.raises(ValueError, match="dp_delta: 0.05 is not below 1 / num_clients"):
        privacy.epsilon(1.0, 0.05, 3, sampling="poisson", num_clients=100, rate=0.1)
    with pytest.raises(ValueError, match=r"client_sampling: one of \('uniform'.*got 'possion'"):
        fedfast.SimConfig(client_sampling="possion", dp_clip=1.0, dp_noise_multiplier=1.0)


@pytest.mark.parametrize("sampling", ["poisson", "uniform"])
def test_a_private_record_holds_only_what_is_accounted(sampling):
    """Without dp_diagnostics a private round's record has no training loss, cohort ids, round times or method
    values; the cohort's size only where it is public (fixed-size sampling); fixed-size sampling's records say what
    Poisson sampling would report for the same noise. dp_diagnostics = true keeps them; a plain run records the
    cohort size under Poisson sampling too."""
    kw = dict(dp_clip=0.1, dp_noise_multiplier=1.0, client_sampling=sampling, rounds=2)
    rec = _run(**kw)[1].run()[-1]
    assert rec["train_loss"] is None and rec["clients"] is None and rec["seconds"] is None and rec["timers"] is None
    assert "method_metrics" not in rec
    assert rec["cohort_size"] == (None if sampling == "poisson" else 4)
    if sampling == "uniform":
        assert 0 < rec["dp_epsilon_poisson"] < rec["dp_epsilon"]
    diag = _run(**kw, dp_diagnostics=True)[1].run()[-1]
    assert diag["train_loss"] > 0 and diag["seconds"] > 0 and len(diag["clients"]) == diag["cohort_size"]
    plain = _run(client_sampling="poisson")[1].run()[-1]
    assert plain["cohort_size"] == len(plain["clients"])


def test_a_private_run_directory_holds_no_unaccounted_value_nor_the_secret(tmp_path):
    """`fedfast run`: metrics.jsonl, metrics.csv and summary.json of a private Poisson run carry no training loss or
    times; summary.json the final epsilon; the secret only in checkpoint.pt (the threat model: the checkpoint is the
    trusted server's state)."""
    import json

    from fedfast.checkpoint import load
    from fedfast.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'dataset = "synthetic"\npartition = "iid"\nnum_clients = 20\nclients_per_round = 4\nrounds = 2\n'
        'batch_size = 32\nlr = 0.05\nclient_sampling = "poisson"\ndp_clip = 0.5\ndp_noise_multiplier = 1.0\n'
    )
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(x["train_loss"] is None and x["seconds"] is None and x["cohort_size"] is None for x in lines)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dp_epsilon"] > 0 and summary["wall_seconds"] is None
    key = load(str(out / "checkpoint.pt"))["state"]["privacy"]["secret"]["key"]
    for f in out.iterdir():
        if f.is_file() and f.name != "checkpoint.pt":
            assert key.encode() not in f.read_bytes(), f.name
