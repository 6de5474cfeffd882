"""The notebooks: valid nbformat 4, committed without outputs, and every cell runs.

The quickstart's code cells (all but the ``install``-tagged one, which needs the network)
run in order in one fresh Python process, with ``RLPT_NOTEBOOK_TINY=1`` so the training
run is a few steps of every stage, and the test suite's JAX settings (8 host devices,
the shared persistent compilation cache). nbformat/nbclient are not needed.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS_DIR = os.path.join(REPO_ROOT, "notebooks")
QUICKSTART = os.path.join(NOTEBOOKS_DIR, "quickstart.ipynb")
DONE_MARKER = "quickstart done"

# Runs the cells in one namespace, as a kernel would; a failing cell names itself.
_RUNNER = """\
import json, sys, traceback
cells = json.loads({cells!r})
namespace = {{"__name__": "__main__"}}
for index, source in cells:
    print(f"--- cell {{index}}", flush=True)
    try:
        exec(compile(source, f"<notebook cell {{index}}>", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"cell {{index}} failed", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.stdout.flush()
"""


def _source(cell):
    source = cell["source"]
    return "".join(source) if isinstance(source, list) else source


def _load(path):
    with open(path, encoding="utf-8") as f:
        notebook = json.load(f)
    assert notebook["nbformat"] == 4
    assert isinstance(notebook.get("nbformat_minor"), int)
    assert isinstance(notebook.get("metadata"), dict)
    cells = notebook["cells"]
    assert isinstance(cells, list) and cells
    for i, cell in enumerate(cells):
        assert cell["cell_type"] in ("markdown", "code", "raw"), (i, cell["cell_type"])
        assert isinstance(cell["source"], list | str), i
        assert isinstance(cell.get("metadata"), dict), i
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"cell {i}: outputs must be cleared before committing"
            assert cell["execution_count"] is None, f"cell {i}: execution_count must be null"
    return cells


def _is_install(cell):
    return "install" in cell.get("metadata", {}).get("tags", [])


def _runnable(source):
    """The cell without shell (``!``) and magic (``%``) lines."""
    kept = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("!", "%"))]
    return "\n".join(kept) + "\n"


def test_quickstart_is_a_valid_notebook_in_the_expected_order():
    cells = _load(QUICKSTART)
    assert cells[0]["cell_type"] == "markdown" and _source(cells[0]).lstrip().startswith("#")
    code = [c for c in cells if c["cell_type"] == "code"]
    assert _is_install(code[0]) and "pip install" in _source(code[0])
    assert not any(_is_install(c) for c in code[1:])
    sources = [_source(c) for c in code[1:]]
    for needle in ("RLPT_NOTEBOOK_TINY", "train.train_and_evaluate", "metrics.jsonl",
                   "plot.write_plots", "restore_policy", DONE_MARKER):  # fmt: skip
        assert any(needle in s for s in sources), needle
    assert DONE_MARKER in sources[-1]
    assert cells[-1]["cell_type"] == "markdown" and "tensorboard" in _source(cells[-1])


def test_quickstart_runs_end_to_end(tmp_path):
    cells = _load(QUICKSTART)
    runnable = [
        (i, _runnable(_source(c)))
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and not _is_install(c)
    ]
    script = tmp_path / "quickstart_cells.py"
    script.write_text(_RUNNER.format(cells=json.dumps(runnable)), encoding="utf-8")

    env = dict(os.environ)
    # What tests/conftest.py sets for this process; repeated in case it did not run.
    if "--xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "rlpt-test-jax-cache")
    )
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    env["RLPT_NOTEBOOK_TINY"] = "1"
    env["MPLBACKEND"] = "Agg"
    env["TMPDIR"] = str(tmp_path)  # the notebook's tempfile workdir lands here
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)

    proc = subprocess.run(
        [sys.executable, str(script)], cwd=NOTEBOOKS_DIR, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, log
    assert DONE_MARKER in proc.stdout.splitlines(), log
    workdirs = re.findall(r"^WORKDIR=(.+)$", proc.stdout, flags=re.MULTILINE)
    assert len(workdirs) == 1, log
    workdir = workdirs[0].strip()
    assert os.path.isfile(os.path.join(workdir, "summary.json")), log
    assert os.path.isfile(os.path.join(workdir, "metrics.jsonl")), log
    assert os.listdir(os.path.join(workdir, "plots")), log
