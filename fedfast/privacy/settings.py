"""What a private run's mechanism reads of the config (:class:`fedfast.SimConfig`'s fields of the same names)."""

from __future__ import annotations

import dataclasses

from .._settings import Settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacySettings(Settings):
    """The clip and noise (or the budget the noise is calibrated to), the accountant, adaptive clipping's settings,
    the sampling the accountant assumes, the mechanism, and whether unaccounted diagnostics are written."""

    dp_mechanism: str
    dp_clip: float
    dp_noise_multiplier: float | None
    dp_epsilon: float | None
    dp_delta: float
    dp_accountant: str
    dp_clip_quantile: float | None
    dp_clip_lr: float
    dp_clip_count_noise: float | None
    dp_diagnostics: bool
    dp_ftrl_restart: int | None
    clients_per_round: int
    client_sampling: str
    rounds: int
