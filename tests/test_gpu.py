"""GPU tests: triton and cuda backends against the float64 reference on a CUDA device.

Run on a GPU machine with: FEDFAST_GPU_TESTS=1 python -m pytest -m gpu tests/test_gpu.py
"""

import pytest
import torch
from helpers import make_inputs, rel_err

from fedfast import nn as ffnn, ops
from fedfast.ops import _backend

pytestmark = pytest.mark.gpu
GPU_BACKENDS = ["triton", "cuda"]
SHAPES = [(1, 2), (5, 3), (17, 10), (500, 10), (333, 100), (64, 1000), (7, 1023), (9, 32000), (4096, 100)]


def _need(backend):
    if not _backend.available(backend, "cuda"):
        pytest.skip(f"backend {backend} not available on this machine")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("R,C", SHAPES)
@pytest.mark.parametrize("kind", ["full", "not_true"])
def test_gpu_distill_matches_reference(backend, R, C, kind):
    _need(backend)
    z, t, y = make_inputs(R, C)
    rho = torch.rand(C)
    for extra in (dict(), dict(rho=rho) if kind == "full" else dict(row_weight=torch.rand(R))):
        zz = z.cuda().requires_grad_(True)
        ex = {k: v.cuda() for k, v in extra.items()}
        l1 = ops.distill(
            zz,
            t.cuda(),
            y.cuda(),
            kind=kind,
            tau=2.0,
            kd_weight=1.3,
            reduction="none",
            backend=backend,
            validate="eager",
            **ex,
        )
        l1.sum().backward()
        z64 = z.double().requires_grad_(True)
        l0 = ops.distill_reference(
            z64,
            t.double(),
            y,
            tau=2.0,
            kd_weight=1.3,
            not_true=kind == "not_true",
            **{k: v.double() for k, v in extra.items()},
        )
        (g0,) = torch.autograd.grad(l0.sum(), z64)
        assert rel_err(l1.cpu(), l0.detach()) <= 1e-5
        assert rel_err(zz.grad.cpu(), g0) <= 1e-5


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gpu_low_precision(backend, dt):
    _need(backend)
    z, t, y = make_inputs(257, 100)
    zz = z.cuda().to(dt).requires_grad_(True)
    l1 = ffnn.NTDLoss(tau=2.0, backend=backend)(zz, t.cuda().to(dt), y.cuda())
    l1.backward()
    z64 = z.to(dt).double().requires_grad_(True)
    l0 = ffnn.NTDLoss(tau=2.0, backend="reference")(z64, t.to(dt).double(), y)
    l0.backward()
    assert zz.grad.dtype == dt
    assert rel_err(l1.cpu(), l0.detach()) <= 1e-5
    assert rel_err(zz.grad.cpu(), z64.grad) <= (8e-3 if dt == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_mixture_and_asd(backend):
    _need(backend)
    M, R, C = 4, 300, 100
    T = torch.randn(M, R, C) * 3
    w = torch.rand(M)
    y = torch.randint(0, C, (R,))
    y[0] = -100
    P0, n0 = ops.teacher_mixture_reference(T.double(), w.double(), y, tau=2.0, not_true=True)
    P1, n1 = ops.teacher_mixture(T.cuda(), w.cuda(), y.cuda(), tau=2.0, not_true=True, backend=backend)
    assert rel_err(P1.cpu(), P0) <= 1e-5 and rel_err(n1.cpu(), n0) <= 1e-5
    seg = torch.sort(torch.randint(0, 5, (R,))).values
    prior = torch.rand(5, C) + 0.05
    a0 = ops.asd_weights_reference(T[0].double(), y, prior.double(), seg, entropy_tau=2.0)
    a1 = ops.asd_weights(T[0].cuda(), y.cuda(), prior.cuda(), seg.cuda(), entropy_tau=2.0, backend=backend)
    assert rel_err(a1.cpu(), a0) <= 1e-5


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_deferred_validation(backend):
    _need(backend)
    z, t, y = make_inputs(8, 10)
    y[3] = 99
    out = ffnn.KDLoss(backend=backend)(z.cuda(), t.cuda(), y.cuda())  # default on GPU: defer, no sync
    assert torch.isfinite(out).item()
    with pytest.raises(ValueError, match="target"):
        ops.raise_if_invalid("cuda")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_row_scale_kernel_matches_the_tensor_ops(backend):
    """The reduction weights and deferred checks in one launch (Triton and CUDA) against the tensor ops, with
    ignored and out-of-range targets and bad client ids, across the one-block kernel's row blocks."""
    _need(backend)
    from fedfast.ops.distill import device_row_scale, row_scale_torch

    g = torch.Generator().manual_seed(1)
    for R in (1, 1023, 1025, 65536):
        for dtype in (torch.int64, torch.int32):
            y = torch.randint(0, 10, (R,), generator=g)
            y[torch.rand(R, generator=g) < 0.2] = -100
            seg = torch.sort(torch.randint(0, max(R // 50, 1), (R,), generator=g)).values
            cases = [(y, seg, R, (0, 0))]
            if R > 1:
                yb, sb = y.clone(), seg.clone()
                yb[R - 1], sb[0] = 10, sb[-1] + 1  # a class out of range; the ids no longer sorted
                cases += [(yb, seg, R, (1, 0)), (y, sb, R, (0, 1)), (y, seg, int(seg[-1]), (0, 1))]
            for yy, ss, limit, flags in cases:
                yy, ss = yy.to(dtype).cuda(), ss.to(dtype).cuda()
                for mode in (0, 1, 2):
                    st = torch.zeros(6, dtype=torch.int32, device="cuda")
                    done, rs = device_row_scale(backend, yy, ss, 10, -100, mode, limit, st)
                    assert done and tuple(st.tolist()) == flags + (0,) * 4, (R, dtype, mode, st)
                    if mode:
                        want = row_scale_torch(yy, 10, -100, ss if mode == 2 else None)
                        assert torch.equal(rs, want), (R, dtype, mode)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_aggregate_and_client_step(backend):
    _need(backend)
    from fedfast.ops.aggregate_reference import aggregate_reference
    from fedfast.ops.client_step_reference import client_step_reference

    N, P = 12, 100003
    X = torch.randn(N, P)
    g = torch.randn(P)
    ids = torch.tensor([0, 3, 4, 7, 11])
    w = torch.rand(5)
    wn = w / w.sum()
    m = torch.randn(P)
    R, shift, coef = torch.randn(5, P), torch.randn(P), torch.rand(5) - 0.5
    B = torch.randn(3, P)
    cu = lambda t: t.cuda()  # noqa: E731
    for kw_ref, kw in [
        (dict(beta=0.9, lr=1.5, momentum=m), dict(beta=0.9, lr=1.5, momentum=cu(m))),
        (dict(state_rows=R), dict(state_rows=cu(R))),
        (
            dict(state_rows=R, state_coef=coef, state_shift=shift, ring=B, ring_slot=1, ring_count=2),
            dict(state_rows=cu(R), state_coef=cu(coef), state_shift=cu(shift), ring=cu(B), ring_slot=1, ring_count=2),
        ),
    ]:
        ref = aggregate_reference(
            X[ids].double(),
            g.double(),
            wn.double(),
            **{k: (v.double() if torch.is_tensor(v) else v) for k, v in kw_ref.items()},
        )
        out = ops.aggregate(cu(X), cu(g), weights=cu(w), rows=cu(ids), backend=backend, **kw)
        for key, val in out.items():
            assert rel_err(val.cpu(), ref[key]) <= 1e-5, key
    Xn = X.clone()
    Xn[4, 17] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[4\]"):
        ops.aggregate(cu(Xn), cu(g), rows=cu(ids), backend=backend)
    # client step: momentum, wd, prox, loss rows, clipping, corrections (scaled vector, rows), offset, masking
    n = 6
    th0, G = torch.randn(n, P), torch.randn(n, P)
    buf0 = torch.randn(n, P)
    act = torch.tensor([1, 1, 0, 1, 1, 0], dtype=torch.bool)
    lr = torch.rand(n) * 0.1
    c = torch.randn(P)
    kw = dict(
        momentum=0.9,
        weight_decay=1e-3,
        prox_mu=0.1,
        anchor=g,
        corr_vec=c,
        corr_rows=torch.randn(n, P),
        corr_rows_coef=-1.0,
        corr_vec_scale=torch.rand(n) + 0.5,
        loss_rows=torch.randn(n, P) * 0.1,
        step_vec=torch.randn(P) * 0.01,
        step_vec_scale=torch.rand(n) + 0.5,
        max_norm=5.0,
        active=act,
    )
    ref, rbuf = client_step_reference(
        th0.double(),
        G.double(),
        lr=lr.double(),
        momentum_buf=buf0.double(),
        **{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()},
    )
    th, buf = cu(th0), cu(buf0)
    ops.client_step(
        th,
        cu(G),
        lr=cu(lr),
        momentum_buf=buf,
        backend=backend,
        **{k: (cu(v) if torch.is_tensor(v) else v) for k, v in kw.items()},
    )
    assert rel_err(th.cpu(), ref) <= 1e-6 and rel_err(buf.cpu(), rbuf) <= 1e-6


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("decoupled", [False, True])
def test_gpu_client_adam(backend, decoupled):
    _need(backend)
    from fedfast.ops.client_adam_reference import client_adam_reference

    n, P = 5, 100003
    th0, G = torch.randn(n, P), torch.randn(n, P)
    m0, v0 = torch.randn(n, P) * 0.1, torch.rand(n, P) * 0.1
    step, lr = torch.tensor([1.0, 2.0, 5.0, 9.0, 30.0]), torch.rand(n) * 0.01
    kw = dict(
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=torch.rand(n) * 0.01,
        decoupled=decoupled,
        prox_mu=0.1,
        anchor=torch.randn(P),
        loss_rows=torch.randn(n, P) * 0.1,
        max_norm=50.0,
        active=torch.tensor([True, False, True, True, True]),
    )
    ref = client_adam_reference(
        th0.double(),
        G.double(),
        m0.double(),
        v0.double(),
        step,
        lr=lr.double(),
        **{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()},
    )
    cu = lambda t: t.cuda()  # noqa: E731
    th, m, v = cu(th0), cu(m0), cu(v0)
    ops.client_adam(
        th,
        cu(G),
        m,
        v,
        cu(step),
        lr=cu(lr),
        backend=backend,
        **{k: (cu(x) if torch.is_tensor(x) else x) for k, x in kw.items()},
    )
    for got, want in zip((th, m, v), ref, strict=True):
        assert rel_err(got.cpu(), want) <= 1e-6


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "algorithm,options,extra",
    [
        ("fedntd", dict(tau=2.0), dict(max_grad_norm=0.5)),
        ("scaffold", {}, {}),
        ("feddyn+asd", dict(feddyn=dict(alpha=0.1)), {}),
        ("fedadc_plus", dict(beta=0.8), dict(momentum=0.0)),
        ("fedgkd_vote", dict(buffer=2), dict(rounds=3)),
        ("moon", {}, {}),
        ("fedprox", dict(mu=0.1), dict(client_optimizer="adamw", momentum=0.0, lr=1e-3)),
    ],
)
def test_gpu_engine_matches_sequential_loop(backend, algorithm, options, extra):
    """The whole round on the GPU (batched forward, fused loss / client step / server update on `backend`)
    against the literal per-client loop on the CPU."""
    from sequential_loop import engine_vs_loop

    _need(backend)
    err, _, _ = engine_vs_loop(algorithm, options, device="cuda", backend=backend, **extra)
    assert err <= 1e-4, err


def _strict_local_training(sim):
    """Make every synchronizing call during the simulation's local training raise (CUDA sync-debug mode)."""
    orig = sim.trainer.train_chunk

    def strict(*a, **k):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return orig(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    sim.trainer.train_chunk = strict


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "algorithm,extra", [("fedavg", {}), ("fedntd+asd", dict(max_grad_norm=1.0)), ("scaffold", {}), ("fedadc_plus", {})]
)
def test_gpu_local_training_never_syncs(backend, algorithm, extra):
    """CUDA's sync-debug mode raises on any synchronizing call (``.item()``, a pageable host-to-device copy,
    ``nonzero``...) made while the round's local steps run on the GPU."""
    import copy

    from sequential_loop import setup_data as _setup

    import fedfast

    _need(backend)
    train, test, part, model = _setup()
    cfg = fedfast.SimConfig(
        algorithm=algorithm,
        clients_per_round=4,
        rounds=2,
        local_epochs=2,
        batch_size=10,
        lr=0.05,
        seed=3,
        momentum=0.9,
        backend=backend,
        **extra,
    )
    sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part, device="cuda")
    sim.round()
    _strict_local_training(sim)
    sim.round()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_transformer_round_matches_loop_and_never_syncs(backend):
    """A tiny DistilBERT through the grouped executor on the GPU (FedGKD with Adam, FedGKD's NLP setting): the
    global model after two rounds equals the CPU loop's, and the second round's local steps make no host sync."""
    import copy

    pytest.importorskip("transformers")
    import text_helpers as th
    from sequential_loop import sequential

    import fedfast
    from fedfast import data, grouped
    from fedfast.data import text
    from fedfast.models import hf

    _need(backend)
    texts, y = th.sentences(160, 4, seed=0)
    tok = th.tokenizer(texts)
    train, test = (text.tokenize(texts[a:b], y[a:b], tok, 4, max_length=12) for a, b in ((0, 120), (120, 160)))
    part = data.dirichlet_lda(train.y, 6, alpha=0.5, seed=1, min_size=5)
    model = hf.from_config(th.distilbert_config(4, len(tok)), seed=0)
    cfg = fedfast.SimConfig(
        algorithm="fedgkd",
        clients_per_round=3,
        rounds=2,
        local_epochs=2,
        batch_size=8,
        lr=5e-3,
        client_optimizer="adam",
        seed=3,
        backend=backend,
    )
    g0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = sequential(cfg, model, train, part, 1)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part, device="cuda")
    assert isinstance(sim.trainer.stack.plan, grouped.GroupedPlan)
    sim.round()
    g = sim.global_flat.cpu()
    keep = torch.ones_like(g0, dtype=torch.bool)
    for s in sim.runtime.layout.params:  # the attention key bias has a zero gradient (see test_transformers)
        if s.name.endswith("k_lin.bias"):
            keep[s.offset : s.offset + s.numel] = False
    assert float((g - ref)[keep].abs().max() / (ref - g0)[keep].abs().max()) <= 1e-3
    _strict_local_training(sim)
    sim.round()


# -- issue 26: device handling of the data helpers, the loop baseline, per-client convolutions, memory -----------
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def test_gpu_dataset_and_partitions_take_indices_from_any_device():
    """ArrayDataset.rows/batch/subset with CPU tensors, numpy arrays and lists into data on the GPU (the loop
    baseline's crash: index_select with a CPU index), and every partition from labels on the GPU."""
    import numpy as np

    from fedfast import data

    _cuda()
    train, _ = data.synthetic(4, 50, 10, (1, 4, 4), seed=0)
    gpu = train.to("cuda")
    idx = torch.tensor([[3, 1], [0, 7]])
    want_x, want_y = train.batch(idx)
    for i in (idx, idx.cuda()):
        x, y = gpu.batch(i)
        assert x.is_cuda and torch.equal(x.cpu(), want_x) and torch.equal(y.cpu(), want_y)
    assert torch.equal(gpu.rows(np.array([3, 1]))[1].cpu(), train.y[[3, 1]])
    assert torch.equal(gpu.subset(torch.tensor([5, 2])).y.cpu(), train.y[[5, 2]])
    assert torch.equal(gpu.subset(torch.tensor([5, 2]).cuda()).y.cpu(), train.y[[5, 2]])
    y = gpu.y
    for part in (
        data.iid(y, 5),
        data.shards(y, 10, 2),
        data.dirichlet_lda(y, 5, 0.5, min_size=2),
        data.by_writer(y % 3, labels=y),
    ):
        assert sum(len(i) for i in part.indices) == len(y) and part.histogram.sum() == len(y)
    assert len(data.per_class_sample(y, 2)) == 8


def test_gpu_plain_loop_baseline_runs_and_equals_the_engine():
    """benchmarks/plain_loop.py's round with model and data on the GPU (it crashed on main at fedc5f8) against the
    engine's round, fp32 semantics (no TF32 on either side)."""
    import copy
    import os
    import sys

    import fedfast
    from fedfast import data, models
    from fedfast.sim.memory import fp32_semantics

    _cuda()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from plain_loop import plain_loop_round

    train, test = data.synthetic(10, 40, 20, (3, 12, 12), seed=0)
    part = data.iid(train.y, 8, seed=0)
    torch.manual_seed(0)
    model = models.SimpleCNN(10, 3, 0.0, 12)
    s = dict(algorithm="fedntd", m=4, E=2, B=10, lr=0.05, momentum=0.9, weight_decay=1e-5)
    cfg = fedfast.SimConfig(
        algorithm="fedntd",
        options={"beta": 1.0, "tau": 1.0},
        clients_per_round=4,
        rounds=2,
        local_epochs=2,
        batch_size=10,
        lr=0.05,
        momentum=0.9,
        weight_decay=1e-5,
    )
    with fp32_semantics():
        loop = copy.deepcopy(model).cuda()
        for r in range(2):
            plain_loop_round(s, loop, train.to("cuda"), part, r)
        sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part)
        sim.run()
    ref = torch.cat([p.detach().reshape(-1) for p in loop.parameters()])
    assert float((sim.global_flat - ref).abs().max() / ref.abs().max()) <= 1e-4
    # teacher-cache style predictions with an index from the CPU or the GPU give the same logits
    a = sim.predict(sim.global_flat, sim.train, torch.arange(7))
    b = sim.predict(sim.global_flat, sim.train, torch.arange(7, device="cuda"))
    assert a.is_cuda and a.shape == (7, 10) and torch.equal(a, b)


