"""Experiment tracking.

The engine, evaluation and the CLI know nothing of MLflow's API: they call a `Tracker` (base.py,
with the no-op implementation), whose methods return at once. The MLflow implementation
(mlflow_tracker.py) queues network work for background threads (background.py); runs.py finds the
job's run and holds the checkpoint-tag protocol; transfers.py moves checkpoint-sized files (multipart,
timeouts by size) and pruning.py keeps TRACKING.CHECKPOINTS_KEEP of them in the run;
system_metrics.py runs MLflow's system-metrics monitor. `create_tracker` picks the implementation
from TRACKING.ENABLED and the rank.
"""
from __future__ import annotations

from trainer.config import Config
from trainer.tracking.base import RunInfo, Tracker

__all__ = ["RunInfo", "Tracker", "attach", "create_tracker"]


def create_tracker(cfg: Config, rank: int = 0, world_size: int = 1) -> Tracker:
    """Only global rank 0 talks to MLflow."""
    if not cfg.TRACKING.ENABLED or rank != 0:
        return Tracker()
    from trainer.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker(cfg, world_size)


def attach(cfg: Config, run_id: str) -> Tracker:
    """A tracker that logs into an existing run and leaves its status alone (`tracktron eval`)."""
    from trainer.tracking.mlflow_tracker import MlflowTracker

    tracker = MlflowTracker(cfg)
    tracker.attach(run_id)
    return tracker
