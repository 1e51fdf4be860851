"""One trainer per OUTPUT_DIR: a second one started on the same folder stops before it touches
anything, naming the first. The lock is the kernel's (flock on OUTPUT_DIR/.lock, and on the folder
where the file system allows it), so a trainer that is killed leaves nothing stuck."""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import time
from pathlib import Path

from trainer.errors import UserError

LOCK_NAME = ".lock"


class OutputLock:
    """Held from `acquire()` until `release()` (or the process's end)."""

    def __init__(self, output_dir: Path):
        self.dir = Path(output_dir)
        self.path = self.dir / LOCK_NAME
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self._folder: tuple | None = None  # (device, inode) of the folder locked
        self._made: list[Path] = []  # the folders acquire() made, OUTPUT_DIR first, then its new parents

    def acquire(self) -> OutputLock:
        self._made = [p for p in (self.dir, *self.dir.parents) if not os.path.lexists(p)]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a dangling symlink, a special file system
            raise UserError(f"cannot make OUTPUT_DIR {self.dir}: {e.strerror or e}") from None
        self._dir_fd = self._lock_folder()
        while True:
            try:  # never through a link: the file is truncated and written
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            except OSError as e:
                self._close_folder()
                if os.path.lexists(self.path) and (os.path.islink(self.path) or not os.path.isfile(self.path)):
                    raise self._not_ours() from None
                for folder in self._made:  # made just now (a umask of 0777 makes them unwritable): not left behind
                    with contextlib.suppress(OSError):
                        folder.rmdir()
                mask = os.umask(0o022)
                os.umask(mask)
                hint = f" (this process's umask {mask:04o} makes folders it cannot write)" if mask & 0o200 else ""
                raise UserError(f"cannot write to OUTPUT_DIR {self.dir}: {e.strerror or e}{hint}") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO or a device put there
                os.close(fd)
                self._close_folder()
                raise self._not_ours()
            if st.st_nlink > 1:  # another name of a file elsewhere (a `cp -al` copy of a folder): never written
                os.close(fd)  # nor locked, which would lock out that folder's trainer; this name goes, a new file comes
                if self._dir_fd is None:  # no folder lock (NFS): a trainer of this folder may hold that name
                    raise UserError(f"{self.path} is another name of a file elsewhere (a hard link); move it away")
                os.unlink(self.path)
                continue
            try:
                _flock_soon(fd, fcntl.LOCK_EX)
            except BlockingIOError:
                os.close(fd)
                self._close_folder()
                raise self._in_use() from None
            if self._is_current(fd):
                break
            os.close(fd)  # a trainer that was ending removed that file meanwhile: lock the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
        self._fd = fd
        self._folder = _identity(os.fstat(self._dir_fd) if self._dir_fd is not None else os.stat(self.dir))
        return self

    def check(self) -> None:
        """Whether acquire() would succeed, creating nothing (--dry-run)."""
        if os.path.isdir(self.dir) and (folder := self._lock_folder(fcntl.LOCK_SH)) is not None:
            os.close(folder)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError:  # a link (ELOOP)
            raise self._not_ours() from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise self._not_ours()
            _flock_soon(fd, fcntl.LOCK_SH)
        except BlockingIOError:
            raise self._in_use() from None
        finally:
            os.close(fd)

    def _lock_folder(self, mode: int = fcntl.LOCK_EX) -> int | None:
        """The folder's own flock; None where the file system has none for folders (NFS emulates
        flock with POSIX locks, which need a file open for writing): there the file's lock alone."""
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            _flock_soon(fd, mode)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use() from None
        except OSError:
            os.close(fd)
            return None
        return fd

    def _close_folder(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def _not_ours(self) -> UserError:
        return UserError(f"{self.path} is not the lock file tracktron keeps in OUTPUT_DIR (a link, a folder, a "
                         "FIFO or a device); move it away")

    def _in_use(self) -> UserError:
        try:  # the first trainer wrote its name into the file (gone if someone deleted it)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO put there must not block
            try:
                holder = os.read(fd, 200).decode(errors="replace").strip()
            finally:
                os.close(fd)
        except OSError:
            holder = ""
        return UserError(f"OUTPUT_DIR {self.dir} is in use by another trainer ({holder or 'another process'}): "
                         "wait for it to end, or give this job another OUTPUT_DIR")

    def still_here(self) -> bool:
        """Whether the path still leads to the folder this lock holds: not when the folder was moved or
        renamed, or a link on its path now leads elsewhere (where a second trainer may work). A `.lock`
        deleted by hand changes nothing: the folder's own lock still keeps others out."""
        try:
            return self._folder is not None and _identity(os.stat(self.dir)) == self._folder
        except OSError:
            return False

    def _is_current(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Drop the lock; an OUTPUT_DIR this job made and wrote nothing to goes too, with the parents it made."""
        if self._fd is None:
            return
        try:
            untouched = bool(self._made) and [p.name for p in self.dir.iterdir()] == [LOCK_NAME]
        except OSError:  # OUTPUT_DIR was deleted or made unreadable meanwhile: nothing to tidy
            untouched = False
        if untouched:
            self.path.unlink(missing_ok=True)
            for folder in self._made:  # `output/` of `output/demo` too; one that got a file meanwhile stays
                try:
                    folder.rmdir()
                except OSError:
                    break
        os.close(self._fd)  # closing the descriptors drops the locks
        self._fd = None
        self._close_folder()


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino


def _flock_soon(fd: int, mode: int, within_s: float = 1.0) -> None:
    """flock without waiting on a holder, tried again for a moment (a --dry-run's check holds a shared
    lock for an instant); BlockingIOError once `within_s` has passed."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)