@pytest.mark.parametrize("impl", ["grouped", "gemm", "triton", "hybrid"])
@pytest.mark.parametrize("tf32", [False, True])
def test_gpu_client_conv_matches_reference(impl, tf32):
    """Every per-client convolution implementation on the GPU against the float64 per-client loop: fp32 to 1e-5;
    with TF32 on (cuDNN's default, which every implementation follows) to 5e-3."""
    from test_client_conv import GEOMS, _grads, _inputs

    from fedfast.ops.client_conv import client_conv2d, client_conv2d_reference

    _need("triton") if impl in ("triton", "hybrid") else _cuda()
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        for i, g in enumerate(GEOMS):
            x, w, b, s, p, d = _inputs(g, channels_last=i % 2 == 0, seed=i)
            want = _grads(client_conv2d_reference, x, w, b, s, p, d)
            cu = lambda t: None if t is None else t.float().cuda()  # noqa: E731
            got = _grads(lambda *a: client_conv2d(*a, impl=impl), cu(x), cu(w), cu(b), s, p, d)
            for a, e in zip(got, want, strict=True):
                if e is not None:
                    assert rel_err(a.double().cpu(), e) <= (5e-3 if tf32 else 1e-5), (impl, i)
    finally:
        torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("split", [0, 1, 3])
