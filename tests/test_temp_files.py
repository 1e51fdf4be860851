"""Temporary files of writers that are still running, under clocks that disagree: a download's
`.part-*` in TRACKTRON_CACHE, a checkpoint's `.<name>.tmp.<host>.<pid>` in OUTPUT_DIR. The cleanups
that drop a killed writer's leftovers must never take a running writer's file, whatever its mtime."""
from __future__ import annotations

import errno
import fcntl
import http.server
import json
import os
import subprocess
import sys
import threading
import time

from tests.servers import serve_handler
from trainer import downloads

DAY = 24 * 3600


class _GatedServer:
    """Serves `body` at every path; /gated.pkl sends its first half, then the rest once `gate` is set."""

    def __init__(self, body: bytes):
        gate = self.gate = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.path == "/gated.pkl":
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    gate.wait(60)
                    self.wfile.write(body[len(body) // 2:])
                else:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd, self.url = serve_handler(Handler)

    def close(self) -> None:
        self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_running_downloads_part_outlives_another_jobs_cleanup_whatever_its_mtime(tmp_path, monkeypatch):
    """Hosts sharing a cache on NFS whose clocks differ, or a clock set forward: a download running in
    another process had a part that looked hours old, and the next job's download deleted it under the
    writer (`download failed (FileNotFoundError ...)` at its end). Now a running download holds a lock
    on its part: that one stays, however old it looks; a part nobody holds (a killed download's) goes
    at once, however new."""
    weights = tmp_path / "cache" / "weights"
    weights.mkdir(parents=True)
    killed = weights / ".part-killed"
    body = os.urandom(3 << 20)
    server = _GatedServer(body)
    for name, value in {"TRACKTRON_CACHE": str(tmp_path / "cache"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    code = "import sys; from trainer.downloads import download; print(download(sys.argv[1], 'TRAIN.WEIGHTS'))"
    other = subprocess.Popen([sys.executable, "-c", code, f"{server.url}/gated.pkl"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (parts := [p for p in weights.glob(".part-*") if p.stat().st_size]):
            assert other.poll() is None and time.monotonic() < deadline, other.communicate()
            time.sleep(0.02)
        killed.write_bytes(b"half")  # a killed download's, a second old: for this job's cleanup to find
        os.utime(killed, (time.time() - 1, time.time() - 1))
        two_days_ago = time.time() - 2 * DAY  # what another host's clock, or this one set forward, makes of it
        os.utime(parts[0], (two_days_ago, two_days_ago))
        mine = downloads.download(f"{server.url}/now.pkl", "TRAIN.WEIGHTS")  # cleans up before it fetches
        assert parts[0].exists() and not killed.exists()
        server.gate.set()
        out, err = other.communicate(timeout=60)
    finally:
        other.kill()
        server.close()
    assert other.returncode == 0, err
    theirs = weights / os.path.basename(out.strip())
    assert theirs.read_bytes() == body and mine.read_bytes() == body
    assert sorted(p.name for p in weights.iterdir()) == sorted([mine.name, theirs.name]), "no part is left"


def test_where_there_is_no_flock_a_part_is_dropped_after_a_day(tmp_path, monkeypatch):
    """Some network file systems refuse flock (ENOLCK): there a part goes by its age, a day, not an hour."""
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    hours, days = tmp_path / ".part-hours", tmp_path / ".part-days"
    for part, age in ((hours, 3 * 3600), (days, 2 * DAY)):
        part.write_bytes(b"half")
        os.utime(part, (time.time() - age, time.time() - age))
    downloads._drop_stale_parts(tmp_path)
    assert hours.exists() and not days.exists()


# The clock reads an hour ahead as the process starts, then is set back (an NTP step, a VM resumed):
# what the process writes afterwards has an mtime before its start. It writes a checkpoint's temporary
# file and starts a checkpoint's download, then a leftover of an earlier life of its pid (a container's
# PID 1, restarted) turns up; then the job's start cleans OUTPUT_DIR up.
_CLOCK_SET_BACK = """
import json, os, sys, time
from pathlib import Path
real = time.time
time.time = lambda: real() + 3600
from trainer.atomic_write import HOST, temp_name
from trainer.checkpoint.files import download_folder, remove_stale_temps
time.time = real
out = Path(sys.argv[1])
with open(temp_name(out / "model_iter8.pth"), "wb") as writing:
    writing.write(b"half")
    folder = download_folder(out)
    earlier = out / f".model_iter3.pth.tmp.{HOST}.{os.getpid()}"
    earlier.write_bytes(b"half")
    os.utime(earlier, (real() - 7200, real() - 7200))
    removed = sorted(p.name for p in remove_stale_temps(out))
    print(json.dumps({"removed": removed, "kept": sorted(p.name for p in out.iterdir()), "pid": os.getpid(),
                      "folder": folder.name}))
"""


def test_what_a_process_writes_survives_its_own_cleanup_after_the_clock_was_set_back(tmp_path):
    """A temporary file with this process's pid was kept only if its mtime was after the process's
    start: once the clock was set back, the checkpoint being written, and the download folder of the
    resume's checkpoint, were deleted under the writer. Now the process knows the names it made; a
    leftover of an earlier life of its pid still goes, another live process's stays, a dead one's goes."""
    from trainer.atomic_write import HOST

    dead = subprocess.Popen(["true"])
    dead.wait()
    live, gone = tmp_path / f".json_stats.log.tmp.{HOST}.{os.getpid()}", tmp_path / f".config.yaml.tmp.{HOST}.{dead.pid}"
    for path in (live, gone):
        path.write_bytes(b"half")
    result = subprocess.run([sys.executable, "-c", _CLOCK_SET_BACK, str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    writing = f".model_iter8.pth.tmp.{HOST}.{seen['pid']}"
    assert seen["removed"] == sorted([gone.name, f".model_iter3.pth.tmp.{HOST}.{seen['pid']}"])
    assert seen["kept"] == sorted([writing, seen["folder"], live.name])
