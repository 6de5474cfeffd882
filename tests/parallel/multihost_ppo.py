"""Run a few PPO updates of a tiny model as one of several JAX processes (or alone).

    python tests/parallel/multihost_ppo.py OUT.json PROCESS_ID NUM_PROCESSES PORT CKPT_DIR

Each process owns 8 / NUM_PROCESSES fake CPU devices; together they form one
(data=2, fsdp=2, tensor=2) mesh. Every process builds the same global batch
from the seed and contributes the rows of its own devices. Process 0 writes the
final parameters (gathered), the metrics, and the parameters restored from an
orbax checkpoint saved by all processes, to OUT.json.
"""

import json
import os
import sys
import time

_T0 = time.time()


def _log(msg):
    print(f"[{time.time() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


out_path, process_id, num_processes, port, ckpt_dir = sys.argv[1:6]
process_id, num_processes = int(process_id), int(num_processes)
# The test run's other XLA flags carry over; only the device count is this process's own.
_inherited = [
    flag for flag in os.environ.get("XLA_FLAGS", "").split()
    if not flag.startswith("--xla_force_host_platform_device_count")
]  # fmt: skip
os.environ["XLA_FLAGS"] = " ".join(
    [*_inherited, f"--xla_force_host_platform_device_count={8 // num_processes}"]
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes, process_id)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from rlpt.models import CausalLM, ValueModel, create_model, get_preset  # noqa: E402
from rlpt.parallel import make_mesh  # noqa: E402
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state, new_rollout_batch  # noqa: E402

CFG = get_preset("tiny")
B, P, T = 8, 6, 7


def global_batch(seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(5, 200, size=(B, P))
    resp_len = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < resp_len[:, None]).astype(np.float32)
    response = np.where(mask > 0, rng.integers(5, 200, size=(B, T)), 0)
    return new_rollout_batch(
        prompt, np.ones((B, P), bool), response, mask,
        sequence_rewards=rng.normal(size=B).astype(np.float32),
    )  # fmt: skip


def to_global(tree, shardings):
    """Each process supplies the shards of its own devices from the global host value."""
    host = jax.tree.map(np.asarray, tree)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), host, shardings
    )


mesh = make_mesh(2, 2, 2)
cfg = PPOConfig(epochs=2, num_minibatches=2, learning_rate=1e-3, value_learning_rate=1e-3)
ITERATIONS = 1
policy_graph, policy = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0), mesh)
value_graph, value = create_model(lambda r: ValueModel(CFG, rngs=r), jax.random.key(1), mesh)
_, ref = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0), mesh)
trainer = PPOTrainer(cfg, policy_graph, value_graph, mesh=mesh)
# Built inside jit with output shardings: a plain device_put cannot place host values
# on devices that belong to other processes.
abstract_state = jax.eval_shape(lambda p, v: init_train_state(cfg, p, v, jax.random.key(5)),
                                policy, value)  # fmt: skip
state = jax.jit(
    lambda p, v: init_train_state(cfg, p, v, jax.random.key(5)),
    out_shardings=trainer.state_shardings(abstract_state),
)(policy, value)
metrics = []
_log("state built")
for it in range(ITERATIONS):
    batch = global_batch(it)
    batch = to_global(batch, trainer._batch_shardings(batch))
    batch = trainer.advantages(state, trainer.score(state, ref, batch))
    state, m = trainer.update(state, batch)
    metrics.append({k: float(v) for k, v in jax.device_get(m).items()})

_log("updates done")
checkpointer = ocp.StandardCheckpointer()
path = os.path.join(os.path.abspath(ckpt_dir), "state")
checkpointer.save(path, state)
checkpointer.wait_until_finished()
abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
)
restored = checkpointer.restore(path, abstract)
_log("restored")

gather = lambda tree: [np.asarray(x).tolist() for x in jax.tree.leaves(
    multihost_utils.process_allgather(tree, tiled=True))]  # fmt: skip
params = gather(state.policy)
value_params = gather(state.value)
restored_params = gather(restored.policy)
_log("gathered")
if process_id == 0:
    with open(out_path, "w") as f:
        json.dump({"metrics": metrics, "params": params, "value": value_params,
                   "restored": restored_params}, f)  # fmt: skip
if num_processes > 1:
    # Leave together, then exit without jax.distributed.shutdown(), which hung
    # here with the gloo CPU collectives once both processes were done.
    multihost_utils.sync_global_devices("rlpt-multihost-done")
    sys.stdout.flush()
    os._exit(0)
