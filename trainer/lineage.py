"""Where a job's inputs come from, recorded on its run: each dataset as an MLflow dataset input (its
annotation file's sha256 as digest), and TRAIN.WEIGHTS, which may name a model in MLflow (`runs:/...`,
`models:/...`): downloaded, loaded like a file, and recorded as the run's parent.
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

from trainer.hashing import sha256_of
from trainer.data import resolve_dataset
from trainer.tracking.logged_model import fetch_weights
from trainer.tracking.model_uris import MLFLOW_URIS


def dataset_inputs(cfg, training: bool = True) -> list[dict]:
    """The job's datasets as MLflow inputs; training=False: its test sets only (`tracktron eval`)."""
    found = []
    for context, names in (("training", cfg.TRAIN.DATASETS if training else []), ("evaluation", cfg.TEST.DATASETS)):
        for name in names:
            _, annotations = resolve_dataset(cfg, name)
            digest = sha256_of(annotations)
            found.append({"name": name, "source": str(Path(annotations).resolve()), "digest": digest[:36],
                          "context": context, "profile": json.dumps({"sha256": digest})})
    return found


@contextlib.contextmanager
def initial_weights(cfg):
    """(what load_weights reads, the parent to record): TRAIN.WEIGHTS as it is, or downloaded."""
    spec = cfg.TRAIN.WEIGHTS
    if not spec.startswith(MLFLOW_URIS):
        yield spec, {}
        return
    with tempfile.TemporaryDirectory(prefix="tracktron-weights-") as tmp:
        path, parent = fetch_weights(cfg, spec, Path(tmp))
        yield str(path), parent
