"""The MLflow implementation of the tracking interface. `start()` finds the job's run on a thread while the caller
imports torch and checks the job, then makes or reopens it; `run` waits for it. Everything after goes through two
threads with MLflow's own client: the MetricSender (a `log_batch` every few seconds, the run's heartbeat with it) and
the Uploader (artifacts, checkpoints and their tags, pruning, the evaluations and the final model, the status)."""
from __future__ import annotations

import importlib
import logging
import threading
import time
from concurrent.futures import Future, wait
from pathlib import Path

from trainer.checkpoint.files import FINAL, download_folder, drop_download_folder, iteration_of
from trainer.config import Config
from trainer.daemon_call import daemon_call
from trainer.errors import UserError, first_line
from trainer.redaction import redact_text
from trainer.tracking.base import RunInfo, Tracker
from trainer.tracking.background import MetricSender, Uploader
from trainer.tracking.checkpoint_uploads import PRUNE_JOB, CheckpointUploads, Destination
from trainer.tracking.checkpoint_models import MODEL_TAG, evaluation_due, link_evaluation, update_best
from trainer.tracking.final_model import fail_unfinished, log_final, register_best, register_logged, registration_due, set_aliases
from trainer.tracking.heartbeat import HEARTBEAT_TAG, beat, check_not_held
from trainer.tracking.prefetch import Prefetch, download_verified
from trainer.tracking.run_description import input_entities, safe_params
from trainer.tracking.job_run import FoundRun, find_run, found_in_new_store, open_run
from trainer.tracking.runs import (STATUS_REASON, bound_http, checkpoints_from, env_experiment_id, logged_steps,
                                   make_client, retryable, run_url, sha_tag, tracking_uri)
from trainer.tracking.server_errors import run_refusal, start_error
from trainer.tracking.sqlite_store import first_use_guard, not_made_yet
from trainer.tracking.tables import log_table
from trainer.tracking.first_upload import send_first
from trainer.tracking.transfers import download, run_repository, upload as upload_file
from trainer.tracking.unsent import UnsentMetrics

log = logging.getLogger(__name__)

METRICS_INTERVAL_S = 5.0  # one log_batch every few seconds: the UI lags that much, the server idles
STATUS_JOB = "set the run's status"
STATUS_RESERVE_S = 1.0  # of finish()'s time, kept for the status when the queue ahead of it is slow
STATUS_FLOOR_S = 5.0  # the status's own request, even at a FLUSH_TIMEOUT_S of 0 (a signal's grace is its own)


