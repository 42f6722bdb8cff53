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
    config.addinivalue_line("markers", "slow: slower CPU tests")


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
