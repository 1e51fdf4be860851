"""The job's MLflow run: where it is tracked, finding or creating it (DESIGN.md's resume rules),
and fetching its checkpoints. The functions that take a `client` are run by the tracking agent
(tracking_agent.py) or, when there is none, by the training process: their results are plain data.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from trainer.checkpoint_files import FINAL, iteration_of, sha256_of
from trainer.config import Config, flatten, job_hash, redact_text, redacted
from trainer.errors import UserError

DEFAULT_URI = "sqlite:///mlflow.db"
JOB_TAG = "tracktron.job"
LATEST_TAG = "tracktron.ckpt.latest"
MAX_PARAM_LEN = 6000  # MLflow's limit on a param value


def sha_tag(name: str) -> str:
    return f"tracktron.ckpt.{name}.sha256"


def tracking_uri(cfg: Config) -> str:
    return without_credentials(cfg.TRACKING.URI or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI)


def without_credentials(uri: str) -> str:
    """`http://user:password@host` -> `http://host`, the user and password moved to MLflow's own
    MLFLOW_TRACKING_USERNAME/PASSWORD (this process and its children). MLflow then sends them as
    basic auth, and no URL that we or MLflow print ("View run at ...") carries them."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    return urlunsplit(parts._replace(netloc=host))


def experiment_name(cfg: Config) -> str:
    return cfg.TRACKING.EXPERIMENT or os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.NAME or "tracktron"


def checkpoints_of(run) -> list[str]:
    """Complete checkpoints of a run (those whose sha256 tag was set), newest first."""
    return checkpoints_from(run.data.tags)


def checkpoints_from(tags: dict) -> list[str]:
    names = [k[len("tracktron.ckpt."):-len(".sha256")] for k in tags
             if k.startswith("tracktron.ckpt.") and k.endswith(".sha256")]
    return sorted(names, key=iteration_of, reverse=True)


def safe_params(cfg: Config) -> dict[str, str]:
    """The flattened config as params: secrets redacted, long values truncated."""
    out = {}
    for key, value in flatten(redacted(cfg)).items():
        text = str(value)
        out[key] = text if len(text) <= MAX_PARAM_LEN else text[: MAX_PARAM_LEN - 3] + "..."
    return out


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _start_tags(cfg: Config, world_size: int) -> dict[str, str]:
    tags = {  # torch's versions and the device come with set_tags() once torch is imported
        JOB_TAG: job_hash(cfg),
        "tracktron.config_name": cfg.NAME,
        "tracktron.world_size": str(world_size),
    }
    if commit := _git_commit():
        tags["mlflow.source.git.commit"] = commit
    tags["mlflow.note.content"] = describe_job(cfg, world_size)
    return tags


def describe_job(cfg: Config, world_size: int) -> str:
    """The run's description in the UI: what was trained on what data, how."""
    s, t = cfg.SOLVER, cfg.TRAIN
    backbone = f" ({cfg.MODEL.BACKBONE} backbone)" if cfg.MODEL.BACKBONE else ""
    weights = redact_text(t.WEIGHTS) or "random initialisation"
    return (f"{cfg.MODEL.TYPE}{backbone} trained on {', '.join(t.DATASETS)} from {weights}: "
            f"{s.MAX_ITER} iterations of {t.IMS_PER_BATCH} images x {world_size} process(es), "
            f"LR {s.BASE_LR} ({s.LR_POLICY}), scales {t.SCALES}, max size {t.MAX_SIZE}. "
            f"Evaluated on {', '.join(cfg.TEST.DATASETS) or 'nothing'}.")


# ---- finding the job's run: done by the tracking agent (or here), so plain data comes back ----

def open_run(client, uri: str, cfg: Config, world_size: int, resume_run_id: str | None, new_run: bool) -> dict:
    """Find or create the job's run: its id, experiment, whether an earlier start of the job made
    it, its tags, its params' names, the last step logged, and a note for the log."""
    from mlflow.entities import RunTag

    try:
        run, exp_id, note = _find_run(client, uri, cfg, resume_run_id, new_run)
        resumed = run is not None and JOB_TAG in run.data.tags
        last_step = -1
        if run is None:
            run = client.create_run(exp_id, tags=_start_tags(cfg, world_size), run_name=_run_name(cfg))
        elif not resumed:  # a run made for us (`mlflow run`, or --resume of a bare run): adopt it
            tags = _start_tags(cfg, world_size)
            client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            run = client.get_run(run.info.run_id)
        else:
            if FINAL not in checkpoints_of(run):  # a finished job stays FINISHED
                client.update_run(run.info.run_id, status="RUNNING")
            last_step = _last_step(client, run)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - nothing was written yet: say why in one line
        raise UserError(start_error(uri, e)) from None
    return {"run_id": run.info.run_id, "experiment_id": exp_id, "resumed": resumed, "tags": dict(run.data.tags),
            "params": set(run.data.params), "last_step": last_step, "note": note}


