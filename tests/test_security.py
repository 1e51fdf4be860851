"""Security: checkpoints never run code when loaded, secrets never leave the process, basic auth works.

- A malicious pickle (a torch file whose unpickling runs `os.system`) is refused wherever a
  checkpoint can come from: OUTPUT_DIR, TRAIN.WEIGHTS, `tracktron eval --weights`, and the tracking
  server (uploaded as the run's newest checkpoint with a matching sha256 tag). Everything is read
  with `torch.load(weights_only=True)`; the marker file the pickle would create never appears.
- Secrets given to the trainer (a password in TRACKING.URI, DATASET_CATALOG entries named *KEY*,
  *TOKEN*, *SECRET*, AWS keys and tracking credentials in the environment) appear in no param, tag,
  artifact, local output file, stdout or stderr.
- MLflow's basic-auth server: MLFLOW_TRACKING_USERNAME/PASSWORD work; a wrong password is one line
  and exit 2.
"""
from __future__ import annotations

import base64
import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import DEMO, demo_overrides, run_trainer, trainer_cmd
from tests.faultkit import Job, wait_until
from tests.servers import MlflowServer
from tests.test_bad_input import Outcome, run_cli
from trainer.hashing import sha256_of
from trainer.checkpoint.state import load as load_checkpoint
from trainer.config import load_config
from trainer.job_identity import job_hash

QUICK = {"SOLVER.MAX_ITER": 2, "TRAIN.SNAPSHOT_ITERS": 100, "TEST.DATASETS": "()", "TRACKING.LOG_MODEL": "false"}


