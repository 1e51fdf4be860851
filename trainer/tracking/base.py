"""The tracking interface the engine, evaluation and the CLI talk to, and its no-op implementation."""
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
    experiment_id: str | None = None
    model_logged: bool = False  # the servable model is in the run (and registered, if asked)
    last_step: int = -1  # the newest iteration whose metrics the run had when the job started (-1: none)
    resent_metrics: str = ""  # the metrics an earlier start could not send, which this one sends first (unsent.py)


class Tracker:
    """No-op tracker (TRACKING.ENABLED false, and every rank but 0)."""

    uri: str | None = None
    run: RunInfo = RunInfo()

    def start(self, cfg: Config, resume_run_id: str | None = None, new_run: bool = False,
              wait_for_checks: bool = False) -> None:
        """Find the job's run on a background thread (a resumed job's newest checkpoint starts
        downloading at once), then make or reopen it; `run` waits for it. With wait_for_checks, nothing
        is written until checks_passed(): a job that fails its checks leaves the store as it was."""

    def checks_passed(self) -> None:
        """The job's checks passed: start() may now make or reopen its run."""

    def found_checkpoints(self) -> list[str]:
        """The checkpoints of the run start() found, when the job continues it, newest first (model_final
        first of all); waits for the lookup."""
        return []

    def check_found(self) -> None:
        """Wait for start()'s lookup and raise its UserError: a store that cannot be used, or another
        live trainer of the job's run (the lookup watches its heartbeat)."""
        self.found_checkpoints()

    def fetch_checkpoint(self, name: str, dest_dir: Path) -> Path | None:
        """Download a complete checkpoint of the run and verify it: None when it cannot be downloaded,
        CheckpointError when its bytes are not the ones its sha256 tag names."""
        return None

    def fetch_artifact(self, name: str, dest_dir: Path) -> Path | None:
        return None

    def set_tags(self, tags: dict) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int) -> None:
        pass

    def log_artifact(self, path: Path, artifact_path: str | None = None, first: bool = False) -> None:
        """In the background; `first`: the run's first upload, sent now, so that an artifact store that
        refuses uploads stops the job before it trains (UserError) rather than every checkpoint after."""

    def log_inputs(self, datasets: list[dict], parent: dict) -> None:
        """The run's datasets (lineage.dataset_inputs) and the model its weights came from, if any."""

    def log_image(self, image, key: str, step: int) -> None:
        """An HxWx3 uint8 picture at `step` (the UI shows them with a step slider)."""

    def log_table(self, table: dict, artifact_file: str) -> None:
        """Columns (name -> list of values) as an MLflow table artifact."""

    def log_evaluation(self, metrics: dict, step: int, checkpoint: str) -> None:
        """An evaluation of the run's checkpoint file `checkpoint`: metrics linked to it as a model."""
        self.log_metrics(metrics, step)

    def evaluation_due(self, checkpoint: str, datasets: list[dict]) -> bool:
        """Whether a rerun evaluates the run's checkpoint file `checkpoint` into the run, on the test sets
        `datasets` (lineage.dataset_inputs): the run lacks it, and they are its own (no run: nothing to send)."""
        return False

    def log_checkpoint(self, path: Path, sha256: str) -> None:
        """Upload a written checkpoint and mark it complete (tags); a newer one supersedes it. With
        TRACKING.CHECKPOINTS_KEEP, older model_iter ones then leave the run (tracking/checkpoint_uploads.py)."""

    def uploading(self) -> set[str]:
        """Checkpoint files whose upload is still to come (an outage holds them): pruning keeps them."""
        return set()

    def log_model(self, folder: Path, cfg: Config) -> None:
        """Log a model folder (trainer.inference.save) as the run's servable MLflow model."""

    def registration_due(self, registered: str) -> list[str]:
        """The aliases of the registered model `registered` (final, best) that a rerun of the finished
        job sets for its logged model: TRACKING.REGISTERED_MODEL set only now, or a registration cut short."""
        return []

    def register_model(self, registered: str, aliases: list[str]) -> None:
        """Register the run's logged model as `registered`, and set `aliases`: final (it), best (the
        run's best checkpoint)."""

    def wait(self, timeout: float) -> bool:
        """Wait for queued uploads (preemption: the last checkpoint must reach the server)."""
        return True

    def finish(self, status: str | None, reason: str = "", timeout: float | None = None) -> list[str]:
        """FINISHED, FAILED or KILLED (None: leave the status alone); flushes what is queued within
        `timeout` (default TRACKING.FLUSH_TIMEOUT_S). Returns what never reached the server that
        matters (empty: everything did, or a newer checkpoint made an older one moot)."""
        return []

    def refusal(self, timeout: float = 5.0) -> tuple[str, str] | None:
        """Why the server refuses every write to the run ("deleted", "gone", "credentials", ...), asked
        once; None when it takes them or cannot tell."""
        return None

    def last_words(self, status: str, reason: str) -> None:
        """The process is about to be killed, stuck (a collective waiting for a dead rank): set the
        run's status now, unless finish() has, with nothing flushed or waited for."""
