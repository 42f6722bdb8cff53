"""Private runs (issue 49): DP-FedAvg in the engine against the literal loop (clip each client's delta, sum, add the
same noise, divide by the expected cohort size), Poisson sampling with empty cohorts, the noise's standard
deviation, epsilon against the accountant called directly, calibration, checkpoints, and the refusals by name."""

import copy
import math

import pytest
import torch

import fedfast
from fedfast import privacy
from fedfast.sampling import sample_clients_poisson

from sequential_loop import sequential, setup_data

pytest.importorskip("dp_accounting")

BASE = dict(clients_per_round=4, rounds=3, local_epochs=1, batch_size=16, lr=0.05, seed=3, max_grad_norm=0.0)


def _run(algorithm="fedavg", options=None, **kw):
    train, test, part, model = setup_data("mlp")
    cfg = fedfast.SimConfig(algorithm=algorithm, options=options or {}, **{**BASE, **kw})
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    return cfg, sim, (train, test, part, model)


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
    sampled_fn = (
        (lambda r: sample_clients_poisson(cfg.seed, r, K, cfg.clients_per_round / K)) if sampling == "poisson" else None
    )
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
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
    gen2 = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    no_clip = sequential(
        cfg,
        copy.deepcopy(start),
        train,
        part,
        cfg.rounds,
        sampled_fn=sampled_fn,
        dp=dict(clip=1e9, z=0.7 * 0.05 / 1e9, E=float(cfg.clients_per_round), gen=gen2),
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
    rounds = [r for r in range(40) if len(sample_clients_poisson(3, r, K, 1 / K)) == 0]
    assert rounds, "no empty cohort in 40 rounds"
    n = rounds[0] + 1
    for dp in ({}, dict(dp_clip=0.05, dp_noise_multiplier=1.0)):
        cfg = fedfast.SimConfig(
            algorithm="fedavg", **{**BASE, "clients_per_round": 1, "rounds": n}, client_sampling="poisson", **dp
        )
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
        for _ in range(n - 1):
            sim.round()
        before = sim.global_flat.clone()
        rec = sim.round()
        assert rec["clients"] == []
        if not dp:
            assert torch.equal(sim.global_flat, before)
        else:
            gen = torch.Generator().manual_seed(3 + 1_000_003)
            for _ in range(n):  # one draw per round, empty or not
                xi = torch.randn(before.shape, generator=gen)
            assert torch.allclose(sim.global_flat, before + xi * (1.0 * 0.05 / 1.0), rtol=0, atol=1e-7)


def test_noise_standard_deviation_is_z_clip_over_the_expected_cohort():
    from fedfast.sim.privacy import PrivacySettings, RoundPrivacy

    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=8, rounds=1, dp_clip=0.5, dp_noise_multiplier=1.3)
    p = RoundPrivacy(PrivacySettings.of(cfg), cfg.method(), 100, torch.device("cpu"))
    g = torch.zeros(200_000)
    noise = p.average(g, torch.zeros_like(g))
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
        (dict(algorithm="scaffold"), "scaffold uploads its control variates"),
        (dict(algorithm="feddistill_plus"), "per-label mean logits"),
        (dict(algorithm="feddisco"), "label distribution"),
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


def test_adaptive_clipping_equals_the_literal_loop():
    """dp_clip_quantile 0.5: the updates noised with z_update = (z^-2 - (2 sigma_b)^-2)^(-1/2), the count of unclipped
    updates with sigma_b, and the clip moved geometrically each round, as the loop does; the records show the clip
    each round used, and epsilon is the accountant's at z (the count's release is inside it)."""
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
    dp = dict(
        clip=0.05,
        z=0.7,
        z_update=z_update,
        E=E,
        gen=torch.Generator().manual_seed(cfg.seed + 1_000_003),
        quantile=0.5,
        lr_c=0.2,
        sigma_b=sigma_b,
    )
    ref = sequential(
        cfg, start, train, part, cfg.rounds, dp=dp, sampled_fn=lambda r: sample_clients_poisson(cfg.seed, r, K, 4 / K)
    )
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
def test_every_method_runs_a_private_round_or_is_refused_by_name():
    """Issue 49's contract: under dp_clip each registered method either trains a private round (its uploads are its
    update alone) or is refused naming what it uploads."""
    train, test, part, model = setup_data("mlp")
    ran, refused = [], []
    for name in sorted(fedfast.methods.BUILTIN):
        cls = fedfast.methods.get(name)
        try:
            cfg = fedfast.SimConfig(
                algorithm=name, dp_clip=0.5, dp_noise_multiplier=1.0, **{**BASE, "rounds": 1, "clients_per_round": 3}
            )
        except ValueError as e:  # (and a method with the +asd add-on: the base's uploads decide)
            assert cls.uploads and cls.uploads in str(e) and "dp_clip" in str(e), (name, e)
            refused.append(name)
            continue
        assert not cls.uploads, name
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
    assert {"fedavg", "fedntd", "fedgkd", "fedgkd_vote", "moon"} <= set(ran), ran
    assert {"scaffold", "feddyn", "fednova", "fedgen"} <= set(refused), refused


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
        fedfast.flat.NoSuchName
    with pytest.raises(AttributeError):
        fedfast.methods.kd.NoSuchName


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
