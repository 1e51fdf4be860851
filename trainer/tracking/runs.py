"""Where the job's MLflow runs are tracked (URI, credentials, HTTP bounds), the tag protocol a run
carries (job, checkpoints, status reason) and what a run holds. Finding or opening the job's run is
job_run.py's, which builds on these; downloading a runs:/ or models:/ URI, model_uris.py's; the store's
errors in one line, server_errors.py's.
"""
from __future__ import annotations

import ast
import json
import logging
import os
import re
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from trainer.checkpoint.files import iteration_of
from trainer.config import Config
from trainer.errors import NoRoom, UserError
from trainer.redaction import redact_text, redact_urls, remember, remember_basic_auth
from trainer.tracking.server_errors import start_error
from trainer.tracking.sqlite_store import sqlite_path

log = logging.getLogger(__name__)

DEFAULT_URI = "sqlite:///mlflow.db"
JOB_TAG = "tracktron.job"
LATEST_TAG = "tracktron.ckpt.latest"


STATUS_REASON = "tracktron.status_reason"  # why a run ended FAILED or KILLED
EVAL_SETS_TAG = "tracktron.eval.datasets"  # the test sets `tracktron eval` scored a run on (trained without)
DETECTOR_TYPE = "tracktron-detector"  # the model_type of every servable model tracktron logs (not a user's)
CHECKPOINT_TYPE = "tracktron-checkpoint"  # the model_type of a checkpoint's LoggedModel (checkpoint_models.py)
CHECKPOINT_TAG = "tracktron.checkpoint"  # on such a LoggedModel: runs:/<run>/checkpoints/<file>
CHECKPOINT_DIR = "checkpoints"  # the folder of a run's artifacts that holds its checkpoints
_SHA_TAG = ("tracktron.ckpt.", ".sha256")  # a checkpoint's sha256 tag, set once its upload is complete


def checkpoint_artifact(name: str) -> str:
    """The checkpoint `name`'s path in its run's artifacts."""
    return f"{CHECKPOINT_DIR}/{name}"


def sha_tag(name: str) -> str:
    return f"{_SHA_TAG[0]}{name}{_SHA_TAG[1]}"


def lists_artifact(client, run_id: str, path: str) -> bool:
    """Whether the run's artifact store lists `path` (one listing of its folder)."""
    return any(a.path == path for a in client.list_artifacts(run_id, path.rpartition("/")[0] or None))


_HTTP_KEYS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")
_SET_BY_USER = {k for k in _HTTP_KEYS if k in os.environ}


# MLflow's ranged download (files past MLFLOW_MULTIPART_DOWNLOAD_MINIMUM_FILE_SIZE, where the server
# offers it: transfers.download) holds each chunk whole in memory, on up to 20 threads: 100 MB chunks
# by default. Ours: 8 MB, boto3's own part size.
DOWNLOAD_CHUNK = 8 * 1024**2


def bound_http(timeout: int = 30, retries: int = 2) -> None:
    """MLflow's own HTTP retries can block for minutes: bounded, unless the user set them. Large
    transfers set their own timeouts by size (transfers.py)."""
    for key, value in zip(_HTTP_KEYS, (timeout, retries)):
        if key not in _SET_BY_USER:
            os.environ[key] = str(value)
    os.environ.setdefault("MLFLOW_MULTIPART_DOWNLOAD_CHUNK_SIZE", str(DOWNLOAD_CHUNK))


def tracking_uri(cfg: Config | None, uri: str | None = None) -> str:
    """TRACKING.URI (or `uri`), else MLFLOW_TRACKING_URI, else the embedded default; no credentials."""
    given = (uri or (cfg.TRACKING.URI if cfg is not None else "")).strip()  # a Secret's file ends in a newline
    chosen = without_credentials(_lower_scheme(given or os.environ.get("MLFLOW_TRACKING_URI", "").strip() or DEFAULT_URI))
    _remember_query(chosen)
    in_memory = chosen.startswith("sqlite:///") and str(sqlite_path(chosen)) == ":memory:"
    if chosen.startswith("sqlite:") and (not chosen.startswith("sqlite:///") or not sqlite_path(chosen).name or in_memory):
        raise UserError(f"tracking URI {redact_text(chosen)} names no database file (sqlite:// alone, or :memory:, is "
                        "in memory and keeps nothing past the job); give a file, e.g. sqlite:///mlflow.db")
    return chosen


def registry_uri(cfg: Config | None) -> str:
    """MLFLOW_REGISTRY_URI, as MLflow reads it, else the tracking URI: a fine-tune's `models:/` weights,
    the parent it records and the model it registers all come from one registry."""
    if not (given := _lower_scheme(os.environ.get("MLFLOW_REGISTRY_URI", "").strip())):
        return tracking_uri(cfg)
    _remember_query(given)
    return given


