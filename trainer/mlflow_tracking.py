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
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from trainer.background import MetricSender, Uploader
from trainer.checkpoint_files import FINAL, download_folder, iteration_of, local_checkpoints
from trainer.config import Config, redact_text
from trainer.errors import UserError
from trainer.mlflow_runs import (LATEST_TAG, MAX_PARAM_LEN, checkpoints_from, download_optional, download_verified,
                                 first_line, open_run, safe_params, sha_tag, start_error, tracking_uri)
from trainer.tracking import RunInfo, Tracker
from trainer.tracking_agent import AgentError, TrackingCalls, retryable

log = logging.getLogger(__name__)

METRICS_INTERVAL_S = 5.0
AGENT_START_S = 120.0  # for the agent to import MLflow before start() makes the calls itself


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
            self._opening.set_exception(UserError(start_error(self.uri, e)))
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
            path, why = None, f"could not download checkpoint {name}: {first_line(e)}"
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
