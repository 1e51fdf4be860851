"""What a finished job leaves in MLflow beside its metrics: model_final uploaded, and the servable
model logged (and registered, @final and @best). A job killed after model_final but before these
reached the server gets them when it is run again (the rerun trains nothing)."""
from __future__ import annotations

import logging
from pathlib import Path

from trainer.checkpoint.files import FINAL
from trainer.hashing import sha256_of
from trainer.checkpoint.state import CheckpointError, load
from trainer.config import Config
from trainer.inference import save as save_model
from trainer.tracking import Tracker

log = logging.getLogger(__name__)

MODEL_FOLDER = Path("model") / "detector"


def log_final_model(cfg: Config, tracker: Tracker, output_dir: Path, state_dict: dict, categories: dict) -> None:
    """The final weights as a servable model (OUTPUT_DIR/model/detector: weights, config, categories)."""
    if cfg.TRACKING.LOG_MODEL:
        folder = save_model(output_dir / MODEL_FOLDER, cfg, state_dict, categories["categories"],
                            categories["keypoint_names"])
        tracker.log_model(folder, cfg)


def complete_finished_run(cfg: Config, tracker: Tracker, output_dir: Path) -> None:
    """A rerun of a finished job: send what its run lacks (model_final, json_stats.log, the model)."""
    final, run = output_dir / FINAL, tracker.run
    if run.run_id is None or not final.exists():
        return
    if FINAL not in run.checkpoints:  # the artifact store was down to the end
        log.info("the run lacks %s: uploading the local one", FINAL)
        tracker.log_checkpoint(final, sha256_of(final))
        if (output_dir / "json_stats.log").exists():
            tracker.log_artifact(output_dir / "json_stats.log")
    if cfg.TRACKING.LOG_MODEL and not run.model_logged:  # killed while the model was being logged
        try:
            state = load(final)
        except CheckpointError as e:
            log.warning("cannot log the final model: %s", e)
            return
        if "categories" not in state:
            log.warning("cannot log the final model: %s predates the categories a model needs", final)
            return
        log.info("the run lacks its logged model: logging it from %s", FINAL)
        log_final_model(cfg, tracker, output_dir, state["model"], state["categories"])
