"""The training loop: Detectron's train_model(), step by step, each step one named call.

    start = create_model(...)                  dataset and network; AUTO_RESUME: newest checkpoint
    if start.final: nothing to do
    setup_model_for_training(...)             weights, optimizer, scheduler, loader
    for cur_iter in range(start_iter, MAX_ITER):
        step; stats.update; stats.log
        every SNAPSHOT_ITERS // NUM_GPUS: save model_iter{cur_iter}
        every TEST.EVAL_PERIOD: COCO evaluation, metrics to the run
        at start_iter + LOG_PERIOD: reset the iteration timer
        loss NaN: shut the loader down, fail
    save model_final; shut the loader down
"""
from __future__ import annotations

import logging
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from trainer import checkpoint as ckpt
from trainer.checkpoint_writer import CheckpointWriter
from trainer.config import Config, job_keys, redacted, write_config
from trainer.errors import UserError
from trainer.evaluation import evaluate_during_training
from trainer.data import build_train_dataset, build_train_loader
from trainer.distributed import Context, all_mean, any_rank, broadcast_object, gather_object
from trainer.models import build_model, describe_model, load_weights
from trainer.prefetch import Prefetcher
from trainer.preemption import Preempted, PreemptionGuard
from trainer.solver import build_lr_scheduler, build_optimizer, clip_gradients
from trainer.stats import TrainingStats
from trainer.tracking import Tracker

log = logging.getLogger(__name__)


class NonFiniteLoss(Exception):
    """The loss became NaN or infinite: the job fails (Detectron's 'Loss is NaN')."""


@dataclass
class StartPoint:
    iteration: int = 0  # the first iteration to run
    state: dict | None = None  # the checkpoint to restore, if any
    source: str = "scratch"
    final: bool = False  # model_final exists: nothing to do


@dataclass
class Trainer:
    """What the loop works on."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    batches: Prefetcher
    stats: TrainingStats
    writer: CheckpointWriter


def train_model(cfg: Config, tracker: Tracker, ctx: Context) -> StartPoint | None:
    """Train one job to MAX_ITER; returns the start point when there was nothing to do."""
    output_dir = Path(cfg.OUTPUT_DIR)
    seed_everything(cfg)
    start, built = create_model(cfg, tracker, ctx, output_dir)
    if start.final:
        log.info("model_final already exists (%s): nothing to do", start.source)
        if ctx.is_main:
            upload_final_if_missing(tracker, output_dir)
        return start
    t = setup_model_for_training(cfg, tracker, ctx, output_dir, start, built)
    snapshot_period = max(1, cfg.TRAIN.SNAPSHOT_ITERS // cfg.NUM_GPUS)
    cur_iter = start.iteration
    try:
        with PreemptionGuard(cfg.TRAIN.PREEMPT_GRACE_S) as guard:
            for cur_iter in range(start.iteration, cfg.SOLVER.MAX_ITER):
                losses = run_iteration(cfg, t, ctx, tracker, cur_iter)
                check_finite(losses, cur_iter)
                if is_snapshot_iter(cfg, cur_iter, start.iteration, snapshot_period):
                    save_snapshot(cfg, t, ctx, tracker, cur_iter)
                evaluate_during_training(cfg, t.model, ctx, output_dir, tracker, cur_iter)
                t.stats.maybe_reset_timer(cur_iter)
                if any_rank(ctx, guard.requested):
                    raise guard.preempted()
            save_snapshot(cfg, t, ctx, tracker, None)
            t.writer.close()
            evaluate_during_training(cfg, t.model, ctx, output_dir, tracker, cfg.SOLVER.MAX_ITER - 1, final=True)
            log_final_model(cfg, t, ctx, tracker)  # last: it moves the model to the CPU
    except Preempted as e:
        save_preemption_snapshot(cfg, t, ctx, tracker, cur_iter, start.iteration, snapshot_period, e.deadline)
        raise
    finally:
        t.stats.close()
        t.batches.close()  # loader workers never outlive the loop
        t.writer.close(raise_errors=False)  # a checkpoint being written is finished, not torn
    return None


def is_snapshot_iter(cfg: Config, cur_iter: int, start_iter: int, period: int) -> bool:
    """Detectron's rule; the last iteration is left to model_final (the same bytes)."""
    return (cur_iter + 1) % period == 0 and cur_iter > start_iter and cur_iter < cfg.SOLVER.MAX_ITER - 1


