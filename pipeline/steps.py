"""The pipeline's step scripts, each run as `bash -c SCRIPT NAME ARG...` or `python3 -c SCRIPT ARG...`
(arguments are never spliced into code), and how the tracked steps get the tracking Secret."""

# Secret keys -> environment variables. The first is required; the others may be absent.
REQUIRED_SECRET_KEYS = {"MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI"}
OPTIONAL_SECRET_KEYS = {k: k for k in (
    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL")}
# The steps read the Secret from a volume, never from the pod's environment: KFP's driver puts every
# parameter into the pod's command (its executor input), where Kubernetes replaces `$(NAME)` with
# the container's environment, so a parameter `$(MLFLOW_TRACKING_PASSWORD)` would carry the password.
SECRET_MOUNT = "/var/run/secrets/tracktron-mlflow"

# ---- the step scripts (bash -c SCRIPT NAME ARG...; arguments are never spliced into code) ----

# Runs its arguments as a command with the tracking settings exported from the Secret's files.
_SECRET_KEYS = " ".join({**REQUIRED_SECRET_KEYS, **OPTIONAL_SECRET_KEYS})
WITH_TRACKING_SH = f"""
set -euo pipefail
for key in {_SECRET_KEYS}; do
  if [ -f "{SECRET_MOUNT}/$key" ]; then export "$key=$(cat "{SECRET_MOUNT}/$key")"; fi
done
[ -n "${{MLFLOW_TRACKING_URI:-}}" ] || {{ echo "error: the Secret has no MLFLOW_TRACKING_URI" >&2; exit 2; }}
exec "$@"
"""

PREPARE_SH = r"""
set -euo pipefail
dataset="$1" data_dir="$2" num_images="$3" out="$4"
case "$dataset" in
  synth)  # the demo's synthetic shapes, where the catalog looks for them (kept when present)
    tracktron data synth --out "$data_dir/synth_shapes/train" --num-images "$num_images" --seed 0
    tracktron data synth --out "$data_dir/synth_shapes/val" --num-images 16 --seed 1 ;;
  coco)   # real COCO already on the volume: check it is there, copy nothing
    for f in annotations/instances_train2017.json annotations/instances_val2017.json; do
      [ -f "$data_dir/coco/$f" ] || { echo "error: $data_dir/coco/$f is not on the data volume" >&2; exit 2; }
    done
    [ -d "$data_dir/coco/train2017" ] || { echo "error: $data_dir/coco/train2017 is missing" >&2; exit 2; } ;;
  none) ;;
  *) echo "error: dataset must be synth, coco or none, got '$dataset'" >&2; exit 2 ;;
esac
mkdir -p "$(dirname "$out")"
printf '%s' "$data_dir" > "$out"
"""

# `opts` goes to the trainer's --opts as one word, which it splits as a shell would (quotes honoured,
# nothing run) after the step's own DATA_DIR and OUTPUT_DIR; a flag there is refused, not taken as
# one of the trainer's options. One GPU: tracktron itself; several:
# torchrun on this pod. exec: no shell in between (KFP's launcher above it exits on SIGTERM, so a
# preempted pod keeps only its periodic checkpoints: pipeline/README.md).
TRAIN_SH = r"""
set -euo pipefail
config="$1" opts="$2" data_dir="$3" experiment="$4" gpus="$5" run_id_file="$6"
export TRACKTRON_RUN_ID_FILE="$run_id_file"
mkdir -p "$(dirname "$run_id_file")"
if [ -n "$experiment" ]; then export MLFLOW_EXPERIMENT_NAME="$experiment"; fi
if [ "$gpus" -gt 1 ]; then
  exec torchrun --standalone --nnodes=1 --nproc-per-node="$gpus" -m trainer train --config "$config" \
    --opts "$opts" -- DATA_DIR "$data_dir" OUTPUT_DIR /output/train
fi
exec tracktron train --config "$config" --opts "$opts" -- DATA_DIR "$data_dir" OUTPUT_DIR /output/train
"""

BAD_BACKEND_SH = r"""
echo "error: train_backend must be pod or trainjob, got '$1'" >&2
exit 2
"""

# `--weights runs:/<id>/...`: tracktron eval logs the metrics (bbox/AP, ...) into that run, with the
# run's own config and opts (the model they build, the test settings, DATA_DIR or a catalog among them).
EVAL_SH = r"""
set -euo pipefail
config="$1" opts="$2" data_dir="$3" run_id="$4" artifact="$5"
[ -n "$run_id" ] || { echo "error: the train step gave no MLflow run id" >&2; exit 2; }
exec tracktron eval --config "$config" --weights "runs:/$run_id/$artifact" --opts "$opts" -- \
  DATA_DIR "$data_dir" OUTPUT_DIR /output/eval
"""

# The first step: every parameter a later step would refuse, checked before a GPU is taken. The
# config with its opts, as the trainer reads them (`tracktron config` builds the network too); the
# register step's parameters: the name is spliced into a search filter (a quote broke it), a NaN
# min_score would turn the gate off, and MLflow refuses a reserved alias only after registering.
CHECK_PY = r"""
import math
import re
import shlex
import subprocess
import sys

config, opts, name, min_score, alias = sys.argv[1:6]


def refuse(line):
    print(f"error: {line}", file=sys.stderr)
    sys.exit(2)


if not name.strip() or not name.isprintable() or set("/:@#?'\"\\") & set(name):
    refuse(f"model_name {name!r}: a registered model name has no / : @ # ? quote or control character")
if alias and not re.fullmatch(r"[A-Za-z0-9_-]{1,255}", alias):
    refuse(f"alias {alias!r}: letters, digits, _ and - only")
if alias.lower() == "latest" or re.fullmatch(r"[vV][0-9]+", alias):
    refuse(f"alias {alias!r} is reserved by MLflow (latest and v<number> name versions): choose another")
try:
    score = float(min_score)
except ValueError:
    score = math.nan
if not math.isfinite(score):
    refuse(f"min_score {min_score!r} is not a finite number")
checked = subprocess.run(["tracktron", "config", "--config", config, "--opts", opts, "--", "DATA_DIR", "/data",
                          "OUTPUT_DIR", "/output/train"], stdout=subprocess.DEVNULL)
if checked.returncode:
    sys.exit(checked.returncode)
from trainer.config import load_config  # the words as the trainer takes them: its trailing pairs, then opts

if not load_config(config, ["DATA_DIR", "/data", "OUTPUT_DIR", "/output/train", *shlex.split(opts)]).TEST.DATASETS:
    refuse("TEST.DATASETS is empty: the pipeline's evaluate step scores the trained model on the test sets "
           "(name one in opts or the config)")
"""

REGISTER_PY = r"""
import re
import sys
from pathlib import Path

import mlflow
from mlflow import MlflowClient

run_id, name, metric, min_score, alias, out = sys.argv[1:7]  # checked by the first step (CHECK_PY)
min_score = float(min_score)
if not re.fullmatch(r"[0-9a-f]{32}", run_id):  # spliced into a search filter below
    sys.exit(f"error: run id {run_id!r} is not an MLflow run id")
client = MlflowClient()
run = client.get_run(run_id)
score = run.data.metrics.get(metric)
if min_score > 0 and (score is None or score < min_score):
    sys.exit(f"error: {metric} of run {run_id} is {score}, below {min_score}: not registered")
# Idempotent: a re-run of the pipeline for a finished job finds the version it registered.
versions = [v for v in client.search_model_versions(f"run_id = '{run_id}'") if v.name == name]
if versions:
    version = max(versions, key=lambda v: int(v.version))
    print(f"{name} version {version.version} already holds run {run_id}")
else:
    tags = {k: run.data.tags[k] for k in ("tracktron.job", "tracktron.config_name") if run.data.tags.get(k)}
    if score is not None:
        tags[metric] = str(score)
    version = mlflow.register_model(f"runs:/{run_id}/model", name, tags=tags)
    print(f"registered runs:/{run_id}/model as {name} version {version.version}")
if alias:
    client.set_registered_model_alias(name, alias, version.version)
    print(f"alias {alias} -> {name} version {version.version}")
Path(out).parent.mkdir(parents=True, exist_ok=True)
Path(out).write_text(str(version.version))
"""


def with_tracking(*command: str) -> list[str]:
    """A step's command, run with the tracking settings of the Secret's volume in its environment."""
    return ["bash", "-c", WITH_TRACKING_SH, "tracking", *command]
