"""Shared test helpers: random inputs and error measures."""
import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (norm-wise relative error; 0 when both are 0)."""
    a, b = a.double(), b.double()
    den = b.abs().max().item() if b.numel() else 0.0
    num = (a - b).abs().max().item() if b.numel() else 0.0
    return 0.0 if num == 0 else num / max(den, 1e-300)


def make_inputs(R, C, *, scale=3.0, ignore=True, seed=None, device="cpu"):
    g = torch.Generator().manual_seed(seed if seed is not None else R * 7919 + C)
    z = (torch.randn(R, C, generator=g) * scale).to(device)
    t = (torch.randn(R, C, generator=g) * scale).to(device)
    y = torch.randint(0, C, (R,), generator=g).to(device)
    if ignore and R >= 3:
        y[1] = -100
    return z, t, y
