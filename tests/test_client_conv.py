"""ops.client_conv2d: every implementation against the per-client F.conv2d loop in float64 (forward, input,
weight and bias gradients), across edge-case geometries and layouts."""

import pytest
import torch
from helpers import rel_err

from fedfast.ops import client_conv
from fedfast.ops.client_conv import client_conv2d, client_conv2d_reference

# (n, B, Cin, Cout, H, W, kernel, stride, padding, dilation, bias)
GEOMS = [
    (3, 2, 4, 5, 7, 6, 3, 1, 0, 1, True),  # plain 3x3, odd sizes
    (2, 3, 3, 8, 8, 8, 3, 1, 1, 1, False),  # padding, 3 input channels (an image stem)
    (4, 1, 2, 3, 9, 7, (3, 2), 2, (1, 0), 1, True),  # stride 2, non-square kernel and padding, one sample
    (1, 2, 5, 4, 6, 6, 1, 2, 0, 1, False),  # 1x1 projection with stride (a ResNet shortcut), one client
    (2, 2, 3, 2, 9, 9, 3, 1, 2, 2, True),  # dilation
    (3, 2, 1, 6, 5, 5, 5, 1, 2, 1, True),  # 1 channel, 5x5 'same' (the FedAvg MNIST CNN's first layer)
    (2, 2, 17, 19, 4, 5, 3, (2, 1), 1, 1, True),  # channel counts past a tile, mixed strides
]