class MlflowTracker(Tracker):
    def __init__(self, cfg: Config, world_size: int = 1):
        bound_http()  # MLflow's own retries could block for minutes; ours run in the background instead
        self.uri, self.world_size, self.flush_timeout = tracking_uri(cfg), world_size, cfg.TRACKING.FLUSH_TIMEOUT_S
        self.client = None  # MLflow's client, made by start() (MLflow is imported there)
        self._tags: dict[str, str] = {}
        self._run = RunInfo()
        self._opening: Future | None = None  # the run, made or reopened
        self._found: Future | None = None  # the lookup before it
        self._checked = threading.Event()  # the job's checks passed: the run may be written
        self._abandoned = threading.Event()  # the job ended before they did
        self._store_refuses = False  # the run's first upload was refused: no later one is tried
        self._status_set = False  # finish() has recorded the run's end
        self._prefetched: Prefetch | None = None  # the newest checkpoint, downloading since the lookup
        self._sender: MetricSender | None = None
        self._unsent: UnsentMetrics | None = None  # OUTPUT_DIR's metrics that an earlier start could not send
        self._uploader = Uploader(retryable)
        self._checkpoints = CheckpointUploads(self._uploader, cfg.TRACKING.CHECKPOINTS_KEEP, Destination(
            client=lambda: self.client, run_id=lambda: self._run.run_id, artifacts=self._artifacts,
            experiment_id=self._experiment_id, metrics_sent=lambda step, timeout: self._sender.wait_sent(step, timeout)))
        self._attached = False
        self._best_metric, self._best = cfg.TEST.BEST_METRIC, None  # the run's best checkpoint model so far (update_best)
        self._output_dir = Path(cfg.OUTPUT_DIR)
        self._repo = None  # MLflow's artifact repository of the run, made on the uploader thread
        self._refusal: list | None = None  # [refusal()'s answer], once asked

    # ---- start: find or create the job's run ----

    def start(self, cfg: Config, resume_run_id: str | None = None, new_run: bool = False, wait_for_checks: bool = False) -> None:
        if self._opening is None:
            # MLflow's import (a second of Python) before the caller imports torch: the lookup and a
            # resumed job's download start a second sooner, and wait on the network while torch loads.
            importlib.import_module("mlflow")
            self._opening, self._found = Future(), Future()
            if not wait_for_checks:
                self._checked.set()
            threading.Thread(target=self._open, args=(cfg, resume_run_id, new_run), name="tracking-start", daemon=True).start()

    def checks_passed(self) -> None:
        self._checked.set()

    def found_checkpoints(self) -> list[str]:
        return self._found.result().checkpoints if self._found is not None else []

    @property
    def run(self) -> RunInfo:
        """The job's run: waits for start()'s lookup, raises its UserError."""
        if self._opening is not None:
            self._opening.result()
        return self._run

    def attach(self, run_id: str) -> None:
        """Log into an existing run, as it is (no status change, no params)."""
        self.client = make_client(self.uri)
        self._attached = True  # tracktron eval of a checkpoint the run holds
        self._run = RunInfo(run_id)
        self._sender = MetricSender(self._send_metrics, interval=METRICS_INTERVAL_S)

    def _look_up(self, cfg: Config, resume_run_id: str | None, new_run: bool) -> FoundRun:
        """The job's run as the store has it; a SQLite store that does not exist yet is not made here."""
        if not_made_yet(self.uri, resume_run_id, env_experiment_id(cfg)):
            return found_in_new_store(cfg, self.uri)
        with first_use_guard(self.uri):  # a new SQLite store gets its tables from one job only
            self.client = make_client(self.uri)
            return find_run(self.client, self.uri, cfg, resume_run_id, new_run)

    def _open(self, cfg: Config, resume_run_id: str | None, new_run: bool) -> None:
        """On a thread: find the run (start a resumed job's download, make sure no other trainer is
        training it); once the job's checks passed, make or reopen it."""
        def failed(e: BaseException) -> None:  # a UserError, or one line for what the client could not do
            error = e if isinstance(e, UserError) else UserError(start_error(self.uri, e))
            if self._run.run_id:  # made, then the job could not go on (no thread to start): not left RUNNING
                self.last_words("FAILED", str(error))
            for future in (self._found, self._opening):
                if not future.done():
                    future.set_exception(error)

        try:
            found = self._look_up(cfg, resume_run_id, new_run)
            if found.resumes:  # reading only, into a hidden folder: it overlaps the checks
                try:
                    self._prefetched = Prefetch.newest(self.uri, found.run, Path(cfg.OUTPUT_DIR))
                except Exception as e:  # no loss: the resume downloads what it needs itself
                    log.warning("could not start the checkpoint's download early: %s", first_line(e))
            if found.run is not None:  # may watch the run for a while, as the job is checked
                check_not_held(self.client, found.run, stop=self._abandoned)
            self._found.set_result(found)
        except BaseException as e:
            return failed(e)
        self._checked.wait()
        try:
            if self._abandoned.is_set():
                raise UserError("the job stopped before its run was made")
            with first_use_guard(self.uri):
                self.client = make_client(self.uri)
                opened = open_run(self.client, self.uri, cfg, self.world_size, found)
            run_id = opened.run.info.run_id
            self._tags = dict(opened.run.data.tags)
            self._run = RunInfo(run_id, run_url(self.uri, opened.experiment_id, run_id), opened.resumed,
                                checkpoints_from(self._tags), opened.experiment_id, MODEL_TAG in self._tags,
                                opened.last_step)
            self._sender = MetricSender(self._send_metrics, interval=METRICS_INTERVAL_S, beat=True)
            self._unsent = UnsentMetrics(self._output_dir, run_id, cfg.SOLVER.MAX_ITER - 1)
            self._unsent.resend(self._sender, self._run, logged_steps(opened.run))  # before anything else
            self._log_params(cfg, set(opened.run.data.params))
        except BaseException as e:
            return failed(e)
        if opened.note:
            log.info("%s", opened.note)
        self._opening.set_result(None)

    def _log_params(self, cfg: Config, logged: set) -> None:
        from mlflow.entities import Param  # a param cannot change: a restart keeps the run's first values

        items = [Param(k, v) for k, v in safe_params(cfg).items() if k not in logged]
        for i in range(0, len(items), 100):
            self._uploader.submit("params", lambda c=items[i:i + 100]: self.client.log_batch(self._run.run_id, params=c))

    # ---- resume ----

    def fetch_checkpoint(self, name: str, dest_dir: Path) -> Path | None:
        """Downloaded into a hidden folder first (or taken from the prefetch), so that nobody looking for
        local checkpoints meanwhile takes a partial one."""
        prefetch, self._prefetched = self._prefetched, None
        expected = self._tags.get(sha_tag(name))  # as the run was opened: the job's tags are ours alone
        if prefetch is not None and (prefetch.name, prefetch.expected) == (name, expected):
            folder, path = prefetch.folder, prefetch.result()
        else:
            if prefetch is not None:
                prefetch.drop()
            folder = download_folder(dest_dir)
            path, why = download_verified(self._artifacts(), name, folder, expected)
            if why:  # an older checkpoint is tried next
                log.warning("%s", why)
        try:
            return path.replace(dest_dir / name) if path else None
        finally:
            drop_download_folder(folder)

    def fetch_artifact(self, name: str, dest_dir: Path) -> Path | None:
        """dest_dir/name from the run; None when the run has none (yet). Downloaded into a hidden folder
        first, so that a download cut short leaves no partial file for the job to append to and send
        back. Raises when the run's cannot be had: a folder of that name (`mlflow artifacts log-artifacts`,
        which MLflow would download whole into OUTPUT_DIR), a download that failed."""
        repo = self._artifacts()
        listed = next((info for info in repo.list_artifacts() if info.path == name), None)
        if listed is None:
            return None
        if listed.is_dir:
            raise ValueError(f"the run's {name} is a folder, not a file tracktron wrote")
        folder = download_folder(dest_dir)
        try:
            path, _ = download(repo, name, folder, size=listed.file_size)
            return path.replace(dest_dir / name)
        finally:
            drop_download_folder(folder)

    # ---- during training: all queued ----

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        self._uploader.submit("tags", lambda: self.client.log_batch(self.run.run_id, tags=items))

    def log_metrics(self, metrics: dict, step: int) -> None:
        if self._sender is None:  # called before the run was asked for: the lookup makes the sender
            self.run
        if step > self._run.last_step:  # steps an earlier process of this run logged are not sent twice
            self._sender.put(metrics, step)

    def _send_metrics(self, points: list) -> None:
        from mlflow.entities import Metric, RunTag

        metrics = [Metric(k, v, ts, step) for k, v, ts, step in points]  # (key, value, ms, step) each
        tags = [] if self._attached else [RunTag(HEARTBEAT_TAG, beat())]  # eval in a run is not its trainer
        self.client.log_batch(self._run.run_id, metrics=metrics, tags=tags, synchronous=True)

    def log_artifact(self, path: Path, artifact_path: str | None = None, first: bool = False) -> None:
        def send():
            upload_file(self._artifacts(), path, artifact_path or "")
        if self._store_refuses:  # the job stops on it (said): the end's log.txt would be retried to the deadline
            return
        try:
            job = send_first(send, lambda: self._repo.artifact_uri) if first else send  # None: sent
        except UserError:  # refused twice: no credentials, no such bucket
            self._store_refuses = True
            raise
        if job:
            self._uploader.submit(f"upload {path.name}", job)

    def log_checkpoint(self, path: Path, sha256: str) -> None:
        if self._unsent:  # the server down: what it lacks of this checkpoint's iterations, kept beside it
            self._unsent.spill(self._sender, iteration_of(path.name), path.name)
        self._checkpoints.submit(path, sha256)

    def uploading(self) -> set[str]:
        return self._checkpoints.uploading()

    def _artifacts(self):
        self._repo = self._repo or run_repository(self.client, self.uri, self._run.run_id)
        return self._repo

    def log_image(self, image, key: str, step: int) -> None:
        self._uploader.submit(f"image {key}", lambda: self.client.log_image(self.run.run_id, image, key=key, step=step))

    def log_table(self, table: dict, artifact_file: str) -> None:
        self._uploader.submit(f"table {artifact_file}", lambda: log_table(self.client, self.run.run_id, table, artifact_file))

    def log_inputs(self, datasets: list[dict], parent: dict) -> None:
        inputs, models, tags = input_entities(datasets, parent)

        def log():
            self.client.log_inputs(self._run.run_id, datasets=inputs, models=models)
            if tags:
                self.client.log_batch(self._run.run_id, tags=tags)

        self._uploader.submit("log the inputs", log)

    def log_evaluation(self, metrics: dict, step: int, checkpoint: str) -> None:
        self._checkpoints.evaluated.add(checkpoint)
        final, linked = checkpoint == FINAL, []  # model_final's: evaluated again by the job's next start, into its model

        def link():
            on_server = (checkpoint in self._checkpoints.uploaded or self._attached
                         or checkpoint in self._run.checkpoints)  # a rerun's
            if not on_server:  # its upload failed: no model to link
                log.warning("%s is not on the server: its evaluation is %s", checkpoint,
                            "left to the job's next start" if final else "logged without a model")
                return unlinked()
            experiment_id = self._experiment_id()
            linked.append(link_evaluation(self.client, experiment_id, self._run.run_id, checkpoint, metrics, step))
            self._best = update_best(self.client, experiment_id, self._run.run_id, self._best_metric) or self._best

        def unlinked():  # also when the link is given up on (an outage to the end): kept for the job's next start
            return None if final or linked else linked.append(self._sender.put_late(metrics, step))

        self._uploader.submit(f"log the evaluation of {checkpoint}", link, dropped=unlinked)

    def evaluation_due(self, checkpoint: str, datasets: list[dict]) -> bool:
        return evaluation_due(self.client, self._experiment_id(), self.client.get_run(self.run.run_id), checkpoint, datasets)

    def _experiment_id(self) -> str:
        if self._run.experiment_id is None:
            self._run.experiment_id = self.client.get_run(self._run.run_id).info.experiment_id
        return self._run.experiment_id

    def log_model(self, folder: Path, cfg: Config) -> None:
        """Three queued steps, each retried alone: the model (registered), the best checkpoint registered
        and @final and @best set together, then the run's MODEL_TAG, which says that both are done."""
        registered = cfg.TRACKING.REGISTERED_MODEL
        final, aliased = None, not registered  # log_final's FinalModel; @final and @best set (or not asked for)

        def log():
            nonlocal final
            final = log_final(self.uri, self.client, self._experiment_id(), self._run.run_id, folder, registered)

        def best():
            nonlocal aliased
            if final is not None:
                set_aliases(self.client, registered, final.version, self._register_best(registered, final.version))
                aliased = True

        def mark_logged():  # not when a step failed: a rerun of the job then does it again
            if final is not None and aliased:
                self.client.set_tag(self._run.run_id, MODEL_TAG, final.model_id)

        self._uploader.submit("log the final model", log)
        if registered:
            self._uploader.submit("register the best checkpoint", best)
        self._uploader.submit("tag the logged model", mark_logged)

    def registration_due(self, registered: str) -> list[str]:
        return registration_due(self.client, self.run.run_id, registered)

    def register_model(self, registered: str, aliases: list[str]) -> None:
        def register():  # the run's logged model is its MODEL_TAG
            fail_unfinished(self.client, self._experiment_id(), self._run.run_id)  # a registration cut short
            version = register_logged(self.uri, self.client, self._run.run_id, self._tags[MODEL_TAG], registered)
            best = self._register_best(registered, version) if "best" in aliases else None
            set_aliases(self.client, registered, version if "final" in aliases else None, best)

        self._uploader.submit(f"register the model as {registered}", register)

    def _register_best(self, registered: str, final_version: str) -> str:
        return register_best(self.uri, self.client, self._experiment_id(), self._run.run_id, self._best,
                             self._best_metric, self._output_dir, registered, final_version)

    def wait(self, timeout: float) -> bool:
        return self._uploader.wait(timeout)

    def finish(self, status: str | None, reason: str = "", timeout: float | None = None) -> list[str]:
        if not self._checked.is_set():  # the job ended before its checks passed: no run was made
            self._abandoned.set()
            self._checked.set()
        try:
            run_id = self.run.run_id
        except UserError:  # start() failed: there is no run to finish
            run_id = None
        if self._prefetched is not None:  # never asked for (a local checkpoint was newer, or the job stopped)
            self._prefetched.drop()
            self._prefetched = None
        if run_id is None:
            self._uploader.close(0)
            return []
        floor = STATUS_FLOOR_S if timeout is None else 0.0
        timeout = self.flush_timeout if timeout is None else timeout
        deadline = self._wait_for_metrics(time.monotonic() + timeout)
        if status is not None:
            self._uploader.submit(STATUS_JOB, lambda: self._set_status(status, reason))
        self._uploader.close(max(1.0, deadline - time.monotonic() - STATUS_RESERVE_S))
        if status is not None and not self._status_set:  # queued behind uploads that ran out of time: one direct try
            wait([daemon_call(lambda: self.last_words(status, reason), "run-status")], max(floor, deadline - time.monotonic()))
        self._sender.close(max(0.0, deadline - time.monotonic()))  # and the evaluations' late scores
        kept = self._unsent.keep(self._sender.leftover()) if self._unsent else []  # after the uploader's evaluations
        done = {PRUNE_JOB, STATUS_JOB} if self._status_set else {PRUNE_JOB}  # pruning failed costs disk space only
        lost = self._checkpoints.lost([d for d in self._uploader.failed if d not in done])
        lost = [f"{d} ({self._uploader.why[d]})" if d in self._uploader.why else d for d in lost]  # a rerun alone won't mend it
        return list(dict.fromkeys(lost + kept))

    def _wait_for_metrics(self, deadline: float) -> float:
        """The metrics first (the sender beats on meanwhile); the deadline left for the rest. A send that
        fails, now or during the wait (the job's last one may come after its last iteration), has the
        server asked why: the run deleted, or the credentials refused, and no wait sends a thing."""
        while not self._sender.wait_sent(float("inf"), min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            if self._sender.failing and self.refusal(min(max(0.0, deadline - time.monotonic()), 5.0)):
                return time.monotonic()
        return deadline

    def refusal(self, timeout: float = 5.0) -> tuple[str, str] | None:
        """Why the server refuses the run's writes (server_errors.run_refusal), asked once: finish() and
        the job's last line (resend_advice) share the answer."""
        if self._refusal is None:
            self._refusal = [run_refusal(self.client, self._run.run_id, timeout)]
        return self._refusal[0]

    def _set_status(self, status: str, reason: str) -> None:
        from mlflow.entities import RunTag

        if reason:
            self.client.log_batch(self._run.run_id, tags=[RunTag(STATUS_REASON, redact_text(reason)[:5000])])
        self.client.set_terminated(self._run.run_id, status)
        self._status_set = True

    def last_words(self, status: str, reason: str) -> None:
        try:
            if self._run.run_id and not self._status_set:
                self._set_status(status, reason)
        except Exception as e:  # the server is down: the status stays as it was
            log.warning("tracking: could not set the run's status: %s", first_line(e, 300))
