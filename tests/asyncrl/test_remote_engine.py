"""The rollout engine on another JAX process (a driver and an actor process on localhost):
the same samples as an engine on the driver's own devices, weights moved across
processes by JAX, and an asynchronous run driven through it."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

SCRIPT = os.path.join(os.path.dirname(__file__), "multiprocess_engine.py")
PROCESSES = 2  # the driver and one actor process


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _env():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return env


def test_a_process_engine_samples_updates_and_runs_like_a_local_one(tmp_path):
    port, *transfer = _free_ports(1 + PROCESSES)
    out = tmp_path / "result.json"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                SCRIPT,
                str(out),
                str(pid),
                str(PROCESSES),
                str(port),
                *map(str, transfer),
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for pid in range(PROCESSES)
    ]
    for proc in procs:
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log[-3000:]
    result = json.loads(out.read_text())
    for when in ("before", "after"):
        local, remote = result[when]["local"], result[when]["remote"]
        assert [(c["id"], c["index"]) for c in remote] == [(c["id"], c["index"]) for c in local]
        for a, b in zip(remote, local):
            assert a["tokens"] == b["tokens"], when
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-6)
    # Halved weights changed what the actors sample, and every token after carries version 3.
    assert result["before"]["remote"] != result["after"]["remote"]
    assert result["version"] == 3
    assert all(v == 3 for c in result["after"]["remote"] for v in c["versions"])
    # The asynchronous run: each drawn prompt trained once or still held, within the bound.
    consumed, held = result["consumed"], result["held"]
    assert len(set(consumed)) == len(consumed) == 8
    assert sorted(consumed + held) == list(range(result["drawn"]))
    assert all(len(h) == 2 and sum(h) == 2 for h in result["staleness_hists"])
    # Weights published by the learner reached the engine across processes during the run
    # (the last of its four may still be on the way when the run stops).
    assert 3 < result["engine_version"] <= 3 + 4
