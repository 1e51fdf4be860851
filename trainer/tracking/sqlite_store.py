"""SQLite tracking stores, which MLflow creates and migrates as soon as it opens one: a job's first
use of a store is one process at a time (a flock beside the database), a reader waits for it and
checks the file is an MLflow store before MLflow sees it, so that reading never writes (but to roll back
a write a killed process left unfinished, as any SQLite client does)."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from urllib.parse import unquote

from trainer.errors import UserError, leads_back

log = logging.getLogger(__name__)


def sqlite_path(uri: str) -> Path:
    """The database file of a `sqlite:///...` URI, %-escapes decoded as SQLAlchemy decodes them (it
    opens `a%41.db` as `aA.db`): the file MLflow will open, not the one written."""
    return Path(unquote(uri[len("sqlite:///"):].split("?", 1)[0]))


def unmade(uri: str) -> bool:
    """A `sqlite:` store whose file does not exist: it holds nothing, and opening it would make it."""
    return uri.startswith("sqlite:") and not sqlite_path(uri).is_file()


ELSEWHERE = "set MLFLOW_TRACKING_URI (or TRACKING.URI) to a tracking server or to a store in a writable folder"


def _shown(path: Path) -> str:
    """A store's path as the user can find it: a relative one (the default sqlite:///mlflow.db) is the
    working folder's, named in full (not `.`)."""
    return f"the working folder {path.absolute()}" if path == Path(".") else str(path.absolute())


def _refuse_a_loop(uri: str, path: Path) -> None:
    """exists() calls a link that leads back to itself missing: said as such a link, before a lock
    is made beside it."""
    if leads_back(path):
        raise UserError(f"tracking URI {uri}: {path} is a link to {os.readlink(path)}, which leads back to itself")


def not_made_yet(uri: str, resume_run_id: str | None, experiment_id: str | None = None) -> bool:
    """A SQLite store that does not exist yet (a lookup never makes one), so no run is in it: one
    named by --resume or by a launcher (MLFLOW_RUN_ID), or an experiment named by its id, is the
    user's mistake, said now."""
    path = sqlite_path(uri)
    if not uri.startswith("sqlite:///") or path.exists():
        return False
    folder = path.parent
    _refuse_a_loop(uri, path)
    if path.is_symlink():  # a link to nothing: SQLite makes the file it names (on a volume not mounted, cannot)
        folder = Path(os.path.realpath(path)).parent
    if not folder.is_dir():
        link = f" ({path} is a link into it)" if path.is_symlink() else ""
        raise UserError(f"tracking URI {uri}: the folder {folder} does not exist{link}")
    if os.statvfs(folder).f_flag & os.ST_RDONLY or not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"tracking URI {uri}: the store cannot be made in {_shown(folder)} (a read-only file system, or "
                        f"no permission to write there); {ELSEWHERE}")
    for named, given in (("run", resume_run_id), ("MLFLOW_RUN_ID", os.environ.get("MLFLOW_RUN_ID")),
                         ("MLFLOW_EXPERIMENT_ID", experiment_id)):
        if given:
            raise UserError(f"{named} {given} does not exist on {uri} (there is no store yet)")
    return True


def check_new_experiment_artifacts(uri: str, experiment: str) -> None:
    """A new experiment on a database store keeps its artifacts where MLflow's client puts them by
    default: ./mlruns in the working folder, whatever folder the store is in. From a read-only working
    folder (a container's WORKDIR, a store on a volume) the job would make the experiment and a run,
    then stop at its first upload: said before anything is written."""
    if uri.split(":", 1)[0].split("+", 1)[0].lower() not in ("sqlite", "postgresql", "mysql", "mssql"):
        return
    given = os.environ.get("_MLFLOW_SERVER_ARTIFACT_ROOT")  # as mlflow's _get_sqlalchemy_store reads it
    root = given or "./mlruns"
    if "://" in root or (":" in root and not root.startswith(("/", "."))):
        return  # a URI (s3://, file://...): not ours to judge here
    folder = Path(root).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)) or os.statvfs(existing).f_flag & os.ST_RDONLY:
        why = (f"_MLFLOW_SERVER_ARTIFACT_ROOT={given}" if given else
               "MLflow's default for a database store: ./mlruns in the working folder")
        fix = "set _MLFLOW_SERVER_ARTIFACT_ROOT to a writable folder" if given else "start the job in a writable folder"
        raise UserError(f"tracking URI {uri}: a new experiment {experiment} would keep its artifacts in {folder} "
                        f"({why}), which cannot be written; {fix}, or use a tracking server")


