"""Checkpoints of real size (issue 19), against a real `mlflow server` and moto's S3.

A job whose checkpoints weigh some 150 MB (the demo's Faster R-CNN at full width) uploads
them in parts, through the server's proxy (MLflow's multipart upload: the server signs a URL per
part, the parts go to S3) and straight to S3 (boto3's multipart), and the same job resumed on an
empty machine downloads its checkpoint, checks its sha256 and continues. A request through the proxy
may wait for the server in proportion to what it carries, not a flat 30 s. TRACKING.CHECKPOINTS_KEEP
leaves the run its newest model_iter checkpoints and every one that something names; a server that
refuses the deletes loses nothing. 1 GB figures: bench/big_checkpoint.py."""
from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import RunTag

from tests.conftest import DEMO, demo_overrides
from tests.faultkit import (  # noqa: F401 - jobs is a fixture
    jobs, only_run, sha_tag, steps, wait_until)
from tests.servers import FaultProxy, MlflowServer
from trainer.checkpoint.files import checkpoint_name, iteration_of
from trainer.hashing import sha256_of
from trainer.config import load_config
from trainer.tracking.mlflow_tracker import MlflowTracker
from trainer.tracking.checkpoint_uploads import PRUNE_BATCH
from trainer.tracking.model_uris import download_uri
from trainer.tracking.runs import checkpoints_from
from trainer.tracking.transfers import download, file_identity, repository, run_repository, upload

MB = 1024**2
PART = 16 * MB  # the proxy's parts here (MLflow's default: 10 MB from 500 MB files on)
BOTO3_PART = 8 * MB  # boto3's default part size (TransferConfig), which MLflow's S3 repository keeps


# The demo's model at full width (MobileNetV3, 256-channel FPN, 1024-wide box head): a checkpoint of
# its weights and SGD momentum weighs ~150 MB, and an iteration on the demo's 128 px images stays short.
MID_SIZE = {"MODEL.BACKBONE_WIDTH": 1.0, "MODEL.FPN_CHANNELS": 256, "MODEL.REPRESENTATION_SIZE": 1024}


def run_key(client: MlflowClient, run_id: str, name: str, bucket: str, prefix: str) -> str:
    """The S3 key of the run's checkpoint `name` (artifact URIs: mlflow-artifacts:/<exp>/<run>/artifacts
    through the proxy, s3://<bucket>/<prefix>/<exp>/<run>/artifacts direct)."""
    uri = client.get_run(run_id).info.artifact_uri
    tail = uri.split(f"s3://{bucket}/", 1)[1] if uri.startswith("s3://") else f"{prefix}/{uri.split(':/', 1)[1].lstrip('/')}"
    return f"{tail}/checkpoints/{name}"


# ---- a checkpoint of real size, in parts, through the proxy and direct; a resume on an empty machine ----

