"""The run's state: the only mutable state that crosses rounds (fedjax's explicit server state), and its checkpoint.

Everything else a :class:`fedfast.Simulation` holds is fixed at construction (the model runtime, the round plan's
placement of the data, the memory budget) or lives within one round (the trainer's buffers, the round's context).
The method keeps its own state (``Method.state_dict``); a checkpoint is this state's serialisation plus the
method's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def _on_cpu(obj):
    """A method's state dict (nested plain data) with every tensor detached onto the CPU."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


@dataclass(kw_only=True)
class RunState:
    """``round``: rounds completed (0 before the first; only :meth:`fedfast.Simulation.round` advances it);
    ``global_flat`` [P]: the model the next round's clients start from; ``eval_flat`` [P]: the model evaluated
    (``Method.evaluated``: the global model, or FedDyn's participants' average); ``history``: the rounds' records;
    ``class_acc``: the evaluated rounds' per-class test accuracies (FedNTD's forgetting); ``augment``: the
    augmentation generator (re-seeded per step from ``(seed, round, epoch, step)``, kept so a checkpoint holds
    every generator the run draws from; torch's global generator is saved beside it); ``global_buffers`` [B]: the
    global model's buffers (BatchNorm's running statistics: the participants' weighted average; empty for a model
    without), which the evaluated model shares."""

    round: int
    global_flat: torch.Tensor
    eval_flat: torch.Tensor
    history: list
    class_acc: list
    augment: torch.Generator
    global_buffers: torch.Tensor

    @classmethod
    def start(
        cls, global_flat: torch.Tensor, eval_flat: torch.Tensor, seed: int, buffers: torch.Tensor | None = None
    ) -> "RunState":
        """Round 0: the initial model (and its ``buffers``), no history."""
        gen = torch.Generator(device=global_flat.device).manual_seed(seed + 104729)
        if buffers is None:
            buffers = global_flat.new_zeros(0)
        return cls(
            round=0,
            global_flat=global_flat,
            eval_flat=eval_flat,
            history=[],
            class_acc=[],
            augment=gen,
            global_buffers=buffers,
        )

    def checkpoint(self, method_state: dict, shape: dict) -> dict:
        """Plain data (tensors on the CPU): this state, the method's state, torch's generators, and ``shape`` (what
        the run was made for: parameters, clients, classes), which :meth:`restored` checks."""
        dev = self.global_flat.device
        rng = {"torch": torch.get_rng_state(), "augment": self.augment.get_state().cpu()}
        if dev.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(dev)
        return {
            "round": self.round,
            "global": self.global_flat.cpu(),
            "evaluated": self.eval_flat.cpu(),
            "buffers": self.global_buffers.cpu(),
            "method": _on_cpu(method_state),
            "class_accuracy": [a.cpu() for a in self.class_acc],
            "history": self.history,
            "rng": rng,
            "shape": shape,
        }

    @staticmethod
    def check(ck: dict, shape: dict) -> None:
        """ValueError unless checkpoint ``ck`` was made for a run of this ``shape``."""
        if ck.get("shape") != shape:
            raise ValueError(f"checkpoint: made for {ck.get('shape')}, this simulation has {shape}")

    def restore_(self, ck: dict) -> None:
        """This state becomes the one checkpoint ``ck`` holds (:meth:`restored`), in place: the parts that hold it
        (the method's engine view) see the restored run."""
        new = self.restored(ck)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(new, f.name))

    def restored(self, ck: dict) -> "RunState":
        """The state checkpoint ``ck`` holds, on this state's device (torch's generators set from it too)."""
        dev = self.global_flat.device
        gen = torch.Generator(device=self.augment.device)
        gen.set_state(ck["rng"]["augment"].to(self.augment.get_state().device))
        torch.set_rng_state(ck["rng"]["torch"])
        if "cuda" in ck["rng"] and dev.type == "cuda":
            torch.cuda.set_rng_state(ck["rng"]["cuda"], dev)
        buffers = ck.get("buffers")
        if buffers is None:  # a checkpoint of fedfast before the model's buffers were state
            if self.global_buffers.numel():
                raise ValueError(
                    f"checkpoint: holds no model buffers, this model has {self.global_buffers.numel()} "
                    f"buffer values (BatchNorm statistics); it was written by a fedfast that did not "
                    f"keep them: start the run again"
                )
            buffers = self.global_buffers
        if tuple(buffers.shape) != tuple(self.global_buffers.shape):
            raise ValueError(
                f"checkpoint: holds {buffers.numel()} model buffer values, this model has {self.global_buffers.numel()}"
            )
        return RunState(
            round=int(ck["round"]),
            global_flat=ck["global"].to(dev),
            eval_flat=ck["evaluated"].to(dev),
            history=list(ck["history"]),
            class_acc=list(ck["class_accuracy"]),
            augment=gen,
            global_buffers=buffers.to(dev).clone(),
        )
