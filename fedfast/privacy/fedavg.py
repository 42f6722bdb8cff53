"""DP-FedAvg (McMahan et al., ICLR 2018) with adaptive clipping (Andrew et al., NeurIPS 2021): the mechanism.

Each round: every sampled client's update ``X_k - g`` is clipped to L2 norm ``C = dp_clip`` (the norms are added up
by each client's last local step in its own pass over the row, ``delta_norm`` of :func:`fedfast.ops.client_step`;
the clipping factors enter :func:`fedfast.ops.aggregate` as unnormalised weights, so the clipped sum costs the
aggregation's own pass and the mechanism no pass of its own), the chunks' clipped sums are added (and all-reduced
across processes), Gaussian noise ``N(0, (z C)^2 I)`` is added once, and the total is divided by the expected
cohort size ``E = clients_per_round``:

    avg = g + (sum_k min(1, C / ||X_k - g||) (X_k - g) + z C xi) / E,        xi ~ N(0, I_P)

which the method's server rule then takes as the round's average (FedAvg: the new global model). Weights are
uniform; a method that sends anything beside its model update (``Method.uploads``) is refused by
:class:`fedfast.SimConfig`. ``z`` is ``dp_noise_multiplier``, or the multiplier that spends ``dp_epsilon`` at
``dp_delta`` in ``rounds`` rounds (:func:`fedfast.privacy.calibrate`); epsilon after every round is in the round's
record (``dp_epsilon``). The noise of round ``r`` is drawn from the run's :class:`~fedfast.privacy.secret.Secret`
(OS entropy, never the run seed), stream ``(NOISE, r)``, so a resumed run draws the same noise.

**Adaptive clipping** (``dp_clip_quantile`` gamma): the aggregation also counts the updates no longer than C; the
count is *centred*, each client adding ``1/2`` if its update was not clipped and ``-1/2`` if it was (Andrew et al.,
Algorithm 1 as TensorFlow Privacy's quantile estimator runs it), so one client added or removed moves it by at most
1/2, and replacing one client by at most 1. It gets Gaussian noise of std ``sigma_b = dp_clip_count_noise``
(default E / 20, the paper's), and after the round ``C <- C exp(-eta (b - gamma))`` with
``b = (count + noise) / E + 1/2`` and ``eta = dp_clip_lr``. The count's release is paid for by noising the updates
with ``z_update = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: under add/remove the pair (sum of sensitivity C, count of
sensitivity 1/2) is one Gaussian mechanism of multiplier ``((z_update)^-2 + (2 sigma_b)^-2)^(-1/2) = z`` (the
paper's Theorem 1), and under replace-one (2C and 1) the same pair is one of ``z / 2`` relative to its
sensitivity, which the fixed-size accounting assumes: the accountant's z is right under both samplings. An
uncentred count (sensitivity 1 under add/remove) with this ``z_update`` would be a mechanism of multiplier
``((z_update)^-2 + sigma_b^-2)^(-1/2) < z``: epsilon 8 reported where 17.85 is spent (tests/test_privacy_audit.py
measures what each release adds and recomputes epsilon from it).

**Uploads beside the update** (``Method.upload_spec``: SCAFFOLD's control variates, FedCurv's Fisher diagonals,
...): each client's update and uploads are clipped together, ``min(1, C / ||(X_k - g, u_k^1, u_k^2, ...)||)`` on
every part (DP-SCAFFOLD's joint clipping, Noble et al., AISTATS 2022; the joint norm enters the aggregation as its
``dp_norms``, so the fused pass clips the update with it), each upload's clipped sum gets Gaussian noise of the
update's std ``z_update C`` from a stream of its own, and the server rule reads ``scale * noised sum`` where it
reads the plain sum without privacy. The concatenation has sensitivity C and iid noise of std ``z_update C``: the
same mechanism the accountant is given. An upload that *is* the update (FedDyn's ``h``) reads the average's own
noised sum (post-processing). Per-client state rows the aggregation updates (SCAFFOLD's ``c_k``) are the clients'
own and stay unclipped; their unclipped column sum is never handed to the server rule.
"""

from __future__ import annotations

import math
import warnings

import torch

from .. import ops
from . import accounting
from .mechanism import Mechanism
from .secret import NOISE, Secret
from .settings import PrivacySettings

_SERVER_SIDE = {"beta", "scale", "lr", "momentum", "ring", "ring_slot", "ring_count"}
_CLIENT_STATE = {"state_rows", "state_coef", "state_shift"}  # the clients' own rows (with declared uploads)

