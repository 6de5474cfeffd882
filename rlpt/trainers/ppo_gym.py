"""PPO on gymnasium control tasks with a discrete action space (CartPole-v1 and friends).

The environment runs on the host (numpy, ``num_envs`` copies stepped in sync); the
policy acts through one jitted call per vector step, and each update (GAE, then
``num_epochs`` passes over shuffled minibatches) is ONE jitted function scanning over
epochs and minibatches. The model is a Flax NNX module split once into a graph
definition and a parameter state; everything jitted is a pure function of the state.

Rollouts are laid out ``[num_envs, num_steps]`` (B = envs, T = time), the layout of the
``rlpt.rl`` maths, with an all-ones mask.

Episode ends (gymnasium >= 1.0):
  * The vector env uses SAME_STEP autoreset: the step that ends an episode returns the
    next episode's first observation, and the true last observation sits in
    ``info["final_obs"]``. So every stored transition is real (the default NEXT_STEP
    mode would add a dummy reset transition after each end).
  * ``done = terminated or truncated`` cuts GAE after the step. A time-limit truncation
    is not a real end, so its missing future is put back by bootstrapping: the reward of
    a truncated (and not terminated) step becomes ``r + gamma * V(final_obs)``. Only the
    learning signal changes; episode returns are counted from the raw rewards.

Rewards are multiplied by ``config.reward_scale`` before learning (values and returns
are in scaled units) to keep value targets O(1). Unscaled, CartPole's values climb
towards 1 / (1 - gamma) = 100; a tanh critic trained by Adam at lr 2.5e-4 can barely
move its output bias that far, so it saturates its last hidden layer instead, outputs
a constant and stops learning (seed 0 collapsed from 500 to ~220 this way). Advantages
are whitened per minibatch, so the scale does not change the policy gradient.

Metrics go to ``workdir/metrics.jsonl`` with ``step`` = environment steps so far (summed
over the vector envs), the global step of a gymnasium run.
"""

from __future__ import annotations

import collections
import functools
import math
import time
from typing import Any, NamedTuple

import flax
import gymnasium as gym
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from rlpt import rl
from rlpt.metrics import MetricWriter, to_json_value
from rlpt.optim import make_optimizer, make_schedule


class ActorCritic(nnx.Module):
    """Separate tanh MLPs for the policy logits and the value (CleanRL's CartPole agent).

    Orthogonal init with gain sqrt(2) in the trunk; the policy head starts near uniform
    (gain 0.01) and the value head at gain 1 (Huang et al. 2022, "The 37 implementation
    details of PPO").
    """

    def __init__(self, obs_dim: int, num_actions: int, hidden: int, *, rngs: nnx.Rngs):
        def dense(n_in: int, n_out: int, gain: float) -> nnx.Linear:
            return nnx.Linear(n_in, n_out, kernel_init=nnx.initializers.orthogonal(gain), rngs=rngs)

        trunk_gain = math.sqrt(2.0)
        self.actor = nnx.Sequential(
            dense(obs_dim, hidden, trunk_gain),
            jnp.tanh,
            dense(hidden, hidden, trunk_gain),
            jnp.tanh,
            dense(hidden, num_actions, 0.01),
        )
        self.critic = nnx.Sequential(
            dense(obs_dim, hidden, trunk_gain),
            jnp.tanh,
            dense(hidden, hidden, trunk_gain),
            jnp.tanh,
            dense(hidden, 1, 1.0),
        )

    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`[N, obs_dim]` -> (logits `[N, A]`, values `[N]`)."""
        return self.actor(obs), self.critic(obs)[..., 0]


@flax.struct.dataclass
class TrainState:
    """What an update changes: the parameters and the optimiser state."""

    params: nnx.State
    opt_state: optax.OptState


class Rollout(NamedTuple):
    """One rollout, every field `[num_envs, num_steps, ...]` except `last_values`."""

    obs: jax.Array  # [B, T, obs_dim]
    actions: jax.Array  # [B, T] int32
    logp: jax.Array  # [B, T] log-prob of the action under the acting policy
    values: jax.Array  # [B, T] V(obs) at acting time
    rewards: jax.Array  # [B, T] with the truncation bootstrap folded in
    dones: jax.Array  # [B, T] 1 where the episode ended after the step
    last_values: jax.Array  # [B] V of the observation after the last step


def _forward(
    graphdef: nnx.GraphDef, params: nnx.State, obs: jax.Array
) -> tuple[jax.Array, jax.Array]:
    return nnx.merge(graphdef, params)(obs)


def act(
    graphdef: nnx.GraphDef, params: nnx.State, obs: jax.Array, key: jax.Array, step: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Samples actions for `[N, obs_dim]` observations; returns (actions, logp, values), `[N]`.

    `key` is the run's acting key; the per-step key is `fold_in(key, step)`.
    """
    logits, values = _forward(graphdef, params, obs)
    actions = jax.random.categorical(jax.random.fold_in(key, step), logits)  # [N]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[:, None], axis=-1)[:, 0]
    return actions.astype(jnp.int32), logp, values