def test_gpu_triton_weight_gradient_split(split):
    """The weight gradient with its reduction split (0: the automatic rule, which splits this 2-client, 1-tile
    layer on any GPU with >= 2 SMs) against the float64 reference, every element written (NaN-poisoned)."""
    _need("triton")
    from torch.nn.modules.utils import _pair

    from fedfast.ops.client_conv import client_conv2d_reference
    from fedfast.triton import conv

    g = (2, 16, 16, 16, 20, 20, 3, 1, 1, 1, False)  # 6400 pixels per client: room for shares of 16 steps
    from test_client_conv import _inputs

    x, w, b, s, p, d = _inputs(g)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = client_conv2d_reference(x, w, b, s, p, d)
    gy = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = torch.autograd.grad(out, w, gy)[0]
    programs = 2 * 9  # 1 output-channel tile x 9 taps x 2 clients
    if split == 0:
        assert conv.wgrad_split(programs, 6400, 32, torch.device("cuda")) > 1
    dw = torch.full(w.shape, float("nan"), device="cuda")
    cfg = conv.CONFIGS["wgrad"][:5] + (split,)
    conv.conv_weight_grad(gy.float().cuda(), x.detach().float().cuda(), _pair(s), _pair(p), _pair(d), dw, cfg=cfg)
    assert rel_err(dw.double().cpu(), want) <= 1e-5


