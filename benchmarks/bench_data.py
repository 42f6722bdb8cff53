"""Preparing one round's batches for 100 clients x 50 samples (CIFAR-sized uint8 images on the device):
gather by client index lists + normalise + crop/flip/Cutout(16), against the training compute it feeds
(forward + backward of the FedAvg CIFAR CNN on the same 5,000 images).

Run: python -m pytest benchmarks/bench_data.py --benchmark-only
"""

from __future__ import annotations

import os

import pytest
import torch
from _bench import SMOKE

from fedfast.data import ArrayDataset, augment, dirichlet_balanced
from fedfast.models import FedAvgCNN

DEVICE = os.environ.get("FEDFAST_BENCH_DEVICE", "cpu")
CLIENTS, B = (10, 20) if SMOKE else (100, 50)
POOL = 2000 if SMOKE else 50000


@pytest.fixture(scope="module")
def setup():
    g = torch.Generator().manual_seed(0)
    ds = ArrayDataset(
        torch.randint(0, 256, (POOL, 3, 32, 32), generator=g, dtype=torch.uint8),
        torch.randint(0, 10, (POOL,), generator=g),
        10,
        (0.49, 0.48, 0.45),
        (0.25, 0.24, 0.26),
    ).to(DEVICE)
    part = dirichlet_balanced(ds.y, CLIENTS, delta=0.3, seed=0)
    idx = torch.stack([p[:B] for p in part.indices]).to(DEVICE)  # [100, 50]
    return ds, idx


def test_prepare_round_batches(benchmark, setup):
    ds, idx = setup
    gen = torch.Generator(device=DEVICE).manual_seed(1)

    def run():
        x, y = ds.batch(idx)
        x = augment(x, gen, crop_padding=4, flip=True, cutout=16)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return x, y

    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(
        dict(what="gather+normalize+crop+flip+cutout", clients=CLIENTS, batch=B, device=DEVICE, images=CLIENTS * B)
    )


def test_training_compute_for_the_same_images(benchmark, setup):
    ds, idx = setup
    model = FedAvgCNN(3, 10, 32).to(DEVICE)
    x, y = ds.batch(idx)
    x, y = x.reshape(-1, 3, 32, 32), y.reshape(-1)

    def run():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(dict(what=f"FedAvg CNN fwd+bwd on the same {CLIENTS * B} images", device=DEVICE))
