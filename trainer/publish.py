"""What a finished job leaves in MLflow beside its metrics: model_final uploaded, its evaluation, and
the servable model logged (and registered, @final and @best). A job killed after model_final but
before these reached the server gets them when it is run again (the rerun trains nothing)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from trainer.checkpoint.files import FINAL, STATS_LOG
from trainer.hashing import sha256_of
from trainer.checkpoint.state import CheckpointError, load
from trainer.config import Config
from trainer.distributed import Context
from trainer.errors import first_line
from trainer.evaluation import evaluate
from trainer.inference import categories_of, save as save_model
from trainer.lineage import dataset_inputs
from trainer.preflight import check_same_categories
from trainer.tracking import Tracker
from trainer.tracking.runs import checkpoint_artifact

log = logging.getLogger(__name__)

MODEL_FOLDER = Path("model") / "detector"


@dataclass
class AlreadyFinished:
    """A rerun of a finished job: where its model_final is, and what it sent the run (complete_finished_run)."""

    source: str
    sent: list[str] = field(default_factory=list)


def log_final_model(cfg: Config, tracker: Tracker, output_dir: Path, state_dict: dict, categories: dict) -> None:
    """The final weights as a servable model (OUTPUT_DIR/model/detector: weights, config, categories)."""
    if cfg.TRACKING.LOG_MODEL:
        folder = save_model(output_dir / MODEL_FOLDER, cfg, state_dict, categories["categories"],
                            categories["keypoint_names"])
        tracker.log_model(folder, cfg)


def complete_finished_run(cfg: Config, tracker: Tracker, output_dir: Path, prepared=None, device=None) -> list[str]:
    """A rerun of a finished job: send what its run lacks (model_final, json_stats.log, the final
    evaluation, the model, its registration); returns what it sent (queued: finish() says what did
    not arrive). `prepared` is the job's network and dataset (None when its data is gone)."""
    final, run = output_dir / FINAL, tracker.run
    sent = [run.resent_metrics] if run.resent_metrics else []
    if run.run_id is None or not final.exists():
        return sent
    if FINAL not in run.checkpoints:  # the artifact store was down to the end
        log.info("the run lacks %s: uploading the local one", FINAL)
        tracker.log_checkpoint(final, sha256_of(final))
        sent.append(FINAL)
        if (output_dir / STATS_LOG).exists():
            tracker.log_artifact(output_dir / STATS_LOG)
            sent.append(STATS_LOG)
    evaluating = bool(cfg.TEST.DATASETS) and _evaluation_due(cfg, tracker)
    logging_model = cfg.TRACKING.LOG_MODEL and not run.model_logged  # killed while the model was being logged
    if evaluating or logging_model:
        sent += _from_final(cfg, tracker, output_dir, prepared, device, evaluating, logging_model)
    registered = cfg.TRACKING.REGISTERED_MODEL
    if cfg.TRACKING.LOG_MODEL and run.model_logged and (aliases := _registration_due(tracker, registered)):
        log.info("the run's model lacks %s in the registry (asked for only now, or cut short): registering it",
                 " and ".join(f"{registered}@{a}" for a in aliases))
        tracker.register_model(registered, aliases)
        sent.append(f"the model's registration as {registered} (@{', @'.join(aliases)})")
    return sent


def _from_final(cfg: Config, tracker: Tracker, output_dir: Path, prepared, device, evaluating: bool,
                logging_model: bool) -> list[str]:
    """model_final's evaluation and the model logged from it, as the end of training would."""
    try:
        state = load(output_dir / FINAL)
    except CheckpointError as e:
        log.warning("cannot evaluate or log the final model: %s", e)
        return []
    sent = []
    if evaluating and _evaluate_final(cfg, tracker, output_dir, prepared, state, device):  # first: @best is
        sent.append(f"the evaluation of {FINAL}")  # chosen among every evaluation of the run
    if not logging_model:
        return sent
    if (categories := state.get("categories") or _training_set_categories(state, prepared)) is None:
        log.warning("cannot log the final model: %s predates the categories a model needs", output_dir / FINAL)
        return sent
    log.info("the run lacks its logged model: logging it from %s", FINAL)
    log_final_model(cfg, tracker, output_dir, state["model"], categories)
    return sent + ["the model"]


def _training_set_categories(state: dict, prepared) -> dict | None:
    """A model_final of before 2026-12-01 names no categories: the job's training set does, when
    its weights fit the network built for that set (as many classes)."""
    if prepared is None:
        return None
    try:
        prepared.model.load_state_dict(state["model"])
    except Exception:  # other shapes or names: not the categories these weights were trained on
        return None
    log.info("%s predates the categories a model keeps: the training set's are taken", FINAL)
    return categories_of(prepared.dataset)


def _registration_due(tracker: Tracker, registered: str) -> list[str]:
    try:
        return tracker.registration_due(registered)
    except Exception as e:  # the registry cannot be searched: registering blind could make a second version
        log.warning("cannot tell whether the run's model is registered as %s (%s): it is not registered now",
                    registered, first_line(e, 300))
        return []


def _again(tracker: Tracker) -> str:
    return f"tracktron eval --weights runs:/{tracker.run.run_id}/{checkpoint_artifact(FINAL)} logs it into the run"


def _evaluation_due(cfg: Config, tracker: Tracker) -> bool:
    try:
        return tracker.evaluation_due(FINAL, dataset_inputs(cfg, training=False))
    except Exception as e:  # a test set that is gone, a server that failed the search: nothing is logged
        log.warning("cannot tell whether the run has %s's evaluation (%s); %s", FINAL, first_line(e, 300),
                    _again(tracker))
        return False


def _evaluate_final(cfg: Config, tracker: Tracker, output_dir: Path, prepared, state: dict, device) -> bool:
    """model_final's evaluation, which never reached the run, made now on this process alone, as the end
    of training would. Whatever fails here is a warning: the model is logged all the same."""
    if prepared is None:
        log.warning("the run lacks the evaluation of %s and the job's data is gone: %s", FINAL, _again(tracker))
        return False
    log.info("the run lacks the evaluation of %s: evaluating it now", FINAL)
    try:
        check_same_categories(output_dir / FINAL, state, prepared.dataset)  # labels read as these categories
        prepared.model.load_state_dict(state["model"])
        evaluate(cfg, prepared.model.to(device), Context(device=device), output_dir, tracker,
                 step=cfg.SOLVER.MAX_ITER - 1, checkpoint=FINAL)
    except Exception as e:  # other categories, a test set changed meanwhile, no memory, a full disk
        log.warning("cannot evaluate %s (%s): %s", FINAL, first_line(e, 500), _again(tracker))
        return False
    return True
