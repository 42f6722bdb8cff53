"""A run's fingerprint: what determines its result beyond its configuration, recorded in ``config.json`` and the
checkpoint, so that a resume (or a sweep adding seeds) on other code or data is refused, naming what changed.

* ``fedfast``: its version, the git commit of the checkout it runs from (if any), and a SHA-256 over its own Python
  files (an edit without a commit counts);
* ``code``: the plug-in files and every module they import from outside the Python installation (a helper module
  beside the plug-in, say; also one imported only when the plug-in's loader or model runs), each with its SHA-256;
* ``data``: every file the run's data came from - found by watching the files the dataset's loader opened for
  reading (:func:`fedfast._io.record_reads`), packages' own files aside - each with its size, modification time
  and SHA-256. A file is hashed once per (path, size, modification time): the hashes are kept in
  ``$FEDFAST_CACHE/file-hashes.json`` (default ``~/.cache/fedfast``), and a resume whose files have the recorded
  size and time takes the recorded hash, so large data is not read again;
* ``world_size``: how many processes trained the run (``--workers``, ``torchrun``).

A module of the user's own that a run imports only once its rounds run (a hook that imports a helper) is added to
``code`` by :class:`CodeWatch` after the round that imported it, before that round's checkpoint is written (and
``config.json`` rewritten): every module a run executed is recorded where a resume or a sweep checks it.

:func:`changes` lists the differences between a recorded fingerprint and the files now (what a resume and a
sweep's cell check); :func:`identity` is the short digest of what the results depend on (fedfast's source, the
code's and the data's content; not paths, times or the number of processes), by which a report keeps runs of
other code or data in rows of their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from . import __version__
from ._io import file_sha256, read_json, write_atomic
from .callbacks import Callback, source_commit
from .data.datasets import _cache_dir
from .methods import PLUGIN_CODE, user_code
from .rundir import dumps

_sha256_file = file_sha256  # data files' hashes (the name tests count calls of)

_MEMO: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256, this process
_SOURCE: dict = {}  # fedfast's own source digest, once per process


def _cache_path() -> str:
    return os.path.join(_cache_dir(), "file-hashes.json")


def file_record(path: str, known: dict | None = None) -> dict:
    """``{"size", "mtime_ns", "sha256"}`` of a file, hashed once per (path, size, mtime): ``known`` (a record of the
    same file) or the hash cache serve a file whose size and time are unchanged."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    rec = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if known and known.get("size") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns and known.get("sha256"):
        _MEMO[key] = known["sha256"]
    if key not in _MEMO:
        cache = _read_cache()
        hit = cache.get(key[0])
        if hit and hit[:2] == [st.st_size, st.st_mtime_ns]:
            _MEMO[key] = hit[2]
        else:
            _MEMO[key] = _sha256_file(path)
            cache[key[0]] = [st.st_size, st.st_mtime_ns, _MEMO[key]]
            _write_cache(cache)
    return {**rec, "sha256": _MEMO[key]}


def _read_cache() -> dict:
    try:
        got = read_json(_cache_path(), "file-hash cache")
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict) -> None:
    try:
        os.makedirs(os.path.dirname(_cache_path()), exist_ok=True)
        write_atomic(_cache_path(), json.dumps(cache))
    except OSError:  # a read-only home: hashed again next time, same result
        pass


def fedfast_source() -> dict:
    """fedfast's version, the commit of its checkout (None from a wheel) and the SHA-256 over its Python files."""
    if not _SOURCE:
        root = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256()
        for d, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    h.update(os.path.relpath(p, root).encode() + b"\0")
                    with open(p, "rb") as fh:
                        h.update(fh.read() + b"\0")
        _SOURCE.update(version=__version__, commit=source_commit(), source_sha256=h.hexdigest())
    return dict(_SOURCE)