class _RunsCode:
    """Unpickling this calls os.system: what a booby-trapped checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def malicious_checkpoint(path: Path, marker: Path) -> Path:
    """A real torch zip file, shaped like a tracktron checkpoint, whose pickle runs a command."""
    torch.save({"model": {"w": torch.zeros(1), "payload": _RunsCode(marker)}, "iteration": 5,
                "config": {}, "rng": []}, path)
    return path


@pytest.fixture
def trap(tmp_path) -> tuple[Path, Path]:
    """(a malicious checkpoint, the marker its unpickling creates), checked to be really malicious."""
    marker = tmp_path / "PWNED"
    path = malicious_checkpoint(tmp_path / "evil.pth", marker)
    torch.load(path, weights_only=False)  # what an unsafe loader would do: the command runs
    assert marker.exists(), "the test's payload does not work"
    marker.unlink()
    return path, marker


@pytest.fixture
def train(tmp_path, monkeypatch, data_dir):
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(var, raising=False)

    def run(*opts: str, command: str = "train", tracking: bool = False) -> Outcome:
        base = demo_overrides(tmp_path, data_dir, **QUICK)
        if not tracking:
            base += ["TRACKING.ENABLED", "false"]
        return run_cli([command, "--config", str(DEMO), *base, *opts])

    return run


# ---- malicious pickles -------------------------------------------------------------------------------

def test_malicious_checkpoint_in_output_dir_is_skipped_not_run(train, tmp_path, trap):
    evil, marker = trap
    out = tmp_path / "output"
    out.mkdir()
    (out / "model_iter7.pth").write_bytes(evil.read_bytes())  # the newest-looking checkpoint
    result = train()
    assert result.code is None, result.stderr[-2000:]
    assert "skipping unusable checkpoint" in result.stderr and "model_iter7.pth" in result.stderr
    assert "resuming from" not in result.stderr  # trained from scratch instead
    assert not marker.exists()
    assert load_checkpoint(out / "model_final.pth")["iteration"] == 1


def test_malicious_train_weights_are_refused_in_one_line(train, trap):
    evil, marker = trap
    result = train("TRAIN.WEIGHTS", str(evil))
    assert result.code == 2, result.stderr[-2000:]
    assert result.last_line.startswith(f"error: TRAIN.WEIGHTS {evil} is not a weights file tracktron loads: it holds pickled")
    assert "Traceback" not in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("command", ["train", "dry-run"])
def test_a_torchvision_weight_name_whose_cached_file_was_replaced_runs_nothing(train, tmp_path, monkeypatch, trap,
                                                                               command):
    """TRAIN.WEIGHTS as a torchvision weight name reads torch hub's cache, which torch.hub trusts
    as it is (it checks the hash only of what it downloads) and unpickles with weights_only=False:
    a pickle put there under the weight's file name ran its code. Found by the red team of
    2026-12-03 (with the COCO configs' ImageNet weights)."""
    import torchvision

    evil, marker = trap
    weight = torchvision.models.get_weight("MobileNet_V3_Large_Weights.IMAGENET1K_V1")
    cached = tmp_path / "torch" / "hub" / "checkpoints" / weight.url.rsplit("/", 1)[1]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(evil.read_bytes())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    result = train("TRAIN.WEIGHTS", "MobileNet_V3_Large_Weights.IMAGENET1K_V1",
                   *(["--dry-run"] if command == "dry-run" else []))
    assert result.code == 2, result.stderr[-2000:]
    assert result.last_line == (f"error: TRAIN.WEIGHTS MobileNet_V3_Large_Weights.IMAGENET1K_V1: {cached} is not "
                                "the file torchvision publishes (its sha256 does not start with 8738ca79, as its "
                                "name says): delete it, and it is downloaded again")
    assert not marker.exists() and cached.read_bytes() == evil.read_bytes()


def test_malicious_eval_weights_are_refused_in_one_line(tmp_path, monkeypatch, data_dir, trap):
    evil, marker = trap
    monkeypatch.chdir(tmp_path)
    result = run_cli(["eval", "--config", str(DEMO), "--weights", str(evil), "DATA_DIR", str(data_dir),
                      "TRACKING.ENABLED", "false", "DATA_LOADER.NUM_THREADS", "0"])
    assert result.code == 2, result.stderr[-2000:]
    assert result.last_line.startswith(f"error: --weights {evil} is not a weights file tracktron loads: it holds pickled")
    assert not marker.exists()


def test_malicious_checkpoint_on_the_tracking_server_with_a_matching_sha256_is_not_run(
        train, tmp_path, data_dir, mlflow_server, trap):
    evil, marker = trap
    exp = f"evil-{uuid.uuid4().hex[:6]}"
    opts = ["TRACKING.URI", mlflow_server.url, "TRACKING.EXPERIMENT", exp]
    cfg = load_config(DEMO, demo_overrides(tmp_path, data_dir, **QUICK) + opts)
    # The job's run, as an attacker with write access to the server would prepare it.
    client = MlflowClient(mlflow_server.url)
    run = client.create_run(client.create_experiment(exp), tags={"tracktron.job": job_hash(cfg)})
    staged = tmp_path / "staging" / "model_iter5.pth"
    staged.parent.mkdir()
    staged.write_bytes(evil.read_bytes())
    client.log_artifact(run.info.run_id, str(staged), "checkpoints")
    client.set_tag(run.info.run_id, "tracktron.ckpt.model_iter5.pth.sha256", sha256_of(staged))
    client.set_tag(run.info.run_id, "tracktron.ckpt.latest", "model_iter5.pth")

    result = train(*opts, tracking=True)
    assert result.code is None, result.stderr[-3000:]
    assert "skipping" in result.stderr and "UnpicklingError" in result.stderr
    assert not marker.exists()
    assert client.get_run(run.info.run_id).info.status == "FINISHED"  # the same run, trained from scratch
    assert load_checkpoint(tmp_path / "output" / "model_final.pth")["iteration"] == 1


# ---- MLflow's basic-auth server -------------------------------------------------------------------------

ADMIN = ("admin", "adm1n-Pa55-" + uuid.uuid4().hex[:8])


def _has_flask_wtf() -> bool:
    try:
        import flask_wtf  # noqa: F401
    except ImportError:
        return False
    return True


needs_auth_app = pytest.mark.xfail(not _has_flask_wtf(), strict=True, raises=RuntimeError,
                                   reason="mlflow's basic-auth app needs flask-wtf (mlflow[auth]): add it to the "
                                          "test extra in pyproject.toml")


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("auth"), auth_admin=ADMIN).start()
    yield server
    server.stop()


