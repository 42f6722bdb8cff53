"""Checkpoint files and atomic writes.

A checkpoint is ``MAGIC`` + the SHA-256 of the payload + the payload, a ``torch.save`` of tensors, numbers,
strings, lists and dicts only. Reading checks the magic (not a fedfast checkpoint), the length and the hash
(truncated or corrupt) before anything is deserialised, and then deserialises with ``torch.load(...,
weights_only=True)``, which builds no arbitrary object. Every file is written atomically: a temporary file in
the same directory, flushed and fsynced, renamed over the target, and the directory fsynced.
"""

from __future__ import annotations

import hashlib
import io

import torch

from ._io import write_atomic

MAGIC = b"FEDFAST-CHECKPOINT v1\n"


def save(path: str, payload: dict) -> None:
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    write_atomic(path, MAGIC + hashlib.sha256(data).hexdigest().encode() + b"\n" + data)


def load(path: str) -> dict:
    """The payload of a checkpoint; ValueError saying what is wrong with a file that is not a whole, intact
    fedfast checkpoint."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no checkpoint (the run has not written one yet)") from None
    if not raw.startswith(MAGIC):
        raise ValueError(f"{path}: not a fedfast checkpoint (bad header)")
    head = len(MAGIC) + 65
    if len(raw) < head:
        raise ValueError(f"{path}: truncated checkpoint ({len(raw)} bytes)")
    digest, data = raw[len(MAGIC) : head - 1].decode(errors="replace"), raw[head:]
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"{path}: corrupt or truncated checkpoint (checksum mismatch over {len(data)} bytes)")
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - weights_only refuses anything but plain data
        what = (
            "it holds objects other than tensors and plain data, which fedfast never loads"
            if "weights_only" in str(e) or "Unsupported global" in str(e)
            else type(e).__name__
        )
        raise ValueError(
            f"{path}: unreadable checkpoint payload ({what}); fedfast wrote no such file, refusing it"
        ) from None
