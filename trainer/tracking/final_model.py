"""The job's product in MLflow: the servable final model logged into its run and, with
TRACKING.REGISTERED_MODEL, registered (@final) beside the run's best checkpoint (@best). The run's
MODEL_TAG, set last, says all of it is there. Functions of an MlflowClient, called on the tracker's
uploader thread (registration_due: on the training thread of a rerun that has nothing to train)."""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import NamedTuple

from trainer.checkpoint.files import FINAL
from trainer.errors import UserError, first_line
from trainer.tracking.checkpoint_models import checkpoint_file, update_best
from trainer.tracking.runs import CHECKPOINT_TYPE, DETECTOR_TYPE, JOB_TAG, checkpoint_artifact, registry_uri, tracking_uri
from trainer.tracking.search import every_page
from trainer.tracking.server_errors import registry_error
from trainer.tracking.sqlite_store import unmade
from trainer.tracking.transfers import download, run_repository

log = logging.getLogger(__name__)
FINAL_NAME = "model"  # the final model's name in its run (runs:/<id>/model)


class FinalModel(NamedTuple):
    model_id: str
    version: str | None  # of TRACKING.REGISTERED_MODEL; None when not registered


def log_final(uri: str, client, experiment_id: str, run_id: str, folder: Path, registered: str) -> FinalModel:
    """The model folder as the run's servable model, registered when asked (set_aliases makes it
    @final). One an earlier process logged in full (killed before the run's MODEL_TAG was set) is
    taken, not logged again."""
    from trainer.tracking.logged_model import log_detector  # torch: imported once training is over

    fail_unfinished(client, experiment_id, run_id)
    if earlier := _ready_model(client, experiment_id, run_id, FINAL_NAME):
        log.info("the run's model %s was logged by an earlier process: it is not logged again", earlier.model_id)
        version = register_logged(uri, client, run_id, earlier.model_id, registered) if registered else None
        return FinalModel(earlier.model_id, version)
    info = log_detector(uri, run_id, folder, name=FINAL_NAME, registered_model_name=registered)
    return FinalModel(info.model_id, info.registered_model_version)


def set_aliases(client, registered: str, final: str | None, best: str | None) -> None:
    """@final and @best one right after the other, once both versions exist: set apart (the best
    checkpoint's copy logged in between), two jobs registering into one name at once could leave them
    naming two jobs' models."""
    for alias, version in (("final", final), ("best", best)):
        if version is not None:
            client.set_registered_model_alias(registered, alias, version)
            log.info("registered model %s version %s is now @%s", registered, version, alias)


def fail_unfinished(client, experiment_id: str, run_id: str) -> None:
    """Models of the run left PENDING by a process killed while logging them (this process, the run's
    one trainer, logs the model again): FAILED, so that nobody takes them for one still on its way."""
    for model in every_page(client.search_logged_models, experiment_ids=[experiment_id],
                            filter_string=f"source_run_id = '{run_id}'"):
        if str(model.status) == "PENDING" and model.model_type != CHECKPOINT_TYPE:  # an evaluation's is made READY again
            client.finalize_logged_model(model.model_id, "FAILED")
            log.info("model %s (%s) was left unfinished by an earlier process: marked FAILED", model.model_id,
                     model.name)


def registration_due(client, run_id: str, registered: str) -> list[str]:
    """The aliases of `registered` a rerun of the finished job sets: both when no version comes from
    this run (REGISTERED_MODEL set only now), the missing ones when a registration was cut short or
    an alias deleted; none while both name a version (another job's newer model keeps them, and an
    alias set by hand stays)."""
    if not registered:
        return []
    if not _versions(client, run_id, registered):
        return ["final", "best"]
    aliases = client.get_registered_model(registered).aliases
    return [alias for alias in ("final", "best") if alias not in aliases]


def register_logged(uri: str, client, run_id: str, model_id: str, registered: str) -> str:
    """The version of `registered` that holds the run's logged model `model_id`: the one an earlier
    process made, else a new one (the model itself is not copied)."""
    found = [v for v in _versions(client, run_id, registered) if v.source == f"models:/{model_id}"]
    if found:
        return found[0].version
    import mlflow

    mlflow.set_tracking_uri(uri)  # register_model's client reads the registry from it
    return mlflow.register_model(f"models:/{model_id}", registered).version


def _versions(client, run_id: str, registered: str) -> list:
    return [v for v in every_page(client.search_model_versions, filter_string=f"run_id = '{run_id}'")
            if v.name == registered]  # by run_id: a name may hold quotes


