import os

# Triton runs here only in its interpreter, which must be selected before any @triton.jit is imported.
if os.environ.get("FEDFAST_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fedfast.ops import _backend  # noqa: E402


def cpu_backends():
    out = ["reference"]
    if _backend.cpu_ext() is not None:
        out.append("cpu")
    if _backend.available("triton", "cpu"):
        out.append("triton")
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run with FEDFAST_GPU_TESTS=1 on a GPU machine)")
    config.addinivalue_line(
        "markers",
        "slow: tests of 9 s or more on a 2-core machine (wheel builds, CMake, sm_90 "
        "compiles, multi-process runs); pytest -m 'not slow' runs the rest",
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for it in items:
        if "gpu" in it.keywords:
            it.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory):
    """Decoded-dataset caches (fedfast.data) go to a temporary directory, not the user's ~/.cache."""
    old = os.environ.get("FEDFAST_CACHE")
    os.environ["FEDFAST_CACHE"] = str(tmp_path_factory.mktemp("fedfast-cache"))
    yield
    if old is None:
        os.environ.pop("FEDFAST_CACHE", None)
    else:
        os.environ["FEDFAST_CACHE"] = old


def _torch_state() -> dict:
    """The process-wide torch settings a test could leave changed for the tests after it (a thread count changed
    by one test once made a later test hit a oneDNN bug that shows only at 1 thread)."""
    return {
        "threads": torch.get_num_threads(),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "grad mode": torch.is_grad_enabled(),
    }


def _restore(state: dict) -> None:
    torch.set_num_threads(state["threads"])
    torch.set_default_dtype(state["default dtype"])
    torch.use_deterministic_algorithms(
        state["deterministic algorithms"][0], warn_only=state["deterministic algorithms"][1]
    )
    torch.backends.cudnn.deterministic = state["cudnn.deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn.benchmark"]
    torch.set_float32_matmul_precision(state["float32 matmul precision"])
    torch.set_grad_enabled(state["grad mode"])


@pytest.fixture(autouse=True)
def _torch_state_kept():
    """Fails a test that leaves torch's global state changed (restoring it first, so the tests after it run in the
    usual state): the thread count, default dtype, deterministic flags, matmul precision, grad mode."""
    before = _torch_state()
    yield
    after = _torch_state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if changed:
        _restore(before)
        pytest.fail(
            "the test left torch's global state changed (before -> after): "
            + "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items()),
            pytrace=False,
        )
