"""How the job's processes log: one format on stderr, libraries that repeat themselves quietened,
secrets redacted."""
from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from trainer import redaction


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="[%(asctime)s %(levelname)s %(name)s] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)
    for noisy in ("alembic", "botocore", "mlflow.store.db.utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # our retries say it once, not per attempt
    redaction.install()  # no secret in any line that leaves


def write_or_drop(stream: TextIO, text: str) -> None:
    """Write to the console (stdout, stderr), a view of the job whose record json_stats.log and the
    tracking server keep. If its reader is gone (`| head` ended, a `tee` or log shipper died: EPIPE;
    the terminal hung up: EIO), the descriptor is pointed at /dev/null, so that neither this write nor
    a later one (the interpreter's last flush included) fails the job, and that is said once."""
    try:
        stream.write(text)
        stream.flush()
    except OSError as e:
        try:
            fd = stream.fileno()
        except (AttributeError, ValueError, OSError):  # not a file: nothing to redirect
            raise e from None
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        logging.getLogger("tracktron").warning("the console's %s is gone (%s): the job goes on; its stats are in "
                                               "json_stats.log and on the tracking server", _name(fd), e)


def _name(fd: int) -> str:
    return {1: "stdout", 2: "stderr"}.get(fd, f"descriptor {fd}")
