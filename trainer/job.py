"""The training job as every step of it sees it (engine.py, resume.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.config import Config
from trainer.distributed import Context
from trainer.logs import JobLog
from trainer.preflight import Prepared
from trainer.tracking import Tracker


@dataclass
class Job:
    """What every step needs: the config, this process's place in the job, its run, its folder."""

    cfg: Config
    ctx: Context
    tracker: Tracker
    output_dir: Path
    prepared: Prepared | None = None  # the dataset and network the CLI checked the job with
    in_its_folder: Callable[[], bool] = lambda: True  # OUTPUT_DIR is still the folder rank 0 locked
    log: JobLog | None = None  # OUTPUT_DIR/log.txt, which rank 0 writes once the folder is settled