def register_best(uri: str, client, experiment_id: str, run_id: str, best, metric: str, output_dir: Path,
                  registered: str, final_version: str) -> str:
    """The version for @best: the run's best checkpoint (`best`, or found now), registered. The final
    model's version when it is best or when nothing was evaluated (so that @best never names another
    job's model).
    A servable copy of that checkpoint logged before (another name, a registration cut short) is
    registered again rather than logged twice."""
    best = best or update_best(client, experiment_id, run_id, metric)
    name = checkpoint_file(best) if best is not None else FINAL
    if name == FINAL:
        if best is None:
            log.info("nothing was evaluated: @best is the final model")
        return final_version
    if logged := _ready_model(client, experiment_id, run_id, _servable_name(name)):
        return register_logged(uri, client, run_id, logged.model_id, registered)
    return _log_servable_copy(client, uri, run_id, output_dir / name, registered)


def _servable_name(checkpoint: str) -> str:
    """The name in its run of a checkpoint's servable copy: best-model_iter399."""
    return f"best-{Path(checkpoint).stem}"


def _log_servable_copy(client, uri: str, run_id: str, local: Path, registered: str) -> str:
    """A checkpoint of the run (its best: its file, else the run's copy of it, safely loaded) logged
    as a servable model too, registered; its version."""
    from trainer.checkpoint.state import load as load_checkpoint
    from trainer.config import config_from_dict
    from trainer.inference import save as save_model
    from trainer.tracking.logged_model import ARTIFACT, log_detector  # torch

    with tempfile.TemporaryDirectory(prefix="tracktron-best-") as tmp:
        path = local if local.is_file() else download(run_repository(client, uri, run_id),  # timeouts by size
                                                      checkpoint_artifact(local.name), Path(tmp))[0]
        state = load_checkpoint(path)
        folder = save_model(Path(tmp) / ARTIFACT, config_from_dict(state["config"]), state["model"],
                            state["categories"]["categories"], state["categories"]["keypoint_names"])
        return log_detector(uri, run_id, folder, name=_servable_name(local.name),
                            registered_model_name=registered).registered_model_version


def _ready_model(client, experiment_id: str, run_id: str, name: str):
    """The run's READY servable model called `name` (the final model, a checkpoint's copy) that tracktron
    logged (its model_type says so: a model of that name someone else logged into the run is not it)."""
    models = every_page(client.search_logged_models, experiment_ids=[experiment_id],
                        filter_string=f"source_run_id = '{run_id}' AND model_type = '{DETECTOR_TYPE}' AND name = '{name}'")
    return next((m for m in models if str(m.status) == "READY"), None)


def check_registered_model(client, cfg) -> None:
    """TRACKING.REGISTERED_MODEL, before the job's run is made: its registry answers, and a model of
    that name holds tracktron's models only. The job moves its @final and @best at the end: another
    team's `churn@best` must not become a detector, nor a registry that is down be found only then.
    No client: the tracking store is not made yet, so only a registry of its own can hold models."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    name, where = cfg.TRACKING.REGISTERED_MODEL, registry_uri(cfg)
    if not (name and cfg.TRACKING.LOG_MODEL) or unmade(where) or (client is None and where == tracking_uri(cfg)):
        return  # a SQLite registry not made yet holds no model (and a check must not make it)
    client = client or MlflowClient(tracking_uri=where, registry_uri=where)  # its models' runs are there, if anywhere
    try:
        model = client.get_registered_model(name)
        aliased = {str(v): a for a, v in model.aliases.items() if a in ("final", "best")}  # int in a SQLite store
        newest = max((int(v.version) for v in model.latest_versions or ()), default=None)
        for version in sorted({*aliased, *([str(newest)] if newest is not None else [])}, key=int):
            if not _is_ours(client, client.get_model_version(name, version)):
                held = f"version {version}" + (f", @{aliased[version]}" if version in aliased else "")
                raise UserError(f"TRACKING.REGISTERED_MODEL {name} holds a model tracktron did not log ({held}); "
                                "its @final and @best would move to this job's: name another registered model")
    except MlflowException as e:
        if e.error_code in ("PERMISSION_DENIED", "UNAUTHENTICATED"):  # may register, not read: MLflow's auth allows it
            log.warning("cannot check TRACKING.REGISTERED_MODEL %s (%s): it is registered at the end as asked",
                        name, first_line(e, 300))
        elif e.error_code != "RESOURCE_DOES_NOT_EXIST":  # a new name is fine
            said = registry_error(where, tracking_uri(cfg), e) or f"cannot read the model registry ({first_line(e)})"
            raise UserError(f"TRACKING.REGISTERED_MODEL {name}: {said}") from None


def _is_ours(client, version) -> bool:
    """A version of a model tracktron logged: a LoggedModel of its types (a final model or an
    evaluated checkpoint's), or one from a run of a tracktron job (an older tracktron's models had no
    type; one registered by hand from the run's files has a path as its source)."""
    from mlflow.exceptions import MlflowException

    source = version.source or ""
    try:
        if source.startswith("models:/m-") and client.get_logged_model(source[len("models:/"):]).model_type in (
                DETECTOR_TYPE, CHECKPOINT_TYPE):
            return True
        return bool(version.run_id) and JOB_TAG in client.get_run(version.run_id).data.tags
    except MlflowException:  # deleted since, or in another store: nothing says it is someone else's
        return True
