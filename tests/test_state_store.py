"""The per-client state store (fedfast.store.ClientState) in memory and in a memory-mapped file (issue 38): every
mode reads as a dense [K, cols] table would; a file in a run directory is copy-on-write, so a checkpoint is never
overwritten before a newer one exists and a process killed during the scatter loses nothing; an older checkpoint
whose rows were reused, a replaced or missing file are refused by name; a run resumed after a kill inside the
scatter, and one over two processes sharing the file, end bit for bit as a run never stopped."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import fedfast
from fedfast import checkpoint
from fedfast.cli import main
from fedfast.store.rowfile import RowFile
from fedfast.store.state import ClientState

K, P = 40, 6
MODES = [
    ("memory", False, None),
    ("disk", False, None),
    ("disk", True, None),
    ("auto", False, 5 * P * 4),
    ("auto", True, 5 * P * 4),
]


def _rounds(st, ref, rounds, seed=0, m=5, at=None):
    """``rounds`` scatters of m random clients into ``st`` and the dense ``ref``; the state_dict after round
    ``at`` (with the reference then)."""
    g = torch.Generator().manual_seed(seed)
    saved = None
    for r in range(rounds):
        ids = torch.randperm(K, generator=g)[:m]
        rows = torch.randn(m, st.cols, generator=g)
        st.scatter_(ids, rows)
        ref[ids] = rows.to(ref.dtype)
        assert torch.equal(st.dense(), ref.float())
        assert torch.equal(st.gather(ids[:2]), ref[ids[:2]].float())
        if at == r:
            saved = (st.state_dict(), ref.clone())
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("store,in_dir,budget", MODES)
def test_every_store_reads_as_the_dense_table(store, in_dir, budget, dtype, tmp_path):
    d = str(tmp_path) if in_dir else None
    st = ClientState(K, P, fill=0.5, store=store, directory=d, memory_budget=budget, dtype=dtype)
    ref = torch.full((K, P), 0.5).to(dtype)
    assert not st.on_disk  # nothing written: no file yet
    (ck, ref_then) = _rounds(st, ref, 15, at=7)
    assert st.on_disk == (store != "memory")  # "auto" passed its 5 rows
    assert torch.allclose(st.mean(), ref.float().mean(0), atol=1e-6)
    assert st.written == int((ref != 0.5).any(1).sum())
    if st.on_disk and in_dir:
        assert os.path.exists(tmp_path / "client-state.rows") and "rows" not in ck  # the checkpoint refers to it
    elif st.on_disk:
        assert st.place.tmp is not None and "rows" in ck  # a temporary file: the checkpoint holds the rows
    back = ClientState(K, P, fill=0.5, store=store, directory=d, memory_budget=budget, dtype=dtype)
    back.load_state_dict(ck)
    assert torch.equal(back.dense(), ref_then.float())
    newest = st.state_dict()
    back.load_state_dict(newest)
    assert torch.equal(back.dense(), ref.float())


def test_a_file_store_is_copy_on_write_and_reuses_rows_after_the_next_checkpoint(tmp_path):
    st = ClientState(K, P, store="disk", directory=str(tmp_path))
    ids = torch.arange(5)
    g = torch.Generator().manual_seed(9)
    for _ in range(3):  # no checkpoint refers to the file: two sets of rows alternate
        st.scatter_(ids, torch.randn(5, P, generator=g))
    assert st.used == 11
    held = set(st.state_dict()["slots"].tolist())
    for _ in range(4):  # never a row the checkpoint holds: they wait; two other sets alternate
        slots = st.allocate(ids)
        assert not held & set(slots.tolist())
        st.write(slots, torch.randn(5, P, generator=g))
        st.assign(ids, slots)
    assert st.used == 16
    st.state_dict()  # a newer checkpoint: the first one's rows are free
    for _ in range(4):
        st.scatter_(ids, torch.randn(5, P, generator=g))
    assert st.used == 16 and len(st.free) + len(st.pending) == 10


def test_an_older_checkpoint_whose_rows_were_reused_is_refused(tmp_path):
    st = ClientState(K, P, store="disk", directory=str(tmp_path))
    ref = torch.zeros(K, P)
    old = _rounds(st, ref, 4, at=3)[0]
    _rounds(st, ref, 2, seed=1)
    st.state_dict()
    _rounds(st, ref, 6, seed=2)  # reuses rows `old` held
    with pytest.raises(
        ValueError,
        match=r"client-state.rows: the rows of \d+ client\(s\).*overwritten after this "
        r"checkpoint.*newest checkpoint",
    ):
        ClientState(K, P, store="disk", directory=str(tmp_path)).load_state_dict(old)


def test_a_missing_replaced_or_elsewhere_file_is_refused_by_name(tmp_path):
    st = ClientState(K, P, store="disk", directory=str(tmp_path))
    _rounds(st, torch.zeros(K, P), 3)
    ck = st.state_dict()
    with pytest.raises(ValueError, match=r"in the file client-state.rows of its run directory.*state_dir"):
        ClientState(K, P, store="disk").load_state_dict(ck)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(
        ValueError,
        match=r"other/client-state.rows: the per-client state file this checkpoint "
        r"refers to is missing",
    ):
        ClientState(K, P, store="disk", directory=str(other)).load_state_dict(ck)
    RowFile.create(str(other / "client-state"), P, torch.float32, 4)
    with pytest.raises(ValueError, match=r"another per-client state file than the checkpoint's"):
        ClientState(K, P, store="disk", directory=str(other)).load_state_dict(ck)
    (other / "client-state.rows").write_bytes(b"not a state file" * 300)
    with pytest.raises(ValueError, match=r"not a fedfast per-client state file"):
        ClientState(K, P, store="disk", directory=str(other)).load_state_dict(ck)
    with pytest.raises(ValueError, match=r"expected 40 x 7 float32"):
        ClientState(K, P + 1, store="disk", directory=str(tmp_path)).load_state_dict(ck)


def test_bad_store_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="store: 'memory', 'disk' or 'auto'"):
        ClientState(K, P, store="ssd")
    with pytest.raises(ValueError, match="memory_budget: bytes > 0"):
        ClientState(K, P, store="auto", memory_budget=0)
    with pytest.raises(ValueError, match="directory: .* is not a directory"):
        ClientState(K, P, store="disk", directory=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="state_store: one of"):
        fedfast.SimConfig(state_store="ssd")
    with pytest.raises(ValueError, match="state_memory_gb: the limit of state_store = 'auto'"):
        fedfast.SimConfig(state_store="disk", state_memory_gb=1.0)


def test_auto_moves_to_the_file_past_its_limit_with_the_rows_so_far(tmp_path):
    st = ClientState(K, P, store="auto", directory=str(tmp_path), memory_budget=10 * P * 4)
    ref = torch.zeros(K, P)
    g = torch.Generator().manual_seed(0)
    for r in range(6):
        ids = torch.arange(2 * r, 2 * r + 2)
        rows = torch.randn(2, P, generator=g)
        assert st.spills(ids) == (r == 4)  # 1 + 8 rows fit 10; 1 + 10 do not
        st.scatter_(ids, rows)
        ref[ids] = rows
        assert st.on_disk == (r >= 4) and torch.equal(st.dense(), ref)
    assert st.nbytes == st.slot_of.nbytes + st.free.nbytes + st.pending.nbytes  # the table left memory
    assert st.file_bytes == st.used * P * 4
    # a checkpoint of rows in memory loads into memory (every process alike); the next scatter moves them
    mem = ClientState(K, P, store="memory")
    mem.scatter_(np.arange(12), ref[:12])
    os.makedirs(tmp_path / "b")
    back = ClientState(K, P, store="auto", directory=str(tmp_path / "b"), memory_budget=10 * P * 4)
    back.load_state_dict(mem.state_dict())
    assert not back.on_disk and torch.equal(back.dense(), mem.dense())
    back.scatter_([30], torch.ones(1, P))
    assert (
        back.on_disk
        and torch.equal(back.gather(np.arange(12)), ref[:12])
        and torch.equal(back.gather([30]), torch.ones(1, P))
    )


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident memory from /proc")
def test_a_host_table_reserves_the_runs_rows_and_holds_only_those_written():
    """A host table is allocated once for the rows a run can write (no growth copies); the pages of rows never
    written take no memory."""
    cols = 25_000  # 100 KB a row; 4000 rows: 400 MB reserved
    before = _rss()
    st = ClientState(10**6, cols, max_rows=4000)
    st.scatter_(np.arange(100), torch.ones(100, cols))
    table = st.table
    assert table.shape[0] == 4000 and st.nbytes == 8 * 10**6 + 101 * cols * 4
    assert _rss() - before < 100 * 2**20  # 10 MB written, 400 MB reserved
    st.scatter_(np.arange(100, 3000), torch.ones(2900, cols)[:, :1].expand(2900, cols))
    assert st.table is table  # no growth, no copy
    assert torch.equal(st.gather([5, 2999]), torch.ones(2, cols))


def test_the_python_api_without_a_directory_keeps_the_file_temporary_and_checkpoints_the_rows():
    from fedfast import data, models

    train, test = data.synthetic(3, 300, 30, (8,), seed=0)
    part = data.iid(train.y, 12, seed=0)
    cfg = fedfast.SimConfig(algorithm="scaffold", clients_per_round=4, rounds=4, state_store="disk")

    def make():
        torch.manual_seed(0)
        return fedfast.Simulation(cfg, models.MLP(8, (16,), 3), train, test, part)

    whole, half = make(), make()
    whole.run()
    half.round(), half.round()
    st = half.method.client_state
    assert st.on_disk and not st.cow and os.path.isfile(st.file.paths[0])
    ck = half.checkpoint()
    assert ck["method"]["client_state"]["rows"].shape == (st.written, st.cols)  # the rows, not the file's name
    resumed = make()
    resumed.restore(ck)
    resumed.run()
    assert torch.equal(resumed.global_flat, whole.global_flat)
    tmp = os.path.dirname(st.file.paths[0])
    del half, st
    import gc

    gc.collect()
    assert not os.path.exists(tmp)  # the temporary directory goes with the store


def test_a_full_disk_while_the_file_grows_is_a_write_error_naming_it(tmp_path, monkeypatch):
    """The rows a round writes get their disk blocks first (posix_fallocate): a full disk is a WriteError naming the
    file there, never a SIGBUS from a write through the mapping."""
    from fedfast._io import WriteError

    st = ClientState(K, P, store="disk", directory=str(tmp_path))
    st.scatter_(np.arange(3), torch.ones(3, P))

    def full(fd, off, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(WriteError, match=r"client-state.rows: could not be written \(No space left on device"):
        st.scatter_(np.arange(3, 40), torch.ones(37, P))
    assert st.written == 3 and torch.equal(st.gather([0, 5]), torch.tensor([[1.0] * P, [0.0] * P]))


# -- runs: the CLI with the store forced to disk -----------------------------------------------------------------
ARGS = [
    "--set",
    "dataset=synthetic",
    "--set",
    "num_clients=20",
    "--set",
    "clients_per_round=5",
    "--set",
    "algorithm=scaffold",
    "--set",
    "local_epochs=1",
    "--set",
    "batch_size=20",
    "--set",
    "model=mlp",
    "--set",
    "state_store=disk",
    "--set",
    "checkpoint_every=1",
]

KILL_IN_SCATTER = """
import os, signal, sys
from fedfast.store.state import ClientState
real = ClientState.write
def write(self, slots, rows):
    if self.seq == 3:  # round 4: half the rows into the file, then the process dies
        real(self, slots[:2], rows[:2])
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, slots, rows)
ClientState.write = write
from fedfast.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _metrics(d):
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("seconds", "timers")}
        for line in open(os.path.join(d, "metrics.jsonl"))
    ]


