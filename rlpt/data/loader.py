"""The prompt loader: per-domain Grain iterators mixed by a curriculum into padded batches.

Each domain is its own Grain pipeline (source -> shard -> shuffle/repeat ->
decode and tokenise), optionally prefetched by Grain worker processes. The
curriculum runs here in the main process: every batch it reads the current
domain weights, draws a domain per prompt, and pulls from those domains'
iterators. Prompts are left-padded to a few bucket lengths so jitted steps
compile once per bucket.

Exact resume: ``get_state`` holds the batch counter, the curriculum (weights,
statistics, levels), each domain's level and Grain iterator position, and the
skip counters. The per-batch RNG is ``default_rng([seed, step, shard])``, so it
needs no state of its own. A domain whose level changed is rebuilt at the new
level from the same iterator position, which is the same thing a restore does.

Multi-host: each process reads the ``shard_index::shard_count`` slice of every
domain (defaults: the trainer's processes, ``rlpt.parallel.multihost``) and draws
its own rows. Pass every process the global feedback in ``update`` so their
curricula stay identical.

Worker processes (``workers > 0``) use Grain's ``mp_prefetch``, which spawns:
the calling script needs an ``if __name__ == "__main__":`` guard. Grain reads
its absl flags when it starts workers, so the loader marks absl flags as parsed
(keeping defaults) if nothing has parsed them yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from rlpt.data.curriculum import Curriculum, Feedback
from rlpt.data.sources import DataError, DomainSource, Prepare, make_source
from rlpt.sampling.sampler import DEFAULT_BUCKETS, bucket_length, left_pad
from rlpt.tasks import Task, stable_hash
from rlpt.tokenizers import ByteTokenizer, Tokenizer

_STATE_VERSION = 1


@dataclasses.dataclass
class PromptBatch:
    """One batch of prompts, each repeated ``group_size`` times in consecutive rows.

    ``tokens`` [B, P] int32 left-padded, ``mask`` [B, P] bool, ``loss_weight``
    [B] float32 (the per-sequence weight the PPO loss multiplies in),
    ``domain_index`` [B] int32, ``difficulty`` [B] int32, ``group_id`` [B] int32
    (rows with one prompt share an id), ``tasks`` the B ``Task`` objects.
    """

    tokens: np.ndarray
    mask: np.ndarray
    loss_weight: np.ndarray
    domain_index: np.ndarray
    difficulty: np.ndarray
    group_id: np.ndarray
    tasks: list[Task]
    step: int

    @property
    def prompt_len(self) -> int:
        return int(self.tokens.shape[1])


class _Stream:
    """One domain's Grain iterator at one level; built lazily, rebuilt on a level change."""

    def __init__(
        self,
        source: DomainSource,
        *,
        level: int,
        tokenizer: Tokenizer,
        add_bos: bool,
        seed: int,
        shard_index: int,
        shard_count: int,
        workers: int,
        second_half: bool = False,
    ):
        self.source = source
        self.level = level
        # A procedural source's second half: items the main stream never reaches.
        self._second_half = second_half
        self._tokenizer = tokenizer
        self._add_bos = add_bos
        self._seed = seed
        self._shard = (shard_index, shard_count)
        self._workers = workers
        self._it: grain.DatasetIterator | None = None
        self._pending: Any = None  # iterator state to apply when (re)built

    def _build(self) -> grain.DatasetIterator:
        src = self.source
        ds = src.dataset(self.level)
        if self._second_half and src.procedural:
            ds = ds[len(ds) // 2 :]
        index, count = self._shard
        if count > 1:
            ds = ds[index::count]
        if not src.procedural:
            if len(ds) == 0:
                raise DataError(f"domain {src.name!r}: shard {index} of {count} is empty")
            # The same order at every level, so a level change keeps the epoch order.
            ds = ds.shuffle(seed=stable_hash("rlpt-shuffle", self._seed, src.name) % (1 << 31))
            ds = ds.repeat(None)
        ds = ds.map(Prepare(src.name, self.level, self._tokenizer, self._add_bos))
        # Reading ahead in threads would generate items a level change throws away.
        ids = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        if self._workers > 0:
            _ensure_absl_flags_parsed()
            ids = ids.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._workers))
        it = iter(ids)
        if self._pending is not None:
            it.set_state(self._pending)
            self._pending = None
        return it

    def next(self) -> dict[str, Any]:
        if self._it is None:
            self._it = self._build()
        return next(self._it)

    def set_level(self, level: int) -> None:
        if level == self.level:
            return
        if self._it is not None:
            self._pending = self._it.get_state()
            self._it.close()
            self._it = None
        self.level = level

    def get_state(self) -> dict[str, Any]:
        state = self._it.get_state() if self._it is not None else self._pending
        return {"level": int(self.level), "iterator": state}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.close()
        self.level = int(state["level"])
        self._pending = state["iterator"]

    def close(self) -> None:
        if self._it is not None:
            self._it.close()
            self._it = None


