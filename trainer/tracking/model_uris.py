"""MLflow URIs as TRAIN.WEIGHTS and --weights: `runs:/<run>/<path>`, `models:/<name>/<version>`,
`models:/<name>/latest`, `models:/<name>@<alias>`, `models:/<model id>`.

check_source   before a training job creates anything: the URI is well formed and names something
               that exists (metadata only; the weights are downloaded when the model is built)
pinned         an alias (or latest) as the version it names now, a checkpoint's LoggedModel as its
               checkpoint file: what a fine-tune downloads and records
followed       a checkpoint's LoggedModel as its checkpoint file: what --weights downloads
parent_of      what a fine-tune records of the model its weights came from
"""
from __future__ import annotations

import logging
import re
from concurrent.futures import wait

from trainer.checkpoint.files import FINAL
from trainer.daemon_call import daemon_call
from trainer.errors import UserError, first_line
from trainer.tracking.runs import (CHECKPOINT_DIR, CHECKPOINT_TAG, CHECKPOINT_TYPE, bound_http, check_shape,
                                   checkpoint_artifact, is_model_id, lists_artifact, registry_uri, tracking_uri)
from trainer.tracking.sqlite_store import store_settled, unmade

log = logging.getLogger(__name__)

MLFLOW_URIS = ("runs:/", "models:/")
WEIGHT_SUFFIXES = (".pth", ".pt")


def _client(cfg):
    from mlflow import MlflowClient

    bound_http()
    where, registry = tracking_uri(cfg), registry_uri(cfg)
    if registry != where and unmade(registry):  # MLflow would make it
        raise UserError(f"the model registry {registry} (MLFLOW_REGISTRY_URI) does not exist")
    return MlflowClient(tracking_uri=where, registry_uri=registry)


def pinned(cfg, spec: str) -> str:
    """`models:/name@alias` or `models:/name/latest` as the version it names now, `models:/name/N`:
    the weights downloaded and the parent recorded are one version, even when the alias moves (a
    promotion) while the model downloads. A checkpoint's LoggedModel (`models:/<id>`, or
    `runs:/<run>/model_final` by its name), which holds no files, as its checkpoint file. Anything
    else, or a lookup that fails (the download then says why), as it is."""
    if spec.startswith(MLFLOW_URIS) and (checkpoint := _checkpoint_named(cfg, spec)):
        return checkpoint
    target = spec.split(":/", 1)[1].strip("/") if spec.startswith("models:/") else ""
    if is_model_id(target) or not ("@" in target or target.lower().endswith("/latest")):
        return spec
    try:
        with store_settled(tracking_uri(cfg)):
            found = model_version(_client(cfg), target)
    except Exception:
        return spec
    if "@" in found.name:  # MLflow reads `models:/a@b/1` as an alias: such a name is downloaded as typed
        return spec
    return f"models:/{found.name}/{found.version}"


def followed(cfg, spec: str) -> str:
    """--weights as downloaded: a checkpoint's LoggedModel as its checkpoint file, else `spec`. The
    lookup is left after 30 s (a server answering a byte at a time): the guarded download says why."""
    if not spec.startswith(MLFLOW_URIS):
        return spec
    found = daemon_call(lambda: _checkpoint_named(cfg, spec), "weights-lookup")
    return (wait([found], 30.0).done and found.exception() is None and found.result()) or spec


def _checkpoint_named(cfg, spec: str) -> str | None:
    """`runs:/<run>/checkpoints/<file>` of the checkpoint a LoggedModel of tracktron's stands for
    (the ones the Models tab ranks by AP); None for anything else."""
    target = spec.split(":/", 1)[1].strip("/")
    run_id, _, name = target.partition("/")
    if not (is_model_id(target) or (spec.startswith("runs:/") and name and "/" not in name and "." not in name)):
        return None
    try:
        with store_settled(tracking_uri(cfg)):  # a missing SQLite file is never made here
            client = _client(cfg)
            model = client.get_logged_model(target) if is_model_id(target) else _run_logged_model(client, run_id, name)
    except Exception:  # the download says why
        return None
    if model is None or model.model_type != CHECKPOINT_TYPE or not model.source_run_id:
        return None
    tagged = model.tags.get(CHECKPOINT_TAG, "")  # only a checkpoint of the model's own run
    return tagged if re.fullmatch(rf"runs:/{re.escape(model.source_run_id)}/{CHECKPOINT_DIR}/[\w.-]+[.]pth", tagged) else None