def _final(d):
    return torch.load(os.path.join(d, "model_final.pt"), weights_only=True)


def _same_run(a, b):
    assert _metrics(a) == _metrics(b)
    x, y = _final(a), _final(b)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# "auto" with room for 12 rows of the MLP's 199,210 parameters: in memory for two rounds, then the file (round 3)
STORES = {"disk": [], "auto": ["--set", "state_store=auto", "--set", "state_memory_gb=0.009"]}


@pytest.mark.parametrize("store", sorted(STORES))
def test_a_kill_during_the_scatter_loses_nothing_and_resume_is_bit_exact(tmp_path, store):
    args = [*ARGS, *STORES[store]]
    ref = tmp_path / "ref"
    assert main(["run", *args, "--set", "rounds=6", "--out", str(ref), "--quiet"]) == 0
    assert os.path.getsize(ref / "client-state-scaffold.rows") > 4096  # the rows are in the run's file
    marker = json.load(open(ref / ".fedfast-run.json"))
    assert {"client-state-scaffold.rows", "client-state-scaffold.stamps"} <= set(marker["files"])
    out = tmp_path / "killed"
    p = subprocess.run(
        [sys.executable, "-c", KILL_IN_SCATTER, "run", *args, "--set", "rounds=6", "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert len(_metrics(out)) == 3  # killed inside round 4's scatter, after round 3's checkpoint
    ck = checkpoint.load(str(out / "checkpoint.pt"))["state"]["method"]["client_state"]
    assert "file" in ck and "rows" not in ck  # round 3's checkpoint refers to the file ("auto": moved there then)
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    _same_run(out, ref)


def test_a_run_whose_state_file_meets_a_full_disk_stops_naming_it_and_resumes(tmp_path, monkeypatch, capsys):
    ref, out = tmp_path / "ref", tmp_path / "full"
    assert main(["run", *ARGS, "--set", "rounds=4", "--out", str(ref), "--quiet"]) == 0
    real, calls = os.posix_fallocate, {"n": 0}

    def full(fd, off, size):
        calls["n"] += 1
        if calls["n"] > 4:  # the file made and round 1's rows reserved (rows and stamps each); then the disk is full
            raise OSError(28, "No space left on device")
        return real(fd, off, size)

    monkeypatch.setattr(os, "posix_fallocate", full)
    capsys.readouterr()
    assert main(["run", *ARGS, "--set", "rounds=4", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        "client-state-scaffold.rows: could not be written (No space left on device); the run's files up to its "
        "checkpoint of round 1 are intact" in err
    ), err
    monkeypatch.setattr(os, "posix_fallocate", real)
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    _same_run(out, ref)


def test_workers_share_one_file_and_resume_to_the_one_process_run(tmp_path):
    ref = tmp_path / "ref"
    assert main(["run", *ARGS, "--set", "rounds=4", "--out", str(ref), "--quiet"]) == 0
    two = tmp_path / "two"
    assert main(["run", *ARGS, "--set", "rounds=2", "--workers", "2", "--out", str(two), "--quiet"]) == 0
    assert sorted(f for f in os.listdir(two) if f.startswith("client-state")) == [
        "client-state-scaffold.rows",
        "client-state-scaffold.stamps",
    ]  # one file for both processes
    assert main(["run", "--resume", str(two), "--set", "rounds=4", "--workers", "2", "--quiet"]) == 0
    got, want = _metrics(two), _metrics(ref)
    assert [r["round"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, want, strict=True):  # two processes sum in another order: equal to rounding
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=0.02)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    x, y = _final(two), _final(ref)
    assert all(torch.allclose(x[k], y[k], atol=1e-5) for k in x)


def test_the_store_protocol_is_public_and_the_old_rowfile_address_warns():
    """Issue 61: fedfast.store.shared reaches the store through its public protocol only (no private name of
    ClientState), and fedfast.rowfile still resolves for one release, warning."""
    import ast
    import inspect

    import fedfast.rowfile as old
    from fedfast.store import rowfile as home, shared

    tree = ast.parse(inspect.getsource(shared))
    private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")]
    assert private == [], private
    for verb in ("allocate", "write", "assign", "spills", "spill", "attach", "follow"):
        assert verb in ClientState.__dict__ and ClientState.__dict__[verb].__doc__, verb
    with pytest.warns(DeprecationWarning, match=r"fedfast.rowfile.RowFile moved to fedfast.store.rowfile.RowFile"):
        assert old.RowFile is home.RowFile
    with pytest.raises(AttributeError):
        _ = old.NoSuchName


def test_the_row_map_alone():
    """Issue 61: the row map apart from the store. In memory a client keeps its row; copy-on-write every write takes
    a fresh row, the superseded one waits (pending) while the latest checkpoint may hold it, and is reused only
    after the next checkpoint; a checkpoint's map restores with every other row free."""
    from fedfast.store.rowmap import RowMap

    grown = []
    m = RowMap(6)
    a = np.array([4, 1])
    s1 = m.allocate(a, False, lambda used, need: grown.append((used, need)))
    m.assign(a, s1, cow=False)
    assert list(s1) == [1, 2] and grown == [(1, 3)] and m.written == 2 and m.seq == 1
    s2 = m.allocate(np.array([1, 5]), False, lambda *_: None)
    assert list(s2) == [2, 3]  # client 1 keeps row 2, client 5 gets a new one
    stamps = np.zeros(16, dtype=np.int64)
    c = RowMap(6)
    c.uncommitted()
    for rnd in range(1, 3):
        s = c.allocate(a, True, lambda *_: None)
        stamps[s] = rnd
        c.assign(a, s, cow=True, stamps=stamps)
    assert list(c.free) == [1, 2] and len(c.pending) == 0  # no checkpoint: free at once
    c.commit()
    s = c.allocate(a, True, lambda *_: None)  # reuses the free rows
    assert sorted(s) == [1, 2]
    stamps[s] = 3
    c.assign(a, s, cow=True, stamps=stamps)
    assert sorted(c.pending) == [3, 4] and len(c.free) == 0  # the checkpoint holds rows 3 and 4
    s = c.allocate(a, True, lambda *_: None)
    assert sorted(s) == [5, 6]  # never a held row
    c.commit()
    assert sorted(c.free) == [3, 4]
    ids, slots = c.referenced()
    r = RowMap(6)
    r.restore(ids, slots, c.used, c.seq)
    assert list(r.slot_of) == list(c.slot_of) and sorted(r.free) == [3, 4, 5, 6] and r.written == 2
