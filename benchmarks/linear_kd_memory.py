"""Peak memory of fedfast.nn.LinearKDLoss at a language-model shape (default 4096 rows x 4096 hidden x 128,000
classes, the teacher as hidden states + head): the growth of the process's peak resident set (Linux VmHWM, reset
after the inputs exist) over one forward + backward, in GiB and in logits-sized buffers (R x V x 4 bytes). CPU.

    python benchmarks/linear_kd_memory.py                      # about 7 minutes on the project's 2-core VM
    python benchmarks/linear_kd_memory.py --rows 512 --hidden 256 --vocab 32000
"""

import argparse
import gc
import time

import torch

import fedfast.nn as fnn
from fedfast.ops.linear_distill import default_chunk_rows


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(key)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128000)
    a = ap.parse_args(argv)
    R, H, V = a.rows, a.hidden, a.vocab
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(R, H, generator=g) * 0.05).requires_grad_()
    W = (torch.randn(V, H, generator=g) * 0.01).requires_grad_()
    th, tW = torch.randn(R, H, generator=g) * 0.05, torch.randn(V, H, generator=g) * 0.01
    y = torch.randint(0, V, (R,), generator=g)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    t0 = time.time()
    loss = fnn.LinearKDLoss(tau=2.0)(h, W, y, teacher_hidden=th, teacher_weight=tW)
    loss.backward()
    dt = time.time() - t0
    grow, L = _status("VmHWM") - base, R * V * 4
    print(
        f"R={R} H={H} V={V} (chunks of {default_chunk_rows(R, V)} rows): loss {float(loss.detach()):.4f}; peak "
        f"growth {grow / 2**30:.2f} GiB = {grow / L:.2f} logits buffers of {L / 2**30:.2f} GiB (the weight's "
        f"gradient alone: {V * H * 4 / 2**30:.2f} GiB); forward + backward {dt:.1f} s, {torch.get_num_threads()} "
        f"threads"
    )


if __name__ == "__main__":
    main()