# a round's values no accountant covers: left out of a private run's records unless dp_diagnostics (the training
# loss of the clients' data, the cohort's ids, how long the round took, which grows with the cohort and the data,
# and a method's own values)
UNACCOUNTED = ("train_loss", "clients", "timers", "seconds", "method_metrics")


class DPFedAvg(Mechanism):
    """DP-FedAvg's bound step (clipping, fused in the aggregation), noise step and accounting (module docstring).
    ``secret``: the run's :class:`~fedfast.privacy.secret.Secret` (the round plan samples the cohorts from it too);
    ``method_name``: named in refusals."""

    name = "dp_fedavg"
    private = True
    needs_norms = True

    def __init__(
        self,
        settings: PrivacySettings,
        *,
        num_clients: int,
        device: torch.device | str,
        secret: Secret | None = None,
        method_name: str = "the method",
        uploads: dict | None = None,
    ):
        self.settings = s = PrivacySettings.given(settings)
        self.method_name = method_name
        self._uploads(uploads)
        self.secret = secret if secret is not None else Secret()
        self.device = torch.device(device)
        self.num_clients = int(num_clients)
        self.clip = float(s.dp_clip)
        self.expected = float(s.clients_per_round)  # E: the expected cohort size (Poisson: q K)
        self.sampling = "poisson" if s.client_sampling == "poisson" else "fixed"
        accounting.check_accounting(s.dp_delta, self.sampling, s.dp_accountant, self.num_clients)
        self.acct_kw = dict(
            sampling=self.sampling,
            num_clients=self.num_clients,
            accountant=s.dp_accountant,
            clients_per_round=int(s.clients_per_round) if self.sampling == "fixed" else None,
            rate=s.clients_per_round / self.num_clients if self.sampling == "poisson" else None,
        )
        if s.dp_noise_multiplier is not None:
            self.z = float(s.dp_noise_multiplier)
        else:
            self.z = accounting.calibrate(float(s.dp_epsilon), float(s.dp_delta), int(s.rounds), **self.acct_kw)
        self.accountant = accounting.Accountant(self.z, float(s.dp_delta), max_epsilon=s.dp_epsilon, **self.acct_kw)
        planned = self.check_plan(int(s.rounds))
        self.poisson = None  # fixed-size sampling: what Poisson sampling at q = m / K would report for this noise
        if self.sampling == "fixed" and self.z > 0:
            self.poisson = accounting.Accountant(
                self.z,
                float(s.dp_delta),
                sampling="poisson",
                num_clients=self.num_clients,
                rate=self.expected / self.num_clients,
            )
            warnings.warn(
                f"client_sampling: 'uniform' (fixed-size) sampling is accounted under replace-one neighbouring at "
                f"z / 2, a correct but loose bound: epsilon {planned:.4g} after {s.rounds} rounds; the same noise "
                f"with client_sampling = 'poisson' reports {self.poisson.epsilon(int(s.rounds)):.4g} (each record's "
                f"dp_epsilon_poisson)",
                UserWarning,
                stacklevel=4,  # the Simulation(...) call
            )
        self.adaptive = s.dp_clip_quantile is not None
        self.sigma_b = float(s.dp_clip_count_noise or self.expected / 20) if self.adaptive and self.z > 0 else 0.0
        self.z_update = self._update_multiplier(self.z)
        self._count = None  # adaptive clipping: the round's centred count of unclipped updates
        self._round_clip = self.clip  # the clip the current round uses (adaptive clipping moves self.clip after it)

    def _uploads(self, uploads: dict | None) -> None:
        """The method's declared uploads (``Method.upload_spec``), in a fixed order (each its own noise stream)."""
        if uploads is not None and not (
            isinstance(uploads, dict)
            and all(isinstance(k, str) and k and hasattr(v, "cols") and hasattr(v, "scale") for k, v in uploads.items())
        ):
            raise ValueError(
                f"dp_clip: {self.method_name}'s upload_spec must return {{target: fedfast.methods.UploadSpec}} "
                f"or None, got {uploads!r}"
            )
        self.specs = dict(sorted((uploads or {}).items()))
        for k, v in self.specs.items():
            if v.cols is not None and not (isinstance(v.cols, int) and v.cols >= 1):
                raise ValueError(f"dp_clip: {self.method_name}'s upload {k!r}: cols must be an int >= 1 or None")
            if not (isinstance(v.scale, (int, float)) and math.isfinite(v.scale)):
                raise ValueError(f"dp_clip: {self.method_name}'s upload {k!r}: scale must be a finite number")
        self._acc = {}  # the round's clipped upload sums (targets with rows)
        self._s = self._rows = self._joint = None  # the chunk's clipping factors, upload rows and joint norms
        self._released = {}

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

    # -- a round --------------------------------------------------------------------------------------------
    def begin_round(self, ctx) -> float:
        """The round's clip. A method's (or plug-in's) per-round sums ``ctx.sums`` are uploads too: each must be a
        declared upload's target (``Method.upload_spec``), else refused by name."""
        uncovered = sorted(set(ctx.sums) - set(self.specs))
        if uncovered:
            raise ValueError(
                f"dp_clip: {self.method_name} sums {uncovered} over its clients (ctx.sums), uploads that the "
                f"mechanism's clipping and noise do not cover (declare them in the method's upload_spec)"
            )
        missing = sorted(k for k in self.specs if k != "increment" and k not in ctx.sums)
        if missing:
            raise ValueError(
                f"dp_clip: {self.method_name}'s upload_spec names {missing}, which are neither 'increment' nor "
                f"among the round's sums ({sorted(ctx.sums)})"
            )
        if self.adaptive:
            self._count = torch.zeros((), device=self.device)
        self._shapes = {k: tuple(ctx.sums[k].shape) for k in self.specs if k != "increment"}
        for k, shape in self._shapes.items():
            cols = self.specs[k].cols
            if cols is not None and math.prod(shape) != cols:
                raise ValueError(
                    f"dp_clip: {self.method_name}'s upload {k!r} has {cols} values a client, its round sum {shape}"
                )
        self._acc = {k: torch.zeros(v.cols, device=self.device) for k, v in self.specs.items() if v.cols}
        self._round_clip = self.clip
        return self.clip

    def upload_rows(self, method, ctx, lo: int, hi: int) -> dict | None:
        """The chunk's clients' declared uploads (``method.upload_rows``), checked: ``{target: [hi-lo, cols]}``."""
        want = {k: v.cols for k, v in self.specs.items() if v.cols}
        if not self.specs:
            return None
        got = method.upload_rows(ctx, lo, hi)
        if not isinstance(got, dict) or set(got) - {"update"} != set(want):
            raise ValueError(
                f"dp_clip: {self.method_name}'s upload_rows must return rows for {sorted(want)} (and optionally "
                f"'update'), got {sorted(got) if isinstance(got, dict) else type(got).__name__}"
            )
        f = got.get("update")
        if f is not None and not (
            torch.is_tensor(f)
            and f.is_floating_point()
            and tuple(f.shape) == (hi - lo,)
            and bool(((f > 0) & (f <= 1)).all())
        ):
            raise ValueError(
                f"dp_clip: {self.method_name}'s upload_rows['update'] must be each client's factor on its update, a "
                f"float tensor ({hi - lo},) in (0, 1]"
            )
        for k, cols in want.items():
            r = got[k]
            if not (torch.is_tensor(r) and r.is_floating_point() and tuple(r.shape) == (hi - lo, cols)):
                raise ValueError(
                    f"dp_clip: {self.method_name}'s upload_rows[{k!r}] must be a float tensor {(hi - lo, cols)}, got "
                    f"{tuple(r.shape) if torch.is_tensor(r) else type(r).__name__}"
                )
        return got or None  # nothing but the update itself: the plain bound step

    def bound(
        self,
        extra: dict,
        weights: torch.Tensor,
        norms: torch.Tensor | None,
        uploads: dict | None = None,
        clients: torch.Tensor | None = None,
        g: torch.Tensor | None = None,
    ) -> dict:
        """:func:`fedfast.ops.aggregate`'s DP arguments for a chunk, with the method's own (server-side only, and the
        clients' own state rows where the method declares its uploads); ``norms``: the clients' update norms from
        their last local steps (None: measured). With ``uploads`` (the chunk's rows, :meth:`upload_rows`) the norms
        passed on are the joint norms over each client's update and uploads, so the fused pass clips with them."""
        allowed = _SERVER_SIDE | (_CLIENT_STATE if self.specs else set())
        client_side = sorted(set(extra) - allowed)
        if client_side:
            raise ValueError(
                f"dp_clip: {self.method_name}'s chunk_aggregate passes {client_side}, per-client uploads "
                f"that the mechanism's clipping and noise do not cover (declare them in the method's "
                f"upload_spec)"
            )
        self._rows = self._joint = None
        if uploads is not None:
            n = weights.numel()
            if norms is None:
                norms = ops.update_norms(clients, g, torch.arange(n, device=clients.device)).float()
            factor = uploads.get("update")
            self._rows = {k: v for k, v in uploads.items() if k != "update"}
            own = norms.float() * factor if factor is not None else norms.float()
            sq = own**2
            for r in self._rows.values():
                sq = sq + r.float().pow(2).sum(1)
            self._joint = sq.sqrt()
            self._s = torch.clamp(self.clip / self._joint, max=1.0)
            # the fused pass scales each update by min(1, C / norm): the norm that makes it s_k * factor_k (<= 1)
            norms = self._joint if factor is None else self.clip / (self._s * factor)
        return dict(dp_clip=self.clip, dp_denominator=self.expected, dp_norms=norms, **extra)

    def chunk_sum(self, out: dict, weights: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The chunk's clipped sum / E (the noise is added once, in :meth:`average`); with adaptive clipping its
        centred count, each client +1/2 unclipped and -1/2 clipped; with uploads their clipped sums."""
        if self.adaptive:  # with uploads the joint norms decide (the op saw the norms that carry the factor)
            unclipped = out["dp_unclipped"] if self._joint is None else (self._joint <= self.clip).sum()
            self._count += unclipped - 0.5 * weights.numel()
        for k, r in (self._rows or {}).items():
            self._acc[k] += self._s @ r.float()
        self._rows = self._s = self._joint = None
        return out["average"] - g

    def check_collected(self, got) -> None:
        """A chunk's ``Collected``: an increment or round sum the method adds must be a declared upload's target
        (the server reads the noised clipped sum there instead)."""
        if got is None:
            return
        if getattr(got, "increment", None) is not None and "increment" not in self.specs:
            raise ValueError(
                f"dp_clip: {self.method_name}'s collect returns an increment of the server's state summed over its "
                f"clients, an upload the mechanism's clipping and noise do not cover (declare it in upload_spec)"
            )

    def round_sums(self) -> list:
        return ([self._count] if self.adaptive else []) + [self._acc[k] for k in sorted(self._acc)]

    def released(self) -> dict:
        """The round's noised upload sums times their scale, ``{target: tensor}``: what the server rule reads."""
        return self._released

    def _noise(self, shape, dtype, ctx, stream: int) -> torch.Tensor:
        """Upload ``stream``'s (1, 2, ...) Gaussian noise of the round, unit std."""
        gen = self.secret.generator(self.device, NOISE, int(ctx.index), stream)
        return torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32).to(dtype)

    def _release_uploads(self, update_sum: torch.Tensor, ctx) -> None:
        """Each declared upload's released sum: its clipped sum plus noise of std ``z_update C`` (its own stream),
        times its scale; an upload that is the update: the update's noised sum (``update_sum``) times its scale."""
        out = {}
        sd = self.z_update * self.clip
        for j, (k, spec) in enumerate(self.specs.items(), 1):
            if spec.cols is None:
                v = update_sum
            else:
                v = self._acc[k]
                if self.z > 0:
                    v = v + self._noise(v.shape, v.dtype, ctx, j) * sd
            shape = self._shapes.get(k, tuple(update_sum.shape))
            if v.numel() != math.prod(shape):
                raise ValueError(
                    f"dp_clip: {self.method_name}'s upload {k!r} has {v.numel()} values a client, its target {shape}"
                )
            out[k] = (v * float(spec.scale)).reshape(shape)
        self._released = out

    def average(self, g: torch.Tensor, total: torch.Tensor, total_weight: float, ctx) -> torch.Tensor:
        """``g + total + z_update C xi / E``, ``total`` the round's (all-reduced) sum of the chunks' clipped sums
        over E; the noise drawn from the round's own stream. With adaptive clipping the next round's C from the
        noised count (one host read per round)."""
        avg = g + total
        gen = self.secret.generator(self.device, NOISE, int(ctx.index)) if self.z > 0 else None
        if self.z > 0:
            xi = torch.randn(g.shape, generator=gen, device=self.device, dtype=torch.float32)
            avg = avg + xi.to(g.dtype) * (self.z_update * self.clip / self.expected)
        if self.specs:
            self._release_uploads((avg - g) * self.expected, ctx)
        if self.adaptive:
            nb = (
                torch.randn(1, generator=gen, device=self.device, dtype=torch.float32)[0] * self.sigma_b
                if gen is not None
                else 0.0
            )
            b = float((self._count + nb) / self.expected) + 0.5
            s = self.settings
            self.clip = self.clip * math.exp(-float(s.dp_clip_lr) * (b - float(s.dp_clip_quantile)))
        return avg

    def record(self, rec: dict, rounds: int) -> None:
        """The round's record: epsilon spent so far (and, for fixed-size sampling, what Poisson sampling would
        report for the same noise), and with adaptive clipping the clip the round used (``dp_clip``)."""
        rec["dp_epsilon"] = self.epsilon(rounds)
        if self.adaptive:
            rec["dp_clip"] = self._round_clip
        if self.poisson is not None:
            eps = self.poisson.epsilon(rounds)
            rec["dp_epsilon_poisson"] = eps if math.isfinite(eps) else None

    def publish(self, rec: dict) -> dict:
        """The record a private run keeps: with ``dp_diagnostics`` off, the unaccounted values (``UNACCOUNTED``)
        are None, and under Poisson sampling the cohort's size too (one client moves it by one)."""
        if self.settings.dp_diagnostics:
            return rec
        hidden = self._hidden()
        return {k: (None if k in hidden else v) for k, v in rec.items() if k != "method_metrics"}

    def _hidden(self) -> set:
        return set(UNACCOUNTED) | ({"cohort_size"} if self.sampling == "poisson" else set())

    def epsilon(self, rounds: int) -> float | None:
        """Epsilon spent after ``rounds`` rounds (None when infinite: no noise)."""
        eps = self.accountant.epsilon(rounds)
        return eps if math.isfinite(eps) else None

    # -- checkpoints ----------------------------------------------------------------------------------------
    def _accounting(self) -> dict:
        s = self.settings
        return {
            "client_sampling": s.client_sampling,
            "clients_per_round": int(s.clients_per_round),
            "num_clients": self.num_clients,
            "dp_delta": float(s.dp_delta),
            "dp_accountant": s.dp_accountant,
            "dp_clip": float(s.dp_clip),
            "dp_clip_quantile": None if s.dp_clip_quantile is None else float(s.dp_clip_quantile),
            "dp_clip_lr": float(s.dp_clip_lr) if self.adaptive else None,
            "dp_clip_count_noise": self.sigma_b if self.adaptive else None,
        }

    def checkpoint(self, rounds: int) -> dict:
        """The mechanism's part of a checkpoint after ``rounds`` rounds: the noise multiplier, the current clip,
        the accounting settings and the secret."""
        return {
            "privacy": {
                "mechanism": self.name,
                "noise_multiplier": self.z,
                "clip": self.clip,
                "accounting": self._accounting(),
                "secret": self.secret.state_dict(),
            }
        }

    def restore(self, ck: dict, rounds: int) -> None:
        """A checkpoint's DP state: its noise multiplier (a calibrated one is not calibrated again when ``rounds``
        changed), its secret and clip. Refused by name: a checkpoint of a run that was not private, of another
        mechanism, or whose accounting settings (sampling, cohort size, clients, delta, accountant, clip, adaptive
        clipping's settings, the noise multiplier given) differ from this run's: its rounds were accounted with
        them. A run whose ``rounds`` would pass ``dp_epsilon`` is refused naming ``rounds``."""
        if "privacy" not in ck:
            raise ValueError("checkpoint: a run without dp_clip, this config is private")
        st = ck["privacy"]
        if "accounting" not in st or "secret" not in st:
            raise ValueError(
                "checkpoint: a private run's checkpoint from an earlier fedfast (its noise came from the run seed "
                "and its accounting settings were not kept); start the run again"
            )
        if st.get("mechanism") != self.name:
            raise ValueError(
                f"dp_mechanism: the checkpoint's run used {st.get('mechanism')!r}, this config {self.name!r}"
            )
        mine, theirs = self._accounting(), st["accounting"]
        for k in sorted(set(mine) | set(theirs)):
            if mine.get(k) != theirs.get(k):
                raise ValueError(
                    f"{k}: the checkpoint's private run accounted its rounds with {k} = {theirs.get(k)!r}, this "
                    f"config gives {mine.get(k)!r}; a resume keeps the accounting settings (start a new run to "
                    f"change them)"
                )
        z = float(st["noise_multiplier"])
        if self.settings.dp_noise_multiplier is not None and z != self.z:
            raise ValueError(
                f"dp_noise_multiplier: the checkpoint's run drew noise of multiplier {z:g}, this config "
                f"gives {self.z:g}"
            )
        self._set_multiplier(z)
        self.clip = float(st["clip"])
        self.check_plan(int(rounds))
        self.secret.load_state_dict(st["secret"])

    def _set_multiplier(self, z: float) -> None:
        self.z = z
        self.z_update = self._update_multiplier(z)
        self.accountant.noise_multiplier = z
        if self.poisson is not None:
            self.poisson.noise_multiplier = z

    def check_plan(self, rounds: int) -> float:
        """Epsilon after ``rounds``; a ValueError naming ``rounds`` if it passes ``dp_epsilon``."""
        return self.accountant.check_plan(rounds)
