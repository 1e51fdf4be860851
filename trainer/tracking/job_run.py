"""The job's run, by the resume rules of the tracking contract: found without writing anything
(--resume RUN_ID, MLFLOW_RUN_ID, else the job's newest run; another job's run, or someone else's
run, refused), then opened: made, adopted, or marked RUNNING. Functions of an MlflowClient.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

from trainer.checkpoint.files import FINAL
from trainer.config import Config
from trainer.errors import UserError, first_line
from trainer.job_identity import job_hash, job_hashes
from trainer.redaction import redact_text, redact_urls
from trainer.tracking.checkpoint_models import MODEL_TAG
from trainer.tracking.final_model import check_registered_model
from trainer.tracking.heartbeat import HEARTBEAT_TAG, beat, claim_run, last_seen, taken
from trainer.tracking.run_description import context_tags, describe_job, git_commit
from trainer.tracking.runs import (JOB_TAG, STATUS_REASON, bound_http, checkpoint_artifact, checkpoints_from, env_experiment_id,
                                   experiment_name, last_step_of, lists_artifact, make_client, sha_tag)
from trainer.tracking.server_errors import missing_workspace, start_error, without_logged_models
from trainer.tracking.sqlite_store import check_new_experiment_artifacts, check_store, not_made_yet

log = logging.getLogger(__name__)
# The name an experiment tracktron made was made under: renamed in the UI, it is found by this.
EXPERIMENT_TAG = "tracktron.experiment"


def _start_tags(cfg: Config, world_size: int) -> dict[str, str]:
    tags = {  # torch's versions and the device come with set_tags() once torch is imported
        **context_tags(),
        JOB_TAG: job_hash(cfg),
        "tracktron.config_name": cfg.NAME,
        "tracktron.world_size": str(world_size),
        HEARTBEAT_TAG: beat(),  # the run's trainer from its first write on
    }
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    tags["mlflow.note.content"] = redact_text(describe_job(cfg, world_size))
    return tags


# ---- finding the job's run ----

@dataclass
class OpenedRun:
    run: object  # mlflow.entities.Run, as it was when found or made
    experiment_id: str
    resumed: bool  # an earlier start of this job made it
    last_step: int  # the newest step logged to it (-1: none)
    note: str | None  # for the log: why the job continues in another run than the launcher's


@dataclass
class FoundRun:
    """The job's run as the store has it, found without writing anything."""
    run: object | None  # the run to continue or adopt; None: a new one is made
    experiment: str  # the experiment a new run goes to (made with it if it does not exist)
    experiment_id: str | None
    launcher_note: tuple | None = None  # (launcher's run id, the job's run id, note) for the launcher's run
    auto_resume: bool = False  # the job continues its newest run, if it has one

    @property
    def resumes(self) -> bool:
        """The run is the job's own, from an earlier start: the job continues from its checkpoints."""
        return self.run is not None and JOB_TAG in self.run.data.tags

    @property
    def checkpoints(self) -> list[str]:
        return checkpoints_from(self.run.data.tags) if self.resumes else []


def find_run(client, uri: str, cfg: Config, resume_run_id: str | None, new_run: bool) -> FoundRun:
    """--resume RUN_ID, else MLFLOW_RUN_ID, else the job's newest run: read, nothing written. The
    registered model the job would move the aliases of is checked too."""
    try:
        found = _find_run(client, uri, cfg, resume_run_id, new_run)
        _check_artifacts_reachable(client, uri, found)
        _check_logged_model_api(client, uri, cfg)
        check_registered_model(client, cfg)
        return found
    except UserError:
        raise
    except Exception as e:  # nothing was written yet: say why in one line
        raise UserError(start_error(uri, e)) from None