def _inputs(g, dtype=torch.float64, channels_last=False, seed=0):
    n, B, Cin, Cout, H, W, k, s, p, d, bias = g
    gen = torch.Generator().manual_seed(seed)
    kh, kw = (k, k) if isinstance(k, int) else k
    x = torch.randn(B, n * Cin, H, W, generator=gen, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(n, Cout, Cin, kh, kw, generator=gen, dtype=dtype)
    b = torch.randn(n, Cout, generator=gen, dtype=dtype) if bias else None
    return x, w, b, s, p, d


def _grads(fn, x, w, b, s, p, d, seed=1):
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    b = b.detach().requires_grad_(True) if b is not None else None
    out = fn(x, w, b, s, p, d)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(out.device, out.dtype)
    gx, gw, *gb = torch.autograd.grad(out, [x, w] + ([b] if b is not None else []), g)
    return out.detach(), gx, gw, (gb[0] if gb else None)


def _check(impl, g, channels_last=False, tol=1e-5):
    x, w, b, s, p, d = _inputs(g, channels_last=channels_last)
    want = _grads(client_conv2d_reference, x, w, b, s, p, d)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    xf = x.float()
    got = _grads(lambda *a: client_conv2d(*a, impl=impl), xf, w.float(), f32(b), s, p, d)
    for name, a, e in zip(("out", "grad x", "grad w", "grad b"), got, want, strict=True):
        if e is None:
            assert a is None
            continue
        assert a.shape == e.shape, name
        assert rel_err(a.double(), e) <= tol, (name, rel_err(a.double(), e))


@pytest.mark.parametrize("impl", ["grouped", "gemm"])
@pytest.mark.parametrize("g", GEOMS, ids=[f"g{i}" for i in range(len(GEOMS))])
@pytest.mark.parametrize("channels_last", [False, True])
def test_impl_matches_reference(impl, g, channels_last):
    _check(impl, g, channels_last)


@pytest.mark.parametrize("fold_below", [0, 16, 10**6], ids=["per_tap", "default", "folded"])
@pytest.mark.parametrize("g", GEOMS, ids=[f"g{i}" for i in range(len(GEOMS))])
def test_triton_matches_reference(g, fold_below, monkeypatch):
    """Both reduction orders of the implicit GEMMs (per tap, and taps folded with channels), NCHW and NHWC."""
    pytest.importorskip("triton")
    from fedfast.triton import conv

    monkeypatch.setattr(conv, "FOLD_BELOW", fold_below)
    _check("triton", g, channels_last=g[0] % 2 == 0)


@pytest.mark.parametrize("g", GEOMS, ids=[f"g{i}" for i in range(len(GEOMS))])
@pytest.mark.parametrize("channels_last", [False, True])
def test_hybrid_matches_reference(g, channels_last):
    """The Triton forward with the grouped convolution's gradients (a strided 1 x 1 on the CPU: the subsample path)."""
    pytest.importorskip("triton")
    _check("hybrid", g, channels_last)


def test_reference_is_per_client_conv():
    """The reference itself against modules: client k's slice is nn.Conv2d with client k's weights."""
    x, w, b, s, p, d = _inputs(GEOMS[2])
    out = client_conv2d_reference(x, w, b, s, p, d)
    n, Cout, Cin = w.shape[:3]
    for k in range(n):
        conv = torch.nn.Conv2d(Cin, Cout, tuple(w.shape[3:]), s, p, d, bias=True).double()
        with torch.no_grad():
            conv.weight.copy_(w[k])
            conv.bias.copy_(b[k])
        assert torch.allclose(out[:, k * Cout : (k + 1) * Cout], conv(x[:, k * Cin : (k + 1) * Cin]))


def test_a_wrong_client_offset_fails():
    """Swapping two clients' weights must be seen (the check can fail)."""
    x, w, b, s, p, d = _inputs(GEOMS[0])
    ref = client_conv2d_reference(x, w, b, s, p, d)
    got = client_conv2d(x.float(), w[[1, 0, 2]].float(), b.float(), s, p, d, impl="gemm")
    assert rel_err(got.double(), ref) > 0.1


def test_bad_arguments_are_named():
    x, w, b, s, p, d = _inputs(GEOMS[0], dtype=torch.float32)
    with pytest.raises(ValueError, match="impl"):
        client_conv2d(x, w, b, impl="cudnn")
    with pytest.raises(ValueError, match="channels"):
        client_conv2d(x[:, :-1], w, b)
    with pytest.raises(ValueError, match="b: expected"):
        client_conv2d(x, w, b[:, :-1])
    with pytest.raises(ValueError, match="smaller than the kernel"):
        client_conv2d(x[:, :, :2, :2], w, b)
    with pytest.raises(TypeError, match="fp32"):
        client_conv2d(x.double(), w.double(), None, impl="gemm")
    assert client_conv2d.__module__ == client_conv.__name__


@pytest.mark.parametrize("split", [1, 2, 3, 1000])
@pytest.mark.parametrize("g", [GEOMS[0], GEOMS[2], GEOMS[5], GEOMS[6]], ids=["g0", "g2", "g5", "g6"])
def test_triton_weight_gradient_with_a_split_reduction(g, split):
    """The weight gradient's reduction split in shares (partial sums summed in a fixed order) equals the
    reference; an oversized split is clamped to one share per BK-wide step."""
    pytest.importorskip("triton")
    from fedfast.triton import conv

    x, w, b, s, p, d = _inputs(g)
    want = _grads(client_conv2d_reference, x, w, b, s, p, d)[2]
    from torch.nn.modules.utils import _pair

    out = client_conv2d_reference(x, w, b, s, p, d)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dw = torch.full(w.shape, float("nan"))  # every element must be written
    conv.conv_weight_grad(gy.float(), x.float(), _pair(s), _pair(p), _pair(d), dw, cfg=(16, 16, 16, 4, 1, split))
    assert rel_err(dw.double(), want) <= 1e-5


def test_weight_gradient_split_choice(monkeypatch):
    """Off CUDA one share; on a 132-SM GPU, enough shares that the tiles give every SM two programs, none of
    them shorter than MIN_SPLIT_STEPS steps, and one share once the tiles alone do."""
    pytest.importorskip("triton")
    from fedfast.triton import conv

    assert conv.wgrad_split(10, 10**6, 32, torch.device("cpu")) == 1

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props())
    cuda = torch.device("cuda")
    assert conv.wgrad_split(264, 10**6, 32, cuda) == 1
    assert conv.wgrad_split(250, 98000, 32, cuda) == 2  # FedNTD's conv2 at 10 clients: 250 tiles
    assert conv.wgrad_split(9, 7840, 32, cuda) == 7840 // (32 * conv.MIN_SPLIT_STEPS)  # one client: capped by length
    assert conv.wgrad_split(9, 100, 32, cuda) == 1  # too short to split


def test_tf32_precision_is_three_products_by_default_and_checked_by_name(monkeypatch):
    """Where TF32 is allowed the Triton convolutions take three TF32 products (fp32 accuracy: one put the engine 60x
    further from the float64 loop than the TF32 loop on an H100); a bad TF32_PRECISION is refused by name."""
    pytest.importorskip("triton")
    from fedfast.triton import conv

    assert conv.TF32_PRECISION == "tf32x3" and conv._prec(True) == "tf32x3" and conv._prec(False) == "ieee"
    monkeypatch.setattr(conv, "TF32_PRECISION", "tf32")
    assert conv._prec(True) == "tf32"
    monkeypatch.setattr(conv, "TF32_PRECISION", "bf16")
    with pytest.raises(ValueError, match="TF32_PRECISION"):
        conv._prec(True)
