"""Where a job starts (Detectron's AUTO_RESUME): from iteration 0, from the newest checkpoint in
OUTPUT_DIR, or from the newest one of its run on the tracking server, downloaded while the network
is built; or nowhere, when model_final exists."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint.files import FINAL, iteration_of, remove_stale_temps, set_aside
from trainer.checkpoint.state import CheckpointError, load
from trainer.distributed import broadcast_object
from trainer.errors import UserError
from trainer.hashing import sha256_of
from trainer.job import Job
from trainer.preflight import Prepared, check_local, check_restores, check_same_categories, prepare
from trainer.tracking.transfers import file_identity

log = logging.getLogger(__name__)


@dataclass
class StartPoint:
    iteration: int = 0  # the first iteration to run
    state: dict | None = None  # the checkpoint to restore, if any
    source: str = "scratch"
    final: bool = False  # model_final exists: nothing to do
    upload: tuple[Path, str, tuple] | None = None  # a local checkpoint the run lacks: path, sha256, file_identity


@dataclass
class CreatedModel:
    start: StartPoint
    prepared: Prepared | None  # the dataset and the network; None when a finished job's data is gone


def create_model(job: Job) -> CreatedModel:
    """Rank 0 finds where to start on a thread while every rank builds the dataset and the network,
    so that a checkpoint downloaded from the run (a job moved to another machine) arrives during
    the build. Every rank restores the same checkpoint."""
    with ThreadPoolExecutor(1, thread_name_prefix="find-start") as pool:
        finding = pool.submit(find_start_point, job) if job.ctx.is_main else None
        prepared = failed = None
        try:
            prepared = job.prepared or prepare(job.cfg)
        except UserError as e:  # a finished job has nothing to do, whatever became of its dataset
            failed = e
        start = broadcast_object(job.ctx, finding.result() if finding else None)
    if failed is not None and not start.final:
        raise failed
    if start.state is not None:
        log.info("resuming from %s at iteration %d", start.source, start.iteration)
        warn_of_missing_metrics(job.tracker.run, start.iteration)
    if start.upload and job.ctx.is_main:  # once the checks passed: a job that stops here uploads nothing
        path, sha256, hashed = start.upload
        if file_identity(path) != hashed:  # the upload checks the file from here on (transfers.py)
            log.warning("not uploading %s: it changed since its sha256 was taken", path)
        else:
            log.info("uploading %s, which run %s lacks", path.name, job.tracker.run.run_id)
            job.tracker.log_checkpoint(path, sha256)
    return CreatedModel(start, prepared)


def warn_of_missing_metrics(run, start_iter: int) -> None:
    """Said once: the run lacks metrics of iterations before `start_iter` (a job killed before it sent
    them, a resume into a new run), or has some of the iterations trained again (never logged twice)."""
    if run.run_id and run.last_step < start_iter - 1:
        why = ("the job stopped before it sent them, or trained them outside this run" if run.resumed else
               "it is a new run: the job's earlier one, if tracked, is in another store or experiment; a relative "
               "store such as the default sqlite:///mlflow.db is found from the working folder")
        log.warning("run %s has no metrics for iterations %d-%d (%s); json_stats.log has every LOG_PERIOD-th",
                    run.run_id, run.last_step + 1, start_iter - 1, why)
    elif run.run_id and run.last_step >= start_iter:  # one curve: a step is never logged twice
        log.info("run %s has metrics up to iteration %d from an earlier start: this one trains iterations %d-%d "
                 "again without sending them, so the run keeps the earlier values", run.run_id, run.last_step,
                 start_iter, run.last_step)


def find_start_point(job: Job) -> StartPoint:
    """AUTO_RESUME: the newest complete checkpoint in OUTPUT_DIR or on the tracking server.

    A local checkpoint wins when it is at least as new as the run's newest; a downloaded one
    whose bytes do not match its sha256 tag, or that does not load, is skipped for the one before
    it. A run whose checkpoints cannot be downloaded stops the job rather than train over them.
    """
    run = job.tracker.run
    if not (job.cfg.TRAIN.AUTO_RESUME or run.resumed):
        if folder := set_aside(job.output_dir):  # a start over: a later resume must not take them for its own
            log.info("starting over: the checkpoints already in %s moved to %s", job.output_dir, folder)
        return StartPoint()
    remove_stale_temps(job.output_dir)
    checked = job.prepared is not None and job.prepared.local_checked
    local = job.prepared.local if checked else check_local(job.cfg)
    if checked:
        job.prepared.local = None  # the state goes on in the StartPoint only: no second copy kept
    if local and local[0].name == FINAL:
        return StartPoint(final=True, source=str(local[0]))
    local_iter = iteration_of(local[0].name) if local else -1
    unreachable = []  # checkpoints that could not be downloaded, as opposed to bad ones (skipped)
    for name in run.checkpoints:
        if iteration_of(name) <= local_iter:
            break
        try:
            path = job.tracker.fetch_checkpoint(name, job.output_dir)
            if path is None:  # gone from the store or the store is down; model_final too: its last iterations train again
                unreachable.append(name)
                continue
            if name == FINAL:  # finished elsewhere: model_final comes back to OUTPUT_DIR, where Detectron leaves it
                return StartPoint(final=True, source=f"run {run.run_id}, downloaded to {path}")
            state = load(path, sha256_checked=True)  # fetch_checkpoint compared it with the tag
            if job.prepared is not None:  # other categories are the user's to fix (UserError); the rest is skipped
                check_same_categories(f"run {run.run_id}'s {name}", state, job.prepared.dataset)
                check_restores(job.cfg, path, state, job.prepared.model)
        except CheckpointError as e:  # tampered with or not ours: never loaded, the one before is tried
            log.warning("skipping %s", e)
            continue
        return StartPoint(state["iteration"] + 1, state, f"run {run.run_id} ({name})")
    if local:  # one the run lacks goes up: a job that dies on this machine can resume from it on another
        upload = None
        if run.run_id and local[0].name not in run.checkpoints:
            identity = file_identity(local[0])  # taken before the hash: a file changed after it is not uploaded
            upload = (local[0], sha256_of(local[0]), identity)
        return StartPoint(local[1]["iteration"] + 1, local[1], str(local[0]), upload=upload)
    if unreachable:  # a run is never trained over from iteration 0 while its checkpoints may come back
        raise UserError(f"run {run.run_id} has checkpoints ({', '.join(unreachable[:3])}) that could not be "
                        "downloaded (the warnings above say why): run the job again once the tracking server "
                        "serves them, or with --no-resume to start it over")
    if run.checkpoints:
        log.warning("none of run %s's checkpoints is usable (the warnings above say why): training starts "
                    "from iteration 0", run.run_id)
    return StartPoint()