def _check_logged_model_api(client, uri: str, cfg: Config) -> None:
    """A server without MLflow 3's logged-model API (MLflow 2.x, a hosted endpoint without it), refused
    before training when the job needs it: its final model, its evaluations (the test sets' scores,
    tables) and TRACKING.CHECKPOINTS_KEEP's pruning go through it, and would fail only after training."""
    uses = [off for off, used in (("TRACKING.LOG_MODEL false", cfg.TRACKING.LOG_MODEL),
                                  ("TEST.DATASETS '()'", cfg.TEST.DATASETS),
                                  ("TRACKING.CHECKPOINTS_KEEP 0", cfg.TRACKING.CHECKPOINTS_KEEP > 0)) if used]
    if uses and (lacking := without_logged_models(uri, client)):
        raise UserError(f"{lacking}, which the job's model, evaluations and checkpoint pruning need: use an MLflow 3 "
                        f"server (upgrade this one), or train without them ({' '.join(uses)})")


def _check_artifacts_reachable(client, uri: str, found: FoundRun) -> None:
    """An experiment made through an `mlflow server` that serves artifacts keeps them at
    `mlflow-artifacts:/...`, which only that server's clients reach: a job on the store itself
    (`sqlite:///mlflow.db` beside the server) would train, then fail every upload."""
    if uri.lower().startswith(("http://", "https://")):
        return
    if found.run is not None:
        where, location = f"run {found.run.info.run_id}", found.run.info.artifact_uri
    elif found.experiment_id:
        where, location = f"experiment {found.experiment}", client.get_experiment(found.experiment_id).artifact_location
    else:
        return check_new_experiment_artifacts(uri, found.experiment)
    if (location or "").lower().startswith("mlflow-artifacts:"):  # MLflow reads schemes in any case
        raise UserError(f"{where} keeps its artifacts on an mlflow server ({location}), which this job reaches only "
                        "through that server: set TRACKING.URI to its http:// address, not to its store")


def open_run(client, uri: str, cfg: Config, world_size: int, found: FoundRun) -> OpenedRun:
    """Make the job's run (and its experiment), adopt the launcher's, or mark the found one RUNNING:
    the first writes, made once the job's checks have passed (UserError, in one line, when the
    server cannot be used, or when another trainer of the job opened its run since the lookup)."""
    from mlflow.entities import RunTag

    try:
        run, note = found.run and client.get_run(found.run.info.run_id), None  # as it is now, after the checks
        if run is not None:  # the job's own, or a bare one to adopt: before anything else is written to it
            run = claim_run(client, found.run, run)
        if found.launcher_note:  # `mlflow run` made a new run for a job that has one: one job stays one run
            launcher_id, job_run_id, note = found.launcher_note
            client.log_batch(launcher_id, tags=[RunTag("tracktron.job_run_id", job_run_id),
                                                RunTag("mlflow.note.content", note)])
        exp_id = found.experiment_id or _experiment(client, found.experiment)
        resumed = run is not None and JOB_TAG in run.data.tags
        last_step = -1
        if run is None:
            run = client.create_run(exp_id, tags=_start_tags(cfg, world_size), run_name=_run_name(cfg))
            settle_new_run(client, exp_id, run, first_wins=found.auto_resume)
        elif not resumed:  # a run made for us (`mlflow run`, or --resume of a bare run): adopt it
            tags = _start_tags(cfg, world_size)
            client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            if cfg.TRACKING.RUN_NAME:  # `mlflow run` names its run at random: the name the user gave wins
                client.update_run(run.info.run_id, name=_run_name(cfg))
            run = client.get_run(run.info.run_id)
        else:
            if run.data.tags[JOB_TAG] != job_hash(cfg):  # tagged by an earlier tracktron: found by this hash from now on
                client.set_tag(run.info.run_id, JOB_TAG, job_hash(cfg))
            run = _drop_tags_of_what_is_gone(client, run)
            if FINAL not in checkpoints_from(run.data.tags):  # a finished job stays FINISHED
                client.update_run(run.info.run_id, status="RUNNING")
            if STATUS_REASON in run.data.tags:  # why an earlier start stopped is not why this one will
                client.delete_tag(run.info.run_id, STATUS_REASON)
            last_step = last_step_of(run)
    except UserError:
        raise
    except Exception as e:  # say why in one line
        raise UserError(start_error(uri, e)) from None
    return OpenedRun(run, exp_id, resumed, last_step, note)


