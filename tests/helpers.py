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


def client_modules(N=4, seed=0):
    """A small MLP, a ClientStack of N distinct clients of it, and each client as its own nn.Module (for
    step-by-step comparisons of the fused client steps with torch.optim)."""
    import copy

    from torch import nn

    from fedfast.flat import ClientStack

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    stack = ClientStack(base, N)
    with torch.no_grad():
        stack.params.add_(torch.randn_like(stack.params) * 0.1)
    return base, stack, [stack.load_into(copy.deepcopy(base), k) for k in range(N)]


def flat_params(m) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def set_grads(m, flat: torch.Tensor) -> None:
    """Give each parameter of ``m`` its slice of the flat gradient ``flat``."""
    off = 0
    for p in m.parameters():
        p.grad = flat[off : off + p.numel()].view_as(p).clone()
        off += p.numel()
