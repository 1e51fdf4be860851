"""Checkpoint files by name: which iteration a file holds, the newest ones in a folder, the
temporary files of writers that were killed, pruning. No torch here: the tracker uses
these before torch is imported (a resume starts its download while torch loads).
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from trainer.atomic_write import HOST, forget, is_made_here, made_here

log = logging.getLogger(__name__)

FINAL = "model_final.pth"
# The names checkpoint_name() makes, and no other: a `model_iter08.pth` or `model_iter８.pth` read as 8
# would take the place of the job's own model_iter8.pth in pruning, which would then delete it.
_ITER_RE = re.compile(r"model_iter(0|[1-9][0-9]*)\.pth")


def checkpoint_name(iteration: int | None) -> str:
    """`model_iter{N}.pth` for the zero-based iteration N just finished; None means final."""
    return FINAL if iteration is None else f"model_iter{iteration}.pth"


def iteration_of(name: str) -> float:
    """Sort key: model_final is newer than every model_iter."""
    if name == FINAL:
        return float("inf")
    m = _ITER_RE.fullmatch(name)
    return int(m.group(1)) if m else -1


UNSENT_METRICS = "unsent_metrics.json"  # metric points the run never got, for the job's next start to send
JOB_LOG = "log.txt"  # what the job logged (logs.JobLog)
STATS_LOG = "json_stats.log"  # Detectron's json_stats lines (stats.TrainingStats)
JOB_FILES = ("config.yaml", "model.txt", STATS_LOG, JOB_LOG, UNSENT_METRICS)  # what else the job writes in OUTPUT_DIR
# Temporary files of write_atomic and save_atomic (`.<name>.tmp.<host>.<pid>`; before the host was
# in the name, `.<name>.tmp.<pid>`), and a download's folder.
EVAL_FILES = ("detections.json", "per_category_ap.md")  # what an evaluation writes in eval/<set>/
_TMP_RE = re.compile(r"\.(?:model_(?:iter[0-9]+|final)\.pth|" + "|".join(map(re.escape, JOB_FILES + EVAL_FILES)) + r")"
                     r"\.tmp(?:\.(?P<host>[A-Za-z0-9_-]+))?\.?(?P<pid>[0-9]+)"
                     r"|\.download\.(?P<dhost>[A-Za-z0-9_-]+)\.(?P<dpid>[0-9]+)\.[A-Za-z0-9_]+", re.ASCII)
STALE_FOREIGN_TMP_S = 24 * 3600  # another host's temporary file is left alone for a day
_STARTED = time.time()  # about when this process started: it writes no temporary file before


def download_folder(output_dir: Path) -> Path:
    """A hidden folder for a checkpoint being downloaded: named like no checkpoint, and whose. Recorded
    as made here before it exists, so that remove_stale_temps never sees it as an earlier life's."""
    output_dir.mkdir(parents=True, exist_ok=True)
    while True:
        folder = made_here(output_dir / f".download.{HOST}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            folder.mkdir(mode=0o700)
            return folder
        except FileExistsError:
            forget(folder)
        except BaseException:
            forget(folder)
            raise


def drop_download_folder(folder: Path) -> None:
    """The folder and what is in it gone, and no longer this process's."""
    shutil.rmtree(folder, ignore_errors=True)
    forget(folder)


def local_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint files in output_dir, newest first (model_final before every model_iter). Only
    regular files: a folder, FIFO or device under a checkpoint's name is refused by not_files()."""
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if iteration_of(p.name) >= 0 and p.is_file()]
    return sorted(found, key=lambda p: iteration_of(p.name), reverse=True)


def not_files(output_dir: Path) -> list[Path]:
    """Entries named like checkpoints or the job's other files that are no regular file: reading
    one could hang (a FIFO) or never end (a link to /dev/zero), and no file can replace a folder."""
    if not output_dir.is_dir():
        return []
    return sorted(p for p in output_dir.iterdir()
                  if (iteration_of(p.name) >= 0 or p.name in JOB_FILES) and not p.is_file())


