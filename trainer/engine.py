"""The training loop: Detectron's train_model(), step by step, each step one named call.

    created = create_model(job)                dataset and network; AUTO_RESUME: newest checkpoint (resume.py)
    if created.start.final: nothing to do
    state = setup_model_for_training(job, created)     weights, optimizer, scheduler, loader
    for cur_iter in range(start_iter, MAX_ITER):
        step; stats.update; stats.log
        every SNAPSHOT_ITERS // NUM_GPUS: save model_iter{cur_iter}
        every TEST.EVAL_PERIOD: save model_iter{cur_iter} too, COCO evaluation of it, metrics to the run
        at start_iter + LOG_PERIOD: reset the iteration timer
        loss NaN: shut the loader down, fail
    save model_final, evaluate it, log it as the servable model; shut the loader down
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.atomic_write import write_atomic
from trainer.checkpoint.files import FINAL, JOB_LOG, STATS_LOG, checkpoint_name, iteration_of, prune
from trainer.checkpoint.state import capture_rng, restore_rng
from trainer.checkpoint.writer import CheckpointWriter
from trainer.config import Config, redacted, write_config
from trainer.data import build_train_loader, image_list_of
from trainer.data.prefetch import Prefetcher
from trainer.distributed import Context, all_mean, broadcast_object, gather_object
from trainer.errors import SharedError, UserError, first_line
from trainer.evaluation import eval_due, evaluate
from trainer.inference import categories_of
from trainer.lineage import dataset_inputs, initial_weights
from trainer.job import Job
from trainer.models import describe_model, load_weights, unwrap
from trainer.preemption import Preempted, PreemptionGuard
from trainer.publish import AlreadyFinished, complete_finished_run, log_final_model
from trainer.solver import build_lr_scheduler, build_optimizer, clip_gradients
from trainer.stats import TrainingStats
from trainer.resume import CreatedModel, create_model, warn_of_missing_metrics
from trainer.tracking.runs import eval_sets_tag

log = logging.getLogger(__name__)

STATS_UPLOAD_PERIOD_S = 300.0  # json_stats.log and log.txt go up whole, so now and then (and with model_final)


class NonFiniteLoss(Exception):
    """The loss became NaN or infinite: the job fails (Detectron's 'Loss is NaN')."""


@dataclass
class LoopState:
    """What the loop works on."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    batches: Prefetcher
    stats: TrainingStats
    writer: CheckpointWriter | None  # rank 0 writes the checkpoints; the other ranks have none
    categories: dict  # what the labels mean: {"categories": [{"id", "name"}], "keypoint_names": [...]}
    images: dict  # which images the sampler draws from (data.image_list_of), kept with its position


def train_model(job: Job) -> AlreadyFinished | None:
    """Train one job to MAX_ITER; says so when model_final already existed (nothing to train)."""
    cfg = job.cfg
    created = create_model(job)  # seeded by preflight.prepare, before the network was built
    if job.ctx.is_main:  # the folder is settled: an earlier job's files set aside, a checkpoint fetched
        open_job_logs(job)
    if created.start.final:
        log.info("model_final already exists (%s): nothing to train", created.start.source)
        done = AlreadyFinished(created.start.source)
        if job.ctx.is_main:
            warn_of_missing_metrics(job.tracker.run, cfg.SOLVER.MAX_ITER)  # metrics lost for good are said
            done.sent = complete_finished_run(cfg, job.tracker, job.output_dir, created.prepared, job.ctx.device)
        return done
    s = setup_model_for_training(job, created)
    start_iter = created.start.iteration
    snapshot_period = max(1, cfg.TRAIN.SNAPSHOT_ITERS // cfg.NUM_GPUS)
    cur_iter = start_iter
    try:
        with PreemptionGuard(cfg.TRAIN.PREEMPT_GRACE_S) as guard:
            evaluate_if_cut_short(job, s, start_iter)
            for cur_iter in range(start_iter, cfg.SOLVER.MAX_ITER):
                losses, stop = run_iteration(job, s, cur_iter, lambda: guard.requested)
                check_finite(losses, cur_iter)
                evaluating = eval_due(cfg, cur_iter)
                if evaluating or is_snapshot_iter(cfg, cur_iter, start_iter, snapshot_period):
                    save_snapshot(job, s, cur_iter)  # an evaluated model is always a checkpoint too
                if evaluating:
                    evaluate_checkpoint(job, s, cur_iter)
                s.stats.maybe_reset_timer(cur_iter)
                if stop:  # a signal on any rank: every rank stops after the same iteration
                    raise guard.preempted()
            guard.finishing = True  # the last iteration is done: a signal now lets the job complete
            save_snapshot(job, s, None)
            if s.writer:
                s.writer.close()
            if cfg.TEST.DATASETS:
                evaluate_final(job, s)
            if job.ctx.is_main:
                log_final_model(cfg, job.tracker, job.output_dir, unwrap(s.model).state_dict(), s.categories)
    except Preempted as e:
        saved = is_snapshot_iter(cfg, cur_iter, start_iter, snapshot_period) or eval_due(cfg, cur_iter)
        save_preemption_snapshot(job, s, cur_iter, saved, e.deadline)
        raise
    finally:
        s.stats.close()
        s.batches.close()  # loader workers never outlive the loop
        if s.writer:
            s.writer.close(raise_errors=False)  # a checkpoint being written is finished, not torn
    return None


def open_job_logs(job: Job) -> None:
    """json_stats.log and log.txt go on where the job left them: fetched from the run when this machine
    has none, or the uploads would replace the run's with this start's lines alone. A log.txt that
    cannot be fetched stays in the run as it is."""
    unfetched = []
    if job.tracker.run.resumed:
        for name in (STATS_LOG, JOB_LOG):
            if not (job.output_dir / name).exists():
                try:
                    job.tracker.fetch_artifact(name, job.output_dir)
                except Exception as e:
                    unfetched.append(name)
                    log.warning("cannot fetch the run's %s (%s): %s", name, first_line(e), _UNFETCHED[name])
    if job.log:
        job.log.open(job.output_dir / JOB_LOG, send=JOB_LOG not in unfetched)


_UNFETCHED = {STATS_LOG: "this start's lines replace it there (the run's metrics hold every logged iteration too)",
              JOB_LOG: "this start's lines stay in OUTPUT_DIR/log.txt alone, and the run keeps its own"}


def is_snapshot_iter(cfg: Config, cur_iter: int, start_iter: int, period: int) -> bool:
    """Detectron's rule; the last iteration is left to model_final (the same bytes)."""
    return (cur_iter + 1) % period == 0 and cur_iter > start_iter and cur_iter < cfg.SOLVER.MAX_ITER - 1


def setup_model_for_training(job: Job, created: CreatedModel) -> LoopState:
    cfg, ctx, start, prepared = job.cfg, job.ctx, created.start, created.prepared
    loader, _ = build_train_loader(cfg, start.iteration, ctx.rank, ctx.world_size, dataset=prepared.dataset)
    model, parent = prepared.model.to(ctx.device), prepared.parent
    if start.state is not None:  # a resume: the checkpoint's weights
        model.load_state_dict(start.state["model"])
    elif ctx.is_main and not prepared.weights_loaded:  # from iteration 0 after all (unusable checkpoints)
        with initial_weights(cfg) as (weights, parent):
            load_weights(model, weights, shown=cfg.TRAIN.WEIGHTS)
    # Other ranks start from rank 0's weights: DDP broadcasts its parameters and buffers when it wraps
    # the model (a weights file on rank 0's node alone is enough), and build_model set what is neither.
    if refused := broadcast_object(ctx, write_run_files(job, model, parent) if ctx.is_main else None):
        raise SharedError(refused)  # every rank stops with rank 0's line, before any trains
    model.train()
    if ctx.distributed:
        model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_lr_scheduler(cfg, optimizer)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.SOLVER.AMP and ctx.device.type == "cuda")
    images = image_list_of(prepared.dataset)
    if start.state is not None:
        restore_training_state(start.state, optimizer, scheduler, scaler, ctx, images)
    stats = TrainingStats(cfg, start.iteration, job.output_dir / STATS_LOG if ctx.is_main else None,
                          is_main=ctx.is_main)
    writer = CheckpointWriter(AfterCheckpoint(job)) if ctx.is_main else None
    return LoopState(model, optimizer, scheduler, scaler, Prefetcher(loader, ctx.device), stats, writer,
                     categories_of(prepared.dataset), images)


