"""How the job's processes log: one format on stderr, libraries that repeat themselves quietened,
secrets redacted; and the console (stdout, stderr), whose loss never fails the job."""
from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import stat
import sys
import time
import warnings
from pathlib import Path
from typing import TextIO

from trainer import redaction
from trainer.atomic_write import HOST
from trainer.errors import UserError


FORMAT = "[%(asctime)s %(levelname)s %(name)s] %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=FORMAT, datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    for noisy in ("alembic", "botocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # It logs every SQLite error with its traceback (~90 lines), then raises it: our retries say it in one line.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # our retries say it once, not per attempt
    if not sys.warnoptions:  # MLFLOW_TRACKING_INSECURE_TLS: urllib3 warns of every request; said once a host
        warnings.filterwarnings("once", message="Unverified HTTPS request")  # (PYTHONWARNINGS and -W stay the user's)
    redaction.install()  # no secret in any line that leaves


@contextlib.contextmanager
def held_while_checking():
    """Around a job's checks: what is logged meanwhile is held, then shown in order once they all
    passed. When one fails, the INFO lines (a dataset's summary, the weights loaded) are dropped and
    the warnings shown, so that bad input ends in its one `error:` line, not after a dataset's news."""
    root = logging.getLogger()
    shown, held = root.handlers[:], logging.handlers.BufferingHandler(capacity=sys.maxsize)
    root.handlers = [held]
    passed = False
    try:
        yield
        passed = True
    finally:
        root.handlers = shown
        for record in held.buffer:
            if passed or record.levelno >= logging.WARNING:
                for handler in shown:
                    if record.levelno >= handler.level:
                        handler.handle(record)


class JobLog(logging.Handler):
    """OUTPUT_DIR/log.txt, detectron2's: what the job logs, appended start after start (each start's
    host and pid said first), for the run to keep. Lines wait in memory until open(): until the
    job's checks passed and its folder is settled (an earlier job's files set aside, a moved job's
    log fetched from its run); a job that never gets there writes nothing. A write that fails (a full
    disk) ends the file, said once: the console and json_stats.log go on. It goes to the run only while
    it is the file opened, and only when it holds the run's copy (sendable)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        self.path: Path | None = None
        self._file: TextIO | None = None
        self._waiting: list[str] | None = []
        self._started = time.time()
        self._identity: tuple | None = None  # (device, inode) of the file opened
        self._send = False

    def open(self, path: Path, send: bool = True) -> None:
        """send: False when the run holds a log.txt that is not in this one (it could not be fetched):
        this file, sent whole, would replace it."""
        with self.lock:
            try:
                self._file = open(path, "a", encoding="utf-8", errors="backslashreplace")
                st = os.fstat(self._file.fileno())
                self.path, self._identity, self._send = path, (st.st_dev, st.st_ino), send
            except OSError as e:
                self._failed(e, path)
                return
            waiting, self._waiting = self._waiting or [], None
            self.note(f"started on {HOST} (pid {os.getpid()})", when=self._started)
            for line in waiting:
                self._write(line)

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record) + "\n"
        if self._waiting is not None:
            self._waiting.append(line)
        elif self._file is not None:
            self._write(line)

    def note(self, text: str, when: float | None = None) -> None:
        """A line for the file alone: the console says it otherwise (the job's last line). Redacted as
        the log records are: a reason may quote a URL with its password."""
        with self.lock:
            if self._file is not None:
                text = redaction.printable(redaction.redact_text(text), keep_newlines=True)
                self._write(f"[{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))} tracktron] {text}\n")

    def sendable(self) -> bool:
        """Whether log.txt may go to the run, whole: it is still the file this job opened. One deleted
        since (a clean-up of *.txt) failed the job's end on its upload, and one replaced (by a folder,
        by a link to another job's log) would fail it or put another job's log in the run; the run
        keeps the copy it had, and that is said once."""
        with self.lock:
            if not self._send:
                return False
            try:
                st = os.stat(self.path)
                intact = (st.st_dev, st.st_ino) == self._identity and stat.S_ISREG(st.st_mode)
            except OSError:
                intact = False
            if not intact:
                self._send = False
                self._failed(None, self.path, "it was deleted or replaced while the job ran")
            return intact

    def close(self) -> None:
        with self.lock:
            self._waiting = None
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None
        super().close()

    def _write(self, line: str) -> None:
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            self._failed(e, self.path)

    def _failed(self, e: OSError | None, path: Path, why: str = "") -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        self._file, self._waiting = None, None  # first, so that the warning below is not written here
        logging.getLogger("tracktron").warning("cannot write %s (%s): the job goes on without it; its stats are in "
                                               "json_stats.log and on the tracking server", path,
                                               why or e.strerror or e)


def hold_console_descriptors() -> None:
    """A process started with its console closed (`>&- 2>&-`): the next file opened would take
    descriptor 1 or 2, and a library's C-level write to stdout or stderr would land in it (a
    checkpoint, the SQLite store); Python's sys.stdout and sys.stderr are None, and MLflow's model
    logging failed writing to them. /dev/null stands in for each."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")
    if not isinstance(sys.stdout, _Console):  # main() called again in one process (tests)
        sys.stdout, sys.stderr = _Console(sys.stdout), _Console(sys.stderr)


