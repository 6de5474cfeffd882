"""Run by ``test_remote_engine.py`` as two JAX processes on localhost: process 0 drives
(the learner's weights and a local engine to compare with, on its 2 host devices),
process 1 serves the rollout engine on a mesh over its own 2.

    python multiprocess_engine.py OUT PROCESS_ID 2 PORT TRANSFER_PORT_0 TRANSFER_PORT_1
"""

import json
import os
import sys

out_path, pid, count, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
transfer_ports = sys.argv[5:]
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=2"
)

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")

from rlpt.asyncrl.remote import (  # noqa: E402
    ProcessEngine,
    actor_mesh,
    enable_cross_host_transfers,
    serve_engine,
)

enable_cross_host_transfers(f"127.0.0.1:{transfer_ports[pid]}")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=pid)


from rlpt.asyncrl import AsyncConfig, AsyncRunner  # noqa: E402
from rlpt.models import CausalLM, create_model, get_preset  # noqa: E402
from rlpt.parallel import make_mesh, state_shardings  # noqa: E402
from rlpt.parallel.multihost import to_device  # noqa: E402
from rlpt.sampling import Engine, RequestParams  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_helpers import CyclingPrompts, parity_reward, requests  # noqa: E402

CFG = get_preset("tiny")
graph, params = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))


def completions(done):
    return [
        {"id": c.request_id, "index": c.index, "tokens": c.tokens.tolist(),
         "logprobs": c.logprobs.tolist(), "versions": c.versions.tolist()}
        for c in done
    ]  # fmt: skip


def drive(local, remote, learner_mesh) -> dict:
    result = {"before": {}, "after": {}}
    result["before"]["local"] = completions(local.generate(requests()))
    result["before"]["remote"] = completions(remote.generate(requests()))
    # New weights, sharded over the learner's devices, reach the actors' devices.
    halved = to_device(
        jax.tree.map(lambda x: x * 0.5, params), state_shardings(params, learner_mesh)
    )
    local.update_weights(halved, 3)
    remote.update_weights(halved, 3)
    result["version"] = remote.version
    result["after"]["local"] = completions(local.generate(requests()))
    result["after"]["remote"] = completions(remote.generate(requests()))

    consumed, weights = [], [halved]

    def learn(draw, version):  # a stand-in learner: new weights on its devices every step
        consumed.extend(draw.keys)
        weights.append(jax.tree.map(lambda x: x * 0.99, weights[-1]))
        return weights[-1], {}

    cfg = AsyncConfig(max_staleness=1, batch_groups=2, group_size=2, reward_threads=2)
    prompts = CyclingPrompts()
    runner = AsyncRunner(cfg, remote, prompts, parity_reward, learn, RequestParams(max_tokens=12),
                         seed=1, version=3)  # fmt: skip
    metrics = runner.run(4)
    state = runner.state_dict()
    result["consumed"] = consumed
    result["drawn"] = prompts.position
    result["held"] = [p["key"] for p in state["inflight"]] + [
        i["key"] for i in state["pool"]["items"]
    ]
    result["staleness_hists"] = [m["async/staleness_hist"] for m in metrics]
    result["engine_version"] = remote.version
    return result


if pid != 0:
    engine = Engine(graph, params, CFG, eos_id=2, num_slots=4, mesh=actor_mesh(1))
    serve_engine(engine)
else:
    # The driver: its devices hold the learner's weights and a local engine to compare with.
    learner_mesh = make_mesh(devices=jax.local_devices())
    local = Engine(graph, params, CFG, eos_id=2, num_slots=4, mesh=learner_mesh)
    remote = ProcessEngine(1)
    try:
        result = drive(local, remote, learner_mesh)
    finally:
        remote.close()  # the actor's serve_engine returns, also when the driver failed
    with open(out_path, "w") as f:
        json.dump(result, f)
