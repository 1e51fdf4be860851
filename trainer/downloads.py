"""Weights named by URL (Detectron's configs name their ImageNet weights so): fetched once into
TRACKTRON_CACHE (default ~/.cache/tracktron) and read from there afterwards. No torch here: the CLI
fetches them before a run is made for the job."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import re
import shutil
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from trainer.atomic_write import write_probe
from trainer.errors import UserError, first_line
from trainer.redaction import forget_url_credentials, redact_urls

log = logging.getLogger(__name__)
URL_SCHEMES = ("http://", "https://")
# A server that sends a byte now and then never trips a socket's timeout: less than this many bytes
# in a window of TRACKTRON_DOWNLOAD_STALL_S seconds (default 60) gives the download up.
MIN_BYTES_PER_WINDOW = 64 * 1024
# A running download holds a flock on its `.part-*`; where the file system has no flock (some network
# file systems), a part untouched this long is taken for a download killed before it could clean up.
UNLOCKABLE_PART_STALE_S = 24 * 3600


def download(url: str, option: str) -> Path:
    """The cached copy of `url`, downloaded now if there is none."""
    shown = redact_urls(url)
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise UserError(f"{option} {shown}: credentials in a weights URL are not sent; download the file "
                        f"yourself and set {option} to its path")
    cache = Path(os.environ.get("TRACKTRON_CACHE") or Path.home() / ".cache" / "tracktron") / "weights"
    name = re.sub(r"[^\w.-]", "_", os.path.basename(parts.path))[-100:].lstrip(".") or "weights"
    target = cache / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}"
    if os.path.isfile(target):  # a cached copy needs neither the network nor its settings (isfile never raises)
        forget_url_credentials(url)  # it came from the host a parser reads in it: no password there
        return target
    window = _stall_window()
    writable_cache(cache, f"{option} {shown}", "TRACKTRON_CACHE")
    try:
        _drop_stale_parts(cache)
        _fetch(url, cache, target, window)
    except (OSError, ValueError) as e:  # no network, a proxy, an HTTP error, a full disk: all the same here
        raise UserError(f"{option} {shown}: download failed ({type(e).__name__}: {first_line(e)}); fetch it where "
                        f"the network allows and set {option} to the local file's path") from None
    forget_url_credentials(url)
    log.info("downloaded %s to %s", redact_urls(url), target)
    return target


def writable_cache(folder: Path, what: str, variable: str) -> None:
    """`folder` made and writable by this process, or a line that names it and the variable that moves it."""
    try:
        write_probe(folder)
    except OSError as e:
        raise UserError(f"{what}: the cache folder {folder} cannot be written ({type(e).__name__}: {first_line(e)}); "
                        f"set {variable} to a writable folder") from None


def _stall_window() -> float:
    text = os.environ.get("TRACKTRON_DOWNLOAD_STALL_S") or "60"
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UserError(f"TRACKTRON_DOWNLOAD_STALL_S={text}: must be a number of seconds above 0")
    return seconds


def _fetch(url: str, cache: Path, target: Path, window: float) -> None:
    """Into a temporary file, renamed to `target` only when every byte the server announced came."""
    with _new_part(cache) as part:
        with urllib.request.urlopen(url, timeout=60) as response:
            size = int(response.headers.get("Content-Length") or -1)
            if size > shutil.disk_usage(cache).free:
                raise OSError(f"{size:,} bytes do not fit in {cache}")
            _copy(response, part, window)
        part.flush()
        if size >= 0 and part.tell() != size:
            raise OSError(f"the server sent {part.tell():,} of {size:,} bytes")
        os.replace(part.name, target)


@contextlib.contextmanager
def _new_part(cache: Path):
    """A new `.part-*` in `cache`, locked while it is open (so while it is written), removed after
    unless renamed."""
    while True:
        part = tempfile.NamedTemporaryFile(dir=cache, prefix=".part-", delete=False)
        if _hold(part):
            break
        part.close()
    with part:
        try:
            yield part
        finally:
            Path(part.name).unlink(missing_ok=True)


def _hold(part) -> bool:
    """An exclusive flock on `part` until it is closed: _drop_stale_parts leaves it alone. False when
    another job dropped it between its making and the lock (it unlinks while holding the lock)."""
    try:
        fcntl.flock(part.fileno(), fcntl.LOCK_EX)  # waits only while another job's _drop_stale_parts unlinks it
    except OSError:  # no flock on this file system: the part is kept by its age instead
        return True
    return os.fstat(part.fileno()).st_nlink > 0


def _copy(response, part, window: float) -> None:
    """The body into `part`, given up when a window passes with too few bytes (read1 returns what
    one read brings, so the clock is looked at while a slow server drips)."""
    start, got = time.monotonic(), 0
    while chunk := response.read1(1 << 20):
        part.write(chunk)
        got += len(chunk)
        if (elapsed := time.monotonic() - start) >= window:
            if got < MIN_BYTES_PER_WINDOW:
                raise OSError(f"the server sent {got:,} bytes in {elapsed:.0f} s: too slow to wait for")
            start, got = time.monotonic(), 0


def _drop_stale_parts(cache: Path) -> None:
    """What a download killed before it could clean up left: a part that no process holds a lock on
    (whatever its age: clocks differ between hosts), or where there are no locks, one untouched for a day."""
    for part in cache.glob(".part-*"):
        try:
            if _drop_unlocked(part) is None and time.time() - part.lstat().st_mtime > UNLOCKABLE_PART_STALE_S:
                part.unlink()
        except OSError:  # another job dropped it first
            pass


def _drop_unlocked(part: Path) -> bool | None:
    """Unlink `part` unless a running download holds its lock: True when dropped, False when held,
    None when it cannot be locked here (no flock on this file system, or not ours to open)."""
    try:  # NFS emulates flock with POSIX locks, which want a file open for writing; a FIFO must not block
        fd = os.open(part, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    else:
        part.unlink()  # while locked: a download that made it just now sees it gone once it has the lock
        return True
    finally:
        os.close(fd)