def value(graphdef: nnx.GraphDef, params: nnx.State, obs: jax.Array) -> jax.Array:
    """V(obs) for `[N, obs_dim]` observations, `[N]`."""
    return _forward(graphdef, params, obs)[1]


def _ppo_loss(
    params: nnx.State,
    minibatch: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    config: ml_collections.ConfigDict,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO loss on a flat minibatch `[M, ...]`.

    Each transition is passed to the `rlpt.rl` losses as its own length-1 row
    (`[M, 1]`), so "token_mean" is the plain mean over transitions.
    """
    logits, values = _forward(graphdef, params, minibatch["obs"])  # [M, A], [M]
    logp = jnp.take_along_axis(
        jax.nn.log_softmax(logits), minibatch["actions"][:, None], axis=-1
    )  # [M, 1]
    mask = jnp.ones_like(logp)  # [M, 1]
    advantages = minibatch["advantages"][:, None]  # [M, 1]
    if config.normalize_advantages:
        advantages = rl.whiten(advantages, mask)
    pg_loss, pg_diag = rl.policy_loss(
        logp, minibatch["logp"][:, None], advantages, mask, clip_low=config.clip_eps
    )
    v_loss, v_diag = rl.value_loss(
        values[:, None],
        minibatch["values"][:, None],
        minibatch["returns"][:, None],
        mask,
        clip_eps=config.value_clip_eps,
    )
    entropy = rl.entropy_from_logits(logits[:, None, :], mask)
    loss = pg_loss + config.vf_coef * v_loss - config.ent_coef * entropy
    metrics = {
        "ppo/loss": loss,
        "ppo/policy_loss": pg_loss,
        "ppo/value_loss": v_loss,
        "ppo/entropy": entropy,
        "ppo/approx_kl": pg_diag["approx_kl"],
        "ppo/clip_frac": pg_diag["clip_frac"],
        "ppo/explained_variance": v_diag["explained_variance"],
    }
    return loss, metrics


def update(
    state: TrainState,
    rollout: Rollout,
    key: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: ml_collections.ConfigDict,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One PPO update: GAE, then `num_epochs` x `num_minibatches` gradient steps.

    Epoch `e` shuffles the flattened batch with `fold_in(key, e)`. Returns the new state
    and the metrics averaged over all minibatch steps (plus the gradient norm).
    """
    mask = jnp.ones_like(rollout.rewards)  # [B, T]
    advantages, returns = rl.gae(
        rollout.rewards,
        rollout.values,
        mask,
        gamma=config.gamma,
        lam=config.gae_lambda,
        dones=rollout.dones,
        last_values=rollout.last_values,
    )  # [B, T] each
    flat = {
        "obs": rollout.obs,
        "actions": rollout.actions,
        "logp": rollout.logp,
        "values": rollout.values,
        "advantages": advantages,
        "returns": returns,
    }
    batch_size = rollout.rewards.size
    flat = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), flat)  # [B*T, ...]
    num_minibatches = config.num_minibatches
    grad_fn = jax.grad(functools.partial(_ppo_loss, graphdef=graphdef, config=config), has_aux=True)

    def minibatch_step(state: TrainState, minibatch):
        grads, metrics = grad_fn(state.params, minibatch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["ppo/grad_norm"] = optax.tree.norm(grads)
        return TrainState(params=params, opt_state=opt_state), metrics

    def epoch_step(state: TrainState, epoch):
        perm = jax.random.permutation(jax.random.fold_in(key, epoch), batch_size)
        minibatches = jax.tree.map(
            lambda x: x[perm].reshape(num_minibatches, -1, *x.shape[1:]), flat
        )  # [num_minibatches, M, ...]
        return jax.lax.scan(minibatch_step, state, minibatches)

    state, metrics = jax.lax.scan(epoch_step, state, jnp.arange(config.num_epochs))
    return state, jax.tree.map(jnp.mean, metrics)


def learning_rate(config: ml_collections.ConfigDict, num_updates: int) -> float | optax.Schedule:
    """``config.learning_rate``, decaying linearly to 0 over the run if ``anneal_lr``."""
    if not config.anneal_lr:
        return config.learning_rate
    total = num_updates * config.num_epochs * config.num_minibatches
    return make_schedule(config.learning_rate, "linear", total_steps=total)


def _optimizer(config: ml_collections.ConfigDict, num_updates: int) -> optax.GradientTransformation:
    """Adam (no weight decay) after global-norm clipping, at ``learning_rate``."""
    return make_optimizer(
        learning_rate(config, num_updates), max_grad_norm=config.max_grad_norm,
        weight_decay=None, eps=config.adam_eps,
    )  # fmt: skip


def bootstrap_truncated(
    rewards: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    final_values: np.ndarray,
    gamma: float,
) -> np.ndarray:
    """Rewards with `gamma * V(final_obs)` added where an episode was cut by a time limit.

    A step that is both terminated and truncated is a real end: no bootstrap.
    All arrays are `[N]`; `final_values` need only be meaningful where truncated.
    """
    cut = truncated & ~terminated
    return np.where(cut, rewards + gamma * final_values, rewards).astype(np.float32)


def _make_envs(config: ml_collections.ConfigDict, num_envs: int) -> gym.vector.VectorEnv:
    envs = gym.make_vec(
        config.env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    if not isinstance(envs.single_action_space, gym.spaces.Discrete):
        raise ValueError(f"ppo_gym needs a discrete action space, got {envs.single_action_space}")
    return envs


def _final_obs(next_obs: np.ndarray, info: dict[str, Any], ended: np.ndarray) -> np.ndarray:
    """The true last observation for envs that ended this step, `next_obs` elsewhere."""
    obs = next_obs.copy()
    for i in np.flatnonzero(ended):
        obs[i] = info["final_obs"][i]
    return obs


class EpisodeStats:
    """Returns of finished episodes, counted from the raw environment rewards.

    Args:
      num_envs: number of vector envs.
      window: how many of the most recent returns `mean_return` averages.
    """

    def __init__(self, num_envs: int, window: int):
        self.window = window
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.num_episodes = 0
        self._running = np.zeros(num_envs)

    def add_step(self, rewards: np.ndarray, dones: np.ndarray) -> None:
        """Adds one vector step: `[N]` rewards and `[N]` episode-ended flags."""
        self._running += rewards
        for i in np.flatnonzero(dones):
            self.recent.append(float(self._running[i]))
            self._running[i] = 0.0
            self.num_episodes += 1

    def mean_return(self) -> float:
        """Mean of the recent returns; NaN before the first episode ends."""
        return float(np.mean(self.recent)) if self.recent else float("nan")

    def window_full(self) -> bool:
        return len(self.recent) == self.window


def evaluate(
    config: ml_collections.ConfigDict,
    act_fn,
    params: nnx.State,
    key: jax.Array,
    num_episodes: int,
) -> list[float]:
    """Returns of `num_episodes` episodes of the sampling policy on freshly seeded envs.

    Uses `num_envs` envs (so `act_fn` reuses its compiled shape); each env plays its
    share of episodes and the first `num_episodes` returns in env order are kept.
    """
    num_envs = config.num_envs
    per_env = math.ceil(num_episodes / num_envs)
    envs = _make_envs(config, num_envs)
    obs, _ = envs.reset(seed=config.seed + config.eval_seed_offset)
    # One tracker per env keeps the returns in env order, whatever order episodes end in.
    stats = [EpisodeStats(1, per_env) for _ in range(num_envs)]
    step = 0
    while not all(s.num_episodes >= per_env for s in stats):
        actions, _, _ = jax.device_get(act_fn(params, obs, key, step))
        obs, rewards, terminated, truncated, _ = envs.step(actions)
        dones = terminated | truncated
        for i, s in enumerate(stats):
            if s.num_episodes < per_env:
                s.add_step(rewards[i : i + 1], dones[i : i + 1])
        step += 1
    envs.close()
    return [r for s in stats for r in s.recent][:num_episodes]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains PPO on `config.env_id` until `config.total_env_steps`, then evaluates.

    Logs every `config.log_every` updates to `workdir/metrics.jsonl` (step = env steps).

    Returns:
      Final metrics: `env_steps`, `train/episode_return` (mean of the last
      `return_window` training episodes), `train/env_steps_to_target` (env steps when
      that mean first reached `target_return` over a full window, or None),
      `eval/episode_return`, the last update's `ppo/*` figures and `time/*`.
    """
    num_envs, num_steps = config.num_envs, config.num_steps
    steps_per_update = num_envs * num_steps
    if steps_per_update % config.num_minibatches:
        raise ValueError(
            f"num_envs * num_steps = {steps_per_update} is not divisible by "
            f"num_minibatches = {config.num_minibatches}"
        )
    num_updates = config.total_env_steps // steps_per_update
    if num_updates < 1:
        raise ValueError(f"total_env_steps < one rollout of {steps_per_update} steps")

    envs = _make_envs(config, num_envs)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    num_actions = int(envs.single_action_space.n)

    key = jax.random.key(config.seed)
    init_key, act_key, update_key, eval_key = jax.random.split(key, 4)
    del key
    model = ActorCritic(obs_dim, num_actions, config.hidden_size, rngs=nnx.Rngs(init_key))
    graphdef, params = nnx.split(model)
    del model
    tx = _optimizer(config, num_updates)
    state = TrainState(params=params, opt_state=tx.init(params))

    act_fn = jax.jit(functools.partial(act, graphdef))
    value_fn = jax.jit(functools.partial(value, graphdef))
    update_fn = jax.jit(
        functools.partial(update, graphdef=graphdef, tx=tx, config=config), donate_argnums=0
    )

    obs_buf = np.zeros((num_steps, num_envs, obs_dim), np.float32)
    actions_buf = np.zeros((num_steps, num_envs), np.int32)
    logp_buf = np.zeros((num_steps, num_envs), np.float32)
    values_buf = np.zeros((num_steps, num_envs), np.float32)
    rewards_buf = np.zeros((num_steps, num_envs), np.float32)
    dones_buf = np.zeros((num_steps, num_envs), np.float32)

    episodes = EpisodeStats(num_envs, config.return_window)
    steps_to_target: int | None = None
    env_steps = 0
    writer = MetricWriter(workdir)
    obs, _ = envs.reset(seed=config.seed)
    obs = obs.astype(np.float32)
    start = time.perf_counter()
    window_start, window_steps = start, 0
    metrics: dict[str, Any] = {}

    for update_idx in range(num_updates):
        for t in range(num_steps):
            actions, logp, values = jax.device_get(
                act_fn(state.params, obs, act_key, update_idx * num_steps + t)
            )
            next_obs, rewards, terminated, truncated, info = envs.step(actions)
            next_obs = next_obs.astype(np.float32)
            learn_rewards = (rewards * config.reward_scale).astype(np.float32)
            cut = truncated & ~terminated
            if cut.any():
                final_values = np.asarray(value_fn(state.params, _final_obs(next_obs, info, cut)))
                learn_rewards = bootstrap_truncated(
                    learn_rewards, terminated, truncated, final_values, config.gamma
                )
            obs_buf[t], actions_buf[t], logp_buf[t], values_buf[t] = obs, actions, logp, values
            rewards_buf[t] = learn_rewards
            dones = terminated | truncated
            dones_buf[t] = dones
            episodes.add_step(rewards, dones)
            obs = next_obs
        env_steps += steps_per_update
        window_steps += steps_per_update

        rollout = Rollout(
            obs=obs_buf.swapaxes(0, 1),
            actions=actions_buf.T,
            logp=logp_buf.T,
            values=values_buf.T,
            rewards=rewards_buf.T,
            dones=dones_buf.T,
            last_values=value_fn(state.params, obs),
        )
        state, update_metrics = update_fn(
            state, rollout, jax.random.fold_in(update_key, update_idx)
        )

        mean_return = episodes.mean_return()
        reached = episodes.window_full() and mean_return >= config.target_return
        if steps_to_target is None and reached:
            steps_to_target = env_steps
        is_last = update_idx + 1 == num_updates
        if (update_idx + 1) % config.log_every == 0 or is_last:
            now = time.perf_counter()
            metrics = {
                "train/episode_return": mean_return,
                "train/episodes": episodes.num_episodes,
                **to_json_value(jax.device_get(update_metrics)),
                "time/steps_per_s": window_steps / (now - window_start),
                "time/elapsed_s": now - start,
            }
            window_start, window_steps = now, 0
            # The last line waits for the evaluation so that no step is logged twice.
            if not is_last:
                writer.write(env_steps, metrics, stage="ppo")
            logging.info(
                "env_steps %d  return %.1f  policy_loss %.4f  value_loss %.3f  %.0f steps/s",
                env_steps,
                mean_return,
                metrics["ppo/policy_loss"],
                metrics["ppo/value_loss"],
                metrics["time/steps_per_s"],
            )
    envs.close()
    train_s = time.perf_counter() - start

    eval_returns = evaluate(config, act_fn, state.params, eval_key, config.eval_episodes)
    eval_metrics = {
        "eval/episode_return": float(np.mean(eval_returns)),
        "eval/episodes": len(eval_returns),
    }
    if steps_to_target is not None:
        eval_metrics["train/env_steps_to_target"] = steps_to_target
    writer.write(env_steps, {**metrics, **eval_metrics}, stage="ppo")
    writer.close()
    final = {
        "env_steps": env_steps,
        **metrics,
        **eval_metrics,
        "train/env_steps_to_target": steps_to_target,
        "time/train_s": train_s,
    }
    logging.info("Final: %s", final)
    return final
