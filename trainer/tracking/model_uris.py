"""MLflow URIs as TRAIN.WEIGHTS and --weights: `runs:/<run>/<path>`, `models:/<name>/<version>`,
`models:/<name>/latest`, `models:/<name>@<alias>`, `models:/<model id>`.

check_source   before a training job creates anything: the URI is well formed and names something
               that exists (metadata only; the weights are downloaded when the model is built)
pinned         an alias (or latest) as the version it names now, a checkpoint's LoggedModel as its
               checkpoint file: what a fine-tune downloads and records
followed       a checkpoint's LoggedModel as its checkpoint file: what --weights downloads
parent_of      what a fine-tune records of the model its weights came from
download_uri   the files a URI names, into a folder: through a tracking server file by file, each with a
               timeout that suits its size (transfers.py), a run's checkpoint checked against its tag
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from concurrent.futures import wait
from pathlib import Path

from trainer.checkpoint.files import FINAL
from trainer.daemon_call import daemon_call
from trainer.errors import UserError, first_line
from trainer.hashing import sha256_of
from trainer.tracking.runs import (CHECKPOINT_DIR, CHECKPOINT_TAG, CHECKPOINT_TYPE, bound_http, check_shape,
                                   checkpoint_artifact, is_model_id, lists_artifact, registry_uri, run_checkpoint,
                                   sha_tag, tracking_uri)
from trainer.tracking.server_errors import reach_error, registry_error
from trainer.tracking.sqlite_store import store_settled, unmade
from trainer.tracking.transfers import download_tree, repository

log = logging.getLogger(__name__)

MLFLOW_URIS = ("runs:/", "models:/")
WEIGHT_SUFFIXES = (".pth", ".pt")


def _client(cfg):
    from mlflow import MlflowClient

    bound_http()
    return MlflowClient(tracking_uri=tracking_uri(cfg), registry_uri=_registry(cfg))


def _registry(cfg) -> str:
    """The registry's URI; one of its own (MLFLOW_REGISTRY_URI) that is a SQLite store not made yet is
    refused: MLflow would make it, then find nothing in it."""
    if (registry := registry_uri(cfg)) != tracking_uri(cfg) and unmade(registry):
        raise UserError(f"the model registry {registry} (MLFLOW_REGISTRY_URI) does not exist")
    return registry


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


def followed(cfg, spec: str, option: str = "--weights") -> str:
    """--weights as downloaded: a checkpoint's LoggedModel as its checkpoint file, else `spec`. The
    lookup is left after 30 s (a server answering a byte at a time): the guarded download says why.
    A registered model's URI with a registry not made yet is refused, as TRAIN.WEIGHTS is: MLflow's
    download would make the store and say the model is not found on the tracking server."""
    if not spec.startswith(MLFLOW_URIS):
        return spec
    if _registered(spec):
        try:
            _registry(cfg)
        except UserError as e:
            raise UserError(f"{option} {spec}: {e}") from None
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
    except Exception as e:  # unknown run, model or alias; a server that does not answer (said whole: its cause)
        raise UserError(f"{option} {spec}: {registry_error(_asked(cfg, spec), tracking_uri(cfg), e) or first_line(e)}") from None


def _registered(spec: str) -> bool:
    """Whether a URI names a registered model (a version or an alias), which the model registry resolves."""
    return spec.startswith("models:/") and not is_model_id(spec[len("models:/"):].strip("/"))


def _asked(cfg, spec: str) -> str:
    """The store a URI is looked up in: the model registry for a registered model, else the tracking store."""
    return registry_uri(cfg) if _registered(spec) else tracking_uri(cfg)


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


def download_uri(cfg, uri: str, dest: str, option: str = "--weights", shown: str | None = None) -> Path:
    """A `runs:/...` or `models:/...` artifact, downloaded into `dest` (UserError when it cannot be,
    naming the URI as `shown`: the user's alias, where `uri` is the version it was pinned to)."""
    import mlflow

    said = shown or uri
    check_shape(uri, option)
    bound_http()
    where = tracking_uri(cfg)
    server = where.startswith(("http://", "https://"))
    mlflow.set_tracking_uri(where)  # models:/ is resolved by the registry, which follows the global URI
    quiet = logging.getLogger("mlflow.store.artifact.artifact_repo")  # "No artifacts found": said below, once
    level = quiet.level
    quiet.setLevel(logging.WARNING)

    def fetch():
        with store_settled(where):  # a missing or foreign SQLite file is said, never made into a store
            path, sha256 = (server and _through_server(cfg, where, uri, Path(dest))) or (None, None)  # hashed as it came
            path = path or Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dest, tracking_uri=where))
            return path, sha256, _complete_sha256(where, uri, path)

    try:  # a SQLite store's artifacts are local files; its wait for a store being set up is store_settled's
        path, sha256, expected = _while_progressing(fetch, Path(dest)) if server else fetch()
    except TimeoutError as e:
        raise UserError(f"cannot fetch {said} from {where}: {e}") from None
    except _Unreachable as e:
        raise UserError(f"cannot fetch {said}: {e}") from None
    except UserError as e:
        raise UserError(f"{option} {said}: {e}") from None
    except Exception as e:  # unknown run, missing artifact, unreachable server: all the user's to fix
        if server and (reason := reach_error(where, e, os_errors=False)):
            raise UserError(f"cannot fetch {said}: {reason}") from None  # the cause, which MLflow's text puts past a URL
        raise UserError(f"cannot fetch {said} from {_asked(cfg, uri)}: {first_line(e)}") from None
    finally:
        quiet.setLevel(level)
    if path.is_dir() and not any(path.iterdir()):  # a file's path with a trailing /, a model whose files were deleted
        raise UserError(f"{option} {said}: nothing there (no artifact at that path, or its files were deleted)")
    if expected and (sha256 or sha256_of(path)) != expected:
        raise UserError(f"{option} {said}: the downloaded bytes do not match the run's sha256 tag")
    return path


