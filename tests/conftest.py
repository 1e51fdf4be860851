"""Shared fixtures: the synthetic dataset (made once), a trainer runner, real servers."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Tiny models on 2 shared cores: one intra-op thread per process is several times faster than
# torch's default (its threads spin against the trainer subprocess, loader workers and servers).
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


@pytest.fixture(autouse=True, scope="session")
def _nothing_written_into_the_checkout():
    """Tests keep stores, artifacts and outputs under tmp: a ./mlruns in the checkout (MLflow's default
    artifact root, for an experiment made without one) or ./output (the default OUTPUT_DIR) is a test
    writing where a user's runs go."""
    made = [p for p in (ROOT / "mlruns", ROOT / "mlflow.db", ROOT / "output", ROOT / "datasets") if not p.exists()]
    yield
    assert not [p for p in made if p.exists()], f"a test wrote {[str(p) for p in made if p.exists()]} into the checkout"


@pytest.fixture(autouse=True)
def _isolated_environment():
    """No ambient MLflow settings, and none leak out of a test (mlflow.set_tracking_uri writes
    os.environ): each test picks its tracking store explicitly."""
    saved = dict(os.environ)
    for var in [v for v in os.environ if v.startswith("MLFLOW_")]:
        del os.environ[var]
    yield
    os.environ.clear()
    os.environ.update(saved)
    if "mlflow" in sys.modules:
        from mlflow.tracking._tracking_service import utils

        utils._tracking_uri = None


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """DATA_DIR with synth_shapes_train/val, generated once for the whole session."""
    from trainer.data import resolve_dataset
    from trainer.config import load_config

    path = tmp_path_factory.mktemp("datasets")
    cfg = load_config(DEMO, ["DATA_DIR", str(path)])
    for name in ("synth_shapes_train", "synth_shapes_val"):
        resolve_dataset(cfg, name)  # generates on first use
    return path


def demo_overrides(tmp: Path, data_dir: Path, **keys) -> list[str]:
    """The demo config, shrunk for tests: a few iterations, frequent logs and checkpoints."""
    base = {"OUTPUT_DIR": str(tmp / "output"), "DATA_DIR": str(data_dir), "SOLVER.MAX_ITER": 8,
            "TRAIN.SNAPSHOT_ITERS": 3, "LOG_PERIOD": 4, "DATA_LOADER.NUM_THREADS": 0,
            "TRAIN.IMS_PER_BATCH": 2, "TEST.EVAL_PERIOD": 0, "TRACKING.REGISTERED_MODEL": "''"}  # '' survives MLproject's quoting
    base.update(keys)
    return [str(x) for kv in base.items() for x in kv]


def trainer_cmd(*args: str, config: Path = DEMO) -> list[str]:
    return [sys.executable, "-m", "trainer", "train", "--config", str(config), *args]


def run_trainer(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 300,
                config: Path = DEMO) -> subprocess.CompletedProcess:
    return subprocess.run(trainer_cmd(*args, config=config), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it (torchrun starts each worker in a session of its
    own, so a process group does not hold them), the children listed first."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


@contextlib.contextmanager
def locked_by_another_process(path: Path):
    """`path` under an exclusive flock that a process of its own holds until the block ends."""
    code = "import fcntl, sys; f = open(sys.argv[1], 'ab'); fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); sys.stdin.read()"
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"\n", "the holder could not lock"
        yield holder
    finally:
        holder.stdin.close()  # its read ends, and the lock with the process
        holder.wait(10)


def tmpfs_mount(folder: Path, options: str = "ro,size=1m"):
    """`folder` made and a tmpfs mounted on it for the test: read-only (a container's read-only root, a
    shared volume: root may write wherever permissions say no, so only a mount shows it), or small
    (`size=1m`: a container's --tmpfs /tmp). A generator for a fixture to yield from; skips where
    mounting is not allowed."""
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def run_tree(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run of a launcher (torchrun) whose workers start sessions of their own: on a
    timeout every process under it is killed too, not left training after the test failed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[2:4]} did not end within {timeout}s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    from tests.servers import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, s3_server):
    """`mlflow server` (sqlite) whose artifacts go to moto's S3, proxied through the server."""
    from tests.servers import PROXY_MULTIPART, MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"), artifacts=f"s3://{s3_server.bucket}/proxied",
                          env={**s3_server.env, **PROXY_MULTIPART}).start()
    yield server
    server.stop()
