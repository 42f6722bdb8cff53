"""The oneDNN strided 1 x 1 convolution bug (torch 2.13, AVX2 kernels) and fedfast's way round it
(:mod:`fedfast.ops.conv_cpu`), in subprocesses: the bug aborts the process (a corrupted heap) at 1 thread and
returns a wrong weight gradient at 2. Each path that can reach it - the grouped client convolution, the batched
executor, a plain model with a strided shortcut - is run on the shapes that crash, at 1 and 2 threads, with
oneDNN held to its AVX2 kernels (``ONEDNN_MAX_CPU_ISA=AVX2``: what a CPU without AVX-512 runs), and compared with
the float64 convolution."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import rel_err

from fedfast.ops import conv_cpu

HERE = os.path.dirname(os.path.abspath(__file__))

# one child process: every path on every shape, forward + backward in float32 against float64; prints one line per
# case ("PATH CIN HW B ok" or "... wrong ERRORS"), flushed, so a crash shows the case it died in.
# argv: threads, [unguarded]
CHILD = r"""
import sys, torch
threads = int(sys.argv[1])
torch.set_num_threads(threads)
from fedfast.ops import conv_cpu
if "unguarded" in sys.argv[2:]:
    conv_cpu.takes_subsample = lambda *a: False
paths = sys.argv[3].split(",")
SHAPES = [(3, 8, 2), (5, 6, 2), (3, 16, 4)]   # (input channels, height = width, batch): each crashes at 1 thread

def run(path, x, w, b):
    x, w, b = x.detach().requires_grad_(), w.detach().requires_grad_(), b.detach().requires_grad_()
    if path == "conv2d":
        out = conv_cpu.conv2d(x.contiguous(memory_format=torch.channels_last), w, b, 2)
    elif path == "client_conv":  # one client: the grouped convolution is a plain one (groups = 1)
        from fedfast.ops.client_conv import client_conv2d
        out = client_conv2d(x.contiguous(memory_format=torch.channels_last), w[None], b[None], 2, impl="grouped")
    elif path == "batched":  # the batched executor, one client, a model with a strided 1x1 projection
        from torch import nn
        from fedfast import batched
        m = nn.Sequential(nn.Conv2d(x.shape[1], 4, 1, 2), nn.Flatten()).to(x.dtype)
        prog, why = batched.plan(m)
        assert prog is not None, why
        out = prog.forward({"0.weight": w[None], "0.bias": b[None]}, x[None], True)[0]
    elif path == "module":  # a plain model's strided shortcut (the ResNets'), as a per-client loop runs it
        from fedfast.ops.conv_cpu import PointwiseConv2d
        m = PointwiseConv2d(x.shape[1], 4, 1, 2).to(x.dtype)
        out = torch.func.functional_call(m, {"weight": w, "bias": b},
                                         (x.contiguous(memory_format=torch.channels_last),))
    return (out,) + torch.autograd.grad(out, [x, w, b], torch.ones_like(out))

for path in paths:
    for cin, hw, B in SHAPES:
        gen = torch.Generator().manual_seed(0)
        x64 = torch.randn(B, cin, hw, hw, generator=gen, dtype=torch.float64)
        w64 = torch.randn(4, cin, 1, 1, generator=gen, dtype=torch.float64)
        b64 = torch.randn(4, generator=gen, dtype=torch.float64)
        got, want = run(path, x64.float(), w64.float(), b64.float()), run(path, x64, w64, b64)
        errs = [((a.double() - e).norm() / e.norm()).item() for a, e in zip(got, want)]
        ok = max(errs) < 1e-5
        print(path, cin, hw, B, "ok" if ok else "wrong " + " ".join(f"{e:.2e}" for e in errs), flush=True)