# ---- start: seed, resume point, model ----

def seed_everything(cfg: Config) -> None:
    random.seed(cfg.RNG_SEED)
    np.random.seed(cfg.RNG_SEED)
    torch.manual_seed(cfg.RNG_SEED)
    if cfg.DETERMINISTIC:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True  # fixed-size inputs per scale: let cuDNN pick kernels


def create_model(cfg: Config, tracker: Tracker, ctx: Context, output_dir: Path):
    """(start point, (dataset, network)). Rank 0 finds where to start on a thread while every rank
    builds the dataset and the network, so that a checkpoint downloaded from the run (a job moved
    to another machine) arrives during the build. Every rank restores the same checkpoint."""
    with ThreadPoolExecutor(1, thread_name_prefix="find-start") as pool:
        finding = pool.submit(find_start_point, cfg, tracker, output_dir) if ctx.is_main else None
        built, failed = None, None
        try:
            built = build_dataset_and_model(cfg)
        except UserError as e:  # a finished job has nothing to do, whatever became of its dataset
            failed = e
        start = broadcast_object(ctx, finding.result() if finding else None)
    if failed is not None and not start.final:
        raise failed
    if start.state is not None:
        log.info("resuming from %s at iteration %d", start.source, start.iteration)
    return start, built


def find_start_point(cfg: Config, tracker: Tracker, output_dir: Path) -> StartPoint:
    """AUTO_RESUME: the newest complete checkpoint in OUTPUT_DIR or on the tracking server.

    A local checkpoint wins when it is at least as new as the run's newest; a downloaded one
    whose bytes do not match its sha256 tag is skipped for the one before it.
    """
    if not (cfg.TRAIN.AUTO_RESUME or tracker.run.resumed):
        return StartPoint()
    local = ckpt.newest_valid(output_dir)
    if local:
        check_same_job(cfg, *local)
    local_iter = ckpt.iteration_of(local[0].name) if local else -1
    if local and local[0].name == ckpt.FINAL:
        return StartPoint(final=True, source=str(local[0]))
    for name in tracker.run.checkpoints:
        if ckpt.iteration_of(name) <= local_iter:
            break
        if name == ckpt.FINAL:
            return StartPoint(final=True, source=f"run {tracker.run.run_id}")
        path = tracker.fetch_checkpoint(name, output_dir)
        if path is not None:
            try:
                state = ckpt.load(path, sha256_checked=True)  # fetch_checkpoint compared it with the tag
            except ckpt.CheckpointError as e:
                log.warning("skipping %s", e)
                continue
            if not (output_dir / "json_stats.log").exists():
                tracker.fetch_artifact("json_stats.log", output_dir)
            return StartPoint(state["iteration"] + 1, state, f"run {tracker.run.run_id} ({name})")
    if local:
        return StartPoint(local[1]["iteration"] + 1, local[1], str(local[0]))
    return StartPoint()


def upload_final_if_missing(tracker: Tracker, output_dir: Path) -> None:
    """A job whose model_final never reached its run (the artifact store was down to the end):
    running it again sends the local one, so the run is complete without training anything."""
    final = output_dir / ckpt.FINAL
    if tracker.run.run_id is None or ckpt.FINAL in tracker.run.checkpoints or not final.exists():
        return
    log.info("the run lacks %s: uploading the local one", ckpt.FINAL)
    tracker.log_checkpoint(final, ckpt.sha256_of(final))
    if (output_dir / "json_stats.log").exists():
        tracker.log_artifact(output_dir / "json_stats.log")


