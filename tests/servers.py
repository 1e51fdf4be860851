"""Real servers on 127.0.0.1 for the end-to-end tests and the benchmarks.

`MlflowServer` runs `mlflow server` with a sqlite backend (artifacts on local disk, or on S3);
`S3Server` runs moto's S3 server, reached through boto3. Both can be stopped and started again
on the same port, so tests can take the tracking server away in the middle of a job.
`MlflowServer(auth_admin=...)` runs MLflow's basic-auth app; `FileServer` serves a folder (weights by
URL). `FaultProxy` sits between a client and a server on loopback and makes the server slow, hung
or failing (HTTP 503), or holds one request (a checkpoint upload) so a test can kill the client in
the middle of it.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
# A server proxying S3 offers its clients multipart uploads (a presigned URL per part) only when its
# operator opts in (MLflow 3.18; before, the client opted in): the tests' and benchmarks' server does.
PROXY_MULTIPART = {"MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD": "true"}
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class FileServer:
    """http.server on 127.0.0.1 serving a folder, in a thread; it counts the requests."""

    def __init__(self, folder: Path):
        self.requests: list[str] = []
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                outer.requests.append(self.path)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def serve_handler(handler) -> tuple[http.server.ThreadingHTTPServer, str]:
    """An http.server request handler class served on 127.0.0.1 from daemon threads: the server and its URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


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
        with open(self.log_path, "ab") as log:  # the server keeps its own copy of the descriptor
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
                 env: dict | None = None, extra_args: tuple = (), auth_admin: tuple[str, str] | None = None):
        super().__init__(workdir / "mlflow-server.log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = workdir / "mlflow-server.db"
        self.artifacts = artifacts or str(workdir / "server-artifacts")
        self.proxy = proxy
        self.env = env or {}
        self.extra_args = tuple(extra_args)
        if auth_admin is not None:  # MLflow's basic-auth app; (user, password) of its admin
            ini = workdir / "basic_auth.ini"
            ini.write_text("[mlflow]\ndefault_permission = READ\n"
                           f"database_uri = sqlite:///{workdir / 'basic-auth.db'}\n"
                           f"admin_username = {auth_admin[0]}\nadmin_password = {auth_admin[1]}\n"
                           "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
            self.env = {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": "tracktron-tests",
                        **self.env}
            self.extra_args = ("--app-name", "basic-auth", *self.extra_args)

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


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of `target` (a URL): the faults a network and a server have.

    `mode`: "pass" (forward), "slow" (sleep `delay` s before forwarding each chunk, both ways),
    "hang" (accept and read, never answer: a server that stopped responding), "error" (answer
    every request with HTTP 503 and close: an overloaded S3 endpoint). Setting a mode closes the
    connections already open, so pooled keep-alive connections see it too.
    `hold(pattern)`: forward the request whose first bytes match `pattern` (a regex on bytes) only
    up to `after` bytes, then hold it (no more bytes either way); `held` is set when that happens and
    `held_request` is its request line.
    `delay_requests(pattern, seconds)`: every request matching `pattern` waits that long before it is sent on.
    `max_body`: a request whose Content-Length is larger is answered 413 and closed, as nginx's
    `client_max_body_size` (1 MB by default) does.
    `missing`: a request whose request line matches this regex (on bytes) is answered 404 with an empty
    body and closed, as a server without that endpoint (MLflow 2.x, a hosted one) answers.
    """

    def __init__(self, target: str, mode: str = "pass", delay: float = 0.05):
        parsed = urllib.parse.urlsplit(target)
        self.target = (parsed.hostname, parsed.port or 80)
        self.mode, self.delay = mode, delay
        self.held = threading.Event()
        self.held_request = b""  # the request line of the held request
        self.errors_sent = 0
        self.requests_seen: list[bytes] = []  # request lines that began a chunk (most do)
        self._hold: tuple[re.Pattern, int] | None = None
        self._delays: list[tuple[re.Pattern, float]] = []
        self.max_body: int | None = None
        self.missing: re.Pattern | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def set_mode(self, mode: str, delay: float | None = None) -> None:
        self.mode = mode
        if delay is not None:
            self.delay = delay
        self.reset()

    def hold(self, pattern: bytes, after: int = 1 << 20) -> None:
        self._hold = (re.compile(pattern), after)

    def delay_requests(self, pattern: bytes, seconds: float) -> None:
        self._delays.append((re.compile(pattern), seconds))

    def reset(self) -> None:
        """Close every open connection (the client sees a reset and reconnects)."""
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            _close(c)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _track(self, *socks) -> None:
        with self._lock:
            self._conns.update(socks)

    def _serve(self, client: socket.socket) -> None:
        self._track(client)
        mode = self.mode
        if mode == "error":
            self._answer_503(client)
            return
        if mode == "hang":
            _drain(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            _close(client)
            return
        self._track(upstream)
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def _answer_503(self, client: socket.socket) -> None:
        try:
            client.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 65536:
                chunk = client.recv(65536)
                if not chunk:
                    break
                data += chunk
            client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                           b"Content-Length: 19\r\nConnection: close\r\n\r\nService Unavailable")
            self.errors_sent += 1
        except OSError:
            pass
        _close(client)

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        """Copy src -> dst; `upstream` is the client-to-server direction (requests)."""
        holding, budget = False, 0
        try:
            while True:
                data = src.recv(1 << 18)
                if not data:
                    break
                if upstream and _REQUEST_LINE.match(data):
                    self.requests_seen.append(data.split(b"\r\n", 1)[0])
                    length = _CONTENT_LENGTH.search(data.partition(b"\r\n\r\n")[0] + b"\r\n")
                    if self.max_body is not None and length and int(length.group(1)) > self.max_body:
                        src.sendall(b"HTTP/1.1 413 Request Entity Too Large\r\nContent-Length: 0\r\n"
                                    b"Connection: close\r\n\r\n")
                        break
                    if self.missing is not None and self.missing.search(data.split(b"\r\n", 1)[0]):
                        _with_small_body(src, data)  # read before the answer: a client still sending sees no reset
                        src.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                        break
                    if self._delays:
                        data = _with_small_body(src, data)  # so a pattern sees what the request carries
                if upstream:
                    for pattern, seconds in self._delays:
                        if pattern.search(data):
                            time.sleep(seconds)
                if upstream and self._hold and not holding and self._hold[0].search(data):
                    holding, budget = True, self._hold[1]
                    self.held_request = data.split(b"\r\n", 1)[0]
                    self._hold = None  # one request only
                if holding:
                    if budget <= 0:
                        self.held.set()
                        _drain(src)  # swallow the rest; the client waits for an answer forever
                        break
                    data, budget = data[:budget], budget - len(data)
                if self.mode == "slow":
                    time.sleep(self.delay)
                elif self.mode == "hang":
                    _drain(src)
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:  # one side gone (or a held client died): the other sees the connection end
            _close(src)
            _close(dst)


_REQUEST_LINE = re.compile(rb"^[A-Z]+ /\S* HTTP/1")
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)\r\n", re.IGNORECASE)


def _with_small_body(sock: socket.socket, data: bytes, limit: int = 1 << 16) -> bytes:
    """The request's headers and its body (up to `limit` bytes) in one piece: clients send them apart."""
    head, sep, body = data.partition(b"\r\n\r\n")
    length = _CONTENT_LENGTH.search(head + b"\r\n")
    if not sep or not length or int(length.group(1)) > limit:
        return data
    while len(body) < int(length.group(1)):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        body += chunk
    return head + sep + body


def _drain(sock: socket.socket) -> None:
    """Read and discard until the peer goes away (or the socket is closed under us)."""
    try:
        sock.settimeout(None)
        while True:
            r, _, _ = select.select([sock], [], [], 1.0)
            if r and not sock.recv(1 << 18):
                break
    except (OSError, ValueError):
        pass
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


@contextlib.contextmanager
def drip_server():
    """A server that answers every request with its headers begun, then one byte a second: each
    byte restarts a client's read timeout. Yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    stop = threading.Event()

    def drip(conn):
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not stop.wait(1.0):
                conn.sendall(b"a")

    def serve():
        while not stop.is_set():
            try:
                conn = listener.accept()[0]
            except OSError:  # the half-second timeout, or closed at the end
                continue
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
