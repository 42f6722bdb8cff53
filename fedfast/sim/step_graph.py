"""A chunk's local step as one CUDA graph (``SimConfig(cuda_graphs=True)``): captured once per chunk, replayed for
its other steps, so that the host launches one graph per step instead of its 60-190 kernels.

Issue 57's profile of FedNTD's MNIST round on an H200 (``benchmarks/results/nvidia-h200-profile.txt``): the host
spends 5.3-6.1 ms per local step (the autograd engine's launches, cuDNN's planning, the Python of the forward and
the fused ops) where the device needs about 3.4: the device idles while the host queues the step. A graph replay
queues the whole step in a few microseconds.

What a replay reads is fixed at capture: the addresses of every tensor the step reads, and every host value
(Python floats, shapes, flags) the step's code used. The engine therefore

* captures per chunk (a new chunk, a new round: a new capture), after one eager step of the chunk (the warm-up
  that compiles Triton kernels and makes cuDNN's and cuBLAS's plans outside the capture);
* copies each step's minibatch (inputs, labels, valid mask, row indices: made outside the graph, as the
  augmentation's generator and the step's row table are host-side) into the graph's own input tensors;
* keys the graph by the step's host values it can see: the active clients and the client step's keyword
  arguments (a tensor by its address, shape, strides and dtype; anything else by value). A step whose key differs
  from the captured one (a private run's last step, which also measures the update norms; a padded minibatch,
  whose BatchNorm mask is decided on the host) runs eagerly;
* takes the method's word for the rest: only hooks marked :func:`fedfast.methods.graph_safe` (their result depends
  on the chunk, not on the step: no ``b.epoch`` / ``b.step``, no host state that changes between steps, no tensor
  made fresh each step at a new address) run under a graph. The engine refuses ``cuda_graphs`` for a method whose
  ``loss`` or ``step_terms`` is not marked, a user ``loss_fn``, SAM, a teacher run on every step and
  ``profile=True``.

The gradient goes through one flat ``[n, P]`` buffer in this mode (the per-parameter pieces' block table would be
a host-to-device copy inside the graph, whose pinned source the replay would read after it was freed): the same
values, one extra pass over the gradient. The graph's memory pool holds the step's activations and that buffer
between replays.
"""

from __future__ import annotations

import torch


def step_key(n_act: int, kw: dict) -> tuple:
    """What a captured step baked in, as far as the engine sees it: the active clients and the client step's
    keyword arguments (a tensor by address, shape, strides, dtype)."""

    def sig(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device))
        if isinstance(v, (list, tuple)):
            return tuple(sig(a) for a in v)
        return ("value", type(v).__name__, v)

    return (int(n_act), tuple(sorted((k, sig(v)) for k, v in kw.items())))


class StepGraph:
    """One chunk's captured local step. :meth:`step` runs a step through the graph (capturing it first) or returns
    False for the caller to run it eagerly: the chunk's first step (the warm-up) and any step whose key differs
    from the captured one. ``captures`` / ``replays`` / ``eager`` count this trainer's steps by kind.
    ``emulate=True`` (any device): the capture keeps the call and a replay re-runs it on the graph's inputs with
    the host values of the capture - a graph's semantics without CUDA, for tests."""

    def __init__(self, device: torch.device, *, emulate: bool = False):
        if device.type != "cuda" and not emulate:
            raise ValueError(f"cuda_graphs: a CUDA graph needs a CUDA device, got {device}")
        self.device, self.emulate = device, emulate
        self.captures = self.replays = self.eager = 0
        self.reset()

    def reset(self) -> None:
        """A new chunk: the next step is its warm-up, the one after it is captured (the last chunk's graph and its
        memory pool freed here)."""
        self.graph, self.key, self.inputs, self.warm = None, None, None, False

    def step(self, key: tuple, inputs: dict, body) -> bool:
        """Run ``body(**inputs)`` as the graph (True), or return False (the caller runs the step eagerly)."""
        if not self.warm:
            self.warm = True
            self.eager += 1
            return False
        if self.graph is None:
            self._capture(key, inputs, body)
        elif key != self.key:
            self.eager += 1
            return False
        else:
            for k, v in inputs.items():
                self.inputs[k].copy_(v)
        self.graph.replay()
        self.replays += 1
        return True

    def _capture(self, key, inputs, body) -> None:
        self.inputs = {k: v.clone() for k, v in inputs.items()}
        if self.emulate:  # a replay re-runs the captured call on the graph's own inputs (tests, on any device)
            self.graph, self.key = _Replay(lambda: body(**self.inputs)), key
            self.captures += 1
            return
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # each capture its own memory pool: a pool handle shared with a graph since destroyed is refused by
            # the caching allocator (seen on an H200, torch 2.11: "it->second->use_count > 0" at the next capture)
            g.capture_begin()
            try:
                body(**self.inputs)
            finally:
                g.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph, self.key = g, key
        self.captures += 1


class _Replay:
    """``emulate=True``'s graph: the captured call, with the host values it closed over at capture, as a replay
    would run the kernels it recorded then (what tests/test_step_graph.py checks the engine against on a CPU)."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()
