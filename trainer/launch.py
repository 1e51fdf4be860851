"""A training job from its checked config to its end: the checks before a run is made for it, the
process group, the loop, and how it ends (finished, nothing to do, stopped by a signal, failed)."""
from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from pathlib import Path

import click

from trainer.atomic_write import write_atomic
from trainer.checkpoint.files import FINAL
from trainer.errors import SharedError, UserError, first_line
from trainer.logs import JobLog, held_while_checking, write_or_drop
from trainer.open_files import check_open_files
from trainer.output_dir import check_config_file_kept, check_output_dir
from trainer.output_lock import OutputLock
from trainer.preemption import Preempted, PreemptionGuard, StopOnSignal, StopRequested, on_hard_exit

log = logging.getLogger("tracktron")


def train_job(cfg, config_file: str, resume_run_id: str | None, no_resume: bool, dry_run: bool, rank: int,
              world_size: int) -> None:
    """`tracktron train` once its config is loaded: every check, then the job (or its --dry-run plan)."""
    from trainer.tracking import create_tracker

    _check_inputs(cfg, config_file)
    if dry_run:
        from trainer.dry_run import plan

        click.echo(plan(cfg, resume_run_id, no_resume, world_size))
        return
    tracker = create_tracker(cfg, rank, world_size)
    lock = OutputLock(Path(cfg.OUTPUT_DIR)).acquire() if rank == 0 else None  # one trainer per OUTPUT_DIR
    job_log = JobLog() if rank == 0 else None  # OUTPUT_DIR/log.txt, from the engine's first step on
    if job_log:
        logging.getLogger().addHandler(job_log)
    monitor = ctx = None
    try:
        with StopOnSignal(cfg.TRAIN.PREEMPT_GRACE_S):  # the loop has its own, gentler handling
            # The job's run is looked up (and a resumed job's checkpoint starts downloading) while
            # torch loads and the job is checked; the run is made or reopened once every check passed.
            tracker.start(cfg, resume_run_id, new_run=no_resume, wait_for_checks=True)
            importlib.import_module("trainer.engine")  # torch, torchvision and the engine load meanwhile
            prepared = _check_job(cfg, tracker, rank == 0, cfg.TRAIN.AUTO_RESUME or bool(resume_run_id))
            tracker.checks_passed()
            from trainer import distributed
            from trainer.tracking.system_metrics import start_monitor, stop_monitor

            _announce_run(tracker)
            on_hard_exit(lambda reason: tracker.last_words("KILLED", reason))  # stuck past the grace period
            ctx = _join(distributed, tracker, cfg, prepared)
            tracker.set_tags({f"tracktron.{k}": v for k, v in distributed.environment(ctx).items()})
            monitor = start_monitor(cfg, distributed.broadcast_object(ctx, tracker.run.run_id), ctx.local_rank,
                                    ctx.world_size, on_gpu=ctx.device.type == "cuda")
            _train(cfg, tracker, ctx, prepared, lock, job_log)
    except StopRequested as e:  # before the loop began: there is nothing of this start to resume
        _stopped(tracker, e, before_training=True, world_size=world_size)
    finally:
        if job_log:
            logging.getLogger().removeHandler(job_log)
            job_log.end()
        if monitor is not None:
            stop_monitor(monitor)
        if ctx is not None:
            distributed.teardown(ctx)
        if lock is not None:
            lock.release()


def _check_inputs(cfg, config_file: str) -> None:
    """What needs neither torch nor a run: the folder, the config file's copy, open files."""
    check_output_dir(Path(cfg.OUTPUT_DIR))
    check_config_file_kept(config_file, Path(cfg.OUTPUT_DIR))
    check_open_files(cfg.DATA_LOADER.NUM_THREADS, cfg.TRAIN.IMS_PER_BATCH + cfg.TEST.IMS_PER_BATCH)  # both loaders live
    _check_run_id_file()


@held_while_checking()
def _check_job(cfg, tracker, main: bool, resumable: bool):
    """The job's datasets and network, the checkpoint in OUTPUT_DIR it would resume from, then its initial
    weights unless it resumes, all checked before a run is made for it: a job that fails a check leaves
    the tracking store as it was. None for a finished job, whatever became of its data."""
    from trainer.preflight import check_local, prepare

    try:
        prepared = prepare(cfg)
    except UserError:
        local_final = cfg.TRAIN.AUTO_RESUME and (Path(cfg.OUTPUT_DIR) / FINAL).is_file()
        try:
            finished = local_final or FINAL in tracker.found_checkpoints()
        except UserError:  # the lookup failed too: the job's own error says more
            finished = False
        if not finished:
            tracker.finish(None)  # no run was made: nothing to mark
            raise
        prepared = None
    try:
        if main and resumable:
            check_local(cfg, prepared)
        tracker.check_found()  # the run it would continue, free to be trained by this job
        if prepared is not None and main:  # the other ranks get them from rank 0 (DDP's broadcast)
            _initial_weights(cfg, tracker, prepared)
    except UserError:
        tracker.finish(None)
        raise
    return prepared


