"""Real servers on 127.0.0.1 for the end-to-end tests and the benchmarks.

`MlflowServer` runs `mlflow server` with a sqlite backend (artifacts on local disk, or on S3);
`S3Server` runs moto's S3 server, reached through boto3. Both can be stopped and started again
on the same port, so tests can take the tracking server away in the middle of a job.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


class _Process:
    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def _spawn(self, cmd: list[str], env: dict) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server's workers too
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


class S3Server(_Process):
    def __init__(self, workdir: Path, bucket: str = "tracktron"):
        super().__init__(workdir / "moto.log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bucket = bucket
        self.env = {**S3_ENV, "MLFLOW_S3_ENDPOINT_URL": self.url}

    def start(self) -> "S3Server":
        self._spawn([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)], S3_ENV)
        wait_http(f"{self.url}/moto-api/", proc=self.proc)
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, **{k.lower(): v for k, v in S3_ENV.items()
                                                          if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")


class MlflowServer(_Process):
    """`mlflow server` over a sqlite file. artifacts: a local folder, or `s3://bucket/prefix`
    (proxied through the server unless `proxy=False`, where clients write to S3 themselves)."""

    def __init__(self, workdir: Path, artifacts: str | None = None, proxy: bool = True,
                 env: dict | None = None, extra_args: tuple = ()):
        super().__init__(workdir / "mlflow-server.log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = workdir / "mlflow-server.db"
        self.artifacts = artifacts or str(workdir / "server-artifacts")
        self.proxy = proxy
        self.env = env or {}
        self.extra_args = tuple(extra_args)

    def start(self) -> "MlflowServer":
        cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.db}", "--workers", "1", *self.extra_args]
        if self.proxy:
            cmd += ["--artifacts-destination", self.artifacts]
        else:
            cmd += ["--no-serve-artifacts", "--default-artifact-root", self.artifacts]
        # The server's background job runners (huey) are not needed for tracking and cost a core.
        self._spawn(cmd, {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.env})
        wait_http(f"{self.url}/health", proc=self.proc)
        return self