def check_same_job(cfg: Config, path: Path, state: dict) -> None:
    """Never resume (or call finished) another job's checkpoints left in OUTPUT_DIR."""
    ours, theirs = job_keys(cfg), job_keys(state.get("config", {}))
    if ours != theirs:
        diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise UserError(f"{path} is from another job ({', '.join(diff[:4])} differ): use another "
                        "OUTPUT_DIR, or --no-resume to start this job over in it")


def build_dataset_and_model(cfg: Config) -> tuple:
    dataset = build_train_dataset(cfg)
    return dataset, build_model(cfg, dataset.num_classes, getattr(dataset, "num_keypoints", 0))


def setup_model_for_training(cfg: Config, tracker: Tracker, ctx: Context, output_dir: Path,
                             start: StartPoint, built: tuple | None = None) -> Trainer:
    dataset, model = built or build_dataset_and_model(cfg)
    loader, _ = build_train_loader(cfg, start.iteration, ctx.rank, ctx.world_size, dataset=dataset)
    model = model.to(ctx.device)
    if ctx.is_main:
        write_run_files(cfg, tracker, output_dir, model)
    if start.state is None:
        load_weights(model, cfg.TRAIN.WEIGHTS)
    else:
        model.load_state_dict(start.state["model"])
    model.train()
    if ctx.distributed:
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_lr_scheduler(cfg, optimizer)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.SOLVER.AMP and ctx.device.type == "cuda")
    if start.state is not None:
        restore_training_state(start.state, optimizer, scheduler, scaler, ctx)
    stats = TrainingStats(cfg, start.iteration, output_dir / "json_stats.log" if ctx.is_main else None,
                          is_main=ctx.is_main)
    writer = (CheckpointWriter(checkpoint_saved(cfg, tracker, output_dir)) if ctx.is_main
              else CheckpointWriter(in_child=False))  # other ranks write nothing
    return Trainer(model, optimizer, scheduler, scaler, Prefetcher(loader, ctx.device), stats, writer)


STATS_UPLOAD_PERIOD_S = 300.0


def checkpoint_saved(cfg: Config, tracker: Tracker, output_dir: Path):
    """After a checkpoint file is complete: upload it (then prune older local ones), and now and
    then json_stats.log (whole each time, so not with every checkpoint; always with model_final)."""
    last_stats_upload = [-math.inf]

    def on_saved(path: Path, digest: str) -> None:
        tracker.log_checkpoint(path, digest, on_done=lambda: ckpt.prune(output_dir, cfg.TRAIN.CHECKPOINTS_KEEP))
        now = time.monotonic()
        if path.name == ckpt.FINAL or now - last_stats_upload[0] >= STATS_UPLOAD_PERIOD_S:
            last_stats_upload[0] = now
            tracker.log_artifact(output_dir / "json_stats.log")

    return on_saved


def write_run_files(cfg: Config, tracker: Tracker, output_dir: Path, model: torch.nn.Module) -> None:
    """config.yaml and model.txt (the heir of Detectron's net.pbtxt), locally and in the run."""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_config(cfg, output_dir / "config.yaml")
    (output_dir / "model.txt").write_text(describe_model(model))
    for name in ("config.yaml", "model.txt"):
        tracker.log_artifact(output_dir / name)


def restore_training_state(state: dict, optimizer, scheduler, scaler, ctx: Context) -> None:
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]  # one per rank: each rank's sampling (RPN, ROI) draws from its own stream
    if len(rngs) != ctx.world_size:
        log.warning("checkpoint from %d processes resumed on %d: random streams are not the same",
                    len(rngs), ctx.world_size)
    ckpt.restore_rng(rngs[ctx.rank % len(rngs)])


# ---- the loop ----

