"""The job's MLflow run: where it is tracked, finding or creating it (the resume rules of the
tracking contract), the checkpoint-tag protocol, and fetching what a run holds. Functions of an
MlflowClient, used by the tracker and by `tracktron status` and `tracktron eval`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from trainer.checkpoint.files import FINAL, iteration_of
from trainer.config import Config, job_hash
from trainer.errors import UserError, first_line
from trainer.redaction import redact_text, redact_urls, remember, remember_basic_auth
from trainer.tracking.heartbeat import HEARTBEAT_TAG, beat, claim_run, last_seen, taken
from trainer.tracking.run_description import describe_job, git_commit
from trainer.tracking.sqlite_store import check_store, not_made_yet, sqlite_path, store_settled

DEFAULT_URI = "sqlite:///mlflow.db"
JOB_TAG = "tracktron.job"
LATEST_TAG = "tracktron.ckpt.latest"


STATUS_REASON = "tracktron.status_reason"  # why a run ended FAILED or KILLED


def sha_tag(name: str) -> str:
    return f"tracktron.ckpt.{name}.sha256"


_HTTP_KEYS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")
_SET_BY_USER = {k for k in _HTTP_KEYS if k in os.environ}


# MLflow's ranged download (files past MLFLOW_MULTIPART_DOWNLOAD_MINIMUM_FILE_SIZE; smaller ones
# stream through the server: transfers.download) holds each chunk whole in memory, on up to 20
# threads: 100 MB chunks by default. Ours: 8 MB, boto3's own part size.
DOWNLOAD_CHUNK = 8 * 1024**2


def bound_http(timeout: int = 30, retries: int = 2) -> None:
    """MLflow's own HTTP retries can block for minutes: bounded, unless the user set them. Large
    transfers set their own timeouts by size (transfers.py)."""
    for key, value in zip(_HTTP_KEYS, (timeout, retries)):
        if key not in _SET_BY_USER:
            os.environ[key] = str(value)
    os.environ.setdefault("MLFLOW_MULTIPART_DOWNLOAD_CHUNK_SIZE", str(DOWNLOAD_CHUNK))


def tracking_uri(cfg: Config | None, uri: str | None = None) -> str:
    """TRACKING.URI (or `uri`), else MLFLOW_TRACKING_URI, else the embedded default; no credentials."""
    given = uri or (cfg.TRACKING.URI if cfg is not None else "")
    chosen = without_credentials(given or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI)
    if chosen.startswith(("http://", "https://")):  # a token in the query: hidden also where a library
        for _, value in parse_qsl(urlsplit(chosen).query):  # prints the path without the scheme (`url: /?t=...`)
            remember(value)
    if chosen.startswith("sqlite:") and (not chosen.startswith("sqlite:///") or not sqlite_path(chosen).name):
        raise UserError(f"tracking URI {redact_text(chosen)} names no database file (sqlite:// alone is in "
                        "memory and keeps nothing past the job); give a file, e.g. sqlite:///mlflow.db")
    return chosen


def without_credentials(uri: str) -> str:
    """`http://user:password@host` -> `http://host`, the user and password moved to MLflow's own
    MLFLOW_TRACKING_USERNAME/PASSWORD (this process and its children). MLflow then sends them as
    basic auth, and no URL that we or MLflow print ("View run at ...") carries them."""
    try:
        parts = urlsplit(uri)
    except ValueError as e:  # `http://[::1` and the like
        raise UserError(f"tracking URI {redact_text(uri)} is not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    remember(unquote(password))
    remember_basic_auth()
    return urlunsplit(parts._replace(netloc=host))


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI, where the tracking URI is a server's."""
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return None


def experiment_name(cfg: Config) -> str:
    # URL credentials only: a name is an identity, never changed by what else this process holds secret
    return redact_urls(cfg.TRACKING.EXPERIMENT or os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.NAME or "tracktron")


def env_experiment_id(cfg: Config) -> str | None:
    """MLFLOW_EXPERIMENT_ID, read as MLflow reads it: only when no experiment is named."""
    if cfg.TRACKING.EXPERIMENT or os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return None
    return os.environ.get("MLFLOW_EXPERIMENT_ID") or None


def checkpoints_of(run) -> list[str]:
    """Complete checkpoints of a run (those whose sha256 tag was set), newest first."""
    return checkpoints_from(run.data.tags)