@contextlib.contextmanager
def first_use_guard(uri: str):
    """Around a job's first calls on a SQLite store: one process at a time, so that two jobs that
    start together on a new store do not both create its tables (which leaves it unusable). A
    lock file beside the database (`<db>.lock`), the kernel's flock: nothing stays stuck."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    db = sqlite_path(uri)
    if not db.parent.is_dir():
        raise UserError(f"tracking URI {uri}: the folder {db.parent} does not exist")
    lock_path = _lock_path(db)
    if db.exists() and not lock_path.exists():  # a file no job made: MLflow's or not, it is only read
        check_store(uri)
    try:
        lock = open(lock_path, "a")
    except OSError as e:
        raise UserError(f"tracking URI {uri}: cannot write beside {_shown(db)} ({e.strerror or e}); {ELSEWHERE}") from None
    with lock:
        _take(lock, fcntl.LOCK_EX, lock_path)
        if db.exists():  # made by another job while this one waited, or used before: MLflow's own
            check_store(uri)
        yield


@contextlib.contextmanager
def store_settled(uri: str):
    """A reader waits while a job creates a new SQLite store's tables (the lock first_use_guard
    holds), then checks it is an MLflow store; it creates nothing itself."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    lock_path = _lock_path(sqlite_path(uri))
    try:
        lock = open(lock_path)
    except OSError:  # no job ever used it
        lock = None
    try:
        if lock is not None:
            _take(lock, fcntl.LOCK_SH, lock_path, give_up_after=READ_WAIT_S)
        check_store(uri)
        yield
    finally:
        if lock is not None:
            lock.close()


READ_WAIT_S = 300  # a reader's wait for a job that creates the store's tables (a minute or two on a busy host)


def _lock_path(db: Path) -> Path:
    path = db.with_name(db.name + ".lock")
    if path.exists() and not path.is_file():  # opening a FIFO would wait for a writer forever
        raise UserError(f"{path} is not the lock file tracktron keeps beside {db.name} (a folder, a FIFO or a "
                        "device); move it away")
    return path


def _take(lock, mode: int, path: Path, give_up_after: float | None = None) -> None:
    """flock, saying so when another process holds it (a job creating the store, or one stopped
    with Ctrl-Z in the middle of it), and giving up after `give_up_after` seconds if given."""
    import fcntl

    deadline = time.monotonic() + (give_up_after or 0)
    try:
        fcntl.flock(lock, mode | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        log.warning("waiting for %s: another process is setting up this tracking store", path)
    if give_up_after is None:
        fcntl.flock(lock, mode)
        return
    while True:
        try:
            fcntl.flock(lock, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise UserError(f"another process has held {path} for {give_up_after:.0f} s (a job setting up the "
                                "store, or one stopped mid-way); try again once it is done") from None
            time.sleep(0.2)


def check_store(uri: str) -> None:
    """An existing SQLite file with MLflow's tables in it, looked at read-only."""
    import sqlite3

    path = sqlite_path(uri)
    if path.exists() and not path.is_file():  # MLflow would retry opening a folder for minutes
        raise UserError(f"tracking URI {uri}: {path} is a folder or a device, not a database file")
    _refuse_a_loop(uri, path)
    if not path.is_file():
        raise UserError(f"no tracking store at {uri} ({path} does not exist)")
    try:
        tables = _tables(path)
    except sqlite3.OperationalError as e:  # a database that another process is writing to
        if "locked" not in str(e):
            raise UserError(f"cannot read the tracking store {path}: {e}") from None
        raise UserError(f"the tracking store {path} is locked by another process's write (for over 5 s); "
                        "try again when it is done") from None
    except sqlite3.DatabaseError as e:  # not a database at all
        raise UserError(f"{path} is not an MLflow tracking store ({e})") from None
    if not {"experiments", "runs", "alembic_version"} <= tables:
        raise UserError(f"{path} is not an MLflow tracking store (it has no MLflow tables)")
    if missing := sorted(_mlflow_tables() - tables):  # MLflow would run every migration on it, unasked
        raise UserError(f"{path} is a tracking store of an older MLflow (it lacks the {missing[0]} table); "
                        f"`mlflow db upgrade {uri}` brings it up to date (back it up first)")


def _tables(path: Path) -> set[str]:
    """The file's tables, read-only. A write cut short by a kill leaves a hot journal that only a
    read-write connection may roll back (read-only, SQLite refuses to read the file at all): the
    rollback any SQLite client makes on opening it, MLflow's included, is made first."""
    import sqlite3

    def read(mode: str) -> set[str]:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode={mode}", uri=True)) as db:
            return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    try:
        return read("ro")
    except sqlite3.OperationalError as e:
        if "readonly" not in str(e) or not Path(f"{path}-journal").is_file():
            raise
    read("rw")  # rolls the interrupted write back, as its journal says
    log.info("%s: rolled back a write that a killed process left unfinished", path)
    return read("ro")


def _mlflow_tables() -> set[str]:
    """The tables this MLflow's stores have (what MLflow itself checks before it migrates)."""
    import mlflow.store.db.utils  # noqa: F401  (registers every store's tables with Base.metadata)
    from mlflow.store.db.base_sql_model import Base

    return set(Base.metadata.tables)