"""

PATHS = ["conv2d", "client_conv", "batched", "module"]


def _child(threads: int, paths=PATHS, *extra) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        ONEDNN_MAX_CPU_ISA="AVX2",
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(threads), "unguarded" if extra else "-", ",".join(paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )


def _avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _avx2(), reason="oneDNN's AVX2 kernels need an x86 CPU with AVX2")
@pytest.mark.parametrize("threads", [1, 2])
def test_strided_pointwise_conv_is_right_on_the_crashing_shapes(threads):
    """Each path (the plain function, the grouped client convolution, the batched executor, a model's shortcut) on
    each crashing shape: the process lives and every case matches float64."""
    r = _child(threads)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 4 * 3 and all(x.endswith(" ok") for x in lines), (
        threads,
        r.returncode,
        r.stdout[-800:],
        r.stderr[-1500:],
    )


@pytest.mark.skipif(not _avx2(), reason="oneDNN's AVX2 kernels need an x86 CPU with AVX2")
def test_the_unguarded_convolution_shows_the_bug():
    """Without the subsample path the same child crashes or is wrong on this torch (so the test above can fail);
    skipped on a torch whose oneDNN has the bug fixed, where the way round is merely unneeded."""
    bad = []
    for threads in (1, 2):
        r = _child(threads, ["conv2d"], "unguarded")
        if r.returncode != 0 or "wrong" in r.stdout:
            bad.append((threads, r.returncode, r.stdout[-300:], r.stderr[-300:]))
    if not bad:
        pytest.skip(f"torch {torch.__version__}: oneDNN computes the strided 1x1 convolution right here")
    assert any(t == 1 and rc != 0 for t, rc, *_ in bad) or any("wrong" in o for _, _, o, _ in bad), bad


@pytest.mark.parametrize("stride,padding", [(2, 0), (3, 0), ((2, 1), 0), (2, 1), ((1, 3), (2, 0))])
@pytest.mark.parametrize("channels_last", [False, True])
def test_subsample_equals_the_strided_convolution(stride, padding, channels_last):
    """In process, float64 (where oneDNN is not used): the subsample path is the strided convolution, values and
    gradients, for strides and paddings of either dimension and both layouts; the layout is kept."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 9, 7, generator=gen, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(6, 3, 1, 1, generator=gen, dtype=torch.float64)  # groups = 2
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    assert conv_cpu.takes_subsample(x, w, stride)
    got_in = [t.clone().requires_grad_() for t in (x, w, b)]
    want_in = [t.clone().requires_grad_() for t in (x, w, b)]
    got = conv_cpu.conv2d(*got_in, stride, padding, 1, 2)
    want = torch.nn.functional.conv2d(*want_in, stride, padding, 1, 2)
    assert got.shape == want.shape
    assert got.is_contiguous(memory_format=torch.channels_last) == (channels_last and not got.is_contiguous())
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad(got, got_in, g), torch.autograd.grad(want, want_in, g), strict=True):
        assert rel_err(a, e) < 1e-13
    assert rel_err(got, want) < 1e-13


def test_the_path_is_taken_only_where_needed():
    x = torch.randn(1, 2, 4, 4)
    assert not conv_cpu.takes_subsample(x, torch.randn(3, 2, 3, 3), 2)  # a 3x3 kernel
    assert not conv_cpu.takes_subsample(x, torch.randn(3, 2, 1, 1), 1)  # stride 1
    assert conv_cpu.takes_subsample(x, torch.randn(3, 2, 1, 1), (1, 2))


def test_resnet_shortcuts_take_it_and_trace():
    """The ResNets' strided shortcuts are PointwiseConv2d (state_dict keys unchanged), and the batched executor
    still traces them as convolutions."""
    from fedfast import batched, models

    m = models.resnet18(10, "gn")
    shorts = [mod for name, mod in m.named_modules() if isinstance(mod, conv_cpu.PointwiseConv2d)]
    assert len(shorts) == 3 and all(s.stride == (2, 2) for s in shorts)
    assert any(k.endswith("short.0.weight") for k in m.state_dict())
    prog, why = batched.plan(m)
    assert prog is not None, why