def write_run_files(job: Job, model: torch.nn.Module, parent: dict) -> str | None:
    """config.yaml and model.txt (Detectron's net.pbtxt), locally and in the run, and the run's inputs;
    the line saying the run's artifact store refuses config.yaml (its first upload), or None."""
    write_config(job.cfg, job.output_dir / "config.yaml")
    write_atomic(job.output_dir / "model.txt", describe_model(model))
    try:
        job.tracker.log_artifact(job.output_dir / "config.yaml", first=True)
    except UserError as e:
        return str(e)
    job.tracker.log_artifact(job.output_dir / "model.txt")
    inputs = dataset_inputs(job.cfg)
    job.tracker.log_inputs(inputs, parent)
    job.tracker.set_tags(eval_sets_tag(inputs))  # what its scores are of, this start's (TEST is no part of the job)
    return None


def restore_training_state(state: dict, optimizer, scheduler, scaler, ctx: Context, images: dict) -> None:
    held = state.get("sampler") if isinstance(state.get("sampler"), dict) else {}
    if ctx.is_main and held.get("digest", images["digest"]) != images["digest"]:  # none: an earlier tracktron's
        log.warning("the training set is not the image list this checkpoint was trained on (%s images then, %d now, "
                    "or others): the job goes on, but not with the batches the uninterrupted job would have seen",
                    held.get("images"), images["images"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]  # one per rank: each rank's sampling (RPN, ROI) draws from its own stream
    if len(rngs) != ctx.world_size:
        log.warning("checkpoint from %d processes resumed on %d: random streams are not the same",
                    len(rngs), ctx.world_size)
    restore_rng(rngs[ctx.rank % len(rngs)])


# ---- the loop ----

def run_iteration(job: Job, s: LoopState, cur_iter: int, stop_requested: Callable[[], bool] = lambda: False
                  ) -> tuple[dict, bool]:
    """One step; (the losses averaged over ranks, whether any rank was asked to stop during it)."""
    s.stats.iter_tic()
    data_start = time.perf_counter()
    images, targets = s.batches.next()
    data_time = time.perf_counter() - data_start
    lr = s.optimizer.param_groups[0]["lr"]
    losses, stop = train_step(job, s, images, targets, stop_requested)
    s.scheduler.step()
    s.stats.iter_toc()
    s.stats.update(losses, lr, data_time, s.batches.qsize(), len(images) * job.ctx.world_size)
    if job.ctx.is_main:
        job.tracker.log_metrics(s.stats.metrics(cur_iter), cur_iter)
        s.stats.log(cur_iter)
    return losses, stop


def train_step(job: Job, s: LoopState, images, targets, stop_requested: Callable[[], bool]) -> tuple[dict[str, float], bool]:
    with torch.autocast(job.ctx.device.type, enabled=s.scaler.is_enabled()):
        loss_dict = s.model(images, targets)
    total = sum(loss_dict.values())
    s.optimizer.zero_grad(set_to_none=True)
    s.scaler.scale(total).backward()
    if job.cfg.SOLVER.CLIP_GRAD_NORM > 0:
        s.scaler.unscale_(s.optimizer)
        clip_gradients(job.cfg, s.model)
    s.scaler.step(s.optimizer)
    s.scaler.update()
    # One host sync and one collective per iteration: every loss term and the stop flag in a single
    # vector (the flag's mean over ranks is > 0 when any rank got a signal). The flag is read now, not
    # as the iteration began: a signal during it stops the job after it, not after the next one.
    flag = torch.tensor(float(stop_requested()), device=total.device, dtype=total.dtype)
    values = torch.stack([total.detach(), *(v.detach() for v in loss_dict.values()), flag]).float()
    *values, stop = all_mean(job.ctx, values).cpu().tolist()
    return dict(zip(["loss", *loss_dict], values)), stop > 0


def check_finite(losses: dict[str, float], cur_iter: int) -> None:
    if not math.isfinite(losses["loss"]):
        terms = ", ".join(f"{k}={v:.4g}" for k, v in losses.items())
        raise NonFiniteLoss(f"loss is {losses['loss']} at iteration {cur_iter} ({terms})")


# ---- checkpoints ----

def training_state(cfg: Config, s: LoopState, cur_iter: int, rngs: list) -> dict:
    return {
        "model": unwrap(s.model).state_dict(),
        "optimizer": s.optimizer.state_dict(),
        "scheduler": s.scheduler.state_dict(),
        "scaler": s.scaler.state_dict() if s.scaler.is_enabled() else {},
        "iteration": cur_iter,
        "config": redacted(cfg),  # checkpoints get shared: no secrets in them
        "categories": s.categories,
        "rng": rngs,
        "sampler": {"seed": cfg.RNG_SEED, "next_iter": cur_iter + 1, **s.images},
    }


def save_snapshot(job: Job, s: LoopState, cur_iter: int | None) -> None:
    """model_iter{cur_iter}.pth, or model_final.pth when cur_iter is None (rank 0 writes)."""
    # Rank 0 holds the folder's lock; every rank stops alike if it was moved (another trainer may work
    # where the path leads now: never two jobs' files in one folder).
    moved = broadcast_object(job.ctx, not job.in_its_folder() if job.ctx.is_main else None)
    if moved:
        raise SharedError(f"OUTPUT_DIR {job.output_dir} is no longer the folder this job locked (it was moved, or a "
                        f"link on its path was changed, while the job trained): its checkpoints up to here are in "
                        f"the folder it locked, {checkpoint_name(cur_iter)} was not written")
    rngs = gather_object(job.ctx, capture_rng())  # every rank takes part; rank 0 gets them all
    if s.writer is None:
        return
    it = job.cfg.SOLVER.MAX_ITER - 1 if cur_iter is None else cur_iter
    s.writer.submit(training_state(job.cfg, s, it, rngs), job.output_dir / checkpoint_name(cur_iter))


class AfterCheckpoint:
    """On the writer thread, after each complete checkpoint: its upload queued, the local ones past
    TRAIN.CHECKPOINTS_KEEP deleted, and now and then json_stats.log and log.txt uploaded."""

    def __init__(self, job: Job):
        self.job = job
        self.last_stats_upload = -math.inf

    def __call__(self, path: Path, sha256: str) -> None:
        self.job.tracker.log_checkpoint(path, sha256)
        last = self.job.cfg.SOLVER.MAX_ITER - 1  # model_final holds it: no model_iter of this job is newer
        prune(self.job.output_dir, self.job.cfg.TRAIN.CHECKPOINTS_KEEP, min(iteration_of(path.name), last),
              spare=self.job.tracker.uploading())  # an evaluated one whose upload an outage holds
        now = time.monotonic()
        if path.name == FINAL or now - self.last_stats_upload >= STATS_UPLOAD_PERIOD_S:
            self.last_stats_upload = now
            upload_logs(self.job)


def upload_logs(job: Job) -> None:
    """json_stats.log and log.txt to the run, whole, where they exist; log.txt only while it is the job's own file."""
    if (job.output_dir / STATS_LOG).exists():
        job.tracker.log_artifact(job.output_dir / STATS_LOG)
    if job.log and job.log.sendable():
        job.tracker.log_artifact(job.log.path)


def evaluate_checkpoint(job: Job, s: LoopState, cur_iter: int | None) -> None:
    """COCO evaluation of the checkpoint just saved (model_final when cur_iter is None), linked to it in the run.
    The write finishes first, so that the checkpoint's upload is queued before the evaluation refers to it."""
    if s.writer:
        s.writer.wait()
    step = job.cfg.SOLVER.MAX_ITER - 1 if cur_iter is None else cur_iter
    evaluate(job.cfg, s.model, job.ctx, job.output_dir, job.tracker, step=step, checkpoint=checkpoint_name(cur_iter))


def evaluate_final(job: Job, s: LoopState) -> None:
    """model_final's evaluation. A test image found unreadable only now (its header was sound) fails
    the job with model_final kept: the error says how to evaluate it once the test set is fixed."""
    try:
        evaluate_checkpoint(job, s, None)
    except UserError as e:
        later = ("the same command evaluates it into the run" if job.cfg.TRACKING.ENABLED
                 else f"`tracktron eval` of the job's config with --weights {job.output_dir / FINAL} evaluates it")
        raise type(e)(f"{e} ({FINAL} is saved; once the test set is fixed, {later})") from None  # shared by every rank or not


def evaluate_if_cut_short(job: Job, s: LoopState, start_iter: int) -> None:
    """A job stopped during a periodic evaluation resumes after the checkpoint it was evaluating, whose
    scores the run lacks: that evaluation comes first, from the same state as in the uninterrupted job."""
    last, due = start_iter - 1, False
    if last < 0 or not eval_due(job.cfg, last):
        return
    name = checkpoint_name(last)
    held = name in job.tracker.run.checkpoints or name in job.tracker.uploading()  # resume.py uploads one it lacks
    if job.ctx.is_main and held:  # else no model to link the scores to
        try:
            due = job.tracker.evaluation_due(name, dataset_inputs(job.cfg, training=False))
        except Exception as e:  # a test set gone, a server failing the search: training goes on
            log.warning("cannot tell whether the run has the evaluation of %s: %s", name, first_line(e))
    if broadcast_object(job.ctx, due):  # every rank evaluates, or none
        log.info("the run lacks the evaluation of %s (the job stopped during it): evaluating it first", name)
        evaluate_checkpoint(job, s, last)


def save_preemption_snapshot(job: Job, s: LoopState, cur_iter: int, saved_by_loop: bool, deadline: float) -> None:
    """Checkpoint the last finished iteration and wait (within the grace period) for its upload."""
    if not saved_by_loop:
        save_snapshot(job, s, cur_iter)
    if s.writer is None:
        return
    s.writer.close()
    upload_logs(job)  # the resumed job continues them
    job.tracker.wait(max(0.0, deadline - time.monotonic() - 3.0))  # leave time to flush and exit
