"""How the job's processes log: one format on stderr, libraries that repeat themselves quietened,
secrets redacted."""
from __future__ import annotations

import logging
import sys

from trainer import redaction


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="[%(asctime)s %(levelname)s %(name)s] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)
    for noisy in ("alembic", "botocore", "mlflow.store.db.utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # our retries say it once, not per attempt
    redaction.install()  # no secret in any line that leaves