def settle_uri_variables() -> None:
    """MLFLOW_TRACKING_URI and MLFLOW_REGISTRY_URI as tracktron reads them (no white space around,
    the scheme in lower case), for MLflow's own clients too, which read them as they are."""
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        if (raw := os.environ.get(key)) is not None and raw != (settled := _lower_scheme(raw.strip())):
            if settled:
                os.environ[key] = settled
            else:  # white space alone: unset, as tracktron takes it
                del os.environ[key]


def _remember_query(uri: str) -> None:
    """A token in an HTTP URI's query, hidden also where a library prints the path without the
    scheme (urllib3's `url: /?token=...`)."""
    if uri.startswith(("http://", "https://")):
        for _, value in parse_qsl(urlsplit(uri).query):
            remember(value)


def _lower_scheme(uri: str) -> str:
    """`HTTP://host` as `http://host`: what follows (a token's hiding, the run's link) knows schemes in lower case."""
    scheme, sep, rest = uri.partition("://")
    return f"{scheme.lower()}{sep}{rest}" if sep and scheme.isascii() and scheme.isalpha() else uri


def without_credentials(uri: str) -> str:
    """`http://user:password@host` -> `http://host`, the user and password moved to MLflow's own
    MLFLOW_TRACKING_USERNAME/PASSWORD (this process and its children). MLflow then sends them as
    basic auth, and no URL that we or MLflow print ("View run at ...") carries them."""
    try:
        parts = urlsplit(uri)
    except ValueError as e:  # `http://[::1` and the like
        raise UserError(f"tracking URI {redact_text(uri)} is not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    remember(unquote(password))
    remember_basic_auth()
    return urlunsplit(parts._replace(netloc=host))


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI, where the tracking URI is a server's. In a workspace other than
    the default (MLFLOW_WORKSPACE), the link names it as MLflow's own does: the UI shows the default one."""
    from mlflow.utils.workspace_context import get_request_workspace
    from mlflow.utils.workspace_utils import DEFAULT_WORKSPACE_NAME

    if not uri.startswith(("http://", "https://")):
        return None
    url = f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    workspace = get_request_workspace()
    if workspace and workspace != DEFAULT_WORKSPACE_NAME:
        url += f"?workspace={quote(workspace, safe='')}"
    return url


def experiment_name(cfg: Config) -> str:
    # URL credentials only: a name is an identity, never changed by what else this process holds secret
    return redact_urls(cfg.TRACKING.EXPERIMENT or os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.NAME or "tracktron")


def env_experiment_id(cfg: Config) -> str | None:
    """MLFLOW_EXPERIMENT_ID, read as MLflow reads it: only when no experiment is named."""
    if cfg.TRACKING.EXPERIMENT or os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return None
    return os.environ.get("MLFLOW_EXPERIMENT_ID") or None


def checkpoints_from(tags: dict) -> list[str]:
    """Complete checkpoints of a run, by its tags (those whose sha256 tag was set), newest first."""
    prefix, suffix = _SHA_TAG
    names = [k[len(prefix):-len(suffix)] for k in tags if k.startswith(prefix) and k.endswith(suffix)]
    return sorted(names, key=iteration_of, reverse=True)


def last_step_of(run, key: str = "loss") -> int:
    return logged_steps(run).get(key, -1)


def logged_steps(run) -> dict[str, int]:
    """The newest step of each key logged to the run. The store keeps each key's latest point (the
    one with the highest step) with the run, and RunData's proto carries its step, so a long job's
    history of every iteration is never fetched."""
    return {m.key: m.step for m in run.data.to_proto().metrics}


# ---- fetching what a run holds ----

def evaluation_sets(run) -> list[list[str]]:
    """The test sets a run's scores are of, in order, as [name, annotation digest] pairs: the tag
    each training start sets (a resumed job may name other TEST.DATASETS) or a first `tracktron eval`
    of a run trained without; for runs older than the tag, TEST.DATASETS' param with the digests of
    the run's dataset inputs. Empty: the run has been scored on nothing yet."""
    unknown = [["?", "?"]]  # what no evaluation matches: a value cut at MLflow's length limit, or edited by hand
    if (tagged := run.data.tags.get(EVAL_SETS_TAG)) is not None:
        try:
            sets = json.loads(tagged)
        except (ValueError, RecursionError):  # nested thousands deep: said as the server's fault
            return unknown
        pairs = isinstance(sets, list) and all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                               for p in sets)
        return sets if pairs else unknown
    if not run.inputs.dataset_inputs:  # never trained tracked (made by a rerun of a job trained untracked)
        return []
    try:
        names = ast.literal_eval(run.data.params.get("TEST.DATASETS", "[]"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return unknown
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return unknown
    digests = {i.dataset.name: i.dataset.digest for i in run.inputs.dataset_inputs}
    return [[name, digests.get(name, "?")] for name in names]


def same_scores(own: list, ours: list) -> bool:
    """An evaluation on `ours` scores what the run's `own` sets name: its first set first (the plain
    `bbox/AP`), the others among the run's (each under its own prefix)."""
    return bool(ours) and ours[0] == own[0] and all(s in own for s in ours)


def takes_scores(client, run, datasets: list[dict], refused: str = "these scores are not logged into") -> bool:
    """Whether scores on `datasets` (lineage.dataset_inputs' sets) go into `run`: they are of its own
    test sets (same_scores), or it has been scored on none yet and these become its own (the tag).
    TEST is no part of the job: other sets' scores would read as the run's `bbox/AP` and could move
    its best checkpoint, so they are refused with a warning (`refused` says what is not done)."""
    from mlflow.entities import RunTag

    own, ours = evaluation_sets(run), eval_sets(datasets)
    if not own:
        client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in eval_sets_tag(datasets).items()])
        return True
    if same_scores(own, ours):
        return True
    log.warning("%s run %s: its scores are of %s; these test sets are %s (or other annotation files)", refused,
                run.info.run_id, ", ".join(n for n, _ in own), ", ".join(n for n, _ in ours))
    return False