class CurriculumLoader(grain.DatasetIterator):
    """Batches of prompts from several domains, mixed by a ``Curriculum``.

    ``next(loader)`` gives a ``PromptBatch``; ``update(feedback)`` feeds the step's
    per-sample results back; ``metrics()`` reports weights, levels, success
    rates and skip counts. A Grain ``DatasetIterator``, so
    ``grain.checkpoint.CheckpointSave(loader)`` saves it; ``get_state()`` is
    plain JSON-able Python for ``ocp.args.JsonSave`` as well.
    """

    def __init__(
        self,
        domains: Mapping[str, DomainSource | Any],
        curriculum: Curriculum,
        tokenizer: Tokenizer | None = None,
        *,
        batch_size: int,
        group_size: int = 1,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_prompt_len: int | None = None,
        add_bos: bool = True,
        seed: int = 0,
        workers: int | Mapping[str, int] = 0,
        shard_index: int | None = None,
        shard_count: int | None = None,
        max_consecutive_skips: int = 1000,
    ):
        super().__init__()
        # A domain that yields only unusable records this many times in a row is
        # broken, not unlucky; stop instead of spinning forever.
        self.max_consecutive_skips = max_consecutive_skips
        if batch_size < 1 or group_size < 1 or batch_size % group_size:
            raise ValueError(
                f"batch_size ({batch_size}) must be a positive multiple of "
                f"group_size ({group_size})"
            )
        self.sources = {name: make_source(name, spec) for name, spec in domains.items()}
        self.names = list(self.sources)
        if self.names != curriculum.names:
            raise ValueError(
                f"the curriculum's domains {curriculum.names} differ from the loader's {self.names}"
            )
        for i, name in enumerate(self.names):
            if curriculum.max_levels[i] > self.sources[name].max_difficulty:
                raise ValueError(
                    f"domain {name!r}: curriculum allows level {curriculum.max_levels[i]} but the "
                    f"source has {self.sources[name].max_difficulty}"
                )
        self.curriculum = curriculum
        self.tokenizer = tokenizer or ByteTokenizer()
        self.batch_size = batch_size
        self.group_size = group_size
        self.buckets = tuple(sorted(buckets))
        self.max_prompt_len = max_prompt_len or self.buckets[-1]
        if self.max_prompt_len > self.buckets[-1]:
            raise ValueError(
                f"max_prompt_len {self.max_prompt_len} exceeds the largest bucket "
                f"{self.buckets[-1]}"
            )
        self.seed = seed
        if shard_index is None or shard_count is None:
            from rlpt.parallel.multihost import trainer_process_count, trainer_process_index

            shard_index, shard_count = trainer_process_index(), trainer_process_count()
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"shard_index {shard_index} not in [0, {shard_count})")
        self.shard_index, self.shard_count = shard_index, shard_count
        if isinstance(workers, Mapping):
            unknown = sorted(set(workers) - set(self.names))
            if unknown:
                raise ValueError(f"workers: unknown domain(s) {unknown}")
        self._streams = [
            _Stream(
                self.sources[name],
                level=int(curriculum.level[i]),
                tokenizer=self.tokenizer,
                add_bos=add_bos,
                seed=seed,
                shard_index=shard_index,
                shard_count=shard_count,
                workers=workers.get(name, 0) if isinstance(workers, Mapping) else workers,
            )
            for i, name in enumerate(self.names)
        ]
        # Review prompts (``difficulty.review``) come from a second stream per domain, so
        # the main stream keeps its level and position (a procedural domain's review
        # stream reads the second half of its items, a file domain's another shuffle).
        self._review_streams = [
            _Stream(
                self.sources[name],
                level=1,
                tokenizer=self.tokenizer,
                add_bos=add_bos,
                seed=stable_hash("rlpt-review", seed) % (1 << 31),
                shard_index=shard_index,
                shard_count=shard_count,
                workers=0,
                second_half=True,
            )
            for name in self.names
        ]
        self.step = 0
        k = len(self.names)
        self.corrupt = np.zeros(k, np.int64)
        self.too_long = np.zeros(k, np.int64)

    @classmethod
    def from_config(
        cls, config: Any, tokenizer: Tokenizer | None = None, **kwargs: Any
    ) -> CurriculumLoader:
        """Sources from ``config.domains`` and the curriculum from ``config.curriculum``.

        ``config.domains`` maps a domain name to None (a registered domain) or a
        source spec (see ``make_source``); or it is a list of registered names.
        """
        from rlpt.data.curriculum import make_curriculum

        domains = config.domains
        if isinstance(domains, list | tuple):
            domains = {name: None for name in domains}
        elif hasattr(domains, "to_dict"):
            domains = domains.to_dict()
        sources = {name: make_source(name, spec) for name, spec in domains.items()}
        curriculum = make_curriculum(
            config.curriculum,
            list(sources),
            max_levels=[s.max_difficulty for s in sources.values()],
            sizes=[s.size for s in sources.values()],
        )
        return cls(sources, curriculum, tokenizer, **kwargs)

    # -- batches -------------------------------------------------------------------------------

    def _pull(self, d: int, review_level: int = 0) -> dict[str, Any]:
        if review_level:
            stream = self._review_streams[d]
            stream.set_level(review_level)
        else:
            stream = self._streams[d]
        for _ in range(self.max_consecutive_skips):
            item = stream.next()
            if "error" in item:
                if item["kind"] == "schema":
                    raise DataError(item["error"])
                self.corrupt[d] += 1
                continue
            if len(item["ids"]) > self.max_prompt_len:
                self.too_long[d] += 1
                continue
            return item
        raise DataError(
            f"domain {self.names[d]!r}: {self.max_consecutive_skips} records in a row were corrupt "
            f"or longer than max_prompt_len={self.max_prompt_len}"
        )

    def __next__(self) -> PromptBatch:
        n_prompts = self.batch_size // self.group_size
        rng = np.random.default_rng([self.seed, self.step, self.shard_index])
        domain_index, probs = self.curriculum.sample(n_prompts, rng)
        for d in np.unique(domain_index):
            self._streams[d].set_level(int(self.curriculum.level[d]))
        review = self.curriculum.config.difficulty.review
        levels = self.curriculum.level[domain_index]
        review_level = np.zeros(n_prompts, np.int64)
        if review > 0:  # no draws otherwise, so a run without review is unchanged
            chosen = (rng.random(n_prompts) < review) & (levels > 1)
            lower = 1 + np.floor(rng.random(n_prompts) * (levels - 1)).astype(np.int64)
            review_level = np.where(chosen, lower, 0)
        items = [self._pull(int(d), int(r)) for d, r in zip(domain_index, review_level)]
        self.curriculum.record_draws(domain_index)
        difficulty = np.where(review_level > 0, review_level, levels)

        g = self.group_size
        ids = [item["ids"] for item in items for _ in range(g)]
        length = bucket_length(max(len(x) for x in ids), self.buckets)
        tokens, mask = left_pad(ids, length, self.tokenizer.pad_id)
        rows = np.repeat(domain_index, g).astype(np.int32)
        loss_w = self.curriculum.loss_weights(probs)
        batch = PromptBatch(
            tokens=tokens,
            mask=mask,
            loss_weight=loss_w[rows].astype(np.float32),
            domain_index=rows,
            difficulty=np.repeat(difficulty, g).astype(np.int32),
            group_id=np.repeat(np.arange(n_prompts), g).astype(np.int32),
            tasks=[item["task"] for item in items for _ in range(g)],
            step=self.step,
        )
        self.step += 1
        return batch

    def next(self) -> PromptBatch:
        return self.__next__()

    def update(self, feedback: Feedback | Mapping[str, Any]) -> None:
        """Feed one step's per-sample results (see ``Feedback``) to the curriculum."""
        self.curriculum.update(feedback)

    def metrics(self) -> dict[str, float]:
        out = self.curriculum.metrics()
        for i, name in enumerate(self.names):
            out[f"data/{name}/corrupt_skipped"] = int(self.corrupt[i])
            out[f"data/{name}/too_long_skipped"] = int(self.too_long[i])
        out["data/corrupt_skipped"] = int(self.corrupt.sum())
        return out

    # -- state ---------------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "step": int(self.step),
            "seed": int(self.seed),
            "shard": [int(self.shard_index), int(self.shard_count)],
            "curriculum": self.curriculum.get_state(),
            "streams": {name: s.get_state() for name, s in zip(self.names, self._streams)},
            "review_streams": {
                name: s.get_state() for name, s in zip(self.names, self._review_streams)
            },
            "corrupt": self.corrupt.tolist(),
            "too_long": self.too_long.tolist(),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {_STATE_VERSION}")
        if list(state["streams"]) != self.names:
            raise ValueError(
                f"loader state is for domains {list(state['streams'])}, not {self.names}"
            )
        if int(state["seed"]) != self.seed:
            raise ValueError(f"loader state has seed {state['seed']}, this loader {self.seed}")
        self.step = int(state["step"])
        self.curriculum.set_state(state["curriculum"])
        for name, stream in zip(self.names, self._streams):
            stream.set_state(state["streams"][name])
        # States written before review existed have no review streams: they start fresh.
        for name, stream in zip(self.names, self._review_streams):
            if name in state.get("review_streams", {}):
                stream.set_state(state["review_streams"][name])
        self.corrupt = np.asarray(state["corrupt"], np.int64)
        self.too_long = np.asarray(state["too_long"], np.int64)

    def close(self) -> None:
        # getattr: grain's __del__ calls close even when __init__ raised early.
        for stream in [*getattr(self, "_streams", ()), *getattr(self, "_review_streams", ())]:
            stream.close()
        super().close()

    def __enter__(self) -> CurriculumLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _ensure_absl_flags_parsed() -> None:
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
