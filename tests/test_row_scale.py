"""The losses' row bookkeeping on the GPU backends (reduction weights + deferred target/segment checks in one launch),
against the tensor-op reference, run here through the Triton interpreter; the CUDA twin is in tests/test_gpu.py."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedfast import ops
from fedfast.ops import _backend, _validate
from fedfast.ops.distill import device_row_scale, row_scale_torch

pytestmark = pytest.mark.skipif(not _backend.available("triton", "cpu"), reason="triton not importable")


def _flags(y, seg, C, limit, ignore_index=-100):
    bad_t = bool((((y < 0) | (y >= C)) & (y != ignore_index)).any())
    bad_s = False
    if seg is not None and seg.numel():
        bad_s = bool((seg < 0).any() | (seg >= limit).any() | (seg[1:] < seg[:-1]).any())
    return int(bad_t), int(bad_s)


# R on both sides of the kernel's 1024-row block, one row, no rows; a few ignored and out-of-range targets
@pytest.mark.parametrize("R", [0, 1, 7, 1024, 1025, 2100])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_row_scale_triton_matches_the_tensor_ops(R, dtype):
    from fedfast.triton.row_scale import row_scale_triton

    g = torch.Generator().manual_seed(R)
    C = 10
    y = torch.randint(0, C, (R,), generator=g)
    y[torch.rand(R, generator=g) < 0.2] = -100
    seg = torch.sort(torch.randint(0, max(R // 7, 1), (R,), generator=g)).values
    bad_y = y.clone()
    if R:
        bad_y[R // 2] = C  # a class out of range
    for yy in (y, bad_y):
        yy = yy.to(dtype)
        for segments in (None, seg.to(dtype)):
            for mode in (0, 1, 2):
                st = torch.zeros(len(_validate._CHECKS), dtype=torch.int32)
                rs, host = row_scale_triton(yy, segments, C, -100, mode, R, st)
                assert host == 0  # the flags are the device's
                assert tuple(st[:2].tolist()) == _flags(yy, segments, C, R)
                assert not st[2:].any()
                if mode == 0:
                    assert rs is None
                    continue
                want = row_scale_torch(yy, C, -100, segments if mode == 2 else None)
                assert rs.dtype == torch.float32 and torch.equal(rs, want)
    # all rows ignored: every weight 1/1 (no division by zero)
    if R:
        st = torch.zeros(6, dtype=torch.int32)
        rs, _ = row_scale_triton(torch.full((R,), -100, dtype=dtype), seg.to(dtype), C, -100, 2, R, st)
        assert torch.equal(rs, torch.ones(R)) and not st.any()


@pytest.mark.parametrize(
    "seg,limit", [([0, 0, 1, 1, 0, 2], 6), ([0, 1, 2, 3, 4, 5], 5), ([-1, 0, 0, 1, 1, 1], 6), ([0, 0, 1, 1, 2, 2], 6)]
)
def test_row_scale_triton_flags_bad_segments(seg, limit):
    from fedfast.triton.row_scale import row_scale_triton

    seg = torch.tensor(seg)
    st = torch.zeros(6, dtype=torch.int32)
    rs, _ = row_scale_triton(torch.zeros(6, dtype=torch.long), seg, 3, -100, 2, limit, st)
    assert tuple(st[:2].tolist()) == _flags(torch.zeros(6, dtype=torch.long), seg, 3, limit)
    assert torch.isfinite(rs).all()  # memory-safe meanwhile: ids clamped as the tensor ops clamp them


def test_deferred_checks_on_the_gpu_path_raise_once_read():
    """backend='triton', validate='defer' (a GPU's default): a bad target or client id flags, never raises at the call,
    and raise_if_invalid names the argument; the loss equals the eager path's where the values are good."""
    ops.raise_if_invalid("cpu")
    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(12, 5, generator=g), torch.randn(12, 5, generator=g)
    y = torch.randint(0, 5, (12,), generator=g)
    seg = torch.arange(12) // 4
    want = ops.distill(z, t, y, segments=seg, backend="reference", tau=2.0)
    got = ops.distill(z, t, y, segments=seg, backend="triton", validate="defer", tau=2.0)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    ops.raise_if_invalid("cpu")
    bad = y.clone()
    bad[5] = 7
    assert torch.isfinite(ops.distill(z, t, bad, segments=seg, backend="triton", validate="defer"))
    with pytest.raises(ValueError, match="target"):
        ops.raise_if_invalid("cpu")
    for bad_seg, kw in ((torch.tensor([0] * 4 + [2] * 4 + [1] * 4), {}), (seg, dict(num_segments=2))):
        ops.distill(z, t, y, segments=bad_seg, backend="triton", validate="defer", **kw)
        with pytest.raises(ValueError, match="segments"):
            ops.raise_if_invalid("cpu")
    # reduction="sum" needs no weights: the checks still run (mode 0)
    ops.distill(z, t, bad, reduction="sum", backend="triton", validate="defer")
    with pytest.raises(ValueError, match="target"):
        ops.raise_if_invalid("cpu")
    ops.distill(z, t, bad, backend="triton", validate="off")
    ops.raise_if_invalid("cpu")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("validate", ["off", "defer"])
def test_gpu_path_has_no_tensor_op_bookkeeping(monkeypatch, validate):
    """The host's cost of a loss step on a GPU is its launches (11 us each on the H100's host): with the kernels
    stubbed out, a triton-backend forward + backward with segments dispatches no more than 5 ops that launch work
    (the weights and checks are one kernel, not the 26-50 tensor ops they were)."""
    import fedfast.triton.distill as td
    import fedfast.triton.row_scale as trs

    calls = []
    monkeypatch.setattr(td, "distill_rows_triton", lambda s, *a, **k: (s.new_empty(s.shape[0]), torch.empty_like(s), 0))
    monkeypatch.setattr(td, "scale_rows_triton", lambda g, gl: g)
    monkeypatch.setattr(trs, "row_scale_triton", lambda y, *a: (calls.append(a) or torch.empty(y.shape[0]), 0))
    z, t = torch.randn(500, 10), torch.randn(500, 10)
    y = torch.randint(0, 10, (500,))
    seg = torch.arange(500) // 50
    _validate.status(torch.device("cpu"))
    with _Count() as c:
        zz = z.requires_grad_(True)
        ops.distill(zz, t, y, segments=seg, backend="triton", validate=validate, tau=2.0).backward()
    views = ("detach", "unsqueeze", "select", "expand", "view", "alias", "empty", "new_empty", "empty_like")
    work = [o for o in c.ops if not any(f"aten.{v}." in o for v in views)]
    assert len(calls) == 1 and calls[0][3] == 2  # one call, per-segment weights
    assert (calls[0][-1] is not None) == (validate == "defer")  # the checks ride along when deferred
    assert len(work) <= 5, work


def test_device_row_scale_falls_back_without_the_cuda_kernel(monkeypatch):
    """A CUDA extension built before the kernel existed: the caller is told to use the tensor ops."""
    monkeypatch.setattr(_backend, "cuda_ext", lambda: object())
    assert device_row_scale("cuda", torch.zeros(3, dtype=torch.long), None, 4, -100, 1, 3, None) == (False, None)
