"""`tracktron train --dry-run`: every check a job's start makes, then what it would do. Nothing is
trained and nothing written (no OUTPUT_DIR, no tracking store, no run: the run lookup only reads),
except the synthetic dataset, which a job generates on first use."""
from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.files import FINAL, local_checkpoints
from trainer.config import Config
from trainer.job_identity import job_hash
from trainer.logs import held_while_checking
from trainer.output_lock import OutputLock
from trainer.preflight import check_local, load_initial_weights, prepare
from trainer.redaction import printable, redact_text
from trainer.lr_policy import lr_at
from trainer.tracking.job_run import find_job_run
from trainer.tracking.runs import tracking_uri


@held_while_checking()
def plan(cfg: Config, resume_run_id: str | None, new_run: bool, world_size: int) -> str:
    """The job as it would run, in a few lines; UserError for the first thing that would stop it."""
    OutputLock(Path(cfg.OUTPUT_DIR)).check()
    prepared = prepare(cfg)  # what a job's start checks
    dataset, model = prepared.dataset, prepared.model
    local = check_local(cfg, prepared) if cfg.TRAIN.AUTO_RESUME else None  # another job's: UserError
    tracking, found = _tracking(cfg, resume_run_id, new_run)  # a job may continue from its run's checkpoints alone
    if local is None and not found:  # as the job's start: only a start from iteration 0 reads them
        load_initial_weights(cfg, prepared)
    params = sum(p.numel() for p in model.parameters())
    lines = [f"job {job_hash(cfg)} ({cfg.NAME}), {world_size} process(es)",
             f"model: {cfg.MODEL.TYPE}{f' ({cfg.MODEL.BACKBONE})' if cfg.MODEL.BACKBONE else ''}, "
             f"{dataset.num_classes} classes, {params:,} parameters, from "
             f"{redact_text(cfg.TRAIN.WEIGHTS) or 'random initialisation'}",
             f"train: {', '.join(cfg.TRAIN.DATASETS)}: {len(dataset.aspect_ratios)} images, "
             f"{cfg.TRAIN.IMS_PER_BATCH} per batch and process",
             f"test: {_test_sets(cfg, prepared.test_sizes)}",
             _schedule(cfg),
             tracking,
             f"output: {cfg.OUTPUT_DIR}: {_local_start(cfg, local)}"]
    return "\n".join(printable(line) for line in lines)  # NAME, paths and dataset names are anyone's to choose


def _test_sets(cfg: Config, sizes: dict) -> str:
    if not cfg.TEST.DATASETS:
        return "none"
    sizes = [f"{name}: {sizes[name]} images" for name in cfg.TEST.DATASETS]
    when = f"every {cfg.TEST.EVAL_PERIOD} iterations and " if cfg.TEST.EVAL_PERIOD else ""
    return f"{'; '.join(sizes)}; evaluated {when}after model_final"


def _schedule(cfg: Config) -> str:
    s, period = cfg.SOLVER, max(1, cfg.TRAIN.SNAPSHOT_ITERS // cfg.NUM_GPUS)
    marks = sorted({0, min(s.WARM_UP_ITERS, s.MAX_ITER - 1), *[x for x in s.STEPS if x < s.MAX_ITER], s.MAX_ITER - 1})
    lrs = ", ".join(f"{lr_at(cfg.SOLVER, it):.6g} at {it}" for it in marks)
    return (f"schedule: {s.MAX_ITER} iterations, LR {s.LR_POLICY} ({lrs}); a checkpoint every {period} "
            f"iterations ({max(0, (s.MAX_ITER - 2) // period)} model_iter files, then model_final)")


def _tracking(cfg: Config, resume_run_id: str | None, new_run: bool) -> tuple[str, list[str]]:
    """The tracking line, and the checkpoints of the run the job continues."""
    if not cfg.TRACKING.ENABLED:
        return "tracking: off", []
    uri = tracking_uri(cfg)
    plan, found = find_job_run(cfg, uri, resume_run_id, new_run)
    return f"tracking: {redact_text(uri)}: {plan}", found


def _local_start(cfg: Config, local: tuple | None) -> str:
    if not cfg.TRAIN.AUTO_RESUME:
        found = local_checkpoints(Path(cfg.OUTPUT_DIR))
        return f"starts over: its {len(found)} checkpoints move to earlier-<time>/" if found else "no checkpoint here"
    if local is None:
        return "no checkpoint here"
    path, state = local
    if path.name == FINAL:
        return "model_final.pth is here: nothing to do"
    return f"newest checkpoint {path.name}: resumes at iteration {state['iteration'] + 1}"
