"""Files that are replaced whole: a reader (or an upload still queued) sees the old file or the new
one, never half of one, whatever kills the writer."""
from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
import threading
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no room: the disk, the quota, the file size limit


class WriteError(OSError):
    """A file that could not be written (write_atomic: for want of room): one line naming it and the
    free space."""

    what = "file"

    def __init__(self, path: Path, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.path = Path(path)
        self.free = free_space(self.path.parent)  # when it failed, before the partial file goes

    def __str__(self) -> str:
        return f"cannot write {self.what} {self.path}: {self.strerror}{self.free}"


HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def temp_name(path: Path) -> Path:
    """`.<name>.tmp.<host>.<pid>` beside `path` (whose it is, so a later job knows when it is stale), the
    name cut to fit 255 bytes; recorded as made here until forget()."""
    suffix = f".tmp.{HOST}.{os.getpid()}".encode()
    return made_here(path.with_name(os.fsdecode(b"." + os.fsencode(path.name)[:255 - 1 - len(suffix)] + suffix)))


# The temporary files and folders this process is writing now: an earlier life of the same pid (a
# container's PID 1, restarted) left names like theirs, which neither the pid nor an mtime tells apart.
_MADE: set[str] = set()
_MADE_LOCK = threading.Lock()


def made_here(path: Path) -> Path:
    """Record `path` as this process's, before it is made: a cleanup that runs meanwhile keeps it."""
    with _MADE_LOCK:
        _MADE.add(_key(path))
    return path


def forget(path: Path) -> None:
    """`path` was renamed or removed: its name is no longer this process's to keep."""
    with _MADE_LOCK:
        _MADE.discard(_key(path))


def is_made_here(path: Path) -> bool:
    with _MADE_LOCK:
        return _key(path) in _MADE


def _key(path: Path) -> str:
    """The folder resolved (OUTPUT_DIR given through a link, or relative), the name itself not followed."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(folder), name)


def free_space(folder: Path) -> str:
    try:
        return f" ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free in {folder})"
    except OSError:
        return ""


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write `data` to a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException as e:
        error = WriteError(path, e) if isinstance(e, OSError) and e.errno in FULL else None
        tmp.unlink(missing_ok=True)
        if error is not None:
            raise error from e
        raise
    finally:
        forget(tmp)
    return path


def write_probe(path: Path) -> None:
    """`path` made and a file written there and dropped, or the OSError: os.access says yes where
    writing fails (root under /proc or /sys, a read-only mount)."""
    path.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=path).close()
