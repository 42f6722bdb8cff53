"""Issue 50: hooks return what they compute and the engine owns the accumulation; Round is read-only for methods.
A plug-in written to the old guide (writing ctx.new_rows, ctx.incr, ctx.reduce) keeps working for one release with a
DeprecationWarning naming the new form, and ends where the new form ends; wrong returns are refused naming the hook."""

import copy

import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast.methods import Collected, FedAvg, StateSpec, register
from fedfast.methods.hooks import HookError

CFG = dict(clients_per_round=4, rounds=3, local_epochs=1, batch_size=16, lr=0.05, seed=2)


class NewForm(FedAvg):
    """Per-client rows (each client's last local model), a server increment (the sum of the updates / K) and a
    declared sum (the squared update norms), in the new form."""

    def client_state_spec(self, engine):
        return StateSpec()

    def setup(self):
        self.total = torch.zeros(self.engine.num_params)
        self.sq = torch.zeros(())

    def round_start(self, ctx):
        return {"sq": torch.zeros(())}

    def collect(self, ctx, out, lo, hi):
        w = self.engine.client_params(hi - lo)
        d = w - self.engine.global_flat
        return Collected(rows=w, increment=d.sum(0) / self.engine.num_clients, sums={"sq": d.pow(2).sum()})

    def server(self, ctx, avg):
        self.total = self.total + ctx.increment
        self.sq = self.sq + ctx.sums["sq"]
        return super().server(ctx, avg)


class OldForm(NewForm):
    """The same method written to the old guide: state allocated in setup, writes into the Round."""

    def client_state_spec(self, engine):
        return None

    def setup(self):
        super().setup()
        self.client_state = self.engine.new_client_state()

    def round_start(self, ctx):
        ctx.reduce["sq"] = torch.zeros(())

    def collect(self, ctx, out, lo, hi):
        w = self.engine.client_params(hi - lo)
        d = w - self.engine.global_flat
        ctx.new_rows[lo:hi] = w
        ctx.incr += d.sum(0) / self.engine.num_clients
        ctx.reduce["sq"] += d.pow(2).sum()

    def server(self, ctx, avg):
        self.total = self.total + ctx.incr
        self.sq = self.sq + ctx.reduce["sq"]
        return FedAvg.server(self, ctx, avg)


def _sim(name):
    train, test, part, model = setup_data()
    return fedfast.Simulation(fedfast.SimConfig(algorithm=name, **CFG), copy.deepcopy(model), train, test, part)


@pytest.fixture
def registered():
    names = []

    def add(name, cls):
        register(name)(cls)
        names.append(name)
        return name

    yield add
    for n in names:
        fedfast.methods.unregister(n)


def test_the_old_guide_still_works_warned_and_ends_where_the_new_form_ends(registered):
    new = _sim(registered("hooks_new_test", NewForm))
    new.run()
    with pytest.warns(DeprecationWarning) as caught:
        old = _sim(registered("hooks_old_test", OldForm))
        old.run()
    said = " ".join(str(w.message) for w in caught)
    for form in ("client_state_spec", "Collected(rows=", "Collected(increment=", "ctx.sums[name]"):
        assert form in said, form
    assert torch.equal(new.global_flat, old.global_flat)
    assert torch.equal(new.method.total, old.method.total) and torch.equal(new.method.sq, old.method.sq)
    assert new.method.sq > 0 and new.method.total.abs().sum() > 0
    assert torch.equal(new.method.client_state.dense(), old.method.client_state.dense())
    assert new.method.client_state.written > 0