# What the job writes into rather than replaces: a log it appends to, folders it writes files in.
WRITTEN_THROUGH = (STATS_LOG, JOB_LOG, "model", "model/detector", "eval")


def links_written_through(output_dir: Path) -> list[Path]:
    """Symbolic links where the job writes through what is there (WRITTEN_THROUGH and eval's
    folders): through one it would append to a file outside OUTPUT_DIR or overwrite another job's
    model. The job's other files are replaced by name, a link with them (a `cp -as` copy)."""
    paths, evals = [output_dir / name for name in WRITTEN_THROUGH], output_dir / "eval"
    if evals.is_dir() and not evals.is_symlink():
        paths += sorted(evals.iterdir())
    return [p for p in paths if p.is_symlink()]


def remove_stale_temps(output_dir: Path) -> list[Path]:
    """Delete the temporary files (checkpoints, the job's other files, an evaluation's in eval/<set>/)
    and download folders left by killed jobs: this host's whose process is gone, another host's (or
    an unnamed one's) after a day."""
    if not output_dir.is_dir():
        return []
    evals = output_dir / "eval"
    folders = [output_dir, *(evals.iterdir() if evals.is_dir() and not evals.is_symlink() else ())]
    removed = []
    for path in (p for folder in folders if folder.is_dir() and not folder.is_symlink() for p in folder.iterdir()):
        m = _TMP_RE.fullmatch(path.name)
        if not m:
            continue
        host, pid = m.group("host") or m.group("dhost"), m.group("pid") or m.group("dpid")
        try:
            if host == HOST:
                if _pid_alive(int(pid), path):
                    continue
            elif time.time() - path.stat().st_mtime < STALE_FOREIGN_TMP_S:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:
            continue
    if removed:
        log.info("removed %d partial file(s) left by a killed job: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def _pid_alive(pid: int, path: Path) -> bool:
    if pid == os.getpid():  # ours, or from an earlier life of this pid: a container's PID 1, restarted
        return is_made_here(path) or path.stat().st_mtime >= _STARTED - 1.0  # the clock may have gone back since
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune(output_dir: Path, keep: int, upto: int, spare: set[str] = frozenset()) -> list[Path]:
    """Delete all but the `keep` newest model_iter files up to iteration `upto` (the one just
    written; never model_final), and none named in `spare` (their upload is still to come). A file
    named past `upto` (a copy, another job's) is not this job's newest: it is neither counted nor
    deleted, so it never pushes out the checkpoint just made."""
    older = [p for p in local_checkpoints(output_dir) if iteration_of(p.name) <= upto][keep:]
    removed = [p for p in older if p.name not in spare]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def set_aside(output_dir: Path) -> Path | None:
    """A job started over (--no-resume, TRAIN.AUTO_RESUME false) in a folder that holds checkpoints:
    they move to `earlier-<time>/` with its logs (and the metrics its run never got), the model
    folder and the evaluations, kept but out of the way, where a later resume cannot take them for
    the new start's. The folder, or None when there was nothing to move."""
    found = local_checkpoints(output_dir)
    if not found:
        return None
    files = [output_dir / name for name in (STATS_LOG, JOB_LOG, UNSENT_METRICS) if (output_dir / name).is_file()]
    folders = [p for p in (output_dir / "model", output_dir / "eval") if p.is_dir() or p.is_symlink()]
    return move_aside(output_dir, [*found, *files, *folders])


def move_aside(output_dir: Path, paths: list[Path]) -> Path:
    """`paths` moved to a new `earlier-<time>-*/` folder of output_dir, kept but out of the way."""
    folder = Path(tempfile.mkdtemp(prefix=time.strftime("earlier-%Y%m%d-%H%M%S-"), dir=output_dir))
    for path in paths:
        os.replace(path, folder / path.name)
    return folder