@needs_auth_app
def test_wrong_password_is_one_line_and_exit_2(train, auth_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password-42")
    result = train("TRACKING.URI", auth_server.url, "TRACKING.EXPERIMENT", "auth", tracking=True)
    assert result.code == 2, result.stderr[-2000:]
    assert result.last_line == (f"error: the tracking server at {auth_server.url} refused the credentials "
                                "(MLFLOW_TRACKING_USERNAME/PASSWORD, MLFLOW_TRACKING_TOKEN)")
    assert "Traceback" not in result.stderr and "not-the-password-42" not in result.stderr + result.stdout


@needs_auth_app
def test_a_user_without_permission_is_told_so_not_that_the_password_is_wrong(train, auth_server, admin_client,
                                                                              monkeypatch):
    """A known user whose password is right but who may only read the experiment (the server's
    default READ): the 403 was reported as refused credentials (helper-65's red team)."""
    from mlflow.server.auth.client import AuthServiceClient

    admin_client.create_experiment("shared-readonly")
    AuthServiceClient(auth_server.url).create_user("bob", "b0b-Pa55-word")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "b0b-Pa55-word")
    result = train("TRACKING.URI", auth_server.url, "TRACKING.EXPERIMENT", "shared-readonly", tracking=True)
    assert result.code == 2, result.stderr[-2000:]
    assert result.last_line.startswith(f"error: the tracking server at {auth_server.url} refuses this user the job's "
                                       "experiment or run (")
    assert result.last_line.endswith("a permission it lacks, or a token it does not accept; ask for the permission "
                                     "(or a valid token), or name another TRACKING.EXPERIMENT")


@needs_auth_app
def test_credentials_refused_mid_job_are_said_in_the_last_line(auth_server, admin_client, tmp_path, data_dir):
    """A password changed (a token expired) while the job trains: every send failed as if the server
    were down, and the last line never said the credentials were refused (helper-65's red team). Nor
    does the job wait out its hour of FLUSH_TIMEOUT_S for sends that cannot succeed."""
    from mlflow.server.auth.client import AuthServiceClient

    AuthServiceClient(auth_server.url).create_user("carol", "car0l-Pa55-word")
    creds = {"MLFLOW_TRACKING_USERNAME": "carol", "MLFLOW_TRACKING_PASSWORD": "car0l-Pa55-word"}
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": auth_server.url, "TRACKING.EXPERIMENT": "carol-expires",
                                                 "SOLVER.MAX_ITER": 60, "TRAIN.SNAPSHOT_ITERS": 5,
                                                 "TRACKING.FLUSH_TIMEOUT_S": 3600})
    job = Job(args, tmp_path, env=creds)
    try:
        wait_until(lambda: (tmp_path / "output" / "model_iter4.pth").exists(), job, "model_iter4")
        AuthServiceClient(auth_server.url).update_user_password("carol", "rotated-Pa55-word")
        assert job.wait(600) == 1, job.stderr[-3000:]
    finally:
        job.kill_group()
    assert "The tracking server now refuses the credentials (" in job.last_line, job.last_line
    assert job.last_line.endswith("renew them; the local files are intact; running the same command again sends "
                                  "what the run lacks")
    assert "car0l-Pa55-word" not in job.stderr


def _answer_plain_http(server: socket.socket) -> None:
    with contextlib.suppress(OSError):  # until the test closes it
        while True:
            client, _ = server.accept()
            with client:
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def test_tls_and_proxy_failures_say_what_failed_not_is_it_running(train, monkeypatch):
    """https:// to a server that speaks plain HTTP (a TLS failure, as an untrusted certificate is), and a
    corporate proxy that is down, were both `cannot reach the tracking server (is it running?)`. (The
    advice for an untrusted certificate, MLFLOW_TRACKING_SERVER_CERT_PATH, is not tried here: it
    needs a certificate made for the test.)"""
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        threading.Thread(target=_answer_plain_http, args=(plain,), daemon=True).start()
        uri = f"https://127.0.0.1:{plain.getsockname()[1]}"
        result = train("TRACKING.URI", uri, tracking=True)
    assert result.code == 2, result.stderr[-2000:]
    assert result.last_line.startswith(f"error: the tracking server at {uri}: TLS failed ([SSL"), result.last_line
    assert result.last_line.endswith("); it answers in plain HTTP: use an http:// URI"), result.last_line

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: the proxy refuses connections
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed.getsockname()[1]}")
        monkeypatch.setenv("NO_PROXY", "")
        result = train("TRACKING.URI", "http://mlflow.example.invalid:5000", tracking=True)
    assert result.code == 2, result.stderr[-2000:]
    assert result.last_line == ("error: cannot reach the tracking server at http://mlflow.example.invalid:5000 through "
                                "the proxy of HTTP_PROXY/HTTPS_PROXY (Unable to connect to proxy: [Errno 111] "
                                "Connection refused); NO_PROXY lists the hosts reached without it")