class _Console:
    """sys.stdout or sys.stderr, for the libraries too: MLflow prints to stderr while it registers the
    model, and with the reader gone (`2>&1 | head`, a dead `tee`: EPIPE) or the disk full (ENOSPC)
    its print failed the registration, retried until the flush timeout. A write that fails points
    the descriptor at /dev/null instead (write_or_drop)."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            _gone(self._stream, e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            _gone(self._stream, e)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def write_or_drop(stream: TextIO, text: str) -> None:
    """Write to the console (stdout, stderr), a view of the job whose record json_stats.log and the
    tracking server keep. If its reader is gone (`| head` ended, a `tee` or log shipper died: EPIPE;
    the terminal hung up: EIO), the descriptor is pointed at /dev/null, so that neither this write nor
    a later one (the interpreter's last flush included) fails the job, and that is said once."""
    try:
        stream.write(text)
        stream.flush()
    except UnicodeEncodeError:  # PYTHONIOENCODING=ascii and a path that is not: escaped, as on Python's stderr
        write_or_drop(stream, text.encode(stream.encoding, "backslashreplace").decode(stream.encoding))
    except OSError as e:
        _gone(stream, e)


def _gone(stream: TextIO, e: OSError) -> None:
    """The console's reader is gone: its descriptor points at /dev/null from now on, said once."""
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, OSError):  # not a file: nothing to redirect
        raise e from None
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    with contextlib.suppress(OSError):  # what the stream still holds goes to /dev/null now
        stream.flush()
    logging.getLogger("tracktron").warning("the console's %s is gone (%s): the job goes on; its stats are in "
                                           "json_stats.log and on the tracking server", _name(fd), e)


def _name(fd: int) -> str:
    return {1: "stdout", 2: "stderr"}.get(fd, f"descriptor {fd}")


def check_arguments_are_text(args: list[str]) -> None:
    """With `LC_ALL=C PYTHONUTF8=0`, Python keeps an argument's non-ASCII bytes (a path's) as lone
    surrogates, which MLflow, SQLite and JSON cannot store: the job would fail at its first write
    of it, or call it unprintable. One line that says what to change instead. The same of the
    MLflow and tracktron variables of the environment (MLFLOW_EXPERIMENT_NAME=démo), named."""
    encoding = sys.getfilesystemencoding()
    named = [(v, f"the value of {k}") for k, v in os.environ.items() if k.startswith(("MLFLOW_", "TRACKTRON_"))]
    for arg, shown in [(a, ascii(a)) for a in args] + named:  # a variable's value unshown: it may be a password
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            if encoding.lower().replace("-", "") == "utf8":  # the bytes themselves: a name from a Latin-1 archive
                raise UserError(f"{shown} is not valid UTF-8, which tracktron needs of every name it is "
                                "given: rename the file or folder (convmv -f latin1 -t utf8 does it)") from None
            raise UserError(f"{shown} is not text in this locale's encoding ({encoding}): "
                            "use a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1") from None