def _drop_tags_of_what_is_gone(client, run):
    """A finished run's model_final deleted from its artifact store, or its logged model deleted (by
    hand, a lifecycle rule): the tag that claims it goes, and the job completes the run again."""
    run_id, gone = run.info.run_id, []
    if FINAL in checkpoints_from(run.data.tags) and not _holds_file(client, run_id, checkpoint_artifact(FINAL)):
        log.warning("run %s's tag says it holds %s, but its artifact store has no such file: the tag goes, "
                    "and the job completes the run again", run_id, FINAL)
        gone.append(sha_tag(FINAL))
    if MODEL_TAG in run.data.tags and not _holds_model(client, run_id, run.data.tags[MODEL_TAG]):
        log.warning("run %s's logged model %s is gone from the tracking server (or is another run's): the job "
                    "logs its own again from %s", run_id, run.data.tags[MODEL_TAG], FINAL)
        gone.append(MODEL_TAG)
    for tag in gone:
        client.delete_tag(run_id, tag)
    return client.get_run(run_id) if gone else run


def _holds_model(client, run_id: str, model_id: str) -> bool:
    """Whether the logged model exists and is the run's (a tag rewritten by hand could name another
    job's, which would then be registered as this one's); True when the server cannot say. An id no
    model can have (MLflow's are `m-<hex>`; '', a path) is none: a server asked for `a/b` answers 404."""
    if not re.fullmatch(r"[\w\-]+", model_id):
        return False
    try:
        return client.get_logged_model(model_id).source_run_id == run_id
    except Exception as e:
        return getattr(e, "error_code", "") not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def _holds_file(client, run_id: str, path: str) -> bool:
    """Whether the run's artifact store lists `path`; True when it cannot be listed (a store that is
    down says nothing of a file: a tag goes only when its file is known to be gone)."""
    try:
        return lists_artifact(client, run_id, path)
    except Exception as e:
        log.info("could not list run %s's %s: %s", run_id, path, first_line(e))
        return True


def _find_run(client, uri: str, cfg: Config, resume_run_id: str | None, new_run: bool) -> FoundRun:
    if resume_run_id:
        run = _resumable_run(client, uri, cfg, resume_run_id)
        return FoundRun(run, "", run.info.experiment_id)
    resume = cfg.TRAIN.AUTO_RESUME and not new_run
    if launcher_id := os.environ.get("MLFLOW_RUN_ID"):
        launcher = _get(client.get_run, uri, "MLFLOW_RUN_ID", launcher_id)
        _check_ours(launcher, cfg, "MLFLOW_RUN_ID", "unset MLFLOW_RUN_ID")  # also before a launcher-only note
        exp_id = launcher.info.experiment_id
        if new_run and JOB_TAG in launcher.data.tags:  # it would be continued, checkpoints and all
            raise UserError(f"MLFLOW_RUN_ID {launcher_id} is this job's run, which --no-resume would not continue: "
                            "unset MLFLOW_RUN_ID to start the job over in a new run, or drop --no-resume")
        if JOB_TAG in launcher.data.tags or not resume:
            return FoundRun(launcher, "", exp_id)
        earlier = _newest_job_run(client, [exp_id], cfg)
        if earlier is None:
            return FoundRun(launcher, "", exp_id)
        note = f"Launcher only: job {job_hash(cfg)} continues in its run {earlier.info.run_id}."
        return FoundRun(earlier, "", exp_id, (launcher_id, earlier.info.run_id, note))
    if given_id := env_experiment_id(cfg):
        exp = _get(client.get_experiment, uri, "MLFLOW_EXPERIMENT_ID", given_id, missing=(400, 404))  # 400: no such id at all
    else:
        exp = client.get_experiment_by_name(experiment_name(cfg))
        exp = exp and _active(exp, uri)
        if exp is None and (lacking := missing_workspace(uri, client)):  # found none: not there, or no such workspace
            raise UserError(lacking)
    if exp is None and resume and not given_id and (moved := _renamed_home(client, cfg)) is not None:
        return FoundRun(moved[1], moved[0].name, moved[0].experiment_id, auto_resume=resume)
    name, exp_id = (exp.name, exp.experiment_id) if exp is not None else (experiment_name(cfg), None)
    return FoundRun(_newest_job_run(client, [exp_id], cfg) if resume and exp_id else None, name, exp_id,
                    auto_resume=resume)


