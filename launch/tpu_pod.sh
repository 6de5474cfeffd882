#!/usr/bin/env bash
# Run an rlpt config on a Cloud TPU pod slice: create, install, run on all workers, copy logs, delete.
#
#   launch/tpu_pod.sh --name=rlpt-demo --zone=us-central2-b --type=v4-32 \
#       --config=experiments/demo.py --workdir=gs://BUCKET/runs/demo [--dry-run] [--keep]
#
# --dry-run prints every command instead of running it. The same config runs
# unchanged: rlpt.train initialises multi-host JAX from the pod's environment
# (its --distributed flag); every host draws the same prompts, verifies its own share of
# the rollouts in its own sandbox pool, and runs its devices' shards of the global mesh.
set -euo pipefail

name="" zone="" type="" config="" workdir="" version="tpu-ubuntu2204-base"
dry_run=0 keep=0 extra=()
for arg in "$@"; do
  case "$arg" in
    --name=*) name="${arg#*=}" ;;
    --zone=*) zone="${arg#*=}" ;;
    --type=*) type="${arg#*=}" ;;
    --config=*) config="${arg#*=}" ;;
    --workdir=*) workdir="${arg#*=}" ;;
    --version=*) version="${arg#*=}" ;;
    --dry-run) dry_run=1 ;;
    --keep) keep=1 ;;
    --config.*) extra+=("$arg") ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
for required in name zone type config workdir; do
  if [ -z "${!required}" ]; then echo "missing --$required" >&2; exit 2; fi
done

run() {
  if [ "$dry_run" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

repo_url="$(git -C "$(dirname "$0")/.." remote get-url origin 2>/dev/null || echo "REPO_URL")"
remote_cmd="set -e; if [ ! -d rlpt ]; then git clone ${repo_url} rlpt; fi; cd rlpt; \
python3 -m venv .venv && . .venv/bin/activate && pip install -q -e '.[tpu]' && \
python -m rlpt.train --config=${config} --workdir=${workdir} --distributed ${extra[*]:-} \
2>&1 | tee train.log"

run gcloud compute tpus tpu-vm create "$name" --zone="$zone" --accelerator-type="$type" --version="$version"
run gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="$remote_cmd"
run mkdir -p "logs/$name"
run gcloud compute tpus tpu-vm scp "$name:rlpt/train.log" "logs/$name/" --zone="$zone" --worker=0
if [ "$keep" = 0 ]; then
  run gcloud compute tpus tpu-vm delete "$name" --zone="$zone" --quiet
fi
