"""A private run's server side (``SimConfig.dp_clip`` > 0): DP-FedAvg (McMahan et al., ICLR 2018) inside the fused
aggregation, its seeded noise and its accounting.

Each round: every sampled client's update ``X_k - g`` is clipped to L2 norm ``C = dp_clip`` (the norms are added up
by each client's last local step in its own pass over the row, ``delta_norm`` of :func:`fedfast.ops.client_step`;
the clipping factors enter :func:`fedfast.ops.aggregate` as unnormalised weights, so the clipped sum costs the
aggregation's own pass and the mechanism no pass of its own), the chunks' clipped sums are added (and all-reduced
across processes), Gaussian noise ``N(0, (z C)^2 I)`` is added once, and the total is divided by the expected
cohort size ``E = clients_per_round``:

    avg = g + (sum_k min(1, C / ||X_k - g||) (X_k - g) + z C xi) / E,        xi ~ N(0, I_P)

which the method's server rule then takes as the round's average (FedAvg: the new global model). Weights are
uniform; a method that sends anything beside its model update (``Method.uploads``) is refused by
:class:`fedfast.SimConfig`. The noise comes from a generator of its own, seeded from the run seed and saved in
checkpoints, so a resumed run draws the same noise. ``z`` is ``dp_noise_multiplier``, or the multiplier that spends
``dp_epsilon`` at ``dp_delta`` in ``rounds`` rounds (:func:`fedfast.privacy.calibrate`); epsilon after every round
is in the round's record (``dp_epsilon``) from :class:`fedfast.privacy.Accountant`.

Adaptive clipping (``dp_clip_quantile`` gamma; Andrew et al., *Differentially Private Learning with Adaptive
Clipping*, NeurIPS 2021): the aggregation also counts the updates no longer than C, the count gets Gaussian noise of
std ``sigma_b = dp_clip_count_noise`` (default E / 20, the paper's), and after the round
``C <- C exp(-eta (b - gamma))`` with ``b = (count + noise) / E`` and ``eta = dp_clip_lr``. The count's release is
paid for by noising the updates with ``z_update = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (the paper's Theorem 1: the pair
is then one Gaussian mechanism of multiplier z), so the accountant's z is unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import privacy
from ..methods.base import Method
from .plan import RoundPlan
from .runtime import ModelRuntime
from .settings import Settings

_SERVER_SIDE = {"beta", "scale", "lr", "momentum", "ring", "ring_slot", "ring_count"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacySettings(Settings):
    """What a private run's server side reads of the config: the clip and noise (or the budget it is calibrated
    to), the accountant, adaptive clipping's settings, and the sampling the accountant assumes."""

    dp_clip: float
    dp_noise_multiplier: float | None
    dp_epsilon: float | None
    dp_delta: float
    dp_accountant: str
    dp_clip_quantile: float | None
    dp_clip_lr: float
    dp_clip_count_noise: float | None
    clients_per_round: int
    client_sampling: str
    rounds: int
    seed: int


