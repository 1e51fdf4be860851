"""What a tracking server's failure means, in one line for the user: down, answering errors,
refusing the credentials or a permission, TLS or a proxy failing, or this machine's own limits;
and whether it has the MLflow 3 API the job's models need (without_logged_models) and the job's
workspace (missing_workspace)."""
from __future__ import annotations

import re

from trainer.errors import first_line
from trainer.redaction import redact_text

_SSL_REASON = r"\[SSL[^\]]*\].*?(?= \(_ssl\.c|['\"]\)|$)"  # [SSL: CERTIFICATE_VERIFY_FAILED] certificate ...
_PROXY_REASON = (r"(?<=ProxyError\(')[^']*", r"Tunnel connection failed:[^'\")]*|\[Errno \d+\][^'\")]*")
_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Connection refused", "ConnectionError",
                "NameResolutionError", "timed out", "RemoteDisconnected")


def _caused_by(text: str, *patterns: str) -> str:
    """What urllib3's 'Max retries exceeded ... (Caused by SSLError(...))' says of the cause: the
    parts `patterns` find, else its first line."""
    found = [m.group(0).strip() for p in patterns if (m := re.search(p, text))]
    return ": ".join(found) or first_line(text)


def _tls_advice(text: str) -> str:
    if "WRONG_VERSION_NUMBER" in text:
        return "it answers in plain HTTP: use an http:// URI"
    if "mismatch" in text:
        return "its certificate is for another host name: use the name it was issued for"
    return ("MLFLOW_TRACKING_SERVER_CERT_PATH names a CA bundle that trusts its certificate, "
            "MLFLOW_TRACKING_CLIENT_CERT_PATH a client certificate")


def reach_error(uri: str, e: BaseException, untracked: str = "", os_errors: bool = True,
                what: str = "the tracking server") -> str | None:
    """The one line for a server at `uri` that could not be asked at all (down, failing, TLS, a proxy,
    the credentials refused), `untracked` added where training without it is the way on; else None.
    `os_errors` False: an OSError is the server's only by its text (a download's own disk fails too).
    `what`: the server named (a registry of its own, MLFLOW_REGISTRY_URI, is not the tracking server)."""
    text = str(e)
    # Up, and failing: urllib3's retries ran out (MLflow < 3.18), or MLflow's client reports the last answer (3.18).
    if answered := re.search(r"too many (\d{3}) error responses|error code (429|5\d\d) != 200", text):
        code = answered.group(1) or answered.group(2)
        return f"{what} at {uri} answers with HTTP {code} errors (see its log){untracked}"
    if "ProxyError" in text:  # first: a proxy's own TLS failure is the proxy's
        return (f"cannot reach {what} at {uri} through the proxy of HTTP_PROXY/HTTPS_PROXY "
                f"({_caused_by(text, *_PROXY_REASON, _SSL_REASON)}); NO_PROXY lists the hosts reached without it")
    if "SSLError" in text:  # before the unreachable ones: its text says "Max retries exceeded" too
        return f"{what} at {uri}: TLS failed ({_caused_by(text, _SSL_REASON)}); {_tls_advice(text)}"
    if (os_errors and isinstance(e, OSError)) or any(m in text for m in _UNREACHABLE):
        return f"cannot reach {what} at {uri} (is it running?){untracked}"
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException) and e.get_http_status_code() == 401:
        return (f"{what} at {uri} refused the credentials "
                "(MLFLOW_TRACKING_USERNAME/PASSWORD, MLFLOW_TRACKING_TOKEN)")
    return None


def registry_error(registry: str, tracking: str, e: BaseException, os_errors: bool = True) -> str | None:
    """reach_error of a model registry at `registry` (the tracking server's own, or MLFLOW_REGISTRY_URI's)."""
    if not registry.lower().startswith(("http://", "https://")):
        return None
    what = "the tracking server" if registry == tracking else "the model registry"
    return reach_error(registry, e, os_errors=os_errors, what=what)


