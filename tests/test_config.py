"""rlpt.config: every experiment parses, every bad value fails with one line naming its path."""

import dataclasses
import glob
import importlib.util
import json
import os

import pytest

from rlpt.config import (
    ConfigError,
    GymConfig,
    PostTrainConfig,
    default_config,
    parse_config,
)
from rlpt.rl import PPOConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO_ROOT, "experiments", "*.py")))
# Each file's arguments, full size and runlocal.
ARGS = {
    "demo_controls.py": ["sft_more", "uniform", "sft_more,runlocal", "uniform,runlocal"],
    "efficacy.py": [
        arm + suffix
        for arm in ("sft", "rl_uniform", "rl_curriculum", "sft_more")
        for suffix in ("", ",runlocal")
    ],
    "curriculum_mix.py": [
        "warm",
        "learned",
        "uniform",
        "warm,runlocal",
        "learned,runlocal",
        "uniform,runlocal",
    ],
}


def _load(path):
    name = "experiments_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _experiment(name, arg=None, **overrides):
    """The experiment's config with overrides (``__`` for the dots of a path), as plain data.

    An override goes into the locked ConfigDict, as the command line's would; one the
    ConfigDict refuses (an unknown key, a value of another type) into the plain data, so the
    parser's own check is what the test sees.
    """
    config = _load(os.path.join(REPO_ROOT, "experiments", name)).get_config(arg)
    config.lock()
    late = {}
    for path, value in overrides.items():
        *sections, key = path.split("__")
        try:
            node = config
            for section in sections:
                node = node[section]
            node[key] = value
        except (AttributeError, KeyError, TypeError):
            late[path] = value
    data = config.to_dict()
    for path, value in late.items():
        *sections, key = path.split("__")
        node = data
        for section in sections:
            node = node[section]
        node[key] = value
    return data


def _cases():
    for path in CONFIG_FILES:
        name = os.path.basename(path)
        for arg in ARGS.get(name, [None, "runlocal"]):
            yield pytest.param(name, arg, id=f"{name}:{arg}")


@pytest.mark.parametrize("name,arg", list(_cases()))
def test_every_experiment_parses_and_round_trips_through_json(name, arg, tmp_path):
    config = _load(os.path.join(REPO_ROOT, "experiments", name)).get_config(arg)
    if "hf_path" in config.get("model", {}) and config.model.hf_path == "":
        with pytest.raises(ConfigError, match=r"^model\.hf_path is empty"):
            parse_config(config)
        config.model.hf_path = str(tmp_path)
    typed = parse_config(config)
    assert isinstance(typed, PostTrainConfig | GymConfig)
    assert typed.trainer == config.trainer and typed.seed == config.seed
    stored = json.loads(json.dumps(typed.to_dict()))  # as run_config.json holds it
    assert parse_config(stored) == typed
    assert parse_config(typed) is typed


def test_the_demo_parses_to_its_documented_values():
    demo = parse_config(_experiment("demo.py"))
    assert demo.model.preset == "mini" and demo.model.hf_path is None
    assert demo.domains == ("arithmetic", "stepwise_math", "program_synthesis")
    assert (demo.rollout.batch_size, demo.rollout.group_size, demo.rollout.temperature) == (
        64,
        8,
        1.4,
    )
    assert (demo.ppo.estimator, demo.ppo.learning_rate, demo.ppo.clip_high) == ("grpo", 4e-4, 0.28)
    assert (demo.ppo_steps, demo.ppo.epochs, demo.ppo.num_minibatches) == (420, 2, 2)
    assert (demo.eval.every, demo.checkpoint.every, demo.sandbox.workers) == (40, 40, 2)
    assert demo.mesh.data == -1 and (demo.mesh.fsdp, demo.mesh.tensor, demo.mesh.sequence) == (
        1,
        1,
        1,
    )
    assert demo.sandbox.backend == "local" and demo.sandbox.allow_unisolated is False
    smoke = parse_config(_experiment("demo.py", "runlocal"))
    assert smoke.model.preset == "tiny" and smoke.rollout.batch_size == 8