def checkpoints_from(tags: dict) -> list[str]:
    names = [k[len("tracktron.ckpt."):-len(".sha256")] for k in tags
             if k.startswith("tracktron.ckpt.") and k.endswith(".sha256")]
    return sorted(names, key=iteration_of, reverse=True)


def _start_tags(cfg: Config, world_size: int) -> dict[str, str]:
    tags = {  # torch's versions and the device come with set_tags() once torch is imported
        JOB_TAG: job_hash(cfg),
        "tracktron.config_name": cfg.NAME,
        "tracktron.world_size": str(world_size),
        HEARTBEAT_TAG: beat(),  # the run's trainer from its first write on
    }
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    tags["mlflow.note.content"] = redact_text(describe_job(cfg, world_size))
    return tags


# ---- finding the job's run ----

@dataclass
class OpenedRun:
    run: object  # mlflow.entities.Run, as it was when found or made
    experiment_id: str
    resumed: bool  # an earlier start of this job made it
    last_step: int  # the newest step logged to it (-1: none)
    note: str | None  # for the log: why the job continues in another run than the launcher's


@dataclass
class FoundRun:
    """The job's run as the store has it, found without writing anything."""
    run: object | None  # the run to continue or adopt; None: a new one is made
    experiment: str  # the experiment a new run goes to (made with it if it does not exist)
    experiment_id: str | None
    launcher_note: tuple | None = None  # (launcher's run id, the job's run id, note) for the launcher's run
    auto_resume: bool = False  # the job continues its newest run, if it has one

    @property
    def resumes(self) -> bool:
        """The run is the job's own, from an earlier start: the job continues from its checkpoints."""
        return self.run is not None and JOB_TAG in self.run.data.tags

    @property
    def final(self) -> bool:
        return self.resumes and FINAL in checkpoints_of(self.run)


def find_run(client, uri: str, cfg: Config, resume_run_id: str | None, new_run: bool) -> FoundRun:
    """--resume RUN_ID, else MLFLOW_RUN_ID, else the job's newest run: read, nothing written."""
    try:
        return _find_run(client, uri, cfg, resume_run_id, new_run)
    except UserError:
        raise
    except Exception as e:  # nothing was written yet: say why in one line
        raise UserError(start_error(uri, e)) from None


def open_run(client, uri: str, cfg: Config, world_size: int, found: FoundRun) -> OpenedRun:
    """Make the job's run (and its experiment), adopt the launcher's, or mark the found one RUNNING:
    the first writes, made once the job's checks have passed (UserError, in one line, when the
    server cannot be used, or when another trainer of the job opened its run since the lookup)."""
    from mlflow.entities import RunTag

    try:
        run, note = found.run and client.get_run(found.run.info.run_id), None  # as it is now, after the checks
        if found.resumes:
            run = claim_run(client, found.run, run)  # before anything else is written to it
        if found.launcher_note:  # `mlflow run` made a new run for a job that has one: one job stays one run
            launcher_id, job_run_id, note = found.launcher_note
            client.log_batch(launcher_id, tags=[RunTag("tracktron.job_run_id", job_run_id),
                                                RunTag("mlflow.note.content", note)])
        exp_id = found.experiment_id or _experiment(client, found.experiment)
        resumed = run is not None and JOB_TAG in run.data.tags
        last_step = -1
        if run is None:
            run = client.create_run(exp_id, tags=_start_tags(cfg, world_size), run_name=_run_name(cfg))
            if found.auto_resume:
                _first_of_its_job(client, exp_id, cfg, run)
        elif not resumed:  # a run made for us (`mlflow run`, or --resume of a bare run): adopt it
            tags = _start_tags(cfg, world_size)
            client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            run = client.get_run(run.info.run_id)
        else:
            if FINAL not in checkpoints_of(run):  # a finished job stays FINISHED
                client.update_run(run.info.run_id, status="RUNNING")
            if STATUS_REASON in run.data.tags:  # why an earlier start stopped is not why this one will
                client.delete_tag(run.info.run_id, STATUS_REASON)
            last_step = last_step_of(run)
    except UserError:
        raise
    except Exception as e:  # say why in one line
        raise UserError(start_error(uri, e)) from None
    return OpenedRun(run, exp_id, resumed, last_step, note)


