"""Ahead-of-time compile of the PPO step for a mesh, on fake devices, before paying for a pod.

    python -m rlpt.aot --config=experiments/demo.py --devices=64   # a run's own settings
    python -m rlpt.aot --preset=llama-1b --devices=64 --data=8 --fsdp=8 --tensor=1 \
        --batch=64 --prompt_len=256 --gen_len=768

With ``--config`` the model, the PPO settings, the batch (``rollout.batch_size``
sequences of the widest prompt bucket plus ``rollout.max_new_tokens``) and the mesh
(``mesh.*``; ``--data/--fsdp/--tensor`` given on the command line replace it) come
from the experiment file, parsed and checked exactly as ``rlpt.train`` does. Packed
rows (``ppo.pack_sequences``) are compiled as padded rows of the same batch: packing
only removes padding, so the padded layout bounds its memory.

Lowers and compiles the PPO update (policy and critic, the given microbatching)
for the requested mesh on ``--devices`` fake host devices, allocating nothing,
and reports the memory each device needs. Sharding mistakes (an axis that does
not divide, a batch that does not split) and out-of-memory layouts show up here.
The last line of standard output is JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "An experiments/NAME.py config: compile its own PPO step.", lock_config=True
)

_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Fake devices to compile for.")
_DATA = flags.DEFINE_integer("data", -1, "Mesh data axis (-1: the rest).")
_FSDP = flags.DEFINE_integer("fsdp", 1, "Mesh fsdp axis.")
_TENSOR = flags.DEFINE_integer("tensor", 1, "Mesh tensor axis.")
_SEQUENCE = flags.DEFINE_integer("sequence", 1, "Mesh sequence (context-parallel) axis.")
_BATCH = flags.DEFINE_integer("batch", 8, "Global sequences per PPO update.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens.")
_GEN_LEN = flags.DEFINE_integer("gen_len", 16, "Response tokens.")
_MINIBATCHES = flags.DEFINE_integer("num_minibatches", 1, "PPO minibatches.")
_GRAD_ACCUM = flags.DEFINE_integer("grad_accum", 1, "Microbatches per minibatch.")
_REMAT = flags.DEFINE_bool("remat", False, "Rematerialise blocks in the backward pass.")
_CRITIC = flags.DEFINE_bool("critic", True, "Compile with a value model (GAE).")


def compile_ppo_step(
    preset: str,
    *,
    mesh_shape: tuple[int, ...],
    batch: int,
    prompt_len: int,
    gen_len: int,
    num_minibatches: int = 1,
    grad_accum: int = 1,
    remat: bool = False,
    critic: bool = True,
    ppo=None,
    model_overrides: dict | None = None,
) -> dict:
    """Compile the PPO update for ``mesh_shape`` (data, fsdp, tensor[, sequence]) on the current
    devices; memory per device.

    ``model_overrides``: model config fields to change (attention kind, ``vocab_chunk`` ...).
    """
    import jax
    import jax.numpy as jnp

    from rlpt.models import CausalLM, ValueModel, abstract_model, count_params, get_preset
    from rlpt.parallel import make_mesh
    from rlpt.rl import PPOConfig, PPOTrainer, RolloutBatch, check_batch_layout
    from rlpt.rl.ppo import init_train_state

    config = get_preset(
        preset, remat=remat, max_seq_len=max(prompt_len + gen_len, 1), **(model_overrides or {})
    )
    mesh = make_mesh(*mesh_shape)
    if ppo is None:
        ppo = PPOConfig(
            num_minibatches=num_minibatches, grad_accum=grad_accum,
            estimator="gae" if critic else "grpo",
        )  # fmt: skip
    else:
        # A packed update is planned from real rollouts; padded rows bound its memory.
        ppo = dataclasses.replace(ppo, pack_sequences=False)
        critic = ppo.uses_critic
    check_batch_layout(ppo, batch, mesh)
    policy_graph, policy = abstract_model(lambda r: CausalLM(config, rngs=r))
    value_graph, value = abstract_model(lambda r: ValueModel(config, rngs=r))
    state = jax.eval_shape(
        lambda p, v: init_train_state(ppo, p, v, jax.random.key(0)), policy,
        value if critic else None,
    )  # fmt: skip
    length = prompt_len + gen_len

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    rollout = RolloutBatch(
        tokens=spec((batch, length), jnp.int32), positions=spec((batch, length), jnp.int32),
        input_mask=spec((batch, length), jnp.bool_),
        **{name: spec((batch, gen_len), jnp.float32) for name in (
            "response_mask", "rewards", "old_logp", "behaviour_logp", "ref_logp", "values",
            "advantages", "returns", "step_mask")},
        loss_weight=spec((batch,), jnp.float32), group_id=spec((batch,), jnp.int32),
        truncated=spec((batch,), jnp.bool_), imitation_weight=spec((batch,), jnp.float32),
    )  # fmt: skip
    trainer = PPOTrainer(ppo, policy_graph, value_graph if critic else None, mesh=mesh)
    fn = trainer.jitted_update(state, rollout)
    compiled = fn.lower(state, rollout, None, None).compile()
    memory = compiled.memory_analysis()
    gib = 1024**3
    report = {
        "preset": preset,
        "mesh": dict(mesh.shape),
        "devices": mesh.devices.size,
        "params": count_params(policy) + (count_params(value) if critic else 0),
        "batch": batch,
        "seq": length,
    }
    if memory is not None:
        per_device = (
            memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes - memory.alias_size_in_bytes
        )  # fmt: skip
        report.update(
            argument_gib_per_device=round(memory.argument_size_in_bytes / gib, 4),
            temp_gib_per_device=round(memory.temp_size_in_bytes / gib, 4),
            output_gib_per_device=round(memory.output_size_in_bytes / gib, 4),
            total_gib_per_device=round(per_device / gib, 4),
            total_bytes_per_device=int(per_device),
        )
    return report


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # Fake devices must be requested before jax initialises its backends.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={_DEVICES.value}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from rlpt.parallel import resolve_mesh_shape

    if _CONFIG.value is not None:
        print(json.dumps(_compile_config(_CONFIG.value)))
        return
    shape = resolve_mesh_shape(
        _DEVICES.value, _DATA.value, _FSDP.value, _TENSOR.value, _SEQUENCE.value
    )
    report = compile_ppo_step(
        _PRESET.value, mesh_shape=shape, batch=_BATCH.value, prompt_len=_PROMPT_LEN.value,
        gen_len=_GEN_LEN.value, num_minibatches=_MINIBATCHES.value,
        grad_accum=_GRAD_ACCUM.value, remat=_REMAT.value, critic=_CRITIC.value,
    )  # fmt: skip
    print(json.dumps(report))


def _compile_config(config) -> dict:
    """The PPO step of an experiment config, on its own mesh (or the flags' axes)."""
    from rlpt.config import ConfigError, parse_config
    from rlpt.parallel import resolve_mesh_shape

    try:
        typed = parse_config(config)
        if typed.model.hf_path:
            raise ConfigError("rlpt.aot --config compiles a preset model; model.hf_path is set")
        mesh = typed.mesh
        sizes = {name: getattr(mesh, name) for name in ("data", "fsdp", "tensor", "sequence")}
        axis_flags = (
            ("data", _DATA),
            ("fsdp", _FSDP),
            ("tensor", _TENSOR),
            ("sequence", _SEQUENCE),
        )
        for name, flag in axis_flags:
            if flags.FLAGS[flag.name].present:
                sizes[name] = flag.value
        shape = resolve_mesh_shape(_DEVICES.value, **sizes)
    except (ConfigError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    report = compile_ppo_step(
        typed.model.preset, mesh_shape=shape, batch=typed.rollout.batch_size,
        prompt_len=max(typed.rollout.buckets), gen_len=typed.rollout.max_new_tokens,
        remat=_REMAT.value, ppo=typed.ppo,
    )  # fmt: skip
    report["rows"] = "padded"
    return report


if __name__ == "__main__":
    app.run(main)
