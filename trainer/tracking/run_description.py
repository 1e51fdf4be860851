"""What a run says about its job, beyond its metrics: the description the UI shows, the code's
commit, the config as params, and its inputs (datasets, the model its weights came from)."""
from __future__ import annotations

import getpass
import json
import subprocess
import sys
from pathlib import Path

from trainer.config import Config, flatten, redacted
from trainer.redaction import REDACTED, is_secret_key, redact_text

MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
MAX_TAG_LEN = 5000  # of a context tag's value (MLflow's limit is 8000)


def describe_job(cfg: Config, world_size: int) -> str:
    """The run's description in the UI: what was trained on what data, how."""
    s, t = cfg.SOLVER, cfg.TRAIN
    backbone = f" ({cfg.MODEL.BACKBONE} backbone)" if cfg.MODEL.BACKBONE else ""
    weights = redact_text(t.WEIGHTS) or "random initialisation"
    return (f"{cfg.MODEL.TYPE}{backbone} trained on {', '.join(t.DATASETS)} from {weights}: "
            f"{s.MAX_ITER} iterations of {t.IMS_PER_BATCH} images x {world_size} process(es), "
            f"LR {s.BASE_LR} ({s.LR_POLICY}), scales {t.SCALES}, max size {t.MAX_SIZE}. "
            f"Evaluated on {', '.join(cfg.TEST.DATASETS) or 'nothing'}.")


def git_commit() -> str | None:
    """The commit of the code that runs, where it runs from a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def context_tags() -> dict[str, str]:
    """The run-context tags mlflow.start_run gives a run and a client's create_run does not: mlflow.user
    (the UI's User column: MLFLOW_TRACKING_USERNAME, else the login), the source, and those of MLflow's
    other context providers (MLFLOW_RUN_CONTEXT's JSON, a platform's plugin)."""
    from mlflow.tracking.context.default_context import DefaultRunContext
    from mlflow.tracking.context.registry import resolve_tags
    from mlflow.utils.credentials import read_mlflow_creds

    try:
        user = read_mlflow_creds().username or getpass.getuser()
    except Exception:  # a user id with no passwd entry and no USER (a container's arbitrary user): KeyError
        user = "unknown"  # MLflow's own word for it, without its warning
    own = {"mlflow.user": user, "mlflow.source.name": sys.argv[0] or "<console>", "mlflow.source.type": "LOCAL"}
    # MLFLOW_RUN_CONTEXT is anyone's JSON: a nested value is its JSON text (a dict failed the run's creation);
    # a CI job's URL with its token, or a key named like a secret, is redacted as the other tags are
    return own | {str(k): REDACTED if is_secret_key(str(k))
                  else redact_text(v if isinstance(v, str) else json.dumps(v))[:MAX_TAG_LEN]
                  for k, v in resolve_tags(ignore=[DefaultRunContext]).items()}


def safe_params(cfg: Config) -> dict[str, str]:
    """The flattened config as params: secrets redacted, long values truncated."""
    out = {}
    for key, value in flatten(redacted(cfg)).items():
        text = redact_text(str(value))
        out[key] = text if len(text) <= MAX_PARAM_LEN else text[: MAX_PARAM_LEN - 3] + "..."
    return out


def input_entities(datasets: list[dict], parent: dict) -> tuple[list, list | None, list]:
    """The run's inputs as MLflow entities: its datasets (lineage.dataset_inputs) with their context,
    the LoggedModel its weights came from (if MLflow has it), and the parent's tags."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelInput, RunTag

    inputs = [DatasetInput(Dataset(d["name"], d["digest"], "local", d["source"], profile=d["profile"]),
                           [InputTag("mlflow.data.context", d["context"])]) for d in datasets]
    models = [LoggedModelInput(parent["model_id"])] if parent.get("model_id") else None
    return inputs, models, [RunTag(f"tracktron.parent.{k}", redact_text(v)) for k, v in parent.items()]