def test_a_round_is_read_only_for_methods(registered):
    class Writes(FedAvg):
        def round_start(self, ctx):
            ctx.mine = 1

    with pytest.raises(AttributeError, match=r"Round.mine: a Round is read-only for methods.*Collected"):
        _sim(registered("hooks_writes_test", Writes)).round()


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda ctx, n: 3, r"collect.*must return a fedfast.methods.Collected"),
        (lambda ctx, n: Collected(rows=torch.zeros(n, 7)), r"Collected.rows must be the chunk's clients' new rows"),
        (lambda ctx, n: Collected(increment=torch.zeros(3)), r"Collected.increment must be a tensor"),
        (
            lambda ctx, n: Collected(sums={"other": torch.zeros(())}),
            r"Collected.sums\['other'\]: not one of the round's",
        ),
        (lambda ctx, n: Collected(sums={"sq": torch.zeros(2)}), r"Collected.sums\['sq'\] must be a tensor \(\)"),
    ],
)
def test_wrong_returns_are_refused_naming_the_hook(registered, bad, match):
    class Wrong(NewForm):
        def collect(self, ctx, out, lo, hi):
            return bad(ctx, hi - lo)

    with pytest.raises(HookError, match=match):
        _sim(registered("hooks_wrong_test", Wrong)).round()


def test_rows_without_declared_state_and_a_bad_round_start_are_refused(registered):
    class NoState(FedAvg):
        def collect(self, ctx, out, lo, hi):
            return Collected(rows=self.engine.client_params(hi - lo))

    class BadStart(FedAvg):
        def round_start(self, ctx):
            return [torch.zeros(())]

    with pytest.raises(HookError, match="declares no per-client state"):
        _sim(registered("hooks_nostate_test", NoState)).round()
    with pytest.raises(HookError, match="round_start.*must return the round's sums"):
        _sim(registered("hooks_badstart_test", BadStart)).round()


def test_the_round_record_is_never_written_after_the_plan_builds_it(registered):
    """Issue 61: the plan builds the Round complete; the engine's accumulators (RoundSums) and each chunk's state come
    as new records. Every record a hook sees keeps every field it had when first seen, to the end of the run; the
    chunk's hooks see what chunk_start returned; server reads the sums that collect returned."""
    import dataclasses

    seen = []  # (record, {field: value}) at first sight

    class Watch(NewForm):
        def _see(self, ctx):
            if not any(r is ctx for r, _ in seen):
                seen.append((ctx, {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}))

        def round_start(self, ctx):
            self._see(ctx)
            assert ctx.rows is not None and ctx.seen_hist is not None  # complete before round_start
            return super().round_start(ctx)

        def chunk_start(self, ctx, lo, hi):
            self._see(ctx)
            assert ctx.chunk is None
            return ("chunk", lo, hi)

        def step_terms(self, ctx, n_act):
            assert ctx.chunk[0] == "chunk"
            return {}

        def collect(self, ctx, out, lo, hi):
            self._see(ctx)
            assert ctx.chunk == ("chunk", lo, hi)
            return super().collect(ctx, out, lo, hi)

        def server(self, ctx, avg):
            self._see(ctx)
            return super().server(ctx, avg)

    sim = _sim(registered("hooks_watch_test", Watch))
    sim.run()
    new = _sim(registered("hooks_new_ref_test", NewForm))
    new.run()
    assert torch.equal(sim.global_flat, new.global_flat) and torch.equal(sim.method.sq, new.method.sq)
    assert len(seen) >= 3 * CFG["rounds"]
    for rec, fields in seen:
        for name, value in fields.items():
            assert getattr(rec, name) is value, name
    with pytest.raises(AttributeError, match="read-only"):
        seen[0][0].sampled = None


def test_the_old_chunk_write_and_the_old_addresses_warn_and_still_work(registered):
    class OldChunk(FedAvg):
        def chunk_start(self, ctx, lo, hi):
            ctx.chunk = ("mine", lo)

        def step_terms(self, ctx, n_act):
            assert ctx.chunk[0] == "mine"
            return {}

    with pytest.warns(DeprecationWarning, match=r"Round.chunk is deprecated.*return the chunk's state"):
        _sim(registered("hooks_old_chunk_test", OldChunk)).round()
    import fedfast.methods.base as base
    from fedfast.methods import options, round

    for name, home in [("Round", round), ("Collected", round), ("opt", options), ("coerce_option", options)]:
        with pytest.warns(DeprecationWarning, match=rf"fedfast.methods.base.{name} moved to {home.__name__}"):
            assert getattr(base, name) is getattr(home, name)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _ = base.Nothing