@pytest.mark.parametrize("conv", ["grouped", "gemm", "triton", "hybrid"])
def test_gpu_engine_conv_implementations_match_the_loop(conv):
    """A CNN round on the GPU with each convolution implementation equals the CPU loop (fp32 semantics), and the
    second round's local steps make no host sync."""
    import copy

    from sequential_loop import sequential
    from test_engine_conv import _cnn_setup

    import fedfast
    from fedfast.sim.memory import fp32_semantics

    _need("triton") if conv in ("triton", "hybrid") else _cuda()
    train, test, part, model = _cnn_setup()
    cfg = fedfast.SimConfig(
        algorithm="fedntd", clients_per_round=3, rounds=2, batch_size=8, lr=0.05, momentum=0.9, seed=1, conv=conv
    )
    ref = sequential(cfg, copy.deepcopy(model), train, part, cfg.rounds)
    with fp32_semantics():
        sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part)
        sim.round()
        _strict_local_training(sim)
        sim.round()
    assert float((sim.global_flat.cpu() - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_gpu_runs_that_cannot_fit_are_refused_with_bytes():
    """A chunk larger than the GPU is refused with fedfast.OutOfMemory naming the bytes and the setting, not a CUDA
    allocator traceback; per-client state for more clients than the GPU holds is not allocated up front."""
    from torch import nn

    import fedfast
    from fedfast import data

    _cuda()
    train, test = data.synthetic(3, 4000, 10, (3072,), seed=0)
    part = data.iid(train.y, 4000, seed=0)
    model = nn.Sequential(nn.Linear(3072, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 3))
    big = fedfast.SimConfig(clients_per_round=4000, client_chunk=4000, batch_size=1)
    with pytest.raises(fedfast.OutOfMemory, match=r"client_chunk: 4000 clients.*GiB.*client_chunk = \d+"):
        fedfast.Simulation(big, model, train.to("cuda"), test.to("cuda"), part, device="cuda")
    # per-client state of 4000 clients x 10.5M parameters (168 GB dense) holds rows only for the clients trained
    sim = fedfast.Simulation(
        fedfast.SimConfig(algorithm="scaffold", clients_per_round=2),
        model,
        train.to("cuda"),
        test.to("cuda"),
        part,
        device="cuda",
    )
    st = sim.method.client_state
    assert st.written == 0 and st.nbytes < 2 * st.row_bytes + st.slot_of.nbytes


def test_gpu_state_store_in_pinned_memory_and_on_disk_equals_the_device_store(tmp_path):
    """SCAFFOLD on the GPU with its per-client state on the device, in pinned host memory, and in the disk store's
    file: the same global model and state, bit for bit."""
    import fedfast
    from fedfast import data, models

    _cuda()
    train, test = data.synthetic(3, 600, 60, (16,), seed=0)
    part = data.iid(train.y, 40, seed=0)
    out = []
    for kw in (dict(state_store="memory"), dict(state_store="auto", state_on_host=True), dict(state_store="disk")):
        torch.manual_seed(0)
        cfg = fedfast.SimConfig(algorithm="scaffold", clients_per_round=8, rounds=4, **kw)
        sim = fedfast.Simulation(
            cfg,
            models.MLP(16, (32,), 3),
            train.to("cuda"),
            test.to("cuda"),
            part,
            device="cuda",
            state_dir=str(tmp_path),
        )
        sim.run()
        st = sim.method.client_state
        assert st.on_disk == (kw["state_store"] == "disk") and st.pin == bool(kw.get("state_on_host"))
        out.append((sim.global_flat.cpu(), st.dense().cpu()))
    for g, d in out[1:]:
        assert torch.equal(g, out[0][0]) and torch.equal(d, out[0][1])


def test_gpu_bench_losses_against_the_authors_code():
    """fedfast bench --device cuda: the authors' code and fedfast agree on the GPU, and a run records times and the
    allocator's peak device memory."""
    _cuda()
    from fedfast import bench

    for loss in bench.LOSSES:
        z, t, y, extra = bench.inputs(loss, 96, 50, seed=2, device="cuda")
        za, zf = z.clone().requires_grad_(), z.clone().requires_grad_()
        a, f = bench.AUTHORS[loss](za, t, y, extra), bench.fedfast_losses()[loss](zf, t, y, extra)
        a.backward()
        f.backward()
        assert rel_err(f.detach().cpu(), a.detach().cpu()) <= 1e-5 and rel_err(zf.grad.cpu(), za.grad.cpu()) <= 1e-5
    res = bench.run(losses=("kd",), shapes=[(256, 1000)], compiled=False, memory=True, device="cuda", echo=print)
    row = res["rows"][0]
    assert res["machine"]["device"] == "cuda" and "gpu" in res["machine"]
    assert all(v > 0 for v in row["seconds"].values()) and all(v and v > 0 for v in row["peak_bytes"].values())


def test_gpu_float64_losses_are_float64_with_the_automatic_backend():
    _cuda()
    from fedfast.ops.distill_reference import distill_reference

    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(40, 9, generator=g, dtype=torch.float64), torch.randn(40, 9, generator=g, dtype=torch.float64)
    y = torch.randint(0, 9, (40,), generator=g)
    want = distill_reference(z, t, y, tau=2.0, kd_weight=4.0).mean()
    got = ffnn.KDLoss(tau=2.0)(z.cuda().requires_grad_(), t.cuda(), y.cuda())
    assert got.dtype == torch.float64 and abs(float(got) - float(want)) <= 1e-13 * abs(float(want))
    prior = torch.full((9,), 1.0 / 9, dtype=torch.float64)
    assert torch.isfinite(ffnn.ASDLoss()(z.cuda(), t.cuda(), y.cuda(), prior.cuda()))


# -- issue 45: what issues 46 and 47 added, on the GPU; the engine with TF32 on as well as off -------------------
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_gpu_client_batch_norm_matches_the_float64_reference(layout):
    """The per-client BatchNorm op in fp32 on the GPU (padding rows masked, running buffers updated) against its
    float64 reference on the CPU: outputs, the three gradients and the buffers to 1e-5."""
    _cuda()
    from fedfast.ops.client_batch_norm import client_batch_norm
    from fedfast.ops.client_batch_norm_reference import client_batch_norm_reference

    g = torch.Generator().manual_seed(0)
    n, C, B = 5, 16, 20
    x = torch.randn(B, n * C, 7, 7, generator=g, dtype=torch.float64) * 2 + 3
    w, b = torch.rand(n, C, generator=g, dtype=torch.float64) + 0.5, torch.randn(n, C, generator=g, dtype=torch.float64)
    valid = torch.ones(n, B, dtype=torch.bool)
    valid[1, 13:] = False
    valid[4, 3:] = False
    gy = torch.randn(x.shape, generator=g, dtype=torch.float64) * valid.t().repeat_interleave(C, 1)[:, :, None, None]
    f64 = dict(generator=g, dtype=torch.float64)
    running = (torch.randn(n, C, **f64), torch.rand(n, C, **f64) + 0.5, torch.full((n,), 3.0, dtype=torch.float64))
    outs = []
    for fn, dev, dt in (
        (client_batch_norm_reference, "cpu", torch.float64),
        (client_batch_norm, "cuda", torch.float32),
    ):
        xx = x.to(dev, dt)
        if layout == "nhwc":
            xx = xx.contiguous(memory_format=torch.channels_last)
        xx, ww, bb = (t.to(dev, dt).detach().clone().requires_grad_() for t in (xx, w, b))
        rm, rv, nbt = (t.to(dev, dt).clone() for t in running)
        y = fn(
            xx,
            n,
            ww,
            bb,
            valid=valid.to(dev),
            running_mean=rm,
            running_var=rv,
            num_batches_tracked=nbt,
            update=True,
            momentum=0.1,
        )
        (y * gy.to(dev, dt)).sum().backward()
        outs.append([t.detach().double().cpu() for t in (y, xx.grad, ww.grad, bb.grad, rm, rv)])
    m = valid.t().repeat_interleave(C, 1)[:, :, None, None].expand_as(x)  # padding rows: outputs unused
    for i, (a, e) in enumerate(zip(outs[1], outs[0], strict=True)):
        if i < 2:
            a, e = a[m], e[m]
        assert rel_err(a, e) <= 1e-5, i


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize("tf32", [False, True])
def test_gpu_batch_norm_resnet_equals_the_loop(executor, tf32):
    """Issue 46's ResNet-18 layout with running statistics (4 clients with partial batches, 3 rounds) on the GPU,
    every parameter and buffer against the float64 loop on the CPU: with TF32 off within 5x the fp32 GPU loop's own
    distance from it, with TF32 on within 5x the TF32 GPU loop's (the loop's own rounding sensitivity either way)."""
    _cuda()
    import copy

    from sequential_loop import PlainLoop
    from test_batch_norm import _Data, _max_rel, _resnet_run

    import fedfast
    from fedfast.sim.memory import tf32_semantics

    cfg, model, train, test, part = _resnet_run(executor, smooth=True)
    ref = PlainLoop(cfg, copy.deepcopy(model).double(), _Data(train), part)
    ref.run(cfg.rounds)
    ref64 = ref.glob.state_dict()
    floats = [k for k, v in ref64.items() if v.is_floating_point()]
    with tf32_semantics(tf32):
        loop = PlainLoop(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), part)
        loop.run(cfg.rounds)
        sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part)
        sim.run()
    cpu = lambda sd: {k: v.cpu() for k, v in sd.items()}  # noqa: E731
    own = _max_rel(cpu(loop.glob.state_dict()), ref64, floats)
    err = _max_rel(cpu(sim.state_dict()), ref64, floats)
    print(f"executor={executor} tf32={tf32}: engine {err:.2e}, GPU loop {own:.2e} from the float64 loop")
    assert err <= max(5 * own, 1e-4), (err, own)
    for k, v in cpu(loop.glob.state_dict()).items():
        if not v.is_floating_point():
            assert torch.equal(sim.state_dict()[k].cpu(), v), k