def current(plugins, data_files, world_size: int, recorded: dict | None = None, code_files=()) -> dict:
    """The fingerprint of a run now: ``plugins`` (the run's plug-in files), ``data_files`` (the files its data was
    read from), ``world_size``; ``code_files``: modules of the user's own the run's build imported (a plug-in's
    loader importing its helpers when it runs). ``recorded``: a fingerprint to take unchanged files' hashes from."""
    code = {}
    for p in [*plugins, None]:
        for f in [p, *PLUGIN_CODE.get(p, ())] if p is not None else list(code_files):
            try:
                code[f] = file_sha256(f)
            except OSError:
                code[f] = None
    known = (recorded or {}).get("data") or {}
    data = {}
    for f in sorted(data_files):
        try:
            data[f] = file_record(f, known.get(f))
        except OSError:
            data[f] = None
    return {"fedfast": fedfast_source(), "code": code, "data": data, "world_size": int(world_size)}


_ROUND_CODE: set = set()  # user modules the rounds of this process's runs imported (a later run uses them too)


class CodeWatch(Callback):
    """Adds the user's modules first imported while the rounds run (a plug-in's hook importing a helper at round
    time) to the run's fingerprint ``fp`` (the dict the checkpoint's header holds: updated in place, so the next
    checkpoint records them) and rewrites ``config.json``'s in ``rd``. Put it before the
    :class:`~fedfast.callbacks.Checkpointer`. A module an earlier run of this process imported at its round time
    is not imported again: it is added to every later run's fingerprint too."""

    def __init__(self, rd, fp: dict):
        self.rd, self.fp = rd, fp
        self.before = set(sys.modules)

    def on_start(self, sim) -> None:
        self._check()

    def on_round(self, sim, rec: dict) -> None:
        self._check()

    def _check(self) -> None:
        new = set(sys.modules) - self.before
        if new:
            self.before |= new
            _ROUND_CODE.update(user_code([sys.modules[n] for n in new if n in sys.modules]))
        missing = sorted(_ROUND_CODE - set(self.fp["code"]))
        if not missing:
            return
        for f in missing:
            try:
                self.fp["code"][f] = file_sha256(f)
            except OSError:
                self.fp["code"][f] = None
        path = os.path.join(self.rd.path, "config.json")
        cfg = read_json(path, "config")
        cfg["fingerprint"] = self.fp
        self.rd.write("config.json", dumps(cfg, indent=2, sort_keys=True))


def identity(fp: dict | None) -> str | None:
    """A 12-character digest of what a run's results depend on: fedfast's source, the contents of its code and data
    files (not their paths or times, nor the number of processes); None for a run recorded without one."""
    if not fp:
        return None
    what = {
        "fedfast": (fp.get("fedfast") or {}).get("source_sha256"),
        "code": sorted(str(v) for v in (fp.get("code") or {}).values()),
        "data": sorted(str((r or {}).get("sha256")) for r in (fp.get("data") or {}).values()),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def changes(recorded: dict, now: dict) -> list[str]:
    """What differs between a recorded fingerprint and the current one, one phrase each (empty: nothing)."""
    out = []
    a, b = recorded.get("fedfast") or {}, now.get("fedfast") or {}
    if a.get("source_sha256") != b.get("source_sha256") or a.get("version") != b.get("version"):

        def ver(s):
            return f"{s.get('version')}" + (f" at commit {str(s['commit'])[:12]}" if s.get("commit") else "")

        out.append(
            f"fedfast's code (then {ver(a)}, source {str(a.get('source_sha256'))[:12]}; now {ver(b)}, source "
            f"{str(b.get('source_sha256'))[:12]})"
        )
    for kind in ("code", "data"):
        then, cur = recorded.get(kind) or {}, dict(now.get(kind) or {})
        if kind == "code":  # each recorded module must be unchanged; one only now is reached through recorded code
            for f in set(then) - set(cur):
                try:
                    cur[f] = file_sha256(f)
                except OSError:
                    cur[f] = None
            cur = {f: v for f, v in cur.items() if f in then}
        for f in sorted(set(then) | set(cur)):
            x, y = then.get(f), cur.get(f)
            hx = x.get("sha256") if isinstance(x, dict) else x
            hy = y.get("sha256") if isinstance(y, dict) else y
            if f not in cur:
                out.append(f"{kind} file {f} (read then, not now)")
            elif f not in then:
                out.append(f"{kind} file {f} (read now, not then)")
            elif hy is None:
                out.append(f"{kind} file {f} (gone)")
            elif hx != hy:
                out.append(f"{kind} file {f} (sha256 {str(hx)[:12]}... then, {str(hy)[:12]}... now)")
    return out