def _while_progressing(fn, dest: Path):
    """fn() on a thread of its own, given up on (TimeoutError) once nothing under `dest` has changed
    (size or modification time) for four HTTP request timeouts: each read's timeout restarts with
    every byte, so a server answering a byte at a time held `eval` for good. A download that goes on
    goes on, MLflow's multipart one too (it sets the file's size first, then writes its chunks in
    place). Given up on, the thread is left to the process's end (a daemon)."""
    stall_s = 4 * float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT") or 30)  # bound_http's, or the user's
    done = daemon_call(fn, "fetch")
    seen, since = None, time.monotonic()
    while not wait([done], min(5.0, stall_s / 4)).done:
        if (now := _state_under(dest)) != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise TimeoutError(f"no progress for {stall_s:g} s (a server that hangs, or answers a byte at a time)")
    return done.result()


def _state_under(folder: Path) -> tuple[int, int]:
    """The files under `folder`: their total size and newest modification time."""
    size = newest = 0
    for f in folder.rglob("*") if folder.is_dir() else ():
        with contextlib.suppress(OSError):  # renamed or removed by the download meanwhile
            if f.is_file():
                st = f.stat()
                size, newest = size + st.st_size, max(newest, st.st_mtime_ns)
    return size, newest


def _through_server(cfg, where: str, uri: str, dest: Path) -> tuple[Path, str | None] | None:
    """What `uri` names, fetched from a tracking server file by file as a resume's checkpoint is
    (transfers.download: one GET each, whose timeout grows with the file, where MLflow's own download
    has a flat one, which a server fetching a large model or checkpoint from its store outlasts): its
    path, and a single file's sha256. None where MLflow's download is left to say why (an unknown run,
    model or path; a shape not resolved here)."""
    try:
        source = _artifact_source(cfg, uri)
    except UserError:
        raise
    except Exception as e:  # a server that cannot be asked is said at once; anything else, by MLflow's download
        if reason := registry_error(_asked(cfg, uri), where, e, os_errors=False):
            raise _Unreachable(reason) from None
        return None
    if source is None:
        return None
    try:
        return download_tree(repository(source[0], where), source[1], dest)
    except FileNotFoundError:  # no such file: MLflow's download says so, as it did
        return None


class _Unreachable(Exception):
    """The store a URI is looked up in cannot be asked: the line that says why."""


def _artifact_source(cfg, uri: str) -> tuple[str, str] | None:
    """(artifact URI, path under it) of what a runs:/ or models:/ URI names, by MLflow's public calls: a
    run's artifacts (its checkpoints first: they are never a model), a run's logged model by name
    (`runs:/<run>/model`, as MLflow reads it), a logged model or a registered version's download URI.
    None for another shape (`models:/name/1/path`), or a version whose files are another URI's."""
    from mlflow import MlflowClient

    target = uri.split(":/", 1)[1].strip("/")
    client = _client(cfg) if _registered(uri) else MlflowClient(tracking_uri=tracking_uri(cfg))  # runs:/ asks no registry
    if uri.startswith("runs:/"):
        run_id, _, path = target.partition("/")
        name, _, rest = path.partition("/")
        if not run_checkpoint(uri) and (model := _logged_model_of(client, run_id, name)) is not None:
            # the run's own files at that path too: MLflow's download gives both, the model's over the run's
            return None if lists_artifact(client, run_id, path) else (model.artifact_location, rest)
        return client.get_run(run_id).info.artifact_uri, path
    if is_model_id(target):
        found = client.get_logged_model(target).artifact_location
    elif "@" in target or target.count("/") == 1:
        version = model_version(client, target)
        found = client.get_model_version_download_uri(version.name, version.version)
    else:
        return None
    return None if found.startswith(MLFLOW_URIS) else (found, "")


def _logged_model_of(client, run_id: str, name: str):
    """The run's logged model `name`; None where there is none, or the server keeps none (MLflow 2)."""
    try:
        return _run_logged_model(client, run_id, name) if name else None
    except Exception:  # an unknown run, a server down: the run's own lookup next says so
        return None


def _complete_sha256(where: str, uri: str, path: Path) -> str | None:
    """A checkpoint of a run (runs:/<id>/checkpoints/<file>) is used only complete: the sha256 its
    tag holds, set once its upload finished (an unfinished or tampered upload is refused)."""
    if (found := run_checkpoint(uri)) is None or not path.is_file():
        return None
    from mlflow import MlflowClient

    expected = MlflowClient(tracking_uri=where).get_run(found[0]).data.tags.get(sha_tag(found[1]))
    if expected is None:
        raise UserError("not a complete checkpoint of that run (no sha256 tag: its upload never finished)")
    return expected