@pytest.mark.parametrize("conv", ["triton", "hybrid"])
def test_gpu_engine_with_tf32_on_is_as_close_as_the_tf32_loop(conv):
    """The CNN round of test_gpu_engine_conv_implementations_match_the_loop with TF32 on (PyTorch's cuDNN default):
    the engine's distance from the float64 loop within 5x the TF32 GPU loop's own."""
    import copy

    from sequential_loop import sequential
    from test_batch_norm import _Data
    from test_engine_conv import _cnn_setup

    import fedfast
    from fedfast.sim.memory import tf32_semantics

    _need("triton")
    train, test, part, model = _cnn_setup()
    cfg = fedfast.SimConfig(
        algorithm="fedntd", clients_per_round=3, rounds=2, batch_size=8, lr=0.05, momentum=0.9, seed=1, conv=conv
    )
    ref = sequential(cfg, copy.deepcopy(model).double(), _Data(train), part, cfg.rounds).cpu()
    with tf32_semantics():
        loop = sequential(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), part, cfg.rounds).cpu()
        sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part)
        sim.run()
    rel = lambda a: float((a.double() - ref).abs().max() / ref.abs().max())  # noqa: E731
    err, own = rel(sim.global_flat.cpu()), rel(loop)
    print(f"conv={conv} tf32: engine {err:.2e}, GPU loop {own:.2e} from the float64 loop")
    assert own > 0 and err <= max(5 * own, 1e-5), (err, own)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "segment", "none"])