SECRETS = {
    "uri_password": "uri-Pa55-" + uuid.uuid4().hex[:10],
    "catalog_key": "catalog-API-KEY-" + uuid.uuid4().hex[:10],
    "catalog_token": "catalog-TOKEN-" + uuid.uuid4().hex[:10],
    "catalog_secret": "catalog-SECRET-" + uuid.uuid4().hex[:10],
    "aws_secret": "aws-SECRET-" + uuid.uuid4().hex[:10],
    "env_password": ADMIN[1],
}


def _leaks(texts: dict[str, bytes | str]) -> list[str]:
    found = []
    for where, text in texts.items():
        data = text.encode() if isinstance(text, str) else text
        found += [f"{name} in {where}" for name, secret in SECRETS.items() if secret.encode() in data]
    return found


def _everything_tracked(client: MlflowClient, run, dest: Path) -> dict[str, bytes | str]:
    texts = {f"param {k}": v for k, v in run.data.params.items()}
    texts.update({f"tag {k}": v for k, v in run.data.tags.items()})
    root = Path(client.download_artifacts(run.info.run_id, "", str(dest)))
    texts.update({f"artifact {p.relative_to(root)}": p.read_bytes() for p in root.rglob("*") if p.is_file()})
    return texts


@pytest.fixture(scope="module")
def secret_job(auth_server, data_dir, tmp_path_factory):
    """One job given every kind of secret: creds in the tracking URI (basic auth from the URL) and in
    the environment, API keys and tokens in its dataset catalog entry, AWS keys in the environment."""
    tmp = tmp_path_factory.mktemp("secrets")
    host = auth_server.url.split("://", 1)[1]
    # A user whose password goes into the tracking URI (requests sends it as basic auth).
    from mlflow.server import get_app_client

    saved = dict(os.environ)
    os.environ.update({"MLFLOW_TRACKING_USERNAME": ADMIN[0], "MLFLOW_TRACKING_PASSWORD": ADMIN[1]})
    try:
        users = get_app_client("basic-auth", tracking_uri=auth_server.url)
        users.create_user("trainer", SECRETS["uri_password"])
        users.update_user_admin("trainer", True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    train_dir = data_dir / "synth_shapes" / "train"
    keys = {**QUICK, "TRACKING.URI": f"http://trainer:{SECRETS['uri_password']}@{host}",
            "TRACKING.EXPERIMENT": "secrets",
            "DATASET_CATALOG.private.IM_DIR": str(train_dir / "images"),
            "DATASET_CATALOG.private.ANN_FN": str(train_dir / "annotations.json"),
            "DATASET_CATALOG.private.API_KEY": SECRETS["catalog_key"],
            "DATASET_CATALOG.private.ACCESS_TOKEN": SECRETS["catalog_token"],
            "DATASET_CATALOG.private.CLIENT_SECRET": SECRETS["catalog_secret"],
            "TRAIN.DATASETS": "('private',)"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update({"AWS_ACCESS_KEY_ID": "AKIATRACKTRONTEST", "AWS_SECRET_ACCESS_KEY": SECRETS["aws_secret"]})
    with_uri = subprocess.run(trainer_cmd(*demo_overrides(tmp, data_dir, **keys)), cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=300)
    # Another job with the credentials in the environment only, as MLflow documents it.
    env_creds = {**env, "MLFLOW_TRACKING_USERNAME": ADMIN[0], "MLFLOW_TRACKING_PASSWORD": ADMIN[1]}
    keys = {**QUICK, "TRACKING.URI": auth_server.url, "TRACKING.EXPERIMENT": "env-creds"}
    with_env = subprocess.run(trainer_cmd(*demo_overrides(tmp / "env", data_dir, **keys)), cwd=tmp, env=env_creds,
                              capture_output=True, text=True, timeout=300)
    for name, job in (("with-uri", with_uri), ("with-env", with_env)):  # for a look after a failure
        (tmp / f"{name}.stdout").write_text(job.stdout)
        (tmp / f"{name}.stderr").write_text(job.stderr)
    return tmp, with_uri, with_env


def _only_run(client: MlflowClient, experiment: str):
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


@pytest.fixture
def admin_client(auth_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
    return MlflowClient(auth_server.url)


@needs_auth_app
def test_basic_auth_server_with_credentials_in_the_environment(secret_job, admin_client, tmp_path):
    _, _, job = secret_job
    assert job.returncode == 0, job.stderr[-3000:]
    run = _only_run(admin_client, "env-creds")
    assert run.info.status == "FINISHED"
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    leaks = _leaks({"stdout": job.stdout, "stderr": job.stderr,
                    **_everything_tracked(admin_client, run, tmp_path)})
    assert not leaks, "secrets found: " + "; ".join(leaks)


@needs_auth_app
def test_basic_auth_from_credentials_in_the_tracking_uri(secret_job, admin_client):
    _, job, _ = secret_job
    assert job.returncode == 0, job.stderr[-3000:]
    run = _only_run(admin_client, "secrets")
    assert run.info.status == "FINISHED"


@needs_auth_app
def test_secrets_given_as_overrides_appear_nowhere(secret_job, admin_client, tmp_path):
    tmp, job, _ = secret_job
    assert job.returncode == 0, job.stderr[-3000:]
    run = _only_run(admin_client, "secrets")
    local = {f"local {p.relative_to(tmp)}": p.read_bytes() for p in (tmp / "output").rglob("*") if p.is_file()}
    leaks = _leaks({"stdout": job.stdout, "stderr": job.stderr, **local,
                    **_everything_tracked(admin_client, run, tmp_path)})
    assert not leaks, "secrets found: " + "; ".join(leaks)


def test_credentials_leave_the_tracking_uri_for_mlflows_variables(monkeypatch):
    from trainer.tracking.runs import without_credentials

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert without_credentials("https://ci%40corp:p%40ss%3Aw%2Frd@mlflow.example:5000/base") == \
        "https://mlflow.example:5000/base"
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("ci@corp", "p@ss:w/rd")
    for uri in ("http://127.0.0.1:5000", "sqlite:///mlflow.db", "databricks"):
        assert without_credentials(uri) == uri


def test_redacted_config_keeps_what_a_rerun_needs():
    from trainer.config import load_config, redacted

    cfg = load_config(None, ["TRACKING.URI", "http://u:pw@host:5000", "DATASET_CATALOG.d.IM_DIR", "s3://b/im",
                             "DATASET_CATALOG.d.ANN_FN", "a.json", "DATASET_CATALOG.d.API_KEY", "k-123",
                             "TRAIN.DATASETS", "('d',)"])
    out = redacted(cfg)
    assert out["TRACKING"]["URI"] == "http://***@host:5000"
    assert out["DATASET_CATALOG"]["d"] == {"IM_DIR": "s3://b/im", "ANN_FN": "a.json", "API_KEY": "***"}
    assert cfg.DATASET_CATALOG["d"]["API_KEY"] == "k-123"  # the job itself still has it


def test_an_mlflow_model_alias_is_no_password():
    """models:/name@alias names an alias, not a user: it is kept (a fine-tune records it as its parent)."""
    from trainer.redaction import redact_urls

    assert redact_urls("TRAIN.WEIGHTS models:/det-01@best") == "TRAIN.WEIGHTS models:/det-01@best"
    assert redact_urls("models:/a@b, http://u:pw@h, s3:/k:s@b") == "models:/a@b, http://***@h, s3:/***@b"


@pytest.mark.parametrize("typed", [
    # helper-56: a password with / # ? (a token's usual alphabet) is no URL's userinfo (the authority
    # ends there), so `config`, `status` and `eval` printed it whole in MLflow's "Invalid url" line
    "http://alice:se/cret99@127.0.0.1:5000", "http://alice:se#cret99@h:1/x", "http://alice:se?cret@h",
    "https://user:2024/secret@host/x",  # helper-57: digits before the / passed for a port
    "https://u:a@b/c@host/x",  # helper-57: an @ inside, then a / : `b/c` was left showing
])
def test_a_url_password_as_typed_is_hidden_wherever_it_is_echoed(typed):
    from trainer.config import load_config, redacted
    from trainer.redaction import REDACTED, redact_text, remember_url_credentials

    remember_url_credentials(typed)  # what main() does with every argument
    password = typed.split("://", 1)[1].rpartition("@")[0].partition(":")[2]
    echoed = redact_text(f"error: cannot read jobs from {typed}: Invalid url {typed}/api/2.0/x")
    assert password not in echoed and f"{REDACTED}@" in echoed, echoed
    assert password not in str(redacted(load_config(None, ["TRACKING.URI", typed])))  # config.yaml, params


@pytest.mark.parametrize("text", [
    # helper-57: the first fix (one regex over all text) replaced these up to their last @; the query's
    # regex scanned from each URL to the line's end (a 100 kB line of URLs took seconds)
    "http://[::1]:5000/x@y", "http://[2001:db8::1]:5000/#/models/det@prod",
    '{"uri":"http://localhost:5000","owner":"me@corp.com"}', "<a href='http://h:80/x'>me@corp.com</a>",
    "http://host:8080/path/u@x.com", "http://127.0.0.1:5000/#/experiments/1/runs/ab", "models:/det@prod",
])
def test_text_with_urls_and_at_signs_but_no_credentials_is_left_as_it_is(text):
    import time

    from trainer.redaction import redact_text

    assert redact_text(text) == text
    start = time.monotonic()
    redact_text('"http://mlflow:5000",' * 6000 + "a://b:c" * 6000)
    assert time.monotonic() - start < 1.0  # linear: a long one-line error body is no stall


FAILING = {  # inputs whose job fails, each with a secret in it; the error paths print the most
    "database URI password": ({"TRACKING.URI": "postgresql://trainer:{secret}@127.0.0.1:1/mlflow"}, {}),
    "weights URL password": ({"TRAIN.WEIGHTS": "https://user:{secret}@127.0.0.1:9/w.pth",
                              "TRACKING.ENABLED": "false"}, {}),
    "catalog entry token": ({"DATASET_CATALOG.private.API_TOKEN": "{secret}", "TRAIN.DATASETS": "('private',)",
                             "TRACKING.ENABLED": "false"}, {}),
    "password in the environment": ({"TRACKING.URI": "http://127.0.0.1:9"},
                                    {"MLFLOW_TRACKING_USERNAME": "trainer", "MLFLOW_TRACKING_PASSWORD": "{secret}"}),
}


@pytest.mark.parametrize("case", sorted(FAILING))
def test_a_failing_job_prints_and_writes_no_secret(case, tmp_path, data_dir):
    secret = "pw-" + uuid.uuid4().hex[:12]
    keys, env = FAILING[case]
    keys = {k: v.format(secret=secret) for k, v in keys.items()}
    env = {k: v.format(secret=secret) for k, v in env.items()}
    result = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path, env=env)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert secret not in result.stdout + result.stderr, (result.stdout + result.stderr)[-2000:]
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


class _EchoHeaders(http.server.BaseHTTPRequestHandler):
    """A gateway that answers 400 with the request it got, headers and all (debug proxies do)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = f"bad request, Authorization: {self.headers.get('Authorization')}; {self.command} {self.path}"
        body = body.encode()
        self.send_response(400)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("where", ["url", "environment"])
def test_basic_auth_echoed_by_the_server_is_not_printed(tmp_path, data_dir, where):
    """MLflow sends the URL's (or the environment's) user and password as `Authorization: Basic
    base64(user:password)`; a server that echoed the request in its error body had that base64 printed
    in the error line. Found by the red team of 2026-12-02."""
    secret = "pw-" + uuid.uuid4().hex[:12]
    encoded = base64.b64encode(f"trainer:{secret}".encode()).decode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoHeaders)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host = f"127.0.0.1:{server.server_address[1]}"
        uri, env = ((f"http://trainer:{secret}@{host}", {}) if where == "url" else
                    (f"http://{host}", {"MLFLOW_TRACKING_USERNAME": "trainer", "MLFLOW_TRACKING_PASSWORD": secret}))
        result = run_trainer(["--dry-run", *demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri})],
                             cwd=tmp_path, env=env)
        # `tracktron status` never installed the redaction of the environment's secrets (helper-56)
        status = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", uri], capture_output=True,
                                text=True, cwd=tmp_path, timeout=120, env={**os.environ, **env})
    finally:
        server.shutdown()
        server.server_close()
    for result in (result, status):
        assert result.returncode == 2, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert "400" in last and "Authorization: Basic ***" in last, last  # the echo reached the line, redacted
        assert secret not in result.stdout + result.stderr and encoded not in result.stdout + result.stderr


def test_a_small_weights_file_that_inflates_to_a_huge_tensor_is_refused_before_loading(train, tmp_path, monkeypatch,
                                                                                       data_dir):
    """torch.load inflates deflated zip entries: a 256 kB .pth held a 256 MiB tensor (the red team's,
    1 MB for 1 GiB), taken into memory before any check. TRAIN.WEIGHTS, eval and predict refuse it."""
    import io
    import zipfile

    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(64 << 20)}, buf)
    bomb = tmp_path / "small.pth"
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as plain, \
            zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as deflated:
        for entry in plain.infolist():
            deflated.writestr(entry.filename, plain.read(entry.filename))
    assert bomb.stat().st_size < 1 << 20
    monkeypatch.chdir(tmp_path)
    image = sorted((data_dir / "synth_shapes" / "val" / "images").glob("*.png"))[0]
    for result, option in (
            (train("TRAIN.WEIGHTS", str(bomb)), "TRAIN.WEIGHTS"),
            (run_cli(["eval", "--config", str(DEMO), "--weights", str(bomb), "DATA_DIR", str(data_dir),
                      "TRACKING.ENABLED", "false"]), "--weights"),
            (run_cli(["predict", "--weights", str(bomb), "--out", str(tmp_path / "p"), str(image)]), None)):
        assert result.code == 2, result.stderr[-2000:]
        assert "inflates" in result.last_line and "torch.save writes no compressed entries" in result.last_line
        assert option is None or result.last_line.startswith(f"error: {option} {bomb}")
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("length, scheme", [(9, "http"), (12, "http"), (16, "http"), (40, "http"), (16, "HTTP")])
def test_a_token_in_the_tracking_uri_is_never_shown_even_in_part(tmp_path, length, scheme):
    """An error line is cut at 200 characters: cut before it was redacted, the token in
    `url: /?token=...` was cut in half, no longer matched the token to hide and was printed
    (all but the last characters of it). Found by the red team of 2026-12-03 (second). A scheme in
    capitals (`HTTP://`, which MLflow and urllib3 take) printed it whole (helper-58)."""
    token = (uuid.uuid4().hex * 2)[:length]
    result = subprocess.run([*trainer_cmd()[:3], "status", "--uri", f"{scheme}://127.0.0.1:9/?token={token}",
                             "--timeout", "20"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    shown = result.stdout + result.stderr
    assert "token=***" in shown, shown[-2000:]
    assert not any(token[i:i + 6] in shown for i in range(length - 5)), shown[-2000:]


def test_run_context_tags_carry_no_credentials(monkeypatch):
    """MLFLOW_RUN_CONTEXT's values became tags as given: a CI job's URL with its token, or a value
    under a secret-named key, reached the store; they are redacted as the job's other tags are."""
    from trainer.tracking.run_description import context_tags

    monkeypatch.setenv("MLFLOW_RUN_CONTEXT", '{"ci.job_url": "https://bot:hunter2@ci.example.com/job/1", '
                                             '"ci.api_token": "tok-123", "pod": {"node": 3}}')
    tags = context_tags()
    assert "hunter2" not in str(tags) and "tok-123" not in str(tags)
    assert tags["ci.job_url"].endswith("@ci.example.com/job/1") and tags["ci.api_token"] == "***"
    assert tags["pod"] == '{"node": 3}'
