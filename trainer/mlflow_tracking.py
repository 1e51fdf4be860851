"""The MLflow implementation of the tracking interface (DESIGN.md's tracking contract).

The MLflow calls are made by the tracking agent process (tracking_agent.py), or by this process
when there is none. `begin()` starts the agent and has it find or create the job's run (then
download a resumed job's newest checkpoint) while the caller imports torch; `start()` waits for the
run, which training needs. Everything after goes through the background MetricSender and Uploader.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from trainer.background import MetricSender, Uploader
from trainer.checkpoint_files import FINAL, download_folder, iteration_of, local_checkpoints, sha256_of
from trainer.config import Config, flatten, job_hash, redact_text, redacted
from trainer.errors import UserError
from trainer.tracking import RunInfo, Tracker
from trainer.tracking_agent import AgentError, TrackingCalls, retryable

log = logging.getLogger(__name__)

DEFAULT_URI = "sqlite:///mlflow.db"
JOB_TAG = "tracktron.job"
LATEST_TAG = "tracktron.ckpt.latest"
MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
METRICS_INTERVAL_S = 5.0
AGENT_START_S = 120.0  # for the agent to import MLflow before start() makes the calls itself


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
        raise UserError(_start_error(uri, e)) from None
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
        return None, f"could not download checkpoint {name}: {_first_line(e)}"
    if sha256_of(path) != expected:
        return None, f"checkpoint {name} from the tracking server does not match its sha256 tag; skipped"
    return str(path), None


def download_optional(client, run_id: str, name: str, folder: str) -> str | None:
    try:
        return client.download_artifacts(run_id, name, folder)
    except Exception:  # noqa: BLE001 - optional files (json_stats.log) may not exist yet
        return None


class MlflowTracker(Tracker):
    def __init__(self, cfg: Config, world_size: int = 1):
        # MLflow's own HTTP retries can block for minutes; ours run in the background instead.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        self.uri = tracking_uri(cfg)
        self.world_size = world_size
        self.flush_timeout = cfg.TRACKING.FLUSH_TIMEOUT_S
        self._skip_until = -1  # steps already logged by an earlier process of this run
        self._tags: dict[str, str] = {}
        self._opening: Future | None = None  # begin()'s lookup of the run
        self._prefetched: tuple[str, Path, Future] | None = None  # a download that begin() started
        self._sender: MetricSender | None = None
        self._uploader = Uploader(retryable)
        self._calls = TrackingCalls(self.uri)  # in the tracking agent, or here
        self.run = RunInfo()

    @property
    def client(self):
        """An MlflowClient of this process (MLflow imported on first use)."""
        return self._calls.local

    # ---- start: find or create the job's run ----

    def begin(self, cfg: Config, resume_run_id: str | None = None, new_run: bool = False) -> None:
        if self._opening is not None:
            return
        self._calls.start_agent()
        self._opening = Future()
        threading.Thread(target=self._open, args=(cfg, resume_run_id, new_run), name="tracking-start",
                         daemon=True).start()

    def start(self, cfg: Config, resume_run_id: str | None = None, new_run: bool = False) -> RunInfo:
        self.begin(cfg, resume_run_id, new_run)
        try:
            found = self._opening.result()
        except BaseException:
            self._calls.close(timeout=0)
            raise
        if found["note"]:
            log.info("%s", found["note"])
        self._skip_until = found["last_step"]
        # One log_batch every few seconds: the UI lags that much, the server does a fraction of the
        # work (its CPU per request hardly grows with the points in it; bench/RESULTS.md).
        self._sender = MetricSender(self._send_metrics, interval=METRICS_INTERVAL_S)
        self._log_params(cfg, found["params"])
        return self.run

    def _open(self, cfg: Config, resume_run_id: str | None, new_run: bool) -> None:
        """On a thread: the run, then (for a resumed job) the download the resume will want."""
        try:
            found = self._calls.run(open_run, self.uri, cfg, self.world_size, resume_run_id, new_run,
                                    wait=AGENT_START_S)
        except UserError as e:  # raised here (no agent)
            self._opening.set_exception(e)
            return
        except AgentError as e:  # open_run's UserError, raised in the agent
            self._opening.set_exception(UserError(str(e)))
            return
        except BaseException as e:  # noqa: BLE001 - a client this process cannot make, say
            self._opening.set_exception(UserError(_start_error(self.uri, e)))
            return
        run_id, self._tags = found["run_id"], found["tags"]
        self.run = RunInfo(run_id, self._ui_url(found["experiment_id"], run_id), found["resumed"],
                           checkpoints_from(self._tags))
        download = self._prefetch_newest(Path(cfg.OUTPUT_DIR)) if found["resumed"] else None
        self._opening.set_result(found)
        if download:
            download()

    def _ui_url(self, exp_id: str, run_id: str) -> str | None:
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
        return None

    def _log_params(self, cfg: Config, logged: set) -> None:
        # A param cannot change value within a run: a restart on another machine (other paths)
        # keeps the values the run started with.
        items = [(k, v) for k, v in safe_params(cfg).items() if k not in logged]
        for i in range(0, len(items), 100):
            chunk = items[i:i + 100]
            self._submit("params", lambda c=chunk: self._calls.log_batch(self.run.run_id, params=c))

    # ---- resume ----

    def _prefetch_newest(self, output_dir: Path):
        """The download that the resume will want (the run's newest checkpoint, when it is newer
        than every local one), to run at once so that it overlaps torch's import and the build."""
        local = local_checkpoints(output_dir)
        newest_local = iteration_of(local[0].name) if local else -1
        name = self.run.checkpoints[0] if self.run.checkpoints else FINAL
        if name == FINAL or iteration_of(name) <= newest_local:
            return None
        folder, future = download_folder(output_dir), Future()

        def download():
            try:
                future.set_result(self._download_verified(name, folder))
            except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the result
                future.set_exception(e)

        self._prefetched = name, folder, future
        return download

    def fetch_checkpoint(self, name: str, dest_dir: Path) -> Path | None:
        """dest_dir/name once its bytes match the sha256 tag. It is downloaded into a hidden folder
        first, so that nobody looking for local checkpoints meanwhile takes a partial one."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == name:
            _, folder, future = prefetched
            path = future.result()
        else:
            self._discard(prefetched)
            folder = download_folder(dest_dir)
            path = self._download_verified(name, folder)
        try:
            return path.replace(dest_dir / name) if path else None
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _discard(prefetched) -> None:
        if prefetched is not None:  # its download, if still going, fails without its folder
            shutil.rmtree(prefetched[1], ignore_errors=True)

    def _download_verified(self, name: str, folder: Path) -> Path | None:
        expected = self._tags.get(sha_tag(name))  # as start() read them: the job's tags are ours alone
        try:
            path, why = self._calls.run(download_verified, self.run.run_id, name, str(folder), expected)
        except Exception as e:  # noqa: BLE001 - the agent could not answer: try an older one
            path, why = None, f"could not download checkpoint {name}: {_first_line(e)}"
        if why:
            log.warning("%s", why)
        return Path(path) if path else None

    def fetch_artifact(self, name: str, dest_dir: Path) -> Path | None:
        try:
            path = self._calls.run(download_optional, self.run.run_id, name, str(dest_dir))
        except Exception:  # noqa: BLE001 - optional files (json_stats.log) may not exist yet
            return None
        return Path(path) if path else None


    # ---- during training: all queued ----

    def set_tags(self, tags: dict) -> None:
        items = [(k, str(v)) for k, v in tags.items()]
        self._submit("tags", lambda: self._calls.log_batch(self.run.run_id, tags=items))

    def log_params(self, params: dict) -> None:
        items = [(k, str(v)[:MAX_PARAM_LEN]) for k, v in params.items()]
        self._submit("params", lambda: self._calls.log_batch(self.run.run_id, params=items))

    def log_metrics(self, metrics: dict, step: int) -> None:
        if step > self._skip_until:
            self._sender.put(metrics, step)

    def _send_metrics(self, points: list) -> None:
        self._calls.log_batch(self.run.run_id, metrics=points)  # (key, value, timestamp, step) each

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._submit(f"upload {path.name}", lambda: self._calls.log_artifact(self.run.run_id, str(path), artifact_path))

    def log_checkpoint(self, path: Path, sha256: str, on_done=None) -> None:
        def upload():
            self._calls.log_artifact(self.run.run_id, str(path), "checkpoints")
            # Complete means resumable without a hole: the metrics of every iteration it holds
            # are on the server too, or a job killed now would resume past unsent points.
            if not self._sender.wait_sent(iteration_of(path.name), timeout=60.0):
                raise TimeoutError(f"metrics up to {path.name} not delivered yet")
            # The tags say "complete": set only after the bytes are on the artifact store.
            self._calls.log_batch(self.run.run_id, tags=[(sha_tag(path.name), sha256), (LATEST_TAG, path.name)])
            if on_done:
                on_done()

        self._submit(f"upload checkpoint {path.name}", upload)

    def log_model(self, model, cfg: Config) -> None:
        import torch
        import torchvision

        def log():
            import mlflow  # here: the pickled model goes from this process

            mlflow.set_tracking_uri(self.uri)
            with mlflow.start_run(run_id=self.run.run_id):
                mlflow.pytorch.log_model(
                    model, name="model", serialization_format="pickle",
                    registered_model_name=cfg.TRACKING.REGISTERED_MODEL or None,
                    pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                      f"torchvision=={torchvision.__version__.split('+')[0]}"])

        self._submit("log the final model", log)

    def wait(self, timeout: float) -> bool:
        return self._uploader.wait(timeout)

    @property
    def agent_pid(self) -> int | None:
        """The tracking agent's pid (started by begin()), None when there is none."""
        return self._calls.agent_pid

    def in_agent(self, timeout: float = 0.0) -> bool:
        """Whether the calls go to the tracking agent (waiting up to `timeout` s for it to be ready)."""
        return self._calls.in_agent(timeout)

    def finish(self, status: str, reason: str = "", timeout: float | None = None) -> list[str]:
        self._discard(self._prefetched)  # never asked for: a local checkpoint was newer
        self._prefetched = None
        if self.run.run_id is None:
            self._uploader.close(0)
            self._calls.close()
            return []
        timeout = self.flush_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._sender:
            self._sender.close(timeout)
        tags = [("tracktron.status_reason", redact_text(reason)[:5000])] if reason else []
        self._submit("set the run's status", lambda: (
            tags and self._calls.log_batch(self.run.run_id, tags=tags),
            self._calls.set_terminated(self.run.run_id, status)))
        self._uploader.close(max(1.0, deadline - time.monotonic()))
        self._calls.close(timeout=min(2.0, max(0.0, deadline - time.monotonic())))
        return list(self._uploader.failed)

    def _submit(self, description: str, job) -> None:
        self._uploader.submit(description, job)


_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Connection refused", "ConnectionError",
                "NameResolutionError", "timed out", "RemoteDisconnected")


def _start_error(uri: str, e: BaseException) -> str:
    text = str(e)
    if isinstance(e, OSError) or any(m in text for m in _UNREACHABLE):
        return (f"cannot reach the tracking server at {uri} (is it running?); "
                "TRACKING.ENABLED false trains without tracking")
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException) and e.get_http_status_code() in (401, 403):
        return f"the tracking server at {uri} refused the credentials (MLFLOW_TRACKING_USERNAME/PASSWORD)"
    return f"tracking server {uri}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__