def _renamed_home(client, cfg: Config) -> tuple | None:
    """(experiment, run): the job's newest run in an experiment tracktron made under the name the job
    gives (EXPERIMENT_TAG), renamed since. A config that names a new experiment finds none. A lookup
    that fails is said, and the job starts as it would have (in a new experiment of its name)."""
    from trainer.tracking.search import every_page

    name = experiment_name(cfg)
    if "'" in name or "\\" in name:  # no quoting in a search filter's value is sure to hold
        return None
    try:
        made = every_page(client.search_experiments, filter_string=f"tags.`{EXPERIMENT_TAG}` = '{name}'")
        run = _newest_job_run(client, [e.experiment_id for e in made][:100], cfg) if made else None
    except Exception as e:
        log.warning("could not look for experiment %s under another name (%s)", name, first_line(e))
        return None
    if run is None:
        return None
    exp = next(e for e in made if e.experiment_id == run.info.experiment_id)
    log.warning("no experiment is named %s: the job's run %s is in experiment %s (made as %s, renamed since), and "
                "continues there; --no-resume starts the job over in a new experiment %s", name,
                run.info.run_id, exp.name, name, name)
    return exp, run


def _resumable_run(client, uri: str, cfg: Config, run_id: str):
    """--resume RUN_ID's run, when it is this job's (or a bare run made for it)."""
    run = _get(client.get_run, uri, "run", run_id)
    _check_ours(run, cfg, "run", "drop --resume")
    return run


_ENDED = ("FINISHED", "FAILED", "KILLED")


def _check_ours(run, cfg: Config, named: str, drop: str) -> None:
    """Never train into (or finish) a run that is not this job's: it is the job's own, or a bare run
    made for it. `mlflow run` (or a user) leaves one RUNNING, with params and mlflow.* tags but no
    metrics; an ended run or one with metrics is someone else's work, which adopting overwrote."""
    theirs, ours, key = run.data.tags.get(JOB_TAG), job_hash(cfg), run.info.run_id
    if theirs is not None and theirs not in job_hashes(cfg):
        raise UserError(f"{named} {key} is another job's (job {theirs}; this config is job {ours}): continue it "
                        f"with its own config, or {drop} to start this job's run")
    if theirs is None and (run.info.status in _ENDED or run.data.metrics):
        raise UserError(f"{named} {key} is not a tracktron run (no {JOB_TAG} tag) and is {run.info.status} with "
                        f"{len(run.data.metrics)} metrics: only an empty, unfinished run is adopted; {drop} to "
                        "start this job's run in a new one")


def found_in_new_store(cfg: Config, uri: str) -> FoundRun:
    """A store not made yet holds no run: a new one, once MLFLOW_REGISTRY_URI's models are checked."""
    check_new_experiment_artifacts(uri, experiment_name(cfg))
    check_registered_model(None, cfg)
    return FoundRun(None, experiment_name(cfg), None)


