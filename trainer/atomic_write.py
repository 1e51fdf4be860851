"""Files that are replaced whole: a reader (or an upload still queued) sees the old file or the new
one, never half of one, whatever kills the writer."""
from __future__ import annotations

import errno
import os
import re
import shutil
import socket
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
    """`.<name>.tmp.<host>.<pid>` beside `path`: whose it is, so a later job knows when it is stale.
    A name near the system's 255 bytes (an image's, for predict) is cut to leave room for the suffix."""
    suffix = f".tmp.{HOST}.{os.getpid()}".encode()
    return path.with_name(os.fsdecode(b"." + os.fsencode(path.name)[:255 - 1 - len(suffix)] + suffix))


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
    return path
