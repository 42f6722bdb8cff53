"""On-device augmentation: crop windows, flips, cutout squares, determinism, batched shapes."""

import pytest
import torch
import torch.nn.functional as F

from fedfast.data import augment


def _imgs(n=6, C=2, H=8, W=8):
    return torch.arange(n * C * H * W, dtype=torch.float32).reshape(n, C, H, W) + 1.0


def test_crop_is_a_window_of_the_padded_image():
    x = _imgs()
    out = augment(x, torch.Generator().manual_seed(0), crop_padding=2, flip=False)
    padded = F.pad(x, (2, 2, 2, 2))
    for i in range(x.shape[0]):
        hits = [
            (oy, ox)
            for oy in range(5)
            for ox in range(5)
            if torch.equal(out[i], padded[i, :, oy : oy + 8, ox : ox + 8])
        ]
        assert len(hits) == 1


def test_flip_and_cutout():
    x = _imgs(40)
    out = augment(x, torch.Generator().manual_seed(1), crop_padding=0, flip=True)
    flipped = [torch.equal(out[i], x[i].flip(-1)) for i in range(40)]
    same = [torch.equal(out[i], x[i]) for i in range(40)]
    assert all(a or b for a, b in zip(flipped, same, strict=True)) and 5 < sum(flipped) < 35
    ones = torch.ones(200, 1, 32, 32)
    cut = augment(ones, torch.Generator().manual_seed(2), crop_padding=0, flip=False, cutout=16)
    zeros = (cut == 0).sum((1, 2, 3))
    assert zeros.min() >= 64 and zeros.max() == 256  # clipped at borders down to 8x8; full 16x16 inside
    for i in range(10):  # the zeroed region is one axis-aligned rectangle
        r = (cut[i, 0] == 0).nonzero()
        h = r[:, 0].max() - r[:, 0].min() + 1
        w = r[:, 1].max() - r[:, 1].min() + 1
        assert h * w == zeros[i]


def test_deterministic_and_batched_shapes():
    x = torch.randn(5, 7, 3, 32, 32)  # [clients, B, C, H, W]
    a = augment(x, torch.Generator().manual_seed(3), cutout=16)
    b = augment(x, torch.Generator().manual_seed(3), cutout=16)
    c = augment(x, torch.Generator().manual_seed(4), cutout=16)
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c)
    r = augment(x, torch.Generator().manual_seed(3), padding_mode="reflect")
    assert (r != 0).float().mean() > 0.99  # reflect padding never introduces zeros
    with pytest.raises(ValueError, match="padding_mode"):
        augment(x, padding_mode="edge")


def test_paper_pipelines_pad_in_the_right_space():
    from fedfast.data import ArrayDataset, augmented_batch

    ds = ArrayDataset(
        torch.full((8, 3, 8, 8), 200, dtype=torch.uint8),
        torch.zeros(8, dtype=torch.long),
        10,
        (0.5, 0.5, 0.5),
        (0.25, 0.25, 0.25),
    )
    idx = torch.arange(8).reshape(2, 4)
    x, y = augmented_batch(ds, idx, torch.Generator().manual_seed(0), "fedgkd")
    assert x.shape == (2, 4, 3, 8, 8) and y.shape == (2, 4)
    img, black = (200 / 255 - 0.5) / 0.25, (0 - 0.5) / 0.25  # raw black borders normalise to -2

    def only(t, allowed):
        d = torch.stack([(t - a).abs() for a in allowed]).min(0).values
        return bool((d < 1e-5).all())

    assert only(x, [img, black]) and ((x - black).abs() < 1e-5).any()
    x, _ = augmented_batch(ds, idx, torch.Generator().manual_seed(0), "asd")
    assert only(x, [img, 0.0])  # ASD pads in normalised space
    x, _ = augmented_batch(ds, idx, torch.Generator().manual_seed(0), "fedntd")
    assert (x == 0).any()  # Cutout zeroes in normalised space
    with pytest.raises(ValueError, match="pipeline"):
        augmented_batch(ds, idx, None, "cutmix")