def test_gpu_linear_kd_loss_matches_the_unfused_float64_loss(backend, reduction):
    """LinearKDLoss in fp32 on the GPU (chunks of 96 rows, a padded label, the teacher as hidden states + head)
    against Linear + KDLoss in float64 on the CPU: value and the hidden, weight and bias gradients to 1e-5."""
    _need(backend)
    import fedfast.nn as fnn

    g = torch.Generator().manual_seed(0)
    R, H, V = 300, 64, 1000
    h, th = torch.randn(R, H, generator=g, dtype=torch.float64), torch.randn(R, 32, generator=g, dtype=torch.float64)
    W, tW = (
        torch.randn(V, H, generator=g, dtype=torch.float64) * 0.2,
        torch.randn(V, 32, generator=g, dtype=torch.float64) * 0.2,
    )
    b, tb = torch.randn(V, generator=g, dtype=torch.float64), torch.randn(V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (R,), generator=g)
    y[5] = -100
    seg = torch.arange(R) // 40
    kw = dict(segments=seg, num_segments=8) if reduction == "segment" else {}
    plain = fnn.KDLoss(tau=2.0, ce_weight=0.7, kd_weight=0.6, reduction=reduction, backend="reference")
    want = plain(h.requires_grad_() @ W.requires_grad_().T + b.requires_grad_(), th @ tW.T + tb, y, **kw)
    wgt = torch.linspace(0.5, 2.0, want.numel(), dtype=torch.float64).reshape(want.shape)
    gw = torch.autograd.grad((want * wgt).sum(), (h, W, b))
    fused = fnn.LinearKDLoss(tau=2.0, ce_weight=0.7, kd_weight=0.6, reduction=reduction, chunk_rows=96, backend=backend)
    cu = lambda t: t.detach().float().cuda()  # noqa: E731
    hc, Wc, bc = (cu(t).requires_grad_() for t in (h, W, b))
    from fedfast.sim.memory import fp32_semantics

    with fp32_semantics():
        got = fused(
            hc,
            Wc,
            y.cuda(),
            bias=bc,
            teacher_hidden=cu(th),
            teacher_weight=cu(tW),
            teacher_bias=cu(tb),
            **{k: (v.cuda() if torch.is_tensor(v) else v) for k, v in kw.items()},
        )
        gg = torch.autograd.grad((got * cu(wgt)).sum(), (hc, Wc, bc))
    assert got.shape == want.shape and rel_err(got.detach().double().cpu(), want.detach()) <= 1e-5
    for a, e in zip(gg, gw, strict=True):
        assert rel_err(a.double().cpu(), e) <= 1e-5


