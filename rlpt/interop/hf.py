"""Hugging Face import and export on the command line.

    python -m rlpt.interop.hf import HF_DIR CKPT
    python -m rlpt.interop.hf export CKPT OUT_DIR [--adapter=NAME]

``import`` writes an rlpt checkpoint (orbax params, model config JSON, the
tokenizer files); ``export`` writes a Hugging Face directory that
``transformers`` loads, with LoRA adapter ``NAME`` merged in when given. The
last line of standard output is JSON describing what was written.
"""

from __future__ import annotations

import json

from absl import app, flags, logging

from rlpt.interop.checkpoint import export_hf, import_hf
from rlpt.parallel import make_mesh

_ADAPTER = flags.DEFINE_string("adapter", None, "export: merge this LoRA adapter (a name).")


def main(argv):
    if len(argv) != 4 or argv[1] not in ("import", "export"):
        raise app.UsageError("usage: import HF_DIR CKPT | export CKPT OUT_DIR [--adapter=NAME]")
    command, source, dest = argv[1:]
    # Parameters are spread over every local device (fsdp), so a model larger than one
    # device's memory still loads.
    mesh = make_mesh(data=1, fsdp=-1)
    if command == "import":
        if _ADAPTER.value is not None:
            raise app.UsageError("--adapter is for export")
        model = import_hf(source, dest, mesh=mesh)
        logging.info("imported %s (%s, %d tensors) to %s", source, model.family,
                     model.stats.tensors, dest)  # fmt: skip
        result = {"checkpoint": dest, "family": model.family, "model": model.config.to_dict()}
    else:
        files = export_hf(source, dest, adapter=_ADAPTER.value, mesh=mesh)
        logging.info("exported %s to %s (%d weight files)", source, dest, len(files))
        result = {"hf_dir": dest, "files": files, "adapter": _ADAPTER.value}
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