def _find_run(client, uri: str, cfg: Config, resume_run_id: str | None, new_run: bool) -> FoundRun:
    if resume_run_id:
        run = _resumable_run(client, uri, cfg, resume_run_id)
        return FoundRun(run, "", run.info.experiment_id)
    resume = cfg.TRAIN.AUTO_RESUME and not new_run
    if launcher_id := os.environ.get("MLFLOW_RUN_ID"):
        launcher = _get(client.get_run, uri, "MLFLOW_RUN_ID", launcher_id)
        _check_ours(launcher, cfg, "MLFLOW_RUN_ID", "continue it with its own config, or unset MLFLOW_RUN_ID to start "
                                                    "this job's run")
        exp_id = launcher.info.experiment_id
        if JOB_TAG in launcher.data.tags or not resume:
            return FoundRun(launcher, "", exp_id)
        earlier = _newest_job_run(client, exp_id, cfg)
        if earlier is None:
            return FoundRun(launcher, "", exp_id)
        note = f"Launcher only: job {job_hash(cfg)} continues in its run {earlier.info.run_id}."
        return FoundRun(earlier, "", exp_id, (launcher_id, earlier.info.run_id, note))
    if given_id := env_experiment_id(cfg):
        exp = _get(client.get_experiment, uri, "MLFLOW_EXPERIMENT_ID", given_id, missing=(400, 404))  # 400: no such id at all
    else:
        exp = client.get_experiment_by_name(experiment_name(cfg))
        exp = exp and _active(exp, uri)
    name, exp_id = (exp.name, exp.experiment_id) if exp is not None else (experiment_name(cfg), None)
    return FoundRun(_newest_job_run(client, exp_id, cfg) if resume and exp_id else None, name, exp_id,
                    auto_resume=resume)


def _resumable_run(client, uri: str, cfg: Config, run_id: str):
    """--resume RUN_ID's run, when it is this job's (or a bare run made for it)."""
    run = _get(client.get_run, uri, "run", run_id)
    _check_ours(run, cfg, "run", "resume it with its own config, or drop --resume to start this job's run")
    return run


def _check_ours(run, cfg: Config, named: str, instead: str) -> None:
    """Never train into (or finish) another job's run: a run of a job is its job's, or a bare one."""
    theirs, ours = run.data.tags.get(JOB_TAG), job_hash(cfg)
    if theirs is not None and theirs != ours:
        raise UserError(f"{named} {run.info.run_id} is another job's (job {theirs}; this config is job {ours}): {instead}")


def find_job_run(cfg: Config, uri: str, resume_run_id: str | None, new_run: bool) -> str:
    """What the job's start would do with its run, found without writing anything (--dry-run)."""
    from mlflow import MlflowClient

    name = experiment_name(cfg)
    if not_made_yet(uri, resume_run_id, env_experiment_id(cfg)):
        return f"a new store, experiment {name}, a new run"
    if uri.startswith("sqlite:///"):
        check_store(uri)
    bound_http(timeout=10, retries=1)  # a read-only look: give up soon
    try:
        client = MlflowClient(uri)
    except Exception as e:  # a URI MLflow has no store for: as the job's start would say
        raise UserError(start_error(uri, e)) from None
    found = find_run(client, uri, cfg, resume_run_id, new_run)
    run = found.run
    if run is None:
        return f"experiment {found.experiment}{'' if found.experiment_id else ' (new)'}, a new run"
    if JOB_TAG not in run.data.tags:
        return f"adopts run {run.info.run_id}, which its launcher made"
    done = checkpoints_of(run)
    if FINAL in done:
        return f"run {run.info.run_id} has model_final: nothing to do"
    return (f"continues run {run.info.run_id} ({run.info.status}{last_seen(run)}) from "
            f"{done[0] if done else 'its start'}")


def _experiment(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp:
        return exp.experiment_id
    try:  # the UI groups experiments by kind: these are model-training ones
        return client.create_experiment(name, tags={"mlflow.experimentKind": "custom_model_development"})
    except MlflowException as e:  # another job made it meanwhile
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code) or not (exp := client.get_experiment_by_name(name)):
            raise
        return exp.experiment_id


def _get(get, uri: str, named: str, key: str, missing: tuple = (404,)):
    """client.get_run or get_experiment; one that does not exist is said in one line."""
    from mlflow.exceptions import MlflowException

    try:
        return _active(get(key), uri)
    except MlflowException as e:
        if e.get_http_status_code() in missing or "RESOURCE_DOES_NOT_EXIST" in str(e.error_code):
            raise UserError(f"{named} {key} does not exist on {uri}") from None
        raise