def model_version(client, target: str):
    """The ModelVersion `name/version`, `name/latest` or `name@alias` names."""
    if "@" in target:
        return client.get_model_version_by_alias(*target.rsplit("@", 1))
    name, _, version = target.partition("/")
    if version.lower() == "latest":  # as MLflow reads it
        versions = client.search_model_versions(f"name = '{name}'")
        if not versions:
            raise UserError(f"registered model {name} has no version")
        return max(versions, key=lambda v: int(v.version))
    return client.get_model_version(name, version)


def check_source(cfg, spec: str, option: str = "TRAIN.WEIGHTS") -> None:
    """That an MLflow URI names an existing run artifact, logged model or model version."""
    if not spec.startswith(MLFLOW_URIS):
        return
    check_shape(spec, option)
    target = spec.split(":/", 1)[1].strip("/")
    try:
        with store_settled(tracking_uri(cfg)):  # a missing or foreign SQLite file: said, never created
            client = _client(cfg)
            if spec.startswith("runs:/"):
                _check_run_path(client, *target.partition("/")[::2])
            elif is_model_id(target):
                client.get_logged_model(target)
            else:
                model_version(client, target)
    except UserError as e:
        raise UserError(f"{option} {spec}: {e}") from None
    except Exception as e:  # unknown run, model or alias; a server that does not answer
        raise UserError(f"{option} {spec}: {first_line(e)}") from None


def _check_run_path(client, run_id: str, path: str) -> None:
    client.get_run(run_id)
    if not path:
        raise UserError(f"names a whole run: add the checkpoint or model, e.g. /{checkpoint_artifact(FINAL)} or /model")
    parent, _, name = path.rpartition("/")
    if lists_artifact(client, run_id, path):
        if "." in name and not name.endswith(WEIGHT_SUFFIXES):
            raise UserError(f"{path} is neither a weights file ({', '.join(WEIGHT_SUFFIXES)}) nor a model")
        return
    if not parent and _run_logged_model(client, run_id, name) is not None:  # runs:/<id>/model: a LoggedModel
        return
    raise UserError(f"run {run_id} has no artifact or model {path}")


def _run_logged_model(client, run_id: str, name: str):
    experiment_id = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}' AND name = '{name}'")
    return found[0] if found else None


def parent_of(cfg, spec: str) -> dict:
    """{"weights", "run_id", "model_id", "version"}: the run and the MLflow model the weights came from."""
    found = {"weights": spec}
    target = spec.split(":/", 1)[1].strip("/")
    try:
        client = _client(cfg)
        if spec.startswith("runs:/"):
            run_id, _, path = target.partition("/")  # runs:/<id>/model, or a checkpoint's own LoggedModel
            model = _run_logged_model(client, run_id, path.rsplit("/", 1)[-1].removesuffix(".pth"))
            found |= {"run_id": run_id, "model_id": model.model_id if model else None}
        elif is_model_id(target):
            found["model_id"] = target
        else:
            mv = model_version(client, target)
            source = mv.source.removeprefix("models:/")
            found |= {"run_id": mv.run_id, "model_id": getattr(mv, "model_id", None) or
                      (source if is_model_id(source) else None),
                      "version": f"{mv.name}/{mv.version}"}
    except Exception as e:  # the download just worked: a registry that fails now is a fault, not bad input
        log.warning("cannot record the parent of %s: %s", spec, first_line(e))
    return {k: v for k, v in found.items() if v}
