"""MLflow searches read to the end (`every_page`), and every tracktron job on a server, as
`tracktron status` lists them."""
from __future__ import annotations

import contextlib
import logging
from concurrent.futures import wait

from trainer.daemon_call import daemon_call
from trainer.errors import UserError, first_line
from trainer.tracking.runs import JOB_TAG, bound_http
from trainer.tracking.server_errors import reach_error, start_error, without_logged_models
from trainer.tracking.sqlite_store import sqlite_path, store_settled

log = logging.getLogger(__name__)


def every_page(search, **kwargs) -> list:
    """All an MLflow search finds: each call returns one page (1,000 by default) and the token of
    the next, so a store with more experiments or runs than that is not silently cut short."""
    found, token = [], None
    while True:
        page = search(page_token=token, **kwargs)
        found += page
        if not (token := page.token):
            return found


def job_runs(uri: str, experiment: str | None = None, timeout: float = 120.0) -> list[tuple]:
    """(experiment, run) for every tracktron job on the server (of `experiment` if named), newest
    first in each experiment; UserError in one line when the server cannot be read, or has no such
    experiment. Reading never writes: a SQLite file that is not an MLflow store is refused before
    MLflow opens it (it would create its tables there), and a server that never answers is given up
    on in bounded time: each request's read timeout, and `timeout` for them all (a server that sends
    a byte every few seconds restarts a read timeout forever). MLflow's imports (seconds on a busy
    host) come before that clock starts: a --timeout of 2 s is the server's."""
    client = _client_maker(uri)
    answer = daemon_call(lambda: _answer(uri, client, experiment), "status-read")
    if not wait([answer], timeout).done:
        raise UserError(f"cannot read jobs from {uri}: no complete answer within {timeout:g}s")
    return answer.result()


def _client_maker(uri: str):
    """The client, made now where that sends nothing; a SQLite store's once it is settled and checked
    (MLflow reads, even writes, a database it opens), with its modules imported now."""
    from mlflow import MlflowClient

    bound_http(timeout=10, retries=1)  # a read-only look: give up soon
    if uri.startswith("sqlite:"):
        import mlflow.store.db.utils  # noqa: F401  (check_store's tables)
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        return lambda: MlflowClient(uri)
    with _read_errors(uri):
        client = MlflowClient(uri)
    return lambda: client


def _answer(uri: str, client, experiment: str | None) -> list[tuple]:
    with store_settled(uri), _read_errors(uri):  # a SQLite store another job is setting up: waited for, within the timeout
        if uri.startswith("sqlite:"):
            _check_default_experiment(uri)
        found = _job_runs(uri, client(), experiment)
        if lacking := without_logged_models(uri, client()):  # asked once the jobs are read
            log.warning("%s: its jobs' models and evaluations cannot be logged there, and a job that would log them "
                        "is refused at its start; use an MLflow 3 server", lacking)
        return found


def _check_default_experiment(uri: str) -> None:
    """MLflow adds its Default experiment (id 0) to a store it opens that lacks one: a reader refuses
    such a store instead, as it refuses to migrate one (looked at read-only, before MLflow opens it)."""
    import sqlite3

    path = sqlite_path(uri)
    with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
        if db.execute("SELECT 1 FROM experiments WHERE experiment_id = 0").fetchone() is None:
            raise UserError(f"{path} has no Default experiment (id 0), which MLflow adds to a store as it opens it, and "
                            f"status only reads: `MLFLOW_TRACKING_URI={uri} mlflow experiments search` adds it")


def _job_runs(uri: str, client, experiment: str | None) -> list[tuple]:
    experiments = [_named(client, uri, experiment)] if experiment else every_page(client.search_experiments)
    return [(exp, run) for exp in experiments
            for run in every_page(client.search_runs, experiment_ids=[exp.experiment_id],
                                  filter_string=f"tags.`{JOB_TAG}` != ''", order_by=["attributes.start_time DESC"])]


def _named(client, uri: str, name: str):
    """--experiment NAME, which must exist: a misspelt or deleted one is not an empty one."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        raise UserError(f"no experiment named {name!r} on {uri}")
    if exp.lifecycle_stage == "deleted":
        raise UserError(f"experiment {name!r} on {uri} is deleted (MLFLOW_TRACKING_URI={uri} "
                        f"mlflow experiments restore --experiment-id {exp.experiment_id} brings it back)")
    return exp


@contextlib.contextmanager
def _read_errors(uri: str):
    """An unreachable server, a file store MLflow refuses: the user's to fix, in one line."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if "filesystem tracking backend" in str(e):  # MLflow 3's notice runs to a paragraph
            raise UserError(start_error(uri, e)) from None
        if uri.lower().startswith(("http://", "https://")) and (line := reach_error(uri, e)):
            raise UserError(line) from None  # its cause, which MLflow's message puts past a long URL
        raise UserError(f"cannot read jobs from {uri}: {first_line(e, 200)}") from None