def test_total_steps_is_derived_from_ppo_steps_epochs_and_minibatches():
    # Hand-worked: 420 PPO steps of 2 epochs of 2 minibatches are 1680 optimiser steps.
    assert parse_config(_experiment("demo.py")).ppo.total_steps == 1680
    assert parse_config(_experiment("demo.py", "runlocal")).ppo.total_steps == 3
    config = _experiment("demo.py", ppo_steps=7, ppo__epochs=3, ppo__num_minibatches=4)
    typed = parse_config(config)
    assert typed.ppo.total_steps == 7 * 3 * 4 == typed.derived_total_steps
    # The other derived fields: groups per batch and the rollout's temperature.
    assert typed.ppo.num_groups == 64 // 8 and typed.ppo.sampling_temperature == 1.4
    # A value given explicitly is kept; None means derived, also in plain data.
    assert parse_config(_experiment("demo.py", ppo__total_steps=50)).ppo.total_steps == 50
    data = _experiment("demo.py", ppo_steps=5)
    data["ppo"]["total_steps"] = None
    assert parse_config(data).ppo.total_steps == 5 * 2 * 2
    # Code that reads the experiment's ConfigDict itself sees the derived value too.
    config = _load(os.path.join(REPO_ROOT, "experiments", "demo.py")).get_config("runlocal")
    config.ppo_steps = 6
    assert config.ppo.total_steps == 6 * 1 * 1


def test_the_ppo_section_is_a_ppo_config_that_binds_a_jitted_function():
    ppo = parse_config(_experiment("demo.py")).ppo
    assert isinstance(ppo, PPOConfig)
    hash(ppo)  # static argument of jit
    assert ppo.uses_critic is False


def test_defaults_live_in_the_dataclasses():
    assert parse_config(default_config("post_train")) == PostTrainConfig()
    assert parse_config(default_config("ppo_gym")) == GymConfig()
    # A derived field is not in the ConfigDict an experiment starts from, but stays
    # overridable where it has a meaning of its own.
    defaults = default_config("post_train")
    assert "sampling_temperature" not in defaults.ppo
    assert defaults.mesh.data == -1 and "hf_path" not in defaults.model


