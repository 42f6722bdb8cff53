"""On-device augmentation of a whole batch of many clients in a few tensor ops, deterministic by seed.

``augment(x, generator, crop_padding=4, flip=True, cutout=16, padding_mode="zeros")`` for ``x`` of shape
[..., C, H, W] (e.g. [clients, B, C, H, W]); each image gets its own crop offset, flip and cutout square:

* random crop with padding: pad by ``p`` (zeros or reflect), take an H x W window at a per-image offset in
  [0, 2p] (torchvision ``RandomCrop(size, padding=p)``);
* horizontal flip with probability 1/2 (``RandomHorizontalFlip``);
* Cutout(L) (DeVries & Taylor): zero one L x L square whose centre is uniform over the image, clipped at
  the borders - applied after normalisation, as in FedNTD's pipeline.

Pipelines of the papers: FedNTD CIFAR/MNIST = crop(4) + flip + cutout(16); CINIC-10 = reflect crop + flip;
FedGKD / ASD = crop(4) + flip. Implementation: one gather with per-image row/column index maps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def augment(
    x: Tensor,
    generator: torch.Generator | None = None,
    *,
    crop_padding: int = 4,
    flip: bool = True,
    cutout: int = 0,
    padding_mode: str = "zeros",
    crop_prob: float = 1.0,
    select: tuple[int, Tensor] | None = None,
) -> Tensor:
    """``select = (total, rows)``: draw the random parameters for ``total`` images and use those of positions
    ``rows`` (the n images of ``x``), so an image's augmentation depends on its position in a larger batch, not
    on which part of it a call holds (the engine: the same result for any chunking or number of processes)."""
    if x.dim() < 3:
        raise ValueError(f"x: expected [..., C, H, W], got shape {tuple(x.shape)}")
    lead = x.shape[:-3]
    C, H, W = x.shape[-3:]
    n = int(torch.tensor(lead).prod()) if lead else 1
    imgs = x.reshape(n, C, H, W)
    dev = x.device
    gen_dev = generator.device if generator is not None else torch.device("cpu")
    total, pick = (n, None) if select is None else (int(select[0]), select[1].reshape(-1).to(gen_dev))

    def draw(t):
        return (t if pick is None else t[pick]).to(dev)

    def rand_int(high, size):
        return draw(torch.randint(0, high, (total,) + tuple(size[1:]), generator=generator, device=gen_dev))

    p = int(crop_padding)
    rows = torch.arange(H, device=dev).expand(n, H)
    cols = torch.arange(W, device=dev).expand(n, W)
    if p > 0:
        if padding_mode not in ("zeros", "reflect"):
            raise ValueError(f"padding_mode: 'zeros' or 'reflect', got {padding_mode!r}")
        mode = "constant" if padding_mode == "zeros" else "reflect"
        imgs = F.pad(imgs, (p, p, p, p), mode=mode)
        oy, ox = rand_int(2 * p + 1, (n, 1)), rand_int(2 * p + 1, (n, 1))
        if crop_prob < 1.0:  # ASD: crop only with probability crop_prob (else the centred window = identity)
            keep = draw(torch.rand((total, 1), generator=generator, device=gen_dev)) >= crop_prob
            oy, ox = torch.where(keep, p, oy), torch.where(keep, p, ox)
        rows, cols = rows + oy, cols + ox
    if flip:
        f = rand_int(2, (n, 1)).bool()
        cols = torch.where(f, cols.flip(1), cols)
    Wp = imgs.shape[-1]
    idx = (rows[:, :, None] * Wp + cols[:, None, :]).reshape(n, 1, H * W).expand(n, C, H * W)
    out = imgs.reshape(n, C, -1).gather(2, idx).reshape(n, C, H, W)
    if cutout > 0:
        cy, cx = rand_int(H, (n, 1, 1)), rand_int(W, (n, 1, 1))
        yy = torch.arange(H, device=dev).reshape(1, H, 1)
        xx = torch.arange(W, device=dev).reshape(1, 1, W)
        half = cutout // 2
        mask = (yy >= cy - half) & (yy < cy - half + cutout) & (xx >= cx - half) & (xx < cx - half + cutout)
        out = out.masked_fill(mask[:, None], 0.0)
    return out.reshape(*lead, C, H, W)


# The papers' training pipelines: where the crop padding lives (raw pixels = black borders, as torchvision's
# RandomCrop before Normalize; or normalised space = 0), and Cutout always after normalisation.
PIPELINES = {
    # CIFAR / MNIST (FedNTD App. B.2 and code)
    "fedntd": dict(crop_padding=4, flip=True, cutout=16, pad_in="raw"),
    "fedntd_cinic": dict(crop_padding=4, flip=True, cutout=0, pad_in="raw", padding_mode="reflect"),
    "fedgkd": dict(crop_padding=4, flip=True, cutout=0, pad_in="raw"),  # FedGKD code: crop (pad 4) + flip
    # ASD code: flip, p=0.5 crop of the padded normalised image
    "asd": dict(crop_padding=4, flip=True, cutout=0, pad_in="normalized", crop_prob=0.5),
    "none": dict(crop_padding=0, flip=False, cutout=0, pad_in="raw"),
}


def augmented_batch(
    ds,
    idx: Tensor,
    generator: torch.Generator | None = None,
    pipeline: str = "fedntd",
    dtype=torch.float32,
    select: tuple[int, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Gather rows ``idx`` (e.g. [clients, B]) of an :class:`~fedfast.data.ArrayDataset` and apply a paper's
    pipeline on the device: crop/flip in raw or normalised space, normalise, then Cutout (``select``: see
    :func:`augment`)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline: one of {sorted(PIPELINES)}, got {pipeline!r}")
    cfg = dict(PIPELINES[pipeline])
    pad_in, cut = cfg.pop("pad_in"), cfg.pop("cutout")
    xb, y = ds.rows(idx)
    if pad_in == "raw":
        x = ds.normalize(augment(xb, generator, select=select, **cfg), dtype)
    else:
        x = augment(ds.normalize(xb, dtype), generator, select=select, **cfg)
    if cut:
        x = augment(x, generator, crop_padding=0, flip=False, cutout=cut, select=select)
    return x, y