class RoundPrivacy:
    """DP-FedAvg's parts of a run: the chunk's aggregation arguments, the round's noise and the accounting."""

    def __init__(self, settings: PrivacySettings, method: Method, num_clients: int, device: torch.device):
        self.settings = s = PrivacySettings.given(settings)
        self.method = method
        self.clip = float(s.dp_clip)
        self.expected = float(s.clients_per_round)  # E: the expected cohort size (Poisson: q K)
        sampling = "poisson" if s.client_sampling == "poisson" else "fixed"
        self.acct_kw = dict(
            sampling=sampling,
            num_clients=int(num_clients),
            accountant=s.dp_accountant,
            clients_per_round=int(s.clients_per_round) if sampling == "fixed" else None,
            rate=s.clients_per_round / num_clients if sampling == "poisson" else None,
        )
        if s.dp_noise_multiplier is not None:
            self.z = float(s.dp_noise_multiplier)
        else:
            self.z = privacy.calibrate(float(s.dp_epsilon), float(s.dp_delta), int(s.rounds), **self.acct_kw)
        self.accountant = privacy.Accountant(self.z, float(s.dp_delta), max_epsilon=s.dp_epsilon, **self.acct_kw)
        self.accountant.check_plan(int(s.rounds))
        self.gen = torch.Generator(device=device).manual_seed(int(s.seed) + 1_000_003)
        self.device = device
        self.adaptive = s.dp_clip_quantile is not None
        self.sigma_b = float(s.dp_clip_count_noise or self.expected / 20) if self.adaptive and self.z > 0 else 0.0
        self.z_update = self._update_multiplier(self.z)

    def _update_multiplier(self, z: float) -> float:
        """The updates' noise multiplier: z, or with adaptive clipping what is left after the count's share."""
        if not self.adaptive or z == 0:
            return z
        if not 2 * self.sigma_b > z:
            raise ValueError(
                f"dp_clip_count_noise: adaptive clipping's count noise {self.sigma_b:g} must exceed "
                f"dp_noise_multiplier / 2 = {z / 2:g} (the updates' noise is "
                f"(z^-2 - (2 sigma_b)^-2)^(-1/2)); raise dp_clip_count_noise"
            )
        return (z**-2 - (2 * self.sigma_b) ** -2) ** -0.5

    @classmethod
    def of(
        cls,
        settings: PrivacySettings,
        method: Method,
        plan: RoundPlan,
        runtime: ModelRuntime,
        schedule,
        device: torch.device,
    ) -> "RoundPrivacy | None":
        """The run's DP parts (None without ``dp_clip``); a schedule (public cohorts) and a model with buffers
        (BatchNorm statistics, averaged from the clients' data unclipped) refused by name."""
        if not PrivacySettings.given(settings).dp_clip:
            return None
        if schedule is not None:
            raise ValueError(
                "schedule: a private run's cohorts must be sampled secretly (client_sampling); a "
                "given schedule is refused under dp_clip"
            )
        if runtime.num_buffers:
            raise ValueError(
                f"dp_clip: the model's {runtime.num_buffers} buffer values (BatchNorm running "
                f"statistics) are averaged from the clients' data, uploads DP-FedAvg's clipping and noise "
                f"do not cover; use a model without them (GroupNorm)"
            )
        return cls(settings, method, plan.num_clients, device)

    def chunk_arguments(self, extra: dict, norms: torch.Tensor | None = None) -> dict:
        """:func:`fedfast.ops.aggregate`'s DP arguments for a chunk, with the method's own (server-side only);
        ``norms``: the clients' update norms from their last local steps (None: the op measures the rows)."""
        client_side = sorted(set(extra) - _SERVER_SIDE)
        if client_side:
            raise ValueError(
                f"dp_clip: {self.method.name}'s chunk_aggregate passes {client_side}, per-client uploads "
                f"that DP-FedAvg's clipping and noise do not cover (declare them in the method's "
                f"`uploads`)"
            )
        return dict(dp_clip=self.clip, dp_denominator=self.expected, dp_norms=norms, **extra)

    def begin_round(self, ctx) -> float:
        """The round's clip. A method's (or plug-in's) per-round sums ``ctx.sums`` are uploads too: refused by
        name. With adaptive clipping, the round's count of unclipped updates (summed over the chunks and processes
        with the method's sums)."""
        if ctx.sums:
            raise ValueError(
                f"dp_clip: {self.method.name} sums {sorted(ctx.sums)} over its clients (ctx.sums), "
                f"uploads that DP-FedAvg's clipping and noise do not cover"
            )
        if self.adaptive:
            ctx.sums["_dp_unclipped"] = torch.zeros((), device=self.device)
        return self.clip

    def collect(self, ctx, out: dict) -> None:
        """A chunk's count of unclipped updates (adaptive clipping)."""
        if self.adaptive:
            ctx.sums["_dp_unclipped"] += out["dp_unclipped"]

    def average(self, g: torch.Tensor, clipped_sum: torch.Tensor, ctx=None) -> torch.Tensor:
        """``g + (clipped_sum + z C xi) / E``, ``clipped_sum`` the round's (all-reduced) sum of the chunks'
        ``(average - g)``, i.e. of the clipped updates already divided by E; the noise drawn once per round. With
        adaptive clipping the next round's C from the noised count (one host read per round)."""
        avg = g + clipped_sum
        if self.z > 0:
            xi = torch.randn(g.shape, generator=self.gen, device=self.device, dtype=torch.float32)
            avg = avg + xi.to(g.dtype) * (self.z_update * self.clip / self.expected)
        if self.adaptive:
            nb = torch.randn(1, generator=self.gen, device=self.device, dtype=torch.float32) * self.sigma_b
            b = float((ctx.sums["_dp_unclipped"] + nb[0]) / self.expected)
            s = self.settings
            self.clip = self.clip * math.exp(-float(s.dp_clip_lr) * (b - float(s.dp_clip_quantile)))
        return avg

    def record(self, rec: dict, rounds: int, clip: float) -> None:
        """The round's record: epsilon spent so far, and with adaptive clipping the clip the round used."""
        rec["dp_epsilon"] = self.epsilon(rounds)
        if self.adaptive:
            rec["dp_clip"] = clip

    def epsilon(self, rounds: int) -> float | None:
        """Epsilon spent after ``rounds`` rounds (None when infinite: no noise)."""
        eps = self.accountant.epsilon(rounds)
        return eps if math.isfinite(eps) else None

    def state_dict(self) -> dict:
        return {"noise_multiplier": self.z, "generator": self.gen.get_state().cpu(), "clip": self.clip}

    @staticmethod
    def restore(privacy: "RoundPrivacy | None", ck: dict, rounds: int) -> None:
        """A checkpoint's DP state into ``privacy`` (the run's, or None); a private checkpoint into a run that is
        not (or the reverse) refused."""
        if (privacy is not None) != ("privacy" in ck):
            raise ValueError(
                "checkpoint: "
                + (
                    "a private run's (dp_clip), this config is not private"
                    if "privacy" in ck
                    else "a run without dp_clip, this config is private"
                )
            )
        if privacy is not None:
            privacy.load_state_dict(ck["privacy"], rounds)

    def load_state_dict(self, st: dict, rounds: int) -> None:
        """The noise of the checkpointed run (its multiplier: a calibrated one is not calibrated again when
        ``rounds`` changed) and its generator; the run refused when ``rounds`` would pass ``dp_epsilon``."""
        z = float(st["noise_multiplier"])
        if self.settings.dp_noise_multiplier is not None and z != self.z:
            raise ValueError(
                f"dp_noise_multiplier: the checkpoint's run drew noise of multiplier {z:g}, this config "
                f"gives {self.z:g}"
            )
        self.z = z
        self.z_update = self._update_multiplier(z)
        self.clip = float(st.get("clip", self.clip))
        self.accountant.noise_multiplier = z
        self.accountant.check_plan(int(rounds))
        self.gen.set_state(st["generator"].to(self.gen.get_state().device))