# Each bad value and the exact line it gives. Overrides use "__" for the dots of a path.
BAD_POST_TRAIN = [
    (
        {"ppo__clip_low": -1.0, "ppo__learning_rate": -0.01},
        "ppo.clip_low must be in (0, 1), got -1",
    ),
    ({"ppo__clip_low": 1.0}, "ppo.clip_low must be in (0, 1), got 1"),
    ({"ppo__clip_high": 0.0}, "ppo.clip_high must be > 0, got 0"),
    ({"ppo__learning_rate": -0.01}, "ppo.learning_rate must be > 0, got -0.01"),
    ({"ppo__value_learning_rate": 0.0}, "ppo.value_learning_rate must be > 0, got 0"),
    ({"sft__learning_rate": 0.0}, "sft.learning_rate must be > 0, got 0"),
    ({"ppo__gamma": 1.5}, "ppo.gamma must be in [0, 1], got 1.5"),
    ({"ppo__lam": -0.1}, "ppo.lam must be in [0, 1], got -0.1"),
    ({"ppo__kl_coef": -0.05}, "ppo.kl_coef must be >= 0, got -0.05"),
    (
        {"ppo__estimator": "ppo2"},
        "ppo.estimator must be one of ('gae', 'grpo', 'rloo', 'dr_grpo'), got 'ppo2'",
    ),
    ({"ppo_steps": -1}, "ppo_steps must be >= 0, got -1"),
    ({"ppo_steps": "10"}, "ppo_steps must be an integer, got '10'"),
    ({"ppo_steps": 2.5}, "ppo_steps must be an integer, got 2.5"),
    ({"ppo__epochs": 0}, "ppo.epochs must be >= 1, got 0"),
    ({"checkpoint__every": 0}, "checkpoint.every must be >= 1, got 0"),
    ({"checkpoint__keep": 0}, "checkpoint.keep must be >= 1, got 0"),
    ({"eval__every": -1}, "eval.every must be >= 0, got -1"),
    (
        {"eval__k": 1},
        (
            "eval.k must be >= 2 when eval.n_samples > 0, got 1: pass@1 is the greedy score "
            "and the sampled pass@1 is reported as sample_pass@1"
        ),
    ),
    ({"eval__n_samples": 3}, "eval.n_samples (3) must be >= eval.k (4)"),
    (
        {"rollout__batch_size": 60},
        "rollout.batch_size must be a multiple of rollout.group_size (8), got 60",
    ),
    ({"ppo__num_minibatches": 3}, "ppo.num_minibatches must divide rollout.batch_size (64), got 3"),
    (
        {"ppo__num_groups": 4},
        "ppo.num_groups must be rollout.batch_size / rollout.group_size = 8 (or None), got 4",
    ),
    ({"rollout__temperature": 0.0}, "rollout.temperature must be a number > 0, got 0.0"),
    ({"rollout__sampler": "vllm"}, "rollout.sampler must be 'engine' or 'static', got 'vllm'"),
    ({"rollout__slots": 0}, "rollout.slots must be >= 1, got 0"),
    (
        {"rollout__group_size": 1, "rollout__batch_size": 8, "ppo__num_minibatches": 1},
        "rollout.group_size must be >= 2 for ppo.estimator 'grpo' "
        "(a group of one has no advantage), got 1",
    ),
    (
        {"ppo__estimator": "gae"},
        "rollout.filter_groups must be False with ppo.estimator 'gae': only a group estimator "
        "(grpo, dr_grpo, rloo) gives a group of equal rewards zero advantage",
    ),
    (
        {"stages": ("sft", "pp")},
        "stages[1] must be one of ('sft', 'rm', 'prm', 'ppo', 'sft_continued'), got 'pp'",
    ),
    (
        {"stages": ("sft", "ppo", "rm")},
        "stages must put 'rm' before 'ppo', got ('sft', 'ppo', 'rm')",
    ),
    (
        {"domains": ("arithmetc",)},
        "domains[0] names an unknown domain 'arithmetc'; did you mean 'arithmetic'? registered: "
        "arithmetic, echo, fractions, humaneval, list_programs, program_synthesis, "
        "random_labels, reasoning_gym, safety, state_tracking, stepwise_math (or an import "
        "path 'pkg.module:attr')",
    ),
    (
        {"curriculum__strategy": "greedy"},
        "curriculum.strategy must be one of "
        "('uniform', 'fixed', 'schedule', 'bandit', 'exp3'), got 'greedy'",
    ),
    (
        {"curriculum__floor": 0.5},
        "curriculum.floor must be <= 1 / 3 (the number of domains), got 0.5",
    ),
    (
        {"curriculum__difficulty__lower": 0.9},
        "curriculum.difficulty needs 0 <= lower < upper <= 1, got lower=0.9, upper=0.7",
    ),
    (
        {"curriculum__difficulty__review": 1.0},
        "curriculum.difficulty.review must be in [0, 1), got 1",
    ),
    (
        {"rewards__reward_model": 0.5},
        "rewards.reward_model is 0.5 but stages ('sft', 'ppo') has no 'rm' stage to train it",
    ),
    (
        {"rewards__process": 0.5},
        "rewards.process is 0.5 but stages ('sft', 'ppo') has no 'prm' stage to train it",
    ),
    (
        {
            "stages": ("sft", "prm", "ppo"),
            "process_reward__domain": "arithmetic",
            "domains": ("stepwise_math",),
        },
        "process_reward.domain must be one of domains ('stepwise_math',), got 'arithmetic'",
    ),
    ({"model__lora__rank": -1}, "model.lora.rank must be >= 0, got -1"),
    (
        {"model__lora__targets": ("wq", "wz")},
        "model.lora.targets must be a non-empty subset of "
        "('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', "
        "'w_down'), got ('wq', 'wz')",
    ),
    ({"model__lora__name": "../x"}, "model.lora.name must be a plain directory name, got '../x'"),
    (
        {"model__preset": "huge"},
        "model.preset must be one of "
        "('llama-1b', 'mini', 'qwen2-1.5b', 'small', 'tiny'), got 'huge'",
    ),
    (
        {"model__overrides": {"d_modl": 64}},
        "unknown config key model.overrides.d_modl; did you mean model.overrides.d_model?",
    ),
    ({"sandbox__timeout_s": 0.0}, "sandbox.timeout_s must be > 0, got 0"),
    ({"sandbox__memory_mb": 0}, "sandbox.memory_mb must be >= 1, got 0"),
    ({"sandbox__workers": 0}, "sandbox.workers must be >= 1, got 0"),
    ({"sandbox__backend": "slurm"}, "sandbox.backend must be one of ('local', 'ray'), got 'slurm'"),
    ({"mesh__fsdp": -1}, "at most one mesh axis may be -1, got mesh.data and mesh.fsdp"),
    ({"mesh__tensor": 0}, "mesh.tensor must be a positive integer or -1, got 0"),
    ({"mesh__sequence": 0}, "mesh.sequence must be a positive integer or -1, got 0"),
    ({"mesh__sequence": -1}, "at most one mesh axis may be -1, got mesh.data and mesh.sequence"),
    ({"reward_model__refresh_every": -1}, "reward_model.refresh_every must be >= 0, got -1"),
    (
        {"process_reward__kind": "prime"},
        "process_reward.kind must be one of ('math_shepherd', 'implicit'), got 'prime'",
    ),
    ({"process_reward__beta": 0.0}, "process_reward.beta must be > 0, got 0"),
    ({"process_reward__samples": 1}, "process_reward.samples must be >= 2, got 1"),
    ({"rollout__filter_max_rounds": 0}, "rollout.filter_max_rounds must be >= 1, got 0"),
    ({"rollout__turns": 0}, "rollout.turns must be >= 1, got 0"),
    ({"rollout__feedback_tokens": 0}, "rollout.feedback_tokens must be >= 1, got 0"),
    ({"rollout__turn_discount": 0.0}, "rollout.turn_discount must be in (0, 1], got 0"),
    ({"rollout__turn_discount": 1.5}, "rollout.turn_discount must be in (0, 1], got 1.5"),
    (
        {"rollout__turns": 3, "rollout__chunked_reasoning__enabled": True},
        "rollout.turns must be 1 with rollout.chunked_reasoning.enabled, got 3",
    ),
    (
        {"rollout__turns": 2, "async_rl__enabled": True, "rollout__filter_groups": False},
        "rollout.turns must be 1 with async_rl.enabled (not yet), got 2",
    ),
    (
        {"rollout__turns": 2, "stages": ("sft", "rm", "ppo"), "rewards__reward_model": 0.5},
        "rollout.turns must be 1 with learned reward terms (rewards.reward_model or "
        "rewards.process > 0; not yet), got 2",
    ),
    ({"sft__jsonl": "/nonexistent/sft.jsonl"}, "sft.jsonl '/nonexistent/sft.jsonl' is not a file"),
    ({"ppo__clip_lo": 0.1}, "unknown config key ppo.clip_lo; did you mean ppo.clip_low?"),
    (
        {"distributed": True},
        "unknown config key distributed: multi-process JAX starts from flags of rlpt.train: "
        "--coordinator_address=HOST:PORT --num_processes=N --process_id=I, or --distributed",
    ),
    ({"trainer": "nope"}, "trainer must be one of ('post_train', 'ppo_gym'), got 'nope'"),
    ({"checkpoint__async_save": "yes"}, "checkpoint.async_save must be true or false, got 'yes'"),
]