def test_gpu_dp_fedavg_aggregate_on_triton_and_refused_on_cuda():
    """DP-FedAvg's noised mean (dp_clip, dp_noise, dp_denominator) on the GPU: the Triton kernel (also what the
    automatic backend picks) against the float64 loop; the CUDA kernel refuses it by name."""
    _need("triton")
    from test_aggregate import _dp_loop

    torch.manual_seed(0)
    N, P = 9, 100003
    g = torch.randn(P)
    X = g + torch.randn(N, P) * 0.01
    X[3] = g + torch.randn(P)
    noise = torch.randn(P) * 0.1
    rows = torch.tensor([0, 3, 4, 8])
    want = _dp_loop(X[rows], g, 0.5, noise, 1.5)
    for be in ("triton", None):
        out = ops.aggregate(
            X.cuda(), g.cuda(), rows=rows.cuda(), dp_clip=0.5, dp_noise=noise.cuda(), dp_denominator=1.5, backend=be
        )
        assert rel_err(out["global"].double().cpu(), want) <= 1e-6
    if _backend.available("cuda", "cuda"):
        with pytest.raises(ValueError, match="backend"):
            ops.aggregate(X.cuda(), g.cuda(), dp_clip=0.5, dp_denominator=1.5, backend="cuda")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_client_step_delta_norm(backend):
    """The update norms of a private run's last local step on the GPU (Triton: in the step's pass; CUDA: one pass
    after it): SGD with momentum and a mask, and Adam, against float64 norms of the stepped rows."""
    _need(backend)
    torch.manual_seed(5)
    n, P = 6, 300007
    theta0, G, start = torch.randn(n, P, device="cuda"), torch.randn(n, P, device="cuda"), torch.randn(P, device="cuda")
    act = torch.tensor([True, True, False, True, True, True], device="cuda")
    for adam in (False, True):
        theta, out = theta0.clone(), torch.full((n,), -1.0, device="cuda")
        if adam:
            ops.client_adam(
                theta,
                G,
                torch.zeros_like(G),
                torch.zeros_like(G),
                1,
                lr=0.01,
                active=act,
                delta_from=start,
                delta_norm=out,
                backend=backend,
            )
        else:
            ops.client_step(
                theta,
                G,
                lr=0.1,
                momentum=0.9,
                momentum_buf=torch.zeros_like(G),
                active=act,
                delta_from=start,
                delta_norm=out,
                backend=backend,
            )
        want = torch.linalg.vector_norm(theta.double() - start.double(), dim=1)
        assert float(((out.double() - want).abs() / want)[act].max()) <= 1e-6 and float(out[2]) == -1.0


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_private_rounds_match_the_literal_loop(backend):
    """DP-FedAvg on the GPU (issue 49): with clipping only (z = 0, so no device-specific noise stream) the engine's
    rounds equal the CPU loop's clipped sums; with noise, the noise's standard deviation is z C / E."""
    _need(backend)
    pytest.importorskip("dp_accounting")
    import copy

    from sequential_loop import sequential, setup_data

    import fedfast

    train, test, part, model = setup_data("mlp")
    kw = dict(
        algorithm="fedavg",
        clients_per_round=4,
        rounds=3,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        seed=3,
        max_grad_norm=0.0,
        dp_clip=0.05,
        backend=backend,
    )
    cfg = fedfast.SimConfig(**kw, dp_noise_multiplier=0.0)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, device="cuda")
    start = copy.deepcopy(sim.model).cpu()
    sim.run()
    from fedfast.sampling import sample_clients

    seed = sim.privacy.secret.cohort_seed()  # a private run's cohorts come from its secret
    ref = sequential(
        cfg,
        start,
        train,
        part,
        cfg.rounds,
        sampled_fn=lambda r: sample_clients(seed, r, part.num_clients, 4),
        dp=dict(clip=0.05, z=0.0, E=4.0, gen=None),
    )
    assert rel_err(sim.global_flat.cpu(), ref) <= 1e-5
    from types import SimpleNamespace

    from fedfast.privacy import DPFedAvg, PrivacySettings

    p = DPFedAvg(
        PrivacySettings.of(fedfast.SimConfig(**kw, dp_noise_multiplier=1.3, client_sampling="poisson")),
        num_clients=100,
        device="cuda",
    )
    g = torch.zeros(1_000_000, device="cuda")
    noise = p.average(g, torch.zeros_like(g), 0.0, SimpleNamespace(index=0))
    assert abs(float(noise.std()) / (1.3 * 0.05 / 4) - 1) < 5e-3