def eval_sets(datasets: list[dict]) -> list[list[str]]:
    """[[name, annotation digest], ...] of lineage.dataset_inputs' evaluation sets, in order."""
    return [[d["name"], d["digest"]] for d in datasets if d["context"] == "evaluation"]


def eval_sets_tag(datasets: list[dict]) -> dict:
    """The run's EVAL_SETS_TAG for lineage.dataset_inputs' evaluation sets (none past a tag's length)."""
    value = json.dumps(eval_sets(datasets))
    return {EVAL_SETS_TAG: value} if len(value) <= 5000 else {}


def check_shape(spec: str, option: str) -> None:
    """No `..`, `?`, `#` or empty part: a URI reaches only what it names (not a file beside the run)."""
    rest = spec.split(":/", 1)[1]
    parts = rest.strip("/").split("/")
    if not rest.strip("/") or any(p in ("", ".", "..") for p in parts) or set("?#\\") & set(rest):
        raise UserError(f"{option} {spec}: not a valid MLflow URI (runs:/<run id>/<path>, models:/<name>/<version> "
                        "or models:/<name>@<alias>)")
    if spec.startswith("models:/") and len(parts) == 1 and "@" not in rest and not is_model_id(parts[0]):
        raise UserError(f"{option} {spec}: names a registered model, not one of its versions: add one "
                        f"({spec.rstrip('/')}/3, {spec.rstrip('/')}/latest or {spec.rstrip('/')}@best)")


def is_model_id(target: str) -> bool:
    """`models:/<target>` names a logged model by its id ("m-" + uuid4 hex, as MLflow's stores make
    them), not a registered model's version or alias: a registered model may be named `m-det`."""
    return re.fullmatch(r"m-[0-9a-f]{32}", target) is not None


def run_checkpoint(uri: str) -> tuple[str, str] | None:
    """(run id, file name) of a run's checkpoint, runs:/<run>/checkpoints/<file>, whose sha256 tag vouches
    for it; None for any other URI (a file in another folder is not the run's checkpoint)."""
    parts = uri[len("runs:/"):].split("/") if uri.startswith("runs:/") else []
    return (parts[0], parts[2]) if len(parts) == 3 and parts[1] == CHECKPOINT_DIR else None


def retryable(e: BaseException) -> bool:
    """Retry what a server that is down or overloaded causes; a request it rejects, or a local file
    that is not there, is final."""
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException):
        status = e.get_http_status_code()
        return status >= 500 or status == 429
    if getattr(getattr(e, "response", None), "status_code", None) == 413:  # a body-size limit: the same bytes never pass
        return False
    final = (TypeError, ValueError, KeyError, AttributeError, FileNotFoundError, IsADirectoryError, PermissionError, NoRoom)
    return not isinstance(e, final)


def make_client(uri: str):
    """MLflow's client of the store at `uri`; one that MLflow has no store for is the user's to fix."""
    try:
        from mlflow import MlflowClient
        return MlflowClient(tracking_uri=uri)
    except Exception as e:
        raise UserError(start_error(uri, e)) from None
