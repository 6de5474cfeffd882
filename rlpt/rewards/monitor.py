"""Agreement between a learned reward and a verifier, per domain.

Where both exist, a learned reward that the policy is exploiting drifts away
from the verifier: its scores keep rising while verified success does not
(reward hacking, Gao et al. 2023). ``RewardMonitor`` tracks, per domain and
over recent batches (exponential averages), how often the learned reward's
verdict agrees with the verifier and the gap between the learned reward's
predicted success rate and the verified one. It flags a domain whose
agreement falls below ``min_agreement`` or whose gap exceeds ``max_gap``, and
turns agreement into a confidence in [0, 1] for the curriculum
(``Feedback.confidence``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    momentum: float = 0.9  # weight of the past in the per-domain averages
    threshold: float = 0.0  # learned score above it means "predicted correct"
    temperature: float = 1.0  # predicted success probability: sigmoid((score - threshold) / T)
    min_agreement: float = 0.7
    max_gap: float = 0.3
    min_samples: int = 16  # a domain is judged only after this many samples


@dataclasses.dataclass
class _DomainStats:
    agreement: float = 0.0
    gap: float = 0.0  # predicted success rate minus verified success rate
    brier: float = 0.0
    samples: int = 0
    batches: int = 0


class RewardMonitor:
    """Per-domain agreement of learned rewards with verifier outcomes (host side)."""

    def __init__(self, config: MonitorConfig | None = None):
        self.config = config or MonitorConfig()
        self.stats: dict[str, _DomainStats] = {}

    def update(
        self,
        domains: Sequence[str],
        learned: np.ndarray,  # [N] learned reward (sequence score or aggregated process reward)
        verified: np.ndarray,  # [N] verifier success in {0, 1} (or a rate)
        valid: np.ndarray | None = None,  # [N] False drops a sample (sandbox failure, NaN)
    ) -> dict[str, float]:
        """Fold one batch in; returns ``monitor/DOMAIN/{agreement,gap,brier,diverged}``."""
        cfg = self.config
        learned = np.asarray(learned, np.float64)
        verified = np.asarray(verified, np.float64)
        if not len(domains) == len(learned) == len(verified):
            raise ValueError(
                f"domains ({len(domains)}), learned ({len(learned)}) and verified "
                f"({len(verified)}) must have the same length"
            )
        ok = np.isfinite(learned) & np.isfinite(verified)
        if valid is not None:
            ok &= np.asarray(valid, bool)
        names = np.asarray(domains, dtype=object)
        for name in sorted(set(domains)):
            sel = ok & (names == name)
            if not sel.any():
                continue
            z = (learned[sel] - cfg.threshold) / cfg.temperature
            prob = 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))
            truth = verified[sel]
            agree = float(np.mean((prob > 0.5) == (truth > 0.5)))
            gap = float(np.mean(prob) - np.mean(truth))
            brier = float(np.mean(np.square(prob - truth)))
            s = self.stats.setdefault(name, _DomainStats())
            m = cfg.momentum if s.batches else 0.0
            s.agreement = m * s.agreement + (1 - m) * agree
            s.gap = m * s.gap + (1 - m) * gap
            s.brier = m * s.brier + (1 - m) * brier
            s.samples += int(sel.sum())
            s.batches += 1
        return self.metrics()

    def diverged(self, domain: str) -> bool:
        s = self.stats.get(domain)
        if s is None or s.samples < self.config.min_samples:
            return False
        return s.agreement < self.config.min_agreement or s.gap > self.config.max_gap

    def confidence(self) -> Mapping[str, float]:
        """Per-domain confidence in [0, 1]: agreement rescaled so chance (0.5) gives 0.

        Only domains with data appear; the curriculum keeps its last value for
        the others, as its ``Feedback.confidence`` contract says.
        """
        return {
            name: float(np.clip(2.0 * s.agreement - 1.0, 0.0, 1.0))
            for name, s in self.stats.items()
        }

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, s in sorted(self.stats.items()):
            out[f"monitor/{name}/agreement"] = s.agreement
            out[f"monitor/{name}/gap"] = s.gap
            out[f"monitor/{name}/brier"] = s.brier
            out[f"monitor/{name}/diverged"] = float(self.diverged(name))
        return out
