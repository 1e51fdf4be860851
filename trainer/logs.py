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
    host and pid first). Lines wait in memory until open(), once the job's checks passed and its folder
    is settled. A write that fails (a full disk) ends the file, said once; the job goes on."""

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
        """Whether log.txt may go to the run, whole: it is still the file this job opened (not deleted,
        nor replaced by a folder or a link to another job's log); else the run keeps its copy, said once."""
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

    def end(self) -> None:
        """The job is over: the file is closed, and what is logged later is not written. Not close(),
        which logging.shutdown and logging.config.dictConfig call on every handler: MLflow up to 3.16
        runs dictConfig when it is first imported, in the middle of a job's checks."""
        with self.lock:
            self._waiting = None
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None
        self.close()

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
    """A process started with its console closed (`>&- 2>&-`): /dev/null stands in for each of 0, 1, 2,
    or the next file opened (a checkpoint) would take the descriptor and get C-level writes to stdout."""
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
    """sys.stdout or sys.stderr, for the libraries too (MLflow prints while it registers the model): a
    write that fails (EPIPE, ENOSPC) points the descriptor at /dev/null instead of raising."""

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
    """Write to the console, a view of the job: if its reader is gone (EPIPE, EIO), the descriptor is
    pointed at /dev/null, so that neither this write nor a later one fails the job; said once."""
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
    """Every argument, and the MLFLOW_/TRACKTRON_ variables, as text MLflow, SQLite and JSON can store:
    with `LC_ALL=C PYTHONUTF8=0` Python keeps non-ASCII bytes as lone surrogates. One line says what to change."""
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