def _find_run(client, uri: str, cfg: Config, resume_run_id: str | None, new_run: bool):
    """(run or None, experiment id, note): --resume RUN_ID, else MLFLOW_RUN_ID, else the job's newest run."""
    from mlflow.entities import RunTag

    if resume_run_id:
        run = _get_run(client, uri, resume_run_id)
        return run, run.info.experiment_id, None
    resume = cfg.TRAIN.AUTO_RESUME and not new_run
    if launcher_id := os.environ.get("MLFLOW_RUN_ID"):
        launcher = _get_run(client, uri, launcher_id)
        exp_id = launcher.info.experiment_id
        if JOB_TAG in launcher.data.tags or not resume:
            return launcher, exp_id, None
        earlier = _newest_job_run(client, exp_id, cfg)
        if earlier is None:
            return launcher, exp_id, None
        # `mlflow run` made a new run for a job that has one: one job stays one run.
        note = f"Launcher only: job {job_hash(cfg)} continues in its run {earlier.info.run_id}."
        client.log_batch(launcher_id, tags=[RunTag("tracktron.job_run_id", earlier.info.run_id),
                                            RunTag("mlflow.note.content", note)])
        return earlier, exp_id, note
    exp_id = _experiment(client, experiment_name(cfg))
    return (_newest_job_run(client, exp_id, cfg) if resume else None), exp_id, None


def _experiment(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp:
        return exp.experiment_id
    # The UI groups experiments by kind: these are model-training ones.
    return client.create_experiment(name, tags={"mlflow.experimentKind": "custom_model_development"})


def _get_run(client, uri: str, run_id: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if e.get_http_status_code() == 404 or "RESOURCE_DOES_NOT_EXIST" in str(e.error_code):
            raise UserError(f"run {run_id} does not exist on {uri}") from None
        raise


def _newest_job_run(client, exp_id: str, cfg: Config):
    runs = client.search_runs([exp_id], filter_string=f"tags.`{JOB_TAG}` = '{job_hash(cfg)}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def _last_step(client, run) -> int:
    """The newest step logged: the run's latest `loss` is the one with the highest step (the
    store keeps it), so no need to fetch a history of every iteration of a long job."""
    latest = [m for m in getattr(run.data, "_metric_objs", None) or () if m.key == "loss"]
    if latest:
        return latest[0].step
    history = client.get_metric_history(run.info.run_id, "loss")
    return max((m.step for m in history), default=-1)


def _run_name(cfg: Config) -> str:
    return cfg.TRACKING.RUN_NAME or f"{cfg.NAME}-{time.strftime('%Y%m%d-%H%M%S')}"


def download_verified(client, run_id: str, name: str, folder: str, expected: str | None) -> tuple:
    """(path, None) once checkpoints/<name> is in `folder` and matches its sha256 tag; (None, why) else."""
    try:
        path = Path(client.download_artifacts(run_id, f"checkpoints/{name}", folder))
    except Exception as e:  # noqa: BLE001 - a missing or unreadable artifact: try an older one
        return None, f"could not download checkpoint {name}: {first_line(e)}"
    if sha256_of(path) != expected:
        return None, f"checkpoint {name} from the tracking server does not match its sha256 tag; skipped"
    return str(path), None


def download_optional(client, run_id: str, name: str, folder: str) -> str | None:
    try:
        return client.download_artifacts(run_id, name, folder)
    except Exception:  # noqa: BLE001 - optional files (json_stats.log) may not exist yet
        return None


_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Connection refused", "ConnectionError",
                "NameResolutionError", "timed out", "RemoteDisconnected")


def start_error(uri: str, e: BaseException) -> str:
    text = str(e)
    if isinstance(e, OSError) or any(m in text for m in _UNREACHABLE):
        return (f"cannot reach the tracking server at {uri} (is it running?); "
                "TRACKING.ENABLED false trains without tracking")
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException) and e.get_http_status_code() in (401, 403):
        return f"the tracking server at {uri} refused the credentials (MLFLOW_TRACKING_USERNAME/PASSWORD)"
    return f"tracking server {uri}: {first_line(e)}"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
