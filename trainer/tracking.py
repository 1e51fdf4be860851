"""The tracking interface the engine talks to, and the no-op implementation.

The engine knows nothing of MLflow: it calls these methods, each of which returns at once (the
MLflow implementation queues network work for background threads). `create_tracker` picks the
implementation from TRACKING.ENABLED.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainer.config import Config


@dataclass
class RunInfo:
    """What the tracker knows of this job's run when training starts."""

    run_id: str | None = None
    ui_url: str | None = None
    resumed: bool = False  # an existing run of this job is continued
    checkpoints: list[str] = field(default_factory=list)  # complete checkpoints, newest first


class Tracker:
    """No-op tracker (TRACKING.ENABLED false, and every rank but 0)."""

    run: RunInfo = RunInfo()

    def begin(self, cfg: Config, resume_run_id: str | None = None, new_run: bool = False) -> None:
        """Start finding or creating the job's run in the background; `start()` returns it."""

    def start(self, cfg: Config, resume_run_id: str | None = None, new_run: bool = False) -> RunInfo:
        return self.run

    def fetch_checkpoint(self, name: str, dest_dir: Path) -> Path | None:
        """Download a complete checkpoint of the run and verify it; None if it is unusable."""
        return None

    def fetch_artifact(self, name: str, dest_dir: Path) -> Path | None:
        return None

    def set_tags(self, tags: dict) -> None:
        pass

    def log_params(self, params: dict) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int) -> None:
        pass

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        pass

    def log_checkpoint(self, path: Path, sha256: str, on_done=None) -> None:
        """Upload a written checkpoint, mark it complete (tags), then call `on_done()`."""
        if on_done:
            on_done()

    def log_model(self, model, cfg: Config) -> None:
        pass

    def wait(self, timeout: float) -> bool:
        """Wait for queued uploads (preemption: the last checkpoint must reach the server)."""
        return True

    def finish(self, status: str, reason: str = "", timeout: float | None = None) -> list[str]:
        """FINISHED, FAILED or KILLED; flushes what is queued within `timeout` (default
        TRACKING.FLUSH_TIMEOUT_S). Returns what never reached the server (empty: everything did)."""
        return []


def create_tracker(cfg: Config, rank: int = 0, world_size: int = 1) -> Tracker:
    """Only global rank 0 talks to MLflow."""
    if not cfg.TRACKING.ENABLED or rank != 0:
        return Tracker()
    from trainer.mlflow_tracking import MlflowTracker

    return MlflowTracker(cfg, world_size)