@pytest.mark.parametrize("route", ["proxy", "direct"])
def test_a_150_mb_checkpoint_goes_up_in_parts_and_a_resume_elsewhere_downloads_and_verifies_it(
        route, tmp_path, data_dir, s3_server, mlflow_server, jobs):  # noqa: F811 - the fixture
    if route == "proxy":  # the trainer has no S3 credentials: the server signs each part's URL
        server, prefix, env = mlflow_server, "proxied", {}
    else:
        prefix = f"direct-{uuid.uuid4().hex[:6]}"
        (tmp_path / "server").mkdir()
        server = MlflowServer(tmp_path / "server", artifacts=f"s3://{s3_server.bucket}/{prefix}", proxy=False).start()
        env = dict(s3_server.env)
    env.update({"MLFLOW_MULTIPART_UPLOAD_MINIMUM_FILE_SIZE": str(64 * MB), "MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE": str(PART)})
    exp = f"big-{route}-{uuid.uuid4().hex[:6]}"
    keys = {**MID_SIZE, "SOLVER.MAX_ITER": 4, "TRAIN.SNAPSHOT_ITERS": 100, "LOG_PERIOD": 1, "TEST.DATASETS": "()",
            "TRACKING.LOG_MODEL": "false", "TRACKING.URI": server.url, "TRACKING.EXPERIMENT": exp}
    try:
        # A machine preempted after its first iteration: it checkpoints that iteration and uploads it.
        first = jobs(demo_overrides(tmp_path / "a", data_dir, **keys), tmp_path / "a", env=env, name="first")
        wait_until(lambda: first.iters(), first, "the first iteration", timeout=300)
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait(120) == 128 + signal.SIGTERM, first.stderr[-3000:]
        client = MlflowClient(server.url)
        run = only_run(client, exp)
        name = run.data.tags["tracktron.ckpt.latest"]
        local = tmp_path / "a" / "output" / name
        size = local.stat().st_size
        assert size > 100 * MB and run.data.tags[sha_tag(name)] == sha256_of(local)
        head = s3_server.client().head_object(Bucket=s3_server.bucket, Key=run_key(client, run.info.run_id, name,
                                                                                    s3_server.bucket, prefix))
        parts = -(-size // (PART if route == "proxy" else BOTO3_PART))
        assert head["ContentLength"] == size and head["ETag"].strip('"').endswith(f"-{parts}"), head["ETag"]

        # Another machine, nothing local: the checkpoint comes from the run, checked, and the job goes on.
        second = jobs(demo_overrides(tmp_path / "b", data_dir, **keys), tmp_path / "b", env=env, name="second")
        assert second.wait(300) == 0, second.stderr[-3000:]
        resumed_at = int(re.search(r"model_iter(\d+)\.pth", name).group(1)) + 1
        assert f"resuming from run {run.info.run_id} ({name}) at iteration {resumed_at}" in second.stderr
        run = only_run(client, exp)
        assert run.info.status == "FINISHED" and steps(client, run.info.run_id) == [0, 1, 2, 3]
        assert run.data.tags[sha_tag("model_final.pth")] == sha256_of(tmp_path / "b" / "output" / "model_final.pth")
    finally:
        if route == "direct":
            server.stop()


# ---- timeouts by size ----

class _SlowToAnswer(FaultProxy):
    """The tracking server behind a proxy that holds its answer to each checkpoint request of `method`
    `seconds`, as a server still storing the file onward (PUT) or fetching it from its store (GET) does."""

    def __init__(self, target: str, seconds: float, method: bytes = b"PUT", path: bytes = rb"/checkpoints/"):
        super().__init__(target)
        self.seconds, self._owed = seconds, set()
        self._request = re.compile(method + rb" /api/2\.0/mlflow-artifacts/artifacts/\S*" + path)

    def _pump(self, src, dst, upstream: bool) -> None:
        try:
            while data := src.recv(1 << 18):
                if upstream and self._request.match(data):
                    self._owed.add(src)  # the client's socket: its next answer waits
                elif not upstream and dst in self._owed:
                    self._owed.discard(dst)
                    time.sleep(self.seconds)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            src.close()
            dst.close()


def test_a_put_through_the_proxy_may_wait_for_the_server_in_proportion_to_its_size(tmp_path, mlflow_server,
                                                                                       monkeypatch):
    """The server answers a PUT once it has stored the file onward: a 96 MB one may wait seconds where
    a 1 MB one may not. Here the base timeout is 2 s and the answer to every PUT comes 5 s late."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with _SlowToAnswer(mlflow_server.url, 5.0) as proxy:
        client = MlflowClient(proxy.url)
        run_id = client.create_run(client.create_experiment(f"held-{uuid.uuid4().hex[:6]}")).info.run_id
        repo = run_repository(client, proxy.url, run_id)
        small, big = tmp_path / "model_iter1.pth", tmp_path / "model_iter2.pth"
        small.write_bytes(os.urandom(MB))
        big.write_bytes(os.urandom(96 * MB))  # under MLflow's 500 MB multipart threshold: one PUT
        started = time.monotonic()
        with pytest.raises(Exception, match="timed out|[Tt]imeout"):
            upload(repo, small, "checkpoints")  # 2 s + 1 MB at 8 MB/s: the answer comes too late
        assert time.monotonic() - started < 4.5
        upload(repo, big, "checkpoints")  # 2 s + 96 MB at 8 MB/s = 14 s: waits for it (9 s past the delay)
    stored = {f.path: f.file_size for f in MlflowClient(mlflow_server.url).list_artifacts(run_id, "checkpoints")}
    assert stored["checkpoints/model_iter2.pth"] == 96 * MB  # (the small one got there too: its client gave up)


def test_a_single_put_through_the_proxy_stores_the_file_byte_for_byte_empty_or_not(tmp_path, mlflow_server):
    """Under the multipart threshold a file goes in one PUT, its bytes mapped from the file."""
    client = MlflowClient(mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"put-{uuid.uuid4().hex[:6]}")).info.run_id
    repo = run_repository(client, mlflow_server.url, run_id)
    files = {"model_iter1.pth": b"", "model_iter2.pth": os.urandom(3 * MB + 17)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        upload(repo, tmp_path / name, "checkpoints")
    for name, data in files.items():
        got = client.download_artifacts(run_id, f"checkpoints/{name}", str(tmp_path / "back"))
        assert Path(got).read_bytes() == data



@pytest.mark.parametrize("route", ["one put", "in parts", "a local store"])
def test_a_file_changed_since_it_was_handed_to_the_uploader_is_not_uploaded(route, tmp_path, mlflow_server, monkeypatch):
    """A checkpoint replaced between its write and its upload (by hand, another process, a resume's
    file swapped: helper-48's red team) went up and was tagged with the sha256 of the bytes it no
    longer held. The file the upload opens must still be the one handed over, on each route."""
    client = MlflowClient(mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"changed-{uuid.uuid4().hex[:6]}")).info.run_id
    if route == "a local store":
        repo = repository(str(tmp_path / "store"), f"sqlite:///{tmp_path / 'mlflow.db'}")
        stored = lambda: sorted(p.name for p in (tmp_path / "store" / "checkpoints").glob("*"))  # noqa: E731
    else:
        repo = run_repository(client, mlflow_server.url, run_id)
        stored = lambda: sorted(f.path.rsplit("/", 1)[1] for f in client.list_artifacts(run_id, "checkpoints"))  # noqa: E731
    if route == "in parts":
        monkeypatch.setenv("MLFLOW_MULTIPART_UPLOAD_MINIMUM_FILE_SIZE", str(MB))
        monkeypatch.setenv("MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE", str(5 * MB))
    path, other = tmp_path / "model_iter14.pth", tmp_path / "model_iter9.pth"

    def replaced():  # another checkpoint's bytes moved over it, as the red team did
        other.write_bytes(os.urandom(6 * MB))
        os.replace(other, path)

    def rewritten():  # the same size, other bytes, in place
        time.sleep(0.05)  # past the file system's timestamp granularity
        path.write_bytes(os.urandom(6 * MB))

    def cut_short():
        os.truncate(path, MB)

    for change in (replaced, rewritten, cut_short):
        path.write_bytes(os.urandom(6 * MB))
        written = file_identity(path)
        change()
        with pytest.raises(ValueError, match=r"model_iter14\.pth changed since it was written .*not uploaded"):
            upload(repo, path, "checkpoints", written)
        assert "model_iter14.pth" not in stored(), change.__name__
    upload(repo, path, "checkpoints", file_identity(path))  # unchanged: it goes up
    assert stored() == ["model_iter14.pth"]


@pytest.mark.parametrize("threshold", [None, 64 * MB])
def test_a_checkpoint_download_through_the_proxy_waits_for_the_server_to_fetch_it_in_proportion_to_its_size(
        tmp_path, mlflow_server, monkeypatch, threshold):
    """The server sends the first byte of a download only once it has fetched the whole file from its
    store. Base timeout 2 s, every checkpoint GET answered 5 s late: a 96 MB checkpoint still comes,
    whole; a 1 MB one times out. So too past MLflow's threshold for ranged downloads (500 MB, here
    lowered to 64 MB) on a server that offers none: MLflow's own download would be the same GET with
    the flat 2 s (FAULTS row 346)."""
    client = MlflowClient(mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"slow-get-{uuid.uuid4().hex[:6]}")).info.run_id
    small, big = tmp_path / "model_iter1.pth", tmp_path / "model_iter2.pth"
    small.write_bytes(os.urandom(MB))
    big.write_bytes(os.urandom(96 * MB))
    for path in (small, big):
        client.log_artifact(run_id, str(path), "checkpoints")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")  # once the test's own uploads are done
    if threshold:
        monkeypatch.setenv("MLFLOW_MULTIPART_DOWNLOAD_MINIMUM_FILE_SIZE", str(threshold))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with _SlowToAnswer(mlflow_server.url, 5.0, b"GET") as proxy:
        repo = run_repository(MlflowClient(proxy.url), proxy.url, run_id)
        (tmp_path / "got").mkdir()
        started = time.monotonic()
        with pytest.raises(Exception, match="timed out|[Tt]imeout"):
            download(repo, "checkpoints/model_iter1.pth", tmp_path / "got")
        assert time.monotonic() - started < 4.5
        got, sha256 = download(repo, "checkpoints/model_iter2.pth", tmp_path / "got")
        assert got == tmp_path / "got" / "model_iter2.pth" and sha256 == sha256_of(got) == sha256_of(big)
        with pytest.raises(FileNotFoundError, match="no artifact checkpoints/model_iter3.pth"):
            download(repo, "checkpoints/model_iter3.pth", tmp_path / "got")


@pytest.fixture
def users_2s_timeout(monkeypatch):
    """Sets the user's MLFLOW_HTTP_REQUEST_TIMEOUT 2 s, as set before the command started (download_uri
    keeps it): called once the test's own uploads are done, which a loaded machine's server may take
    longer than 2 s to store."""
    import mlflow.tracking._tracking_service.utils as tracking_utils

    from trainer.tracking import runs

    monkeypatch.setattr(runs, "_SET_BY_USER", set(runs._HTTP_KEYS))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI", ""))  # download_uri sets both:
    monkeypatch.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)  # put back after

    def set_2s():
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a pooled connection the server closed meanwhile
    return set_2s


def test_a_runs_checkpoint_given_as_weights_waits_for_the_server_as_a_resume_does(tmp_path, mlflow_server,
                                                                                 users_2s_timeout):
    """`runs:/<run>/checkpoints/<file>` as TRAIN.WEIGHTS, or to `eval` and `predict`: a 96 MB checkpoint
    whose GET the server answers 5 s late, the user's MLFLOW_HTTP_REQUEST_TIMEOUT 2 s, comes whole and
    checked against its tag, as a resume's does; MLflow's own download timed out (FAULTS row 346)."""
    client = MlflowClient(mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"weights-{uuid.uuid4().hex[:6]}")).info.run_id
    big = tmp_path / "model_iter2.pth"
    big.write_bytes(os.urandom(96 * MB))
    client.log_artifact(run_id, str(big), "checkpoints")
    client.set_tag(run_id, sha_tag(big.name), sha256_of(big))
    (tmp_path / "got").mkdir()
    users_2s_timeout()
    with _SlowToAnswer(mlflow_server.url, 5.0, b"GET") as proxy:
        cfg = load_config(DEMO, ["TRACKING.URI", proxy.url])
        got = download_uri(cfg, f"runs:/{run_id}/checkpoints/{big.name}", str(tmp_path / "got"))
    assert got == tmp_path / "got" / "checkpoints" / big.name and sha256_of(got) == sha256_of(big)  # as MLflow lays it out


@pytest.mark.parametrize("form", ["alias", "version", "model id", "run's model"])
def test_a_registered_model_given_as_weights_waits_for_the_server_as_a_checkpoint_does(
        form, tmp_path, mlflow_server, users_2s_timeout):
    """`models:/name@alias`, `models:/name/1`, `models:/<id>` and `runs:/<run>/<name>` (TRAIN.WEIGHTS, `eval`,
    `predict`): a model with 96 MB of weights whose GET the server answers 5 s late, the user's
    MLFLOW_HTTP_REQUEST_TIMEOUT 2 s, comes whole, every file where MLflow's download puts it in its folder. MLflow's own
    download timed out: one GET with the flat 2 s (FAULTS row 351)."""
    client = MlflowClient(mlflow_server.url)
    experiment_id = client.create_experiment(f"model-{uuid.uuid4().hex[:6]}")
    run_id = client.create_run(experiment_id).info.run_id
    files = {"MLmodel": b"flavors: {}\n", "artifacts/detector/weights.pth": os.urandom(96 * MB),
             "artifacts/detector/config.yaml": b"MODEL: {}\n"}
    for rel, data in files.items():
        (tmp_path / "model" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "model" / rel).write_bytes(data)
    model = client.create_logged_model(experiment_id, name="detector", source_run_id=run_id)
    client.log_model_artifacts(model.model_id, str(tmp_path / "model"))
    name = f"slow-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(name)
    client.create_model_version(name, f"models:/{model.model_id}", run_id=run_id, model_id=model.model_id)
    client.set_registered_model_alias(name, "prod", "1")
    uri = {"alias": f"models:/{name}@prod", "version": f"models:/{name}/1", "model id": f"models:/{model.model_id}",
           "run's model": f"runs:/{run_id}/detector"}[form]
    users_2s_timeout()
    with _SlowToAnswer(mlflow_server.url, 5.0, b"GET", rb"/weights\.pth") as proxy:
        cfg = load_config(DEMO, ["TRACKING.URI", proxy.url])
        got = download_uri(cfg, uri, str(tmp_path / "got"))
    assert {str(p.relative_to(got)): p.read_bytes() for p in got.rglob("*") if p.is_file()} == files


def test_a_runs_model_that_is_also_a_folder_of_the_run_comes_as_mlflow_gives_it(tmp_path, mlflow_server):
    """`runs:/<run>/model` where the run holds a folder `model` (MLflow 2's log_model) and a logged model
    `model` too: the files of both, the model's over the run's, as MLflow's download gives them. The
    download file by file gave the logged model's alone, so weights in the run's folder were not there
    (FAULTS row 356)."""
    import mlflow

    client = MlflowClient(mlflow_server.url)
    experiment_id = client.create_experiment(f"both-{uuid.uuid4().hex[:6]}")
    run_id = client.create_run(experiment_id).info.run_id
    for rel, data in {"run/model/artifacts/detector/weights.pth": b"run's", "run/model/MLmodel": b"run's",
                      "lm/MLmodel": b"flavors: {}\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    client.log_artifacts(run_id, str(tmp_path / "run" / "model"), "model")
    model = client.create_logged_model(experiment_id, name="model", source_run_id=run_id)
    client.log_model_artifacts(model.model_id, str(tmp_path / "lm"))
    uri = f"runs:/{run_id}/model"
    ours = download_uri(load_config(DEMO, ["TRACKING.URI", mlflow_server.url]), uri, str(tmp_path / "ours"))
    (tmp_path / "theirs").mkdir()
    theirs = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "theirs"),
                                                      tracking_uri=mlflow_server.url))
    assert {str(p.relative_to(ours)): p.read_bytes() for p in ours.rglob("*") if p.is_file()} == \
        {str(p.relative_to(theirs)): p.read_bytes() for p in theirs.rglob("*") if p.is_file()} == \
        {"MLmodel": b"flavors: {}\n", "artifacts/detector/weights.pth": b"run's"}


def test_a_path_that_a_store_of_the_clients_own_lacks_is_said_as_missing(tmp_path, s3_server, monkeypatch):
    """A tracking server with --no-serve-artifacts: the client lists and fetches from S3 itself. A path
    the run lacks is FileNotFoundError, so MLflow's download says `Failed to download artifacts from
    path …`; it was boto3's failed download, whose first line (`The following failures occurred …`)
    said nothing of why (FAULTS row 357)."""
    from trainer.tracking.transfers import download_tree

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    key = f"direct-{uuid.uuid4().hex[:6]}"
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=f"{key}/model/MLmodel", Body=b"x")
    repo = repository(f"s3://{s3_server.bucket}/{key}", "http://127.0.0.1:9")
    with pytest.raises(FileNotFoundError):
        download_tree(repo, "checkpoints/model_iter3.pth", tmp_path)
    assert download_tree(repo, "model/MLmodel", tmp_path)[0].read_bytes() == b"x"


def test_past_the_threshold_a_server_that_offers_ranged_downloads_leaves_the_bytes_to_its_store(
        tmp_path, s3_server, monkeypatch):
    """An operator's MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD (MLflow 3.18): a checkpoint past the threshold
    (lowered to 64 MB) comes from S3 in ranged parts through URLs the server signs, and none of its bytes
    through the server; a smaller one still streams through it, hashed as it arrives."""
    monkeypatch.setenv("MLFLOW_MULTIPART_DOWNLOAD_MINIMUM_FILE_SIZE", str(64 * MB))
    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server", artifacts=f"s3://{s3_server.bucket}/ranged-{uuid.uuid4().hex[:6]}",
                          env={**s3_server.env, "MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "true"}).start()
    try:
        client = MlflowClient(server.url)
        run_id = client.create_run(client.create_experiment("ranged")).info.run_id
        small, big = tmp_path / "model_iter1.pth", tmp_path / "model_iter2.pth"
        small.write_bytes(os.urandom(MB))
        big.write_bytes(os.urandom(96 * MB))
        for path in (small, big):
            client.log_artifact(run_id, str(path), "checkpoints")
        with FaultProxy(server.url) as proxy:
            repo = run_repository(MlflowClient(proxy.url), proxy.url, run_id)
            (tmp_path / "got").mkdir()
            for path in (small, big):
                got, sha256 = download(repo, f"checkpoints/{path.name}", tmp_path / "got")
                assert sha256 == sha256_of(got) == sha256_of(path)
            seen = b"\n".join(proxy.requests_seen)
        assert re.search(rb"GET /api/2\.0/mlflow-artifacts/artifacts/\S*/checkpoints/model_iter1\.pth", seen)
        assert b"presigned" in seen and b"model_iter2.pth" in seen  # the server signed it...
        assert not re.search(rb"GET /api/2\.0/mlflow-artifacts/artifacts/\S*/checkpoints/model_iter2\.pth", seen)
    finally:
        server.stop()


class _ArtifactServer(http.server.BaseHTTPRequestHandler):
    """An artifact endpoint that lists one file, `name` (a path of its choosing), at `listed` bytes
    (None: no size), and then sends `sends` bytes for it."""

    def do_GET(self):
        if "?path=" in self.path or self.path.endswith("/artifacts"):
            size = {} if self.server.listed is None else {"file_size": str(self.server.listed)}
            body = json.dumps({"files": [{"path": self.server.name, "is_dir": False, **size}]}).encode()
        else:
            body = b"x" * self.server.sends
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _artifact_endpoint(listed: int | None, sends: int, name: str = "model_iter1.pth"):
    """A run's artifact URI served by _ArtifactServer on 127.0.0.1."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ArtifactServer)
    server.listed, server.sends, server.name = listed, sends, name
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/api/2.0/mlflow-artifacts/artifacts/1/run/artifacts"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("listed", [10, None])
def test_a_server_that_sends_more_than_it_lists_cannot_fill_the_disk(tmp_path, listed):
    """A broken or hostile server lists a checkpoint at 10 bytes and sends 3 MB: the download stops at
    the first chunk past the listed size. A server that lists no size gets MLflow's own download."""
    with _artifact_endpoint(listed, 3 * MB) as uri:
        repo = repository(uri, uri)
        if listed is None:
            path, sha256 = download(repo, "checkpoints/model_iter1.pth", tmp_path)
            assert path.stat().st_size == 3 * MB and sha256 == sha256_of(path)
        else:
            with pytest.raises(OSError, match="the server sent more than the 10 bytes it lists"):
                download(repo, "checkpoints/model_iter1.pth", tmp_path)
            assert (tmp_path / "model_iter1.pth").stat().st_size == 0


def test_a_file_that_comes_shorter_than_listed_is_refused(tmp_path):
    """A model's file listed at 1000 bytes whose GET ends cleanly after 3: a registered model's files have
    no sha256 to catch it, and the cut file was taken as whole (helper-105; FAULTS row 358)."""
    with _artifact_endpoint(1000, 3) as uri:
        with pytest.raises(OSError, match="the server sent 3 of the 1000 bytes it lists for checkpoints/model_iter1.pth"):
            download(repository(uri, uri), "checkpoints/model_iter1.pth", tmp_path)


@pytest.mark.parametrize("listed", ["../escaped.txt", "a/../../escaped.txt", "/tmp/escaped.txt"])
def test_a_server_listing_a_path_outside_the_folder_writes_nothing_there(tmp_path, listed):
    """A broken or hostile server lists a model's file as `../escaped.txt`: the download of the model,
    file by file, stops there (MLflow's listing refuses such a path) and writes nothing outside the
    folder it was given."""
    from trainer.tracking.transfers import download_tree

    (tmp_path / "dest").mkdir()
    with _artifact_endpoint(3, 3, name=listed) as uri, pytest.raises(Exception, match="[Ii]nvalid path"):
        download_tree(repository(uri, uri), "", tmp_path / "dest")
    assert [p.name for p in tmp_path.rglob("*")] == ["dest"]


# ---- TRACKING.CHECKPOINTS_KEEP ----

def _tracker(tmp: Path, uri: str, exp: str, resume: str | None = None) -> MlflowTracker:
    keys = {"TRACKING.URI": uri, "TRACKING.EXPERIMENT": exp, "OUTPUT_DIR": str(tmp), "TRACKING.CHECKPOINTS_KEEP": 2}
    cfg = load_config(DEMO, [str(x) for kv in keys.items() for x in kv])
    tracker = MlflowTracker(cfg)
    tracker.start(cfg, resume_run_id=resume, new_run=resume is None)
    return tracker


def _checkpoint(tmp: Path, tracker: MlflowTracker, iteration: int | None) -> None:
    path = tmp / checkpoint_name(iteration)
    path.write_bytes(os.urandom(200_000))
    step = 100 if iteration is None else iteration
    tracker.log_metrics({"loss": 1.0}, step)
    tracker.log_checkpoint(path, sha256_of(path))
    assert tracker.wait(60)


def _stored(uri: str, run_id: str) -> set[str]:
    return {f.path.rsplit("/", 1)[1] for f in MlflowClient(uri).list_artifacts(run_id, "checkpoints")}


def _tagged(tags: dict) -> set[str]:
    return {k[len("tracktron.ckpt."):-len(".sha256")] for k in tags if k.endswith(".sha256")}


def test_keep_2_leaves_the_newest_two_and_every_checkpoint_that_is_best_evaluated_or_registered(tmp_path,
                                                                                                  mlflow_server, s3_server):
    """One process evaluates model_iter1 (the best) and model_iter3 and is lost; the user registers
    model_iter5; a second process of the job uploads 7, 9, 11 and model_final. It knows nothing of
    the first one's evaluations: the run's tags, LoggedModels and registry tell it what stays."""
    url, exp = mlflow_server.url, f"keep-{uuid.uuid4().hex[:6]}"
    first = _tracker(tmp_path, url, exp)
    run_id = first.run.run_id
    for it, ap in ((1, 0.9), (3, 0.5)):
        _checkpoint(tmp_path, first, it)
        first.log_evaluation({"bbox/AP": ap}, it, f"model_iter{it}.pth")
    _checkpoint(tmp_path, first, 5)
    assert first.finish(None, timeout=30) == []
    client = MlflowClient(url)
    client.create_registered_model(f"{exp}-reg")
    client.create_model_version(f"{exp}-reg", source=f"runs:/{run_id}/checkpoints/model_iter5.pth", run_id=run_id)

    second = _tracker(tmp_path, url, exp, resume=run_id)
    for it in (7, 9, 11, None):
        _checkpoint(tmp_path, second, it)
        if it == 9:  # 1, 3, 5 are named, so the newest two besides them are 9 and 7: nothing to delete yet
            assert _stored(url, run_id) == {f"model_iter{i}.pth" for i in (1, 3, 5, 7, 9)}
    assert second.finish("FINISHED", timeout=30) == []
    expected = {"model_iter1.pth", "model_iter3.pth", "model_iter5.pth", "model_iter9.pth", "model_iter11.pth",
                "model_final.pth"}  # model_iter7 went when 11 was complete
    tags = client.get_run(run_id).data.tags
    assert _stored(url, run_id) == expected and _tagged(tags) == expected
    assert tags["tracktron.best_checkpoint"] == "model_iter1.pth" and tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert _s3_checkpoints(s3_server, run_id) == expected  # gone from the store, not only from the listing


def test_keep_never_deletes_the_jobs_new_checkpoints_for_a_tag_of_a_later_iteration(tmp_path, mlflow_server,
                                                                                   s3_server):
    """The run carries a sha256 tag of a later iteration than the job now reaches: a checkpoint that
    failed its sha256 (the job went on from an earlier one), or a hand-made tag. Counted as the
    newest, it had each checkpoint the job uploaded deleted as soon as it was tagged, and a job
    killed then lost everything. Found by the red team of 2026-12-03."""
    url, exp = mlflow_server.url, f"later-{uuid.uuid4().hex[:6]}"
    first = _tracker(tmp_path, url, exp)
    run_id = first.run.run_id
    assert first.finish(None, timeout=30) == []
    MlflowClient(url).set_tag(run_id, "tracktron.ckpt.model_iter999.pth.sha256", "00")
    second = _tracker(tmp_path, url, exp, resume=run_id)
    for it in (1, 3, 5):
        _checkpoint(tmp_path, second, it)
    assert second.finish(None, timeout=30) == []
    tags = MlflowClient(url).get_run(run_id).data.tags
    assert _stored(url, run_id) == {"model_iter3.pth", "model_iter5.pth"}  # keep 2 of this job's own
    assert _tagged(tags) == {"model_iter3.pth", "model_iter5.pth", "model_iter999.pth"}  # the user's tag, untouched


def test_a_keep_set_late_on_a_run_of_many_checkpoints_lets_a_new_one_go_up_between_its_deletes(tmp_path, mlflow_server,
                                                                                                 s3_server):
    """helper-71's red team: TRACKING.CHECKPOINTS_KEEP set on a run that holds hundreds of checkpoints.
    Their deletes ran as one job on the uploader thread (194 in 13 s), so a checkpoint written meanwhile,
    a preemption's with its grace period running, went up only after the last of them."""
    url, exp = mlflow_server.url, f"late-keep-{uuid.uuid4().hex[:6]}"
    first = _tracker(tmp_path, url, exp)
    run_id = first.run.run_id
    assert first.finish(None, timeout=30) == []
    old = tmp_path / "old"  # 120 complete checkpoints, as a run of KEEP 0 leaves them
    old.mkdir()
    for it in range(120):
        (old / f"model_iter{it}.pth").write_bytes(b"%d" % it)
    client = MlflowClient(url)
    client.log_artifacts(run_id, str(old), "checkpoints")
    tags = [RunTag(sha_tag(p.name), sha256_of(p)) for p in old.iterdir()]
    for i in range(0, len(tags), 100):
        client.log_batch(run_id, tags=tags[i:i + 100])

    second = _tracker(tmp_path, url, exp, resume=run_id)
    for it in (200, 201):
        path = tmp_path / checkpoint_name(it)
        path.write_bytes(os.urandom(200_000))
        second.log_metrics({"loss": 1.0}, it)
        second.log_checkpoint(path, sha256_of(path))
        if it == 200:  # 201 is written while the deletes that 200's upload began are going on
            _poll(lambda: len(_stored(url, run_id)) < 120)
    tags = _poll(lambda: (t := client.get_run(run_id).data.tags).get(sha_tag("model_iter201.pth")) and t)
    left = [n for n in checkpoints_from(tags) if iteration_of(n) < 120]
    assert len(left) >= 120 - 3 * PRUNE_BATCH  # 201 went up between two passes, not after them all
    assert second.finish(None, timeout=120) == []
    expected = {"model_iter200.pth", "model_iter201.pth"}  # and the passes went on to the end
    assert _stored(url, run_id) == expected and _tagged(client.get_run(run_id).data.tags) == expected
    assert _s3_checkpoints(s3_server, run_id) == expected


def _poll(predicate, timeout: float = 120):
    end = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)
    return value


def _s3_checkpoints(s3_server, run_id: str) -> set[str]:
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=s3_server.bucket)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]  # a page holds 1000 of the suite's
    return {k.rsplit("/", 1)[1] for k in keys if f"/{run_id}/artifacts/checkpoints/" in k}


def _uploaded(job) -> set[str]:
    """The checkpoints a trainer wrote, less those a newer one superseded before their upload (its log)."""
    written = set(re.findall(r"wrote checkpoint \S*/(model_\w+\.pth)", job.stderr))
    return written - set(re.findall(r"not uploading (model_\w+\.pth)", job.stderr))


def _short_job(tmp: Path, data_dir: Path, url: str, exp: str) -> list[str]:
    return demo_overrides(tmp, data_dir, **{
        "SOLVER.MAX_ITER": 16, "TRAIN.SNAPSHOT_ITERS": 2, "LOG_PERIOD": 1, "TEST.DATASETS": "()",
        "TRACKING.LOG_MODEL": "false", "TRACKING.URI": url, "TRACKING.EXPERIMENT": exp, "TRACKING.CHECKPOINTS_KEEP": 2})


def test_a_short_training_keeps_its_newest_two_on_the_server_and_resumes_from_them_elsewhere(
        tmp_path, data_dir, mlflow_server, s3_server, jobs):  # noqa: F811 - the fixture
    """A checkpoint every 2 iterations, preempted after iteration 8, resumed on an empty machine."""
    exp = f"prune-{uuid.uuid4().hex[:6]}"
    first = jobs(_short_job(tmp_path / "a", data_dir, mlflow_server.url, exp), tmp_path / "a", name="first")
    wait_until(lambda: max(first.iters(), default=-1) >= 8, first, "iteration 8")
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(120) == 128 + signal.SIGTERM, first.stderr[-3000:]
    client = MlflowClient(mlflow_server.url)
    run_id = only_run(client, exp).info.run_id
    iters = sorted((n for n in _uploaded(first)), key=lambda n: int(re.sub(r"\D", "", n)))
    assert len(iters) >= 3 and _stored(mlflow_server.url, run_id) == set(iters[-2:])  # pruned as it went

    second = jobs(_short_job(tmp_path / "b", data_dir, mlflow_server.url, exp), tmp_path / "b", name="second")
    assert second.wait(240) == 0, second.stderr[-3000:]
    assert f"resuming from run {run_id} ({iters[-1]})" in second.stderr  # the newest, kept
    run = only_run(client, exp)
    assert run.info.status == "FINISHED" and steps(client, run_id) == list(range(16))
    newest = sorted((n for n in _uploaded(second) if n != "model_final.pth"), key=lambda n: int(re.sub(r"\D", "", n)))
    expected = {"model_final.pth", *(iters + newest)[-2:]}
    assert _stored(mlflow_server.url, run_id) == expected and _tagged(run.data.tags) == expected
    assert _s3_checkpoints(s3_server, run_id) == expected
    for name in expected:  # what stayed is what was written
        assert run.data.tags[sha_tag(name)] == sha256_of(next(p for p in tmp_path.glob(f"*/output/{name}")))


class _RefusingDeletes(FaultProxy):
    """A tracking server whose artifact deletes fail (HTTP 503); every other request passes."""

    refused = 0

    def _pump(self, src, dst, upstream: bool) -> None:
        if not upstream:
            return super()._pump(src, dst, upstream)
        try:
            while data := src.recv(1 << 18):
                if data.startswith(b"DELETE /api/2.0/mlflow-artifacts/"):
                    self.refused += 1
                    src.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                sock.close()


def test_a_server_that_fails_every_delete_loses_nothing_and_the_job_still_succeeds(tmp_path, mlflow_server, caplog):
    """The tracker of a job with KEEP 2 uploads one checkpoint after another (a real training coalesces
    its uploads when the server is fast, so this drives the tracker itself): every delete is refused."""
    exp = f"refused-{uuid.uuid4().hex[:6]}"
    uploaded = {"model_iter1.pth", "model_iter3.pth", "model_iter5.pth", "model_iter7.pth", "model_final.pth"}
    with _RefusingDeletes(mlflow_server.url) as proxy, caplog.at_level(logging.WARNING):
        tracker = _tracker(tmp_path, proxy.url, exp)
        run_id = tracker.run.run_id
        for it in (1, 3, 5, 7, None):
            _checkpoint(tmp_path, tracker, it)
        assert tracker.finish("FINISHED", timeout=60) == []  # a refused prune is no failed upload
        assert proxy.refused >= 1
    assert any("older checkpoints stay on the server for now" in r.getMessage() for r in caplog.records)
    client = MlflowClient(mlflow_server.url)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _stored(mlflow_server.url, run_id) == uploaded == _tagged(run.data.tags)
    for name in uploaded:  # each still whole: its bytes match its tag
        path = client.download_artifacts(run_id, f"checkpoints/{name}", str(tmp_path / "check"))
        assert sha256_of(Path(path)) == run.data.tags[sha_tag(name)]


# ---- a server that moves artifact bytes only through presigned URLs ----

def test_a_server_that_takes_artifacts_only_through_presigned_urls_trains_resumes_elsewhere_and_logs_the_model(
        tmp_path, data_dir, s3_server, jobs):  # noqa: F811 - the fixture
    """MLflow 3.18's MLFLOW_ARTIFACTS_PRESIGNED_ONLY: the server refuses to carry artifact bytes, every
    upload and download goes straight to its store through URLs it signs. Checkpoints of every size go
    up in parts, a resume on an empty machine gets its checkpoint from the store, and the job ends
    with its model logged (FAULTS row 341)."""
    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server", artifacts=f"s3://{s3_server.bucket}/presigned-{uuid.uuid4().hex[:6]}",
                          env={**s3_server.env, "MLFLOW_ARTIFACTS_PRESIGNED_ONLY": "true"}).start()
    exp = f"presigned-{uuid.uuid4().hex[:6]}"
    keys = {"SOLVER.MAX_ITER": 6, "TRAIN.SNAPSHOT_ITERS": 2, "LOG_PERIOD": 1, "TRACKING.URI": server.url,
            "TRACKING.EXPERIMENT": exp}
    try:
        first = jobs(demo_overrides(tmp_path / "a", data_dir, **keys), tmp_path / "a", name="first")
        client = MlflowClient(server.url)

        def uploaded():
            found = client.get_experiment_by_name(exp)
            runs = client.search_runs([found.experiment_id]) if found else []
            return runs and sha_tag("model_iter1.pth") in runs[0].data.tags

        wait_until(uploaded, first, "model_iter1 uploaded", timeout=300)
        first.proc.kill()
        first.wait(60)
        second = jobs(demo_overrides(tmp_path / "b", data_dir, **keys), tmp_path / "b", name="second")
        assert second.wait(600) == 0, second.stderr[-3000:]
        run = only_run(client, exp)
        assert "resuming from run" in second.stderr and run.info.status == "FINISHED"
        assert run.data.tags[sha_tag("model_final.pth")] == sha256_of(tmp_path / "b" / "output" / "model_final.pth")
        assert client.search_logged_models([run.info.experiment_id]), "no logged model"
    finally:
        server.stop()
