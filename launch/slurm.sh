#!/usr/bin/env bash
# Run an rlpt config on a multi-host GPU cluster with SLURM: one task per node.
#
#   launch/slurm.sh --nodes=4 --gpus_per_node=8 --config=experiments/demo.py \
#       --workdir=/shared/runs/demo [--partition=gpu] [--time=24:00:00] [--dry-run]
#
# Writes the batch script next to the workdir and submits it with sbatch;
# --dry-run prints the script and the sbatch command instead. Each task starts
# multi-process JAX with rlpt.train's --distributed flag, which reads the
# coordinator, process count and index from SLURM's environment, so the same
# config runs unchanged.
set -euo pipefail

nodes=1 gpus=8 partition="" time_limit="24:00:00" config="" workdir="" dry_run=0 extra=()
for arg in "$@"; do
  case "$arg" in
    --nodes=*) nodes="${arg#*=}" ;;
    --gpus_per_node=*) gpus="${arg#*=}" ;;
    --partition=*) partition="${arg#*=}" ;;
    --time=*) time_limit="${arg#*=}" ;;
    --config=*) config="${arg#*=}" ;;
    --workdir=*) workdir="${arg#*=}" ;;
    --dry-run) dry_run=1 ;;
    --config.*) extra+=("$arg") ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
if [ -z "$config" ] || [ -z "$workdir" ]; then
  echo "missing --config or --workdir" >&2; exit 2
fi

repo="$(cd "$(dirname "$0")/.." && pwd)"
script="#!/usr/bin/env bash
#SBATCH --job-name=rlpt
#SBATCH --nodes=${nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=${gpus}
#SBATCH --time=${time_limit}
#SBATCH --output=${workdir}/slurm-%j.log
${partition:+#SBATCH --partition=${partition}}
set -euo pipefail
cd ${repo}
. .venv/bin/activate
srun python -m rlpt.train --config=${config} --workdir=${workdir} --distributed ${extra[*]:-}
"

if [ "$dry_run" = 1 ]; then
  echo "$script"
  echo "sbatch ${workdir}/rlpt.sbatch"
  exit 0
fi
mkdir -p "$workdir"
echo "$script" > "$workdir/rlpt.sbatch"
sbatch "$workdir/rlpt.sbatch"
