"""A run's state as plain data: the checkpoint a resumed run continues from bit for bit, and the trained model's
weights."""
from __future__ import annotations

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


class Snapshots:
    """Mixin of :class:`fedfast.Simulation`: checkpoint, restore and the trained model."""

    # -- checkpoints -------------------------------------------------------------------------------------------
    def checkpoint(self) -> dict:
        """Everything the next rounds depend on, as plain data (tensors on the CPU): the global and evaluated
        models, the method's state, the round counter, the metrics so far and the random generators' states.
        :meth:`restore` on a Simulation built with the same config and data continues bit for bit (CPU)."""
        rng = {"torch": torch.get_rng_state(), "augment": self._aug_gen.get_state().cpu()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"round": self.rnd, "global": self.global_flat.cpu(), "evaluated": self.eval_flat.cpu(),
                "method": _on_cpu(self.method.state_dict()),
                "class_accuracy": [a.cpu() for a in self._class_acc], "history": self.history, "rng": rng,
                "shape": {"num_params": self.num_params, "num_clients": self.K, "num_classes": self.num_classes}}

    def restore(self, ck: dict) -> None:
        """Continue from :meth:`checkpoint`; ValueError if it does not fit this simulation."""
        shape = {"num_params": self.num_params, "num_clients": self.K, "num_classes": self.num_classes}
        if ck.get("shape") != shape:
            raise ValueError(f"checkpoint: made for {ck.get('shape')}, this simulation has {shape}")
        self.method.load_state_dict(ck["method"])
        self.global_flat = ck["global"].to(self.device)
        self.eval_flat = ck["evaluated"].to(self.device)
        self.rnd = int(ck["round"])
        self.history = list(ck["history"])
        self._class_acc = list(ck["class_accuracy"])
        torch.set_rng_state(ck["rng"]["torch"])
        self._aug_gen.set_state(ck["rng"]["augment"].to(self._aug_gen.get_state().device))
        if "cuda" in ck["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(ck["rng"]["cuda"], self.device)
        self._load_into_model(self.eval_flat)

    # -- the trained model -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _load_into_model(self, flat: torch.Tensor):
        for p, v in zip(self.model.parameters(), self.layout.param_views(flat).values()):
            p.copy_(v)

    def state_dict(self) -> dict:
        """The evaluated global model as a ``state_dict`` of ``model`` (copies): ``model.load_state_dict(...)``."""
        self._load_into_model(self.eval_flat)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