def _initial_weights(cfg, tracker, prepared) -> None:
    """TRAIN.WEIGHTS, read only by a job with no checkpoint in OUTPUT_DIR (check_local) nor in its run.
    Should the run's prove unusable once downloaded, the engine loads them then."""
    from trainer.preflight import load_initial_weights

    if prepared.local is None and not tracker.found_checkpoints():
        load_initial_weights(cfg, prepared)


def _join(distributed, tracker, cfg, prepared):
    """The job's process group, every rank on rank 0's job; a failure to join it, or a rank started
    with another config or other training data, fails the run (never left RUNNING), in one line."""
    from trainer.config import flatten
    from trainer.job_identity import job_keys
    from trainer.data.coco import dataset_category_key

    try:
        ctx = distributed.setup()
    except (RuntimeError, ValueError, OSError) as e:  # torch.distributed's rendezvous and store errors
        reason = f"cannot join the job's other processes: {first_line(e)}"
        tracker.finish("FAILED", reason)
        raise UserError(reason) from None
    keys = job_keys(cfg) | {k: v for k, v in flatten(cfg).items() if k in distributed.SHARED_KEYS}
    # each node has its own DATA_DIR: the datasets _check_job built are compared, not their paths
    dataset = None if prepared is None else prepared.dataset
    data = None if dataset is None else {"num_classes": dataset.num_classes, "images": len(dataset),
                                         "categories": dataset_category_key(dataset)}
    try:
        distributed.check_same_job(ctx, keys, data)
    except UserError as e:
        tracker.finish("FAILED", str(e))
        distributed.teardown(ctx, together=True)
        raise
    return ctx


def torchrun_environment() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun sets them, checked before anything starts: a job whose
    processes cannot find each other must not create a run it then leaves RUNNING."""
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    values = {}
    for name, text in env.items():
        if text is None:
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise UserError(f"torchrun environment: {name}={text!r} is not an integer") from None
    rank, world_size = values.get("RANK", 0), values.get("WORLD_SIZE", 1)
    local_rank, local_size = values.get("LOCAL_RANK", 0), values.get("LOCAL_WORLD_SIZE", world_size)
    if world_size < 1 or not 0 <= rank < world_size or not 0 <= local_rank < local_size <= world_size:
        raise UserError(f"torchrun environment: RANK {rank}, LOCAL_RANK {local_rank}, LOCAL_WORLD_SIZE {local_size} and "
                        f"WORLD_SIZE {world_size} do not fit (0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE "
                        "<= WORLD_SIZE)")
    port = os.environ.get("MASTER_PORT", "")
    if world_size > 1 and not (os.environ.get("MASTER_ADDR") and port.isascii() and port.isdigit()
                               and 0 < int(port) < 65536):
        raise UserError(f"torchrun environment: WORLD_SIZE > 1 needs MASTER_ADDR and a MASTER_PORT of 1 to 65535, "
                        f"got {port!r} (start the job with torchrun)")
    return rank, world_size


def _check_run_id_file() -> None:
    """TRACKTRON_RUN_ID_FILE is written once the run is made: a name that cannot be a file is found now."""
    if not (target := os.environ.get("TRACKTRON_RUN_ID_FILE")):
        return
    path = Path(target)
    blocker = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
    if path.is_dir() or (blocker is not None and blocker != path and not blocker.is_dir()):
        what = "is a folder" if path.is_dir() else f"cannot be made: {blocker} is no folder"
        raise UserError(f"TRACKTRON_RUN_ID_FILE {target} {what}: name the file the job's run id is written to")


def _announce_run(tracker) -> None:
    """The run's address in the log, and its id in TRACKTRON_RUN_ID_FILE if set."""
    run = tracker.run
    if not run.run_id:
        return
    log.info("MLflow run %s: %s", run.run_id, run.ui_url or f"see it with: mlflow ui --backend-store-uri {tracker.uri}")
    try:
        _write_run_id(run.run_id)
    except OSError as e:  # denied, or made a folder since the check: the run must not stay RUNNING
        tracker.finish("FAILED", f"cannot write TRACKTRON_RUN_ID_FILE: {first_line(e)}")
        raise UserError(f"cannot write TRACKTRON_RUN_ID_FILE {os.environ['TRACKTRON_RUN_ID_FILE']}: "
                        f"{e.strerror or first_line(e)}") from None