def _active(found, uri: str):
    """A deleted run or experiment takes no writes: said now, in one line, not after the job's checks."""
    run = hasattr(found, "info")
    if (found.info if run else found).lifecycle_stage != "deleted":
        return found
    kind, key = ("run", found.info.run_id) if run else ("experiment", found.experiment_id)
    raise UserError(f"{kind} {key} on {uri} is deleted: restore it (`mlflow {kind}s restore --{kind}-id {key}`) "
                    f"or name another {kind}")


def _first_of_its_job(client, exp_id: str, cfg: Config, run) -> None:
    """Two trainers of a new job that both found no run made one each: the first made keeps the job,
    the other deletes its own (still empty) and stops."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`{JOB_TAG}` = '{job_hash(cfg)}'", max_results=20)
    first = min([*runs, run], key=lambda r: (r.info.start_time, r.info.run_id))
    if first.info.run_id != run.info.run_id:
        client.delete_run(run.info.run_id)
        raise taken(first)


def _newest_job_run(client, exp_id: str, cfg: Config):
    runs = client.search_runs([exp_id], filter_string=f"tags.`{JOB_TAG}` = '{job_hash(cfg)}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def last_step_of(run, key: str = "loss") -> int:
    """The newest step of `key` logged to the run, -1 if none. The store keeps each key's latest
    point (the one with the highest step) with the run, and RunData's proto carries its step, so a
    long job's history of every iteration is never fetched."""
    return max((m.step for m in run.data.to_proto().metrics if m.key == key), default=-1)


def _run_name(cfg: Config) -> str:
    return redact_urls(cfg.TRACKING.RUN_NAME or f"{cfg.NAME}-{time.strftime('%Y%m%d-%H%M%S')}")


# ---- fetching what a run holds ----

def check_shape(spec: str, option: str) -> None:
    """No `..`, `?`, `#` or empty part: a URI reaches only what it names (not a file beside the run)."""
    rest = spec.split(":/", 1)[1]
    parts = rest.strip("/").split("/")
    if not rest.strip("/") or any(p in ("", ".", "..") for p in parts) or set("?#\\") & set(rest):
        raise UserError(f"{option} {spec}: not a valid MLflow URI (runs:/<run id>/<path>, models:/<name>/<version> "
                        "or models:/<name>@<alias>)")


def download_uri(cfg: Config, uri: str, dest: str, option: str = "--weights") -> Path:
    """A `runs:/...` or `models:/...` artifact, downloaded into `dest` (UserError when it cannot be)."""
    import mlflow

    check_shape(uri, option)
    bound_http()
    where = tracking_uri(cfg)
    mlflow.set_tracking_uri(where)  # models:/ is resolved by the registry, which follows the global URI
    try:
        with store_settled(where):  # a missing or foreign SQLite file is said, never made into a store
            return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dest, tracking_uri=where))
    except UserError as e:
        raise UserError(f"{option} {uri}: {e}") from None
    except Exception as e:  # unknown run, missing artifact, unreachable server: all the user's to fix
        raise UserError(f"cannot fetch {uri} from {where}: {first_line(e)}") from None


def retryable(e: BaseException) -> bool:
    """Retry what a server that is down or overloaded causes; a request it rejects, or a local file
    that is not there, is final."""
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException):
        status = e.get_http_status_code()
        return status >= 500 or status == 429
    final = (TypeError, ValueError, KeyError, AttributeError, FileNotFoundError, IsADirectoryError, PermissionError)
    return not isinstance(e, final)


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
    if isinstance(e, Warning):  # PYTHONWARNINGS=error (or python -W error) made the client's warning an exception
        return (f"tracking store {uri}: a warning raised as an error (PYTHONWARNINGS or python -W): "
                f"{type(e).__name__}: {first_line(e)}")
    if "filesystem tracking backend" in text:  # MLflow 3 refuses new file stores: say what works
        return (f"tracking URI {uri}: MLflow's file store (a folder such as ./mlruns) takes no new runs; "
                "use a database (sqlite:///mlflow.db) or a server (http://host:5000)")
    return f"tracking server {uri}: {first_line(e)}"
