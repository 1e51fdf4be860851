"""MLflow searches read to the end (`every_page`), and every tracktron job on a server, as
`tracktron status` lists them."""
from __future__ import annotations

from concurrent.futures import wait

from trainer.daemon_call import daemon_call
from trainer.errors import UserError, first_line
from trainer.tracking.runs import JOB_TAG, bound_http
from trainer.tracking.sqlite_store import store_settled


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
    first in each experiment; UserError in one line when the server cannot be read. Reading never
    writes: a SQLite file that is not an MLflow store is refused before MLflow opens it (it would
    create its tables there), and a server that never answers is given up on in bounded time: each
    request's read timeout, and `timeout` for them all (a server that sends a byte every few
    seconds restarts a read timeout forever)."""
    answer = daemon_call(lambda: _answer(uri, experiment), "status-read")
    if not wait([answer], timeout).done:
        raise UserError(f"cannot read jobs from {uri}: no complete answer within {timeout:g}s")
    return answer.result()


def _answer(uri: str, experiment: str | None) -> list[tuple]:
    with store_settled(uri):  # a SQLite store another job is setting up: waited for, within the timeout
        return _job_runs(uri, experiment)


def _job_runs(uri: str, experiment: str | None) -> list[tuple]:
    from mlflow import MlflowClient

    bound_http(timeout=10, retries=1)  # a read-only look: give up soon
    try:
        client = MlflowClient(uri)
        if experiment:
            experiments = [e for e in [client.get_experiment_by_name(experiment)] if e]
        else:
            experiments = every_page(client.search_experiments)
        return [(exp, run) for exp in experiments
                for run in every_page(client.search_runs, experiment_ids=[exp.experiment_id],
                                      filter_string=f"tags.`{JOB_TAG}` != ''", order_by=["attributes.start_time DESC"])]
    except Exception as e:  # an unreachable server is the user's to fix
        raise UserError(f"cannot read jobs from {uri}: {first_line(e, 200)}") from None
