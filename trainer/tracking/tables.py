"""An evaluation's per-category table in the run.

MLflow's `log_table` lists every table it logs in the run's `mlflow.loggedArtifacts` tag (the UI
shows those as tables), and a tag holds 8,000 characters at most: MLflow would cut the list there
into JSON that every later `log_table` fails to read. Past the tag's room a table is the same JSON
file, logged without the listing.
"""
from __future__ import annotations

import functools
import json
import logging

log = logging.getLogger(__name__)

LISTED_TAG = "mlflow.loggedArtifacts"
TAG_ROOM = 8000  # MLflow's longest tag value


def log_table(client, run_id: str, table: dict, artifact_file: str) -> None:
    """`table` (columns of equal length) at `artifact_file` in the run, as MLflow's log_table writes it."""
    entry = {"path": artifact_file, "type": "table"}
    try:
        listed = json.loads(client.get_run(run_id).data.tags.get(LISTED_TAG, "[]"))
    except ValueError:  # cut short by an earlier tracktron's log_table: no later one reads it
        listed = None
    if isinstance(listed, list) and (entry in listed or len(json.dumps([*listed, entry])) <= TAG_ROOM):
        return client.log_table(run_id, table, artifact_file)
    _full(run_id)
    client.log_dict(run_id, {"columns": list(table), "data": [list(row) for row in zip(*table.values())]},
                    artifact_file)  # pandas' "split" layout, which MLflow's log_table writes


@functools.cache
def _full(run_id: str) -> None:
    log.info("the run lists as many tables as MLflow's %s tag holds: later evaluations' tables are JSON files "
             "the UI shows as text", LISTED_TAG)
