"""The experience pool between asynchronous actors and the learner.

Actors generate and score groups (the G responses of one prompt) and ``add`` them;
the learner ``draw``s batches by a token budget. Policy versions are the learner's
update count; every token carries the version of the policy that generated it, and a
group's staleness at the step that consumes it is ``learner_version - min_version``.

Guarantees:

- **Bounded memory, nothing dropped on the way in.** The pool holds at most
  ``capacity_tokens`` response tokens. Actors ask ``has_room`` and pause when it is
  full (admission control); ``add`` past capacity raises.
- **Bounded staleness, nothing thrown away.** ``draw(..., learner_version, max_staleness)``
  first takes every never-used group that would exceed the bound at the next version
  (``learner_version + 1 - min_version > max_staleness``) as *due*, oldest first, even
  when they alone exceed the token budget (``Draw.over_budget``); only then does it fill
  the rest of the budget by priority. A group staler than the bound when ``draw`` is
  called is a caller bug and raises: draw once at every learner version and have actors
  add nothing that would already be stale at the next draw.
- **Reuse.** A group may be drawn up to ``max_reuse`` times. Used groups are not forced as
  due; once a used group would go stale it is removed and counted as ``expired_reused``.
  A group never used never expires.

Priorities (``priority``), floored at ``priority_floor`` (except uniform) so every group
keeps a chance before it falls due:

- ``uniform``: 1.
- ``abs_advantage``: the group's mean |advantage|, ``abs_advantage_default`` when unknown.
- ``learnability``: ``p (1 - p)`` with ``p`` the group's mean success; groups that all
  succeed or all fail carry no gradient and sit at the floor.
- ``freshness``: ``exp(-(learner_version - min_version))``.

Sampling probabilities are ``P(i) = priority_i^alpha / sum_j priority_j^alpha`` over the
``N`` eligible (not due) groups; the batch is a Plackett-Luce order (successive sampling
without replacement) cut where the token budget runs out.

Importance weights (prioritised experience replay, Schaul et al. 2016): a sampled group
gets ``w_i = (N P(i))^(-beta)``, a due group, taken with certainty rather than by
priority, gets 1 (the weight of a group drawn at uniform probability ``1/N``), and the
batch's weights are divided by their maximum. With ``uniform`` priority every weight is
exactly 1. With ``max_reuse == 1`` every group is still used exactly once, so priority
only reorders the data; the weights correct the per-batch gradient estimate for that
reordering (``beta = 1`` fully, ``beta = 0`` not at all).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

PRIORITIES = ("uniform", "abs_advantage", "learnability", "freshness")
_STATE_VERSION = 1


class PoolUnderfull(RuntimeError):
    """The pool holds too few groups for the draw asked; nothing was taken, wait and retry."""


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _float(name: str, value: Any, low: float, high: float = math.inf, *, open_low=False) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    below = out <= low if open_low else out < low
    if not math.isfinite(out) or below or out > high:
        bracket = "(" if open_low else "["
        hi = "inf)" if math.isinf(high) else f"{high:g}]"
        raise ValueError(f"{name} must be finite and in {bracket}{low:g}, {hi}, got {value!r}")
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class PoolItem:
    """One scored group.

    ``key`` is unique among the groups held (e.g. the prompt's loader position);
    ``num_tokens`` its response tokens (what budgets and capacity count);
    ``min_version`` / ``max_version`` the oldest and newest policy versions among its
    tokens; ``domain`` the domain index; ``success`` [G] in [0, 1];
    ``abs_advantage`` the group's mean |advantage| if known; ``added_at`` the learner
    version when it was added; ``payload`` anything (the pool never looks inside).
    """

    key: int
    num_tokens: int
    min_version: int
    max_version: int
    domain: int
    success: np.ndarray
    abs_advantage: float | None = None
    added_at: int = 0
    payload: Any = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "key", _int("PoolItem.key", self.key))
        set_(self, "num_tokens", _int("PoolItem.num_tokens", self.num_tokens, 1))
        set_(self, "min_version", _int("PoolItem.min_version", self.min_version, 0))
        set_(self, "max_version", _int("PoolItem.max_version", self.max_version, 0))
        set_(self, "domain", _int("PoolItem.domain", self.domain, 0))
        set_(self, "added_at", _int("PoolItem.added_at", self.added_at, 0))
        if not self.min_version <= self.max_version <= self.added_at:
            raise ValueError(
                f"PoolItem {self.key}: need min_version <= max_version <= added_at, got "
                f"{self.min_version}, {self.max_version}, {self.added_at}"
            )
        success = np.array(self.success, dtype=np.float64)
        if success.ndim != 1 or success.size == 0:
            raise ValueError(
                f"PoolItem {self.key}: success must be a non-empty 1-D array [G], "
                f"got shape {success.shape}"
            )
        if not np.all((success >= 0.0) & (success <= 1.0)):
            raise ValueError(f"PoolItem {self.key}: success must lie in [0, 1], got {success}")
        success.setflags(write=False)
        set_(self, "success", success)
        if self.abs_advantage is not None:
            set_(
                self,
                "abs_advantage",
                _float(f"PoolItem {self.key}: abs_advantage", self.abs_advantage, 0.0),
            )

    @property
    def mean_success(self) -> float:
        return float(self.success.mean())


@dataclasses.dataclass
class Draw:
    """One batch for the learner, due groups first (oldest first), then priority picks.

    ``weights`` [n] importance weights (max 1), ``staleness`` [n] ``learner_version -
    min_version``, ``due`` how many leading items were taken as due, ``over_budget``
    whether the batch exceeds the token budget or ``max_items`` (due groups, ``min_items``,
    ``multiple_of`` or a single group larger than the budget can cause it).
    """

    items: list[PoolItem]
    weights: np.ndarray
    staleness: np.ndarray
    due: int
    over_budget: bool

    def __len__(self) -> int:
        return len(self.items)

    @property
    def keys(self) -> list[int]:
        return [item.key for item in self.items]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def domain_index(self) -> np.ndarray:
        """[n] each group's domain index."""
        return np.array([item.domain for item in self.items], dtype=np.int64)

    @property
    def group_success(self) -> np.ndarray:
        """[n] each group's mean success."""
        return np.array([item.mean_success for item in self.items], dtype=np.float64)

    def feedback(self) -> dict[str, np.ndarray | None]:
        """Per-response ``domain_index``, ``success`` and ``abs_advantage`` for the curriculum.

        The keys are those of ``rlpt.data.Feedback``, so ``curriculum.update(draw.feedback())``
        works; ``abs_advantage`` repeats the group's mean over its responses and is None
        unless every group has one.
        """
        sizes = [item.success.size for item in self.items]
        domain = np.repeat(self.domain_index, sizes)
        success = (
            np.concatenate([item.success for item in self.items]) if self.items else np.zeros(0)
        )
        adv = [item.abs_advantage for item in self.items]
        abs_adv = None if any(a is None for a in adv) else np.repeat(np.array(adv, float), sizes)
        return {"domain_index": domain, "success": success, "abs_advantage": abs_adv}


def staleness_histogram(draw_or_staleness: Draw | Sequence[int], max_staleness: int) -> np.ndarray:
    """[max_staleness + 1] counts of groups at each staleness 0..max_staleness."""
    max_staleness = _int("max_staleness", max_staleness, 0)
    s = draw_or_staleness.staleness if isinstance(draw_or_staleness, Draw) else draw_or_staleness
    s = np.asarray(s, dtype=np.int64).reshape(-1)
    if s.size and (s.min() < 0 or s.max() > max_staleness):
        raise ValueError(f"staleness values must lie in [0, {max_staleness}], got {s}")
    return np.bincount(s, minlength=max_staleness + 1)


@dataclasses.dataclass
class _Entry:
    item: PoolItem
    uses: int = 0


_STAT_KEYS = (
    "added",
    "draws",
    "drawn",
    "due_draws",
    "over_budget_draws",
    "expired_reused",
)


class ExperiencePool:
    """Scored groups between actors and the learner (see the module docstring).

    Args:
      capacity_tokens: most response tokens held at once (>= the largest group).
      priority: one of ``PRIORITIES``.
      alpha: priority exponent, >= 0 (0 is uniform sampling).
      beta: importance-weight exponent in [0, 1].
      max_reuse: how many times a group may be drawn, >= 1.
      seed: seeds the numpy Generator that orders the priority picks.
      abs_advantage_default: the ``abs_advantage`` priority of a group without one.
      priority_floor: smallest priority of a group (> 0), for all but ``uniform``.
    """

    def __init__(
        self,
        capacity_tokens: int,
        priority: str = "uniform",
        alpha: float = 1.0,
        beta: float = 1.0,
        max_reuse: int = 1,
        seed: int = 0,
        *,
        abs_advantage_default: float = 1.0,
        priority_floor: float = 1e-3,
    ):
        self.capacity_tokens = _int("capacity_tokens", capacity_tokens, 1)
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        self.priority = priority
        self.alpha = _float("alpha", alpha, 0.0)
        self.beta = _float("beta", beta, 0.0, 1.0)
        self.max_reuse = _int("max_reuse", max_reuse, 1)
        self.seed = _int("seed", seed, 0)
        self.abs_advantage_default = _float("abs_advantage_default", abs_advantage_default, 0.0)
        self.priority_floor = _float("priority_floor", priority_floor, 0.0, open_low=True)
        self._rng = np.random.default_rng(self.seed)
        # Insertion-ordered: the order is part of what makes draws reproducible.
        self._entries: dict[int, _Entry] = {}
        self._tokens = 0
        self._last_version: int | None = None
        self._stats = dict.fromkeys(_STAT_KEYS, 0)
        self._last_mean_staleness = 0.0

    # -- contents ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[int]:
        """The held keys, oldest addition first."""
        return iter(list(self._entries))

    @property
    def tokens(self) -> int:
        """Response tokens held now."""
        return self._tokens

    def keys(self) -> list[int]:
        return list(self._entries)

    def uses(self, key: int) -> int:
        """How many times the held group ``key`` has been drawn."""
        return self._entries[key].uses

    def has_room(self, num_tokens: int) -> bool:
        """Whether a group of ``num_tokens`` response tokens fits now."""
        return self._tokens + _int("num_tokens", num_tokens, 1) <= self.capacity_tokens

    def add(self, item: PoolItem) -> None:
        """Holds ``item``; raises if its key is held or it does not fit (ask ``has_room``)."""
        if not isinstance(item, PoolItem):
            raise ValueError(f"item must be a PoolItem, got {type(item).__name__}")
        if item.key in self._entries:
            raise ValueError(f"item key {item.key} is already in the pool")
        if item.num_tokens > self.capacity_tokens:
            raise ValueError(
                f"item {item.key} has {item.num_tokens} tokens, more than capacity_tokens="
                f"{self.capacity_tokens}: no pool state could ever admit it"
            )
        if not self.has_room(item.num_tokens):
            raise ValueError(
                f"pool full: item {item.key} needs {item.num_tokens} tokens, "
                f"{self.capacity_tokens - self._tokens} of capacity_tokens="
                f"{self.capacity_tokens} free (check has_room before adding)"
            )
        self._entries[item.key] = _Entry(item)
        self._tokens += item.num_tokens
        self._stats["added"] += 1

    def domain_stats(self) -> dict[int, tuple[int, float]]:
        """``{domain: (groups held, mean of their mean success)}``."""
        acc: dict[int, list[float]] = {}
        for entry in self._entries.values():
            acc.setdefault(entry.item.domain, []).append(entry.item.mean_success)
        return {d: (len(v), float(np.mean(v))) for d, v in sorted(acc.items())}

    def stats(self) -> dict[str, float]:
        """Counters: ``items``, ``tokens``, ``added``, ``draws``, ``drawn`` (groups, reuse
        counted), ``due_draws`` (groups drawn as due), ``over_budget_draws`` (draws),
        ``expired_reused`` (used groups removed before their uses were spent) and
        ``mean_staleness`` of the last draw."""
        out = {"items": float(len(self._entries)), "tokens": float(self._tokens)}
        out.update({k: float(v) for k, v in self._stats.items()})
        out["mean_staleness"] = float(self._last_mean_staleness)
        return out

    # -- priorities ----------------------------------------------------------------------------

    def _raw_priorities(self, items: Sequence[PoolItem], learner_version: int) -> np.ndarray:
        if self.priority == "uniform":
            return np.ones(len(items))
        if self.priority == "abs_advantage":
            raw = np.array(
                [
                    self.abs_advantage_default if it.abs_advantage is None else it.abs_advantage
                    for it in items
                ],
                dtype=np.float64,
            )
        elif self.priority == "learnability":
            p = np.array([it.mean_success for it in items], dtype=np.float64)
            raw = p * (1.0 - p)
        else:  # freshness
            age = np.array([learner_version - it.min_version for it in items], dtype=np.float64)
            raw = np.exp(-age)
        return np.maximum(raw, self.priority_floor)

    def priorities(self, learner_version: int) -> dict[int, float]:
        """``{key: priority}`` of the held groups at ``learner_version`` (before ``alpha``)."""
        learner_version = _int("learner_version", learner_version, 0)
        items = [e.item for e in self._entries.values()]
        return dict(
            zip([it.key for it in items], self._raw_priorities(items, learner_version).tolist())
        )

    # -- drawing -------------------------------------------------------------------------------

    def draw(
        self,
        token_budget: int,
        learner_version: int,
        max_staleness: int,
        *,
        min_items: int = 1,
        max_items: int | None = None,
        multiple_of: int = 1,
    ) -> Draw:
        """The next batch: due groups, then priority picks while the tokens stay in budget.

        At least ``max(min_items, 1)`` groups, at most ``max_items`` (beyond due ones), a
        multiple of ``multiple_of`` groups (the last priority picks go back to the pool, or
        more are taken when due groups or ``min_items`` need it). Atomic: when it raises
        (``PoolUnderfull`` or a staleness error) the pool is unchanged.
        """
        token_budget = _int("token_budget", token_budget, 1)
        learner_version = _int("learner_version", learner_version, 0)
        max_staleness = _int("max_staleness", max_staleness, 0)
        min_items = _int("min_items", min_items, 1)
        multiple_of = _int("multiple_of", multiple_of, 1)
        if max_items is not None:
            max_items = _int("max_items", max_items, 1)
            if max_items < min_items:
                raise ValueError(f"max_items={max_items} must be >= min_items={min_items}")
            if max_items % multiple_of:
                raise ValueError(
                    f"max_items={max_items} must be a multiple of multiple_of={multiple_of}"
                )
        if self._last_version is not None and learner_version < self._last_version:
            raise ValueError(
                f"learner_version={learner_version} is older than the last draw's "
                f"{self._last_version}"
            )
        entries = list(self._entries.values())
        if not entries:
            raise PoolUnderfull("draw from an empty pool")
        items = [e.item for e in entries]
        min_v = np.array([it.min_version for it in items], dtype=np.int64)
        max_v = np.array([it.max_version for it in items], dtype=np.int64)
        uses = np.array([e.uses for e in entries], dtype=np.int64)
        if max_v.max() > learner_version:
            i = int(np.argmax(max_v))
            raise ValueError(
                f"item {items[i].key} has max_version {max_v[i]}, newer than "
                f"learner_version={learner_version}"
            )
        staleness = learner_version - min_v
        if staleness.max() > max_staleness:
            i = int(np.argmax(staleness))
            raise ValueError(
                f"item {items[i].key} is already {staleness[i]} versions stale, over "
                f"max_staleness={max_staleness}: draw at every learner version, and add no "
                "group that is stale at the next draw"
            )
        due_mask = (staleness + 1 > max_staleness) & (uses == 0)
        due_idx = np.flatnonzero(due_mask)
        # Oldest first; ties keep insertion order (stable sort).
        due_idx = due_idx[np.argsort(min_v[due_idx], kind="stable")]
        eligible = np.flatnonzero(~due_mask)

        n_eligible = eligible.size
        log_p = np.zeros(0)
        order = np.zeros(0, dtype=np.int64)
        if n_eligible:
            pri = self._raw_priorities([items[i] for i in eligible], learner_version)
            log_w = self.alpha * np.log(pri)
            log_p = log_w - np.logaddexp.reduce(log_w)
            # Plackett-Luce order by an exponential race: item j finishes at E_j / w_j,
            # E_j ~ Exp(1), so the first finisher is j with probability w_j / sum(w), and so
            # on among the rest. One vectorised draw, unlike Generator.choice's rejection
            # loop for weighted sampling without replacement; log space keeps large alpha
            # from underflowing.
            race = np.log(self._rng.standard_exponential(n_eligible)) - log_w
            order = np.argsort(race, kind="stable")

        n_due = due_idx.size
        total = int(sum(items[i].num_tokens for i in due_idx))
        cap = math.inf if max_items is None else max_items
        taken = 0
        while taken < n_eligible and n_due + taken < cap:
            t = items[eligible[order[taken]]].num_tokens
            if total + t > token_budget and n_due + taken >= 1:
                break
            total += t
            taken += 1
        need = max(min_items, 1)
        if n_due + taken < need:
            taken = need - n_due
        rem = (n_due + taken) % multiple_of
        if rem:
            lower = n_due + taken - rem
            if lower >= max(n_due, need):
                taken -= rem
            else:
                taken += multiple_of - rem
        if taken > n_eligible:
            raise PoolUnderfull(
                f"the draw needs {n_due + taken} groups (min_items={min_items}, multiple_of="
                f"{multiple_of}, {n_due} due) but the pool holds {len(entries)}"
            )

        picked = order[:taken]
        chosen = np.concatenate([due_idx, eligible[picked]]).astype(np.int64)
        if self.priority == "uniform" or taken == 0:
            weights = np.ones(chosen.size)
        else:
            log_raw = np.concatenate(
                [np.zeros(n_due), -self.beta * (math.log(n_eligible) + log_p[picked])]
            )
            weights = np.exp(log_raw - log_raw.max())
        out_items = [items[i] for i in chosen]
        out_staleness = staleness[chosen].copy()
        total = sum(it.num_tokens for it in out_items)
        over = total > token_budget or (max_items is not None and len(out_items) > max_items)

        for it in out_items:
            entry = self._entries[it.key]
            entry.uses += 1
            if entry.uses >= self.max_reuse:
                self._remove(it.key)
        expired = [
            k
            for k, e in self._entries.items()
            if learner_version + 1 - e.item.min_version > max_staleness
        ]
        for k in expired:
            # Unused groups falling due were all drawn above, so only used ones expire.
            assert self._entries[k].uses > 0, k
            self._remove(k)

        self._last_version = learner_version
        self._stats["draws"] += 1
        self._stats["drawn"] += len(out_items)
        self._stats["due_draws"] += n_due
        self._stats["over_budget_draws"] += int(over)
        self._stats["expired_reused"] += len(expired)
        self._last_mean_staleness = float(out_staleness.mean())
        return Draw(out_items, weights, out_staleness, int(n_due), bool(over))

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._tokens -= entry.item.num_tokens

    # -- checkpointing -------------------------------------------------------------------------

    def state_dict(self, *, encode_payload: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """Everything a restored pool needs to draw exactly the same next batches.

        Builtin containers, python scalars and strings only (JSON-safe), except each
        item's ``payload``, kept as it is (or ``encode_payload(payload)``). ``pickle``
        round-trips it whatever the payloads; ``json`` does when ``encode_payload`` makes
        them JSON-safe. The numpy Generator state (PCG64's 128-bit integers) is stored as
        python ints, which both keep exactly.
        """
        items = []
        for entry in self._entries.values():
            it = entry.item
            items.append(
                {
                    "key": it.key,
                    "num_tokens": it.num_tokens,
                    "min_version": it.min_version,
                    "max_version": it.max_version,
                    "domain": it.domain,
                    "success": it.success.tolist(),
                    "abs_advantage": it.abs_advantage,
                    "added_at": it.added_at,
                    "payload": encode_payload(it.payload) if encode_payload else it.payload,
                    "uses": entry.uses,
                }
            )
        return {
            "version": _STATE_VERSION,
            "config": {
                "capacity_tokens": self.capacity_tokens,
                "priority": self.priority,
                "alpha": self.alpha,
                "beta": self.beta,
                "max_reuse": self.max_reuse,
                "seed": self.seed,
                "abs_advantage_default": self.abs_advantage_default,
                "priority_floor": self.priority_floor,
            },
            "items": items,
            "rng": self._rng.bit_generator.state,
            "last_version": self._last_version,
            "stats": dict(self._stats),
            "last_mean_staleness": self._last_mean_staleness,
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, decode_payload: Callable[[Any], Any] | None = None
    ) -> None:
        """Restores contents, use counts, counters and the RNG; keeps this pool's config
        (so a resumed run may change it), which must still hold the restored tokens."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"pool state version {state.get('version')!r}, expected {_STATE_VERSION}"
            )
        entries: dict[int, _Entry] = {}
        tokens = 0
        for rec in state["items"]:
            payload = decode_payload(rec["payload"]) if decode_payload else rec["payload"]
            fields = {k: v for k, v in rec.items() if k not in ("uses", "payload")}
            item = PoolItem(payload=payload, **fields)
            if item.key in entries:
                raise ValueError(f"pool state holds key {item.key} twice")
            entries[item.key] = _Entry(item, _int("uses", rec["uses"], 0))
            tokens += item.num_tokens
        if tokens > self.capacity_tokens:
            raise ValueError(
                f"the restored pool holds {tokens} tokens, over capacity_tokens="
                f"{self.capacity_tokens}"
            )
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        missing = set(_STAT_KEYS) - set(state["stats"])
        if missing:
            raise ValueError(f"pool state stats lack {sorted(missing)}")
        self._entries = entries
        self._tokens = tokens
        self._rng = rng
        self._last_version = state["last_version"]
        self._stats = {k: int(state["stats"][k]) for k in _STAT_KEYS}
        self._last_mean_staleness = float(state["last_mean_staleness"])

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Any], *, decode_payload: Callable[[Any], Any] | None = None
    ) -> ExperiencePool:
        """A pool with the saved config and contents."""
        pool = cls(**state["config"])
        pool.load_state_dict(state, decode_payload=decode_payload)
        return pool