def _write_run_id(run_id: str) -> None:
    """For pipelines (Kubeflow): the job's run id in the file TRACKTRON_RUN_ID_FILE names."""
    if target := os.environ.get("TRACKTRON_RUN_ID_FILE"):
        write_atomic(Path(target), run_id)


def _train(cfg, tracker, ctx, prepared, lock: OutputLock | None, job_log: JobLog | None) -> None:
    from trainer import distributed
    from trainer.engine import NonFiniteLoss, train_model
    from trainer.job import Job

    job = Job(cfg, ctx, tracker, Path(cfg.OUTPUT_DIR), prepared, log=job_log)
    if lock is not None:
        job.in_its_folder = lock.still_here
    try:
        done = train_model(job)
    except Preempted as e:
        _stopped(tracker, e, job_log=job_log)
    except StopRequested as e:  # before the loop (setting up, a finished job's rerun): this start trained nothing
        finished = cfg.TRAIN.AUTO_RESUME and (job.output_dir / FINAL).is_file()  # --no-resume sets it aside
        _stopped(tracker, e, before_training=True, finished=finished, job_log=job_log)
    except NonFiniteLoss as e:
        _finish(tracker, job_log, "FAILED", str(e))
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except UserError as e:
        _finish(tracker, job_log, "FAILED", str(e))
        if isinstance(e, SharedError):  # every rank has it: none exits (torchrun then stops the rest) before the run is marked
            distributed.teardown(ctx, together=True)
        raise
    except BaseException as e:
        _finish(tracker, job_log, "FAILED", f"{type(e).__name__}: {e}")
        raise
    with PreemptionGuard(cfg.TRAIN.PREEMPT_GRACE_S) as guard:
        guard.finishing = True  # a signal while model_final and the model upload: they go on, within the grace period
        missing = _finish(tracker, job_log, "FINISHED")
    if ctx.rank != 0:  # only rank 0 writes checkpoints: another node has no model_final to show
        return
    if done is not None and done.sent:  # the job's run lacked them; when some did not arrive, the error says which
        sent = "" if missing else f"; sent the run what it lacked: {', '.join(done.sent)}"
        write_or_drop(sys.stdout, f"model_final already exists ({done.source}): nothing to train{sent}\n")
    elif done is not None:
        write_or_drop(sys.stdout, f"nothing to do: model_final already exists ({done.source})\n")
    else:
        write_or_drop(sys.stdout, f"training finished: {Path(cfg.OUTPUT_DIR) / FINAL}\n")
    if missing:  # the weights are safe locally, but the run is not complete: a pipeline must know
        from trainer.tracking import resend_advice

        write_or_drop(sys.stderr, f"error: the tracking server did not get: {', '.join(missing)}. {resend_advice(tracker)}\n")
        raise Stopped(1)  # an upload left running (MLflow running the model's example) must not meet the teardown


def _finish(tracker, job_log: JobLog | None, status: str, reason: str = "", timeout: float | None = None) -> list[str]:
    """The run's end: log.txt says it last and goes to the run, whole; what is logged after is the console's alone."""
    if job_log and job_log.path:
        job_log.note(f"the job ends {status}" + (f": {reason}" if reason else ""))
        if job_log.sendable():
            tracker.log_artifact(job_log.path)
        job_log.end()
    return tracker.finish(status, reason, timeout)


class Stopped(SystemExit):
    """The exit of a job stopped by a signal, or one that left uploads running past its flush timeout:
    main() skips the interpreter's teardown for it (with a daemon thread inside torch, C++'s can abort)."""


def _stopped(tracker, e: Preempted | StopRequested, before_training: bool = False, world_size: int = 1,
             finished: bool = False, job_log: JobLog | None = None):
    """A stop signal (preemption.STOP_SIGNALS): the run is KILLED (not FAILED), and the next start resumes it."""
    missing = _finish(tracker, job_log, "KILLED", str(e), timeout=max(0.0, e.deadline - time.monotonic() - 2.0))
    if missing:  # the server down at the stop: where the metrics the run lacks are kept, too
        log.warning("the tracking server did not get: %s", ", ".join(missing))
    if not before_training:
        log.warning("%s; the job resumes from its last checkpoint", e)
    elif finished:  # a rerun of a finished job, sending its run what it lacked
        log.warning("%s; model_final.pth is saved: the next start sends the run what it still lacks", e)
    elif world_size > 1:  # torchrun's agent stops every rank once one fails: that one's error is the cause
        log.warning("%s before training began (torchrun stops every process of a job when one of them fails: "
                    "its error above says why)", e)
    else:
        log.warning("%s before training began", e)
    raise Stopped(128 + e.signum)