def run_iteration(cfg: Config, t: Trainer, ctx: Context, tracker: Tracker, cur_iter: int) -> dict:
    t.stats.iter_tic()
    data_start = time.perf_counter()
    images, targets = t.batches.next()
    data_time = time.perf_counter() - data_start
    lr = t.optimizer.param_groups[0]["lr"]
    losses = train_step(cfg, t, ctx, images, targets)
    t.scheduler.step()
    t.stats.iter_toc()
    t.stats.update(losses, lr, data_time, t.batches.qsize(), len(images) * ctx.world_size)
    if ctx.is_main:
        tracker.log_metrics(t.stats.metrics(cur_iter), cur_iter)
        t.stats.log(cur_iter)
    return losses


def train_step(cfg: Config, t: Trainer, ctx: Context, images, targets) -> dict[str, float]:
    with torch.autocast(ctx.device.type, enabled=t.scaler.is_enabled()):
        loss_dict = t.model(images, targets)
    total = sum(loss_dict.values())
    t.optimizer.zero_grad(set_to_none=True)
    t.scaler.scale(total).backward()
    if cfg.SOLVER.CLIP_GRAD_NORM > 0:
        t.scaler.unscale_(t.optimizer)
        clip_gradients(cfg, t.model)
    t.scaler.step(t.optimizer)
    t.scaler.update()
    # One host sync and one collective per iteration: every loss term in a single vector.
    values = torch.stack([total.detach(), *(v.detach() for v in loss_dict.values())]).float()
    values = all_mean(ctx, values).cpu().tolist()
    return dict(zip(["loss", *loss_dict], values))


def check_finite(losses: dict[str, float], cur_iter: int) -> None:
    if not math.isfinite(losses["loss"]):
        terms = ", ".join(f"{k}={v:.4g}" for k, v in losses.items())
        raise NonFiniteLoss(f"loss is {losses['loss']} at iteration {cur_iter} ({terms})")


# ---- checkpoints ----

def training_state(cfg: Config, t: Trainer, cur_iter: int, rngs: list) -> dict:
    model = t.model.module if isinstance(t.model, DistributedDataParallel) else t.model
    return {
        "model": model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "scaler": t.scaler.state_dict() if t.scaler.is_enabled() else {},
        "iteration": cur_iter,
        "config": redacted(cfg),  # checkpoints get shared: no secrets in them
        "rng": rngs,
        "sampler": {"seed": cfg.RNG_SEED, "next_iter": cur_iter + 1},
    }


def save_snapshot(cfg: Config, t: Trainer, ctx: Context, tracker: Tracker, cur_iter: int | None) -> None:
    """model_iter{cur_iter}.pth, or model_final.pth when cur_iter is None (rank 0 writes)."""
    rngs = gather_object(ctx, ckpt.capture_rng())  # every rank takes part; rank 0 gets them all
    if not ctx.is_main:
        return
    it = cfg.SOLVER.MAX_ITER - 1 if cur_iter is None else cur_iter
    t.writer.submit(training_state(cfg, t, it, rngs), Path(cfg.OUTPUT_DIR) / ckpt.checkpoint_name(cur_iter))


def save_preemption_snapshot(cfg, t: Trainer, ctx: Context, tracker: Tracker, cur_iter: int,
                             start_iter: int, snapshot_period: int, deadline: float) -> None:
    """Checkpoint the last finished iteration and wait (within the grace period) for its upload."""
    if not is_snapshot_iter(cfg, cur_iter, start_iter, snapshot_period):  # not saved by the loop
        save_snapshot(cfg, t, ctx, tracker, cur_iter)
    t.writer.close()
    if ctx.is_main:
        tracker.log_artifact(Path(cfg.OUTPUT_DIR) / "json_stats.log")  # the resumed job continues it
    tracker.wait(max(0.0, deadline - time.monotonic() - 3.0))  # leave time to flush and exit


def log_final_model(cfg: Config, t: Trainer, ctx: Context, tracker: Tracker) -> None:
    if ctx.is_main and cfg.TRACKING.LOG_MODEL:
        model = t.model.module if isinstance(t.model, DistributedDataParallel) else t.model
        tracker.log_model(model.cpu().eval(), cfg)