def start_error(uri: str, e: BaseException) -> str:
    """The one line a failed first call to the store at `uri` ends a job with."""
    if line := reach_error(uri, e, "; TRACKING.ENABLED false trains without tracking"):
        return line
    text = str(e)
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException) and e.get_http_status_code() == 403:  # some servers say so of a bad token too
        return (f"the tracking server at {uri} refuses this user the job's experiment or run ({first_line(e)}): "
                "a permission it lacks, or a token it does not accept; ask for the permission (or a valid token), "
                "or name another TRACKING.EXPERIMENT")
    if isinstance(e, Warning):  # PYTHONWARNINGS=error (or python -W error) made the client's warning an exception
        return (f"tracking store {uri}: a warning raised as an error (PYTHONWARNINGS or python -W): "
                f"{type(e).__name__}: {first_line(e)}")
    if isinstance(e, RuntimeError) and "can't start new thread" in text:  # not the server's: this machine's limit
        return ("cannot start a thread: a limit on processes and threads (ulimit -u, a container's pids limit) "
                "leaves the job none; raise it")
    if "filesystem tracking backend" in text:  # MLflow 3 refuses new file stores: say what works
        return (f"tracking URI {uri}: MLflow's file store (a folder such as ./mlruns) takes no new runs; "
                "use a database (sqlite:///mlflow.db) or a server (http://host:5000)")
    return f"tracking server {uri}: {first_line(e)}"


def run_refusal(client, run_id: str, timeout: float = 5.0) -> tuple[str, str] | None:
    """Why the tracking server refuses every write to the run, asked once: ("gone", "") (deleted, then
    `mlflow gc`), ("deleted", ""), ("experiment deleted", its id) or ("credentials", the error) (HTTP
    401/403, an expired token). None when it takes them or cannot tell (down, or hanging past
    `timeout`): an outage, which the senders' retries ride out."""
    from concurrent.futures import wait

    from trainer.daemon_call import daemon_call

    def state():
        run = client.get_run(run_id)
        if run.info.lifecycle_stage == "active":
            return None
        try:  # MLflow deletes an experiment's runs with it: restoring the run alone would leave it hidden there
            experiment = client.get_experiment(run.info.experiment_id).lifecycle_stage
        except Exception:  # the server failing now: the run's own state stands
            experiment = "active"
        return ("deleted", "") if experiment == "active" else ("experiment deleted", run.info.experiment_id)

    asked = daemon_call(state, "run-state")
    if not wait([asked], timeout).done:
        return None
    if (e := asked.exception()) is None:
        return asked.result()
    if getattr(e, "get_http_status_code", lambda: None)() in (401, 403):
        return "credentials", first_line(e)
    return ("gone", "") if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST" else None


NO_MODEL = "m-" + "0" * 32  # a logged model id of MLflow's form that no model has


def without_logged_models(uri: str, client) -> str | None:
    """`the tracking server at <uri> has no logged-model API (...)` for an http(s) server that lacks it
    (a store the client opens itself is this MLflow's own); None when it has it."""
    if not uri.lower().startswith(("http://", "https://")) or not lacks_logged_models(client):
        return None
    version = server_version(uri)
    return (f"the tracking server at {redact_text(uri)} has no logged-model API (/api/2.0/mlflow/logged-models answers "
            f"404{f'; it reports {version}' if version else ''})")


def lacks_logged_models(client) -> bool:
    """Whether the tracking server has no MLflow 3 logged-model API (an MLflow 2 server, a hosted one
    without it), asked with one read of a model no one has: a server with the API answers that it
    does not exist (JSON, RESOURCE_DOES_NOT_EXIST), or that this user may not read it (403); one
    without answers 404 with an HTML or empty body, which MLflow's client calls ENDPOINT_NOT_FOUND.
    Any other failure says nothing of the API: False (the job's own requests meet it as ever)."""
    try:
        client.get_logged_model(NO_MODEL)
    except Exception as e:
        return getattr(e, "error_code", "") in ("ENDPOINT_NOT_FOUND", "NOT_IMPLEMENTED") or " 405 != " in str(e)
    return False


def missing_workspace(uri: str, client) -> str | None:
    """`tracking server <uri>: no workspace ...` when MLFLOW_WORKSPACE names one the server lacks: there,
    MLflow's lookup by name finds no experiment, as for a new one, and only making it would fail."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.workspace_context import get_request_workspace

    if not (workspace := get_request_workspace()):
        return None
    try:
        client.get_workspace(workspace)
    except MlflowException as e:  # another error (a server without workspaces) is left to the job's start
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return f"tracking server {redact_text(uri)}: no workspace {workspace!r} (MLFLOW_WORKSPACE)"
    return None


def server_version(uri: str) -> str:
    """What the server's /version says (`MLflow 2.22.5`), else "" (a hosted server may have none)."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        answer = http_request(get_default_host_creds(uri), "/version", "GET", max_retries=0,
                              timeout=5, raise_on_status=False)
    except Exception:
        return ""
    text = answer.text.strip() if answer.status_code == 200 else ""
    return f"MLflow {text}" if re.fullmatch(r"\d+\.\d+[\w.+-]{0,30}", text) else ""
