"""The memory budget of a run, as pure functions of sizes (issue 37, "the memory budget as functions"): the bytes one
client of a chunk needs, how many clients a chunk holds, and the message of an :class:`~fedfast.sim.memory.OutOfMemory`
naming the setting to change. The engine measures the inputs (the model's activations, what the device has free)
and calls these; nothing here reads a device or a model, so each is tested alone (``tests/test_budget.py``)."""

from __future__ import annotations

from .memory import CPU_CHUNK_PARAM_BYTES, _gib


def param_rows(optimizer_rows: int, state_columns: int | None, num_params: int, sam_rows: int) -> int:
    """Parameter-sized fp32 buffers per client of a chunk: the parameters, the flat gradient buffer and autograd's
    per-parameter gradients (3), the client optimiser's (``optimizer_rows``), the method's per-client state rows,
    gathered and updated (2 x ``state_columns`` / ``num_params``; ``state_columns`` None: no state) and a SAM step's
    (``sam_rows``)."""
    state = 2 * state_columns // max(num_params, 1) if state_columns is not None else 0
    return 3 + optimizer_rows + state + sam_rows


def client_bytes(num_params: int, rows: int, probe_activations: int, batch_size: int) -> tuple[int, int]:
    """(parameter-row bytes, activation bytes) of one client: ``rows`` fp32 buffers of ``num_params``, and the
    activations measured on two probe samples (``probe_activations`` elements), x3 for the backward, per sample of
    a batch."""
    return 4 * num_params * rows, 3 * 4 * probe_activations // 2 * batch_size


def budget_bytes(memory_budget_gb: float | None, device_type: str, free_bytes: int) -> float:
    """The bytes a chunk may use: ``memory_budget_gb`` if set, else 80 % of a GPU's free memory, 60 % of the CPU's
    available memory."""
    if memory_budget_gb:
        return memory_budget_gb * 2**30
    return (0.8 if device_type == "cuda" else 0.6) * free_bytes


def chunk_clients(budget: float, row_bytes: int, act_bytes: int, num_params: int, device_type: str) -> int:
    """Clients per chunk: as many as fit ``budget`` at ``row_bytes + act_bytes`` each (at least 1); on a CPU also
    at most ``CPU_CHUNK_PARAM_BYTES`` of the chunk's parameters (larger chunks are slower per sample there)."""
    n = max(1, int(budget // max(row_bytes + act_bytes, 1)))
    if device_type == "cpu":
        n = min(n, max(1, CPU_CHUNK_PARAM_BYTES // (4 * num_params)))
    return n


def oom_message(
    what: str,
    key: str,
    *,
    next_round: int,
    memory_state: str,
    chunk: int,
    num_params: int,
    row_bytes: int,
    act_bytes: int,
    batch_size: int,
    eval_batch: int,
) -> str:
    """The message of an out-of-memory failure in ``what`` (during round ``next_round``, 1-based, unless ``what`` is
    an allocation at set-up): the memory state, the estimate, and the setting ``key`` (``client_chunk`` or
    ``eval_batch``, whose results do not depend on them; ``state_dtype``: the per-client state store)."""
    when = "" if what.startswith("allocating") else f"round {next_round}: "
    head = f"{when}out of memory in {what} ({memory_state}). "
    if key == "client_chunk":
        per = row_bytes + act_bytes
        return head + (
            f"Training {chunk} clients at once needs about {_gib(chunk * per)} by fedfast's estimate "
            f"({per / 2**20:.1f} MiB per client: {num_params} parameters x "
            f"{row_bytes // max(4 * num_params, 1)} parameter-sized fp32 buffers, plus batch-{batch_size} "
            f"activations). Set client_chunk = "
            f"{max(1, chunk // 2)} (or a lower memory_budget_gb) to train fewer clients at a time; results "
            f"do not depend on it."
        )
    if key == "state_dtype":
        return head + (
            "The store holds a row for every client trained so far: state_dtype = 'bfloat16' halves it, "
            "state_on_host = true moves it to host memory, state_store = 'disk' (or a lower "
            "state_memory_gb with state_store = 'auto') keeps the rows in a memory-mapped file of the run "
            "directory, fewer rounds or a smaller cohort touch fewer clients."
        )
    return head + f"Set eval_batch lower than {eval_batch} (rows per forward pass); results do not depend on it."