@pytest.mark.parametrize("overrides,message", BAD_POST_TRAIN)
def test_a_bad_post_train_value_fails_with_one_line_naming_its_path(overrides, message):
    with pytest.raises(ConfigError) as error:
        parse_config(_experiment("demo.py", **overrides))
    assert str(error.value) == message


def test_an_import_path_domain_and_a_family_domain_are_accepted():
    config = _experiment("demo.py", domains=("my_pkg.tasks:MyDomain", "reasoning_gym/chain_sum"))
    assert parse_config(config).domains == ("my_pkg.tasks:MyDomain", "reasoning_gym/chain_sum")


def test_fixed_curriculum_weights_parse():
    weights = {"arithmetic": 0.5, "stepwise_math": 0.25, "program_synthesis": 0.25}
    config = _experiment("demo.py", curriculum__strategy="fixed", curriculum__fixed_weights=weights)
    typed = parse_config(config)
    assert typed.curriculum.fixed_weights == weights
    assert parse_config(json.loads(json.dumps(typed.to_dict()))) == typed


BAD_GYM = [
    ({"num_minibatches": 3}, "num_minibatches must divide num_envs * num_steps (1024), got 3"),
    ({"gamma": 1.01}, "gamma must be in [0, 1], got 1.01"),
    ({"clip_eps": 0.0}, "clip_eps must be in (0, 1), got 0"),
    ({"learning_rate": -1.0}, "learning_rate must be > 0, got -1"),
    ({"total_env_steps": 100}, "total_env_steps must be >= 1024, got 100"),
    ({"num_env": 4}, "unknown config key num_env; did you mean num_envs?"),
]


@pytest.mark.parametrize("overrides,message", BAD_GYM)
def test_a_bad_gym_value_fails_with_one_line_naming_its_path(overrides, message):
    with pytest.raises(ConfigError) as error:
        parse_config(_experiment("cartpole_ppo.py", **overrides))
    assert str(error.value) == message


def test_mesh_sizes_are_checked_against_the_device_count():
    mesh = parse_config(_experiment("demo.py", mesh__fsdp=2, mesh__tensor=2)).mesh
    assert mesh.shape(8) == (2, 2, 2, 1)
    with pytest.raises(ConfigError, match=r"^mesh: .*do not divide the 6 available devices"):
        mesh.shape(6)
    mesh = parse_config(_experiment("demo.py", mesh__data=2, mesh__sequence=4)).mesh
    assert mesh.shape(8) == (2, 1, 1, 4)
    with pytest.raises(ConfigError, match=r"^mesh: .*'sequence': 4.* use 8 devices but 4"):
        mesh.shape(4)


def test_sections_are_frozen():
    typed = parse_config(_experiment("demo.py"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.rollout.batch_size = 3