def find_job_run(cfg: Config, uri: str, resume_run_id: str | None, new_run: bool) -> tuple[str, list[str]]:
    """What the job's start would do with its run, found without writing anything (--dry-run), and
    the checkpoints of the run it continues."""
    name = experiment_name(cfg)
    if not_made_yet(uri, resume_run_id, env_experiment_id(cfg)):
        found_in_new_store(cfg, uri)
        return f"a new store, experiment {name}, a new run", []
    if uri.startswith("sqlite:///"):
        check_store(uri)
    bound_http(timeout=10, retries=1)  # a read-only look: give up soon
    client = make_client(uri)
    found = find_run(client, uri, cfg, resume_run_id, new_run)
    run = found.run
    if run is None:
        return f"experiment {found.experiment}{'' if found.experiment_id else ' (new)'}, a new run", []
    if not found.resumes:
        return f"adopts run {run.info.run_id}, which its launcher made", []
    done = found.checkpoints
    if FINAL in done:
        return f"run {run.info.run_id} has model_final: nothing to do", done
    return (f"continues run {run.info.run_id} ({run.info.status}{last_seen(run)}) from "
            f"{done[0] if done else 'its start'}", done)


def _experiment(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp:
        return exp.experiment_id
    try:  # the UI groups experiments by kind: these are model-training ones
        return client.create_experiment(name, tags={"mlflow.experimentKind": "custom_model_development",
                                                    EXPERIMENT_TAG: name})
    except MlflowException as e:  # another job made it meanwhile
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code) or not (exp := client.get_experiment_by_name(name)):
            raise
        return exp.experiment_id


def _get(get, uri: str, named: str, key: str, missing: tuple = (404,)):
    """client.get_run or get_experiment; one that does not exist is said in one line."""
    from mlflow.exceptions import MlflowException

    try:
        return _active(get(key), uri)
    except MlflowException as e:
        if e.get_http_status_code() in missing or "RESOURCE_DOES_NOT_EXIST" in str(e.error_code):
            raise UserError(f"{named} {key} does not exist on {uri}") from None
        raise


def _active(found, uri: str):
    """A deleted run or experiment takes no writes: said now, in one line, not after the job's checks."""
    run = hasattr(found, "info")
    if (found.info if run else found).lifecycle_stage != "deleted":
        return found
    kind, key = ("run", found.info.run_id) if run else ("experiment", found.experiment_id)
    raise UserError(f"{kind} {key} on {uri} is deleted: restore it (`mlflow {kind}s restore --{kind}-id {key}`) "
                    f"or name another {kind}")


def settle_new_run(client, exp_id: str, run, first_wins: bool) -> None:
    """One search of the job's newest runs, right after this trainer made its own:
    - MLflow's client sends a POST again when its answer is lost, so the server may have made the run
      twice, the same request (start time, heartbeat) each time. The copy this trainer never got
      back is deleted: left, a later start could continue it, empty, instead of the job's run.
    - first_wins (a new job that found no run): of two trainers that each made one, the first made
      keeps the job; the other deletes its own (still empty) and stops."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`{JOB_TAG}` = '{run.data.tags[JOB_TAG]}'",
                              order_by=["attributes.start_time DESC"], max_results=20)
    others = []
    for other in runs:
        if other.info.run_id == run.info.run_id:
            continue
        if (other.info.start_time, other.data.tags.get(HEARTBEAT_TAG)) == (run.info.start_time,
                                                                           run.data.tags[HEARTBEAT_TAG]):
            client.delete_run(other.info.run_id)
        else:
            others.append(other)
    first = min([*others, run], key=lambda r: (r.info.start_time, r.info.run_id))
    if first_wins and first.info.run_id != run.info.run_id:
        client.delete_run(run.info.run_id)
        raise taken(first)


def _newest_job_run(client, exp_ids: list, cfg: Config):
    """The job's newest run: by its hash, else by the one an earlier tracktron gave it (job_hashes)."""
    for tag in job_hashes(cfg):
        runs = client.search_runs(exp_ids, filter_string=f"tags.`{JOB_TAG}` = '{tag}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if runs:
            return runs[0]
    return None


def _run_name(cfg: Config) -> str:
    """The job's hash ends it: a sweep's jobs start in the same second."""
    return redact_urls(cfg.TRACKING.RUN_NAME or f"{cfg.NAME}-{time.strftime('%Y%m%d-%H%M%S')}-{job_hash(cfg)[:6]}")