def _graph_counts(sim):
    g = sim.trainer.graph
    return dict(captures=g.captures, replays=g.replays, eager=g.eager)


@pytest.mark.parametrize("case", ["fedntd-triton", "fedntd-hybrid", "fedprox-grouped", "fedavg-batchnorm"])
def test_gpu_cuda_graph_steps_equal_eager_steps(case):
    """cuda_graphs=True (each chunk's step captured once, replayed: fedfast.sim.step_graph) trains what the eager
    steps train, and what the CPU loop trains: a replay that kept its capture's minibatch, teacher rows or terms
    would be far off. Three local epochs of two steps: per chunk one warm-up, one capture, four replays."""
    import copy

    from sequential_loop import sequential
    from test_engine_conv import _cnn_setup
    from torch import nn

    import fedfast
    from fedfast.sim.memory import fp32_semantics

    method, conv = case.split("-")
    _need("triton") if conv in ("triton", "hybrid") else _cuda()
    train, test, part, model = _cnn_setup()
    if conv == "batchnorm":
        conv = "auto"
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(150, 3),
        )
    opts = {"fedprox": {"mu": 0.5}} if method == "fedprox" else {}
    kw = dict(algorithm=method, options=opts, clients_per_round=3, rounds=2, local_epochs=3, batch_size=8, lr=0.05)
    kw.update(momentum=0.9, seed=1, conv=conv, client_chunk=2)  # two chunks: a capture per chunk and round
    ref = sequential(fedfast.SimConfig(**kw), copy.deepcopy(model), train, part, 2)
    got = {}
    with fp32_semantics():
        for graphs in (False, True):
            cfg = fedfast.SimConfig(**kw, cuda_graphs=graphs)
            sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part)
            sim.run()
            got[graphs] = sim.global_flat.cpu()
    assert _graph_counts(sim) == dict(captures=4, replays=4 * 5, eager=4)  # 2 rounds x 2 chunks x 6 steps
    assert float((got[True] - got[False]).abs().max() / got[False].abs().max()) <= 1e-6
    assert float((got[True] - ref).abs().max() / ref.abs().max()) <= 1e-4


def test_gpu_cuda_graph_private_run_equals_the_loop():
    """A private run with cuda_graphs: the clients' last step (which also measures the update norms) runs eagerly
    (its key differs from the capture's), every other step replays; the clipped mean equals the loop's."""
    import copy

    from sequential_loop import sequential, setup_data

    import fedfast
    from fedfast.sampling import sample_clients

    _need("triton")
    train, test, part, model = setup_data("mlp")
    kw = dict(algorithm="fedavg", clients_per_round=4, rounds=2, local_epochs=3, batch_size=16, lr=0.05, seed=3)
    kw.update(max_grad_norm=0.0, dp_clip=0.05, dp_noise_multiplier=0.0, backend="triton", cuda_graphs=True)
    cfg = fedfast.SimConfig(**kw)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, device="cuda")
    start = copy.deepcopy(sim.model).cpu()
    sim.run()
    seed = sim.privacy.secret.cohort_seed()
    ref = sequential(
        cfg,
        start,
        train,
        part,
        cfg.rounds,
        sampled_fn=lambda r: sample_clients(seed, r, part.num_clients, 4),
        dp=dict(clip=0.05, z=0.0, E=4.0, gen=None),
    )
    counts = _graph_counts(sim)
    assert counts["replays"] > 0, counts
    assert rel_err(sim.global_flat.cpu(), ref) <= 1e-5
