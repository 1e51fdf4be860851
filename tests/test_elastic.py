"""Elastic multi-node: two torchrun "nodes" on 127.0.0.1 (c10d rendezvous, one gloo worker each,
--max-restarts 1), each with its own OUTPUT_DIR (its own disk), both tracked in one `mlflow server`.

One worker is SIGKILLed after the first checkpoint; the agents restart both workers and the job
continues from that checkpoint in the same run, every step logged once, and ends with the weights
of the same two nodes trained without the kill (DETERMINISTIC).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
from mlflow import MlflowClient

from tests.conftest import DEMO, demo_overrides, kill_tree
from tests.faultkit import assert_same_weights, only_run, sha_tag, steps
from tests.servers import free_port
from trainer.checkpoint.state import load as load_checkpoint

MAX_ITER = 10
# Two processes make NUM_GPUS 2: a checkpoint every SNAPSHOT_ITERS // 2 = 4 iterations (model_iter3, 7).
JOB = {"DETERMINISTIC": "true", "SOLVER.MAX_ITER": MAX_ITER, "TRAIN.SNAPSHOT_ITERS": 8, "LOG_PERIOD": 1,
       "TRAIN.CHECKPOINTS_KEEP": 10, "TEST.DATASETS": "()", "TRACKING.LOG_MODEL": "false"}
FIRST = "model_iter3.pth"


class Node:
    """One torchrun agent (`--nnodes 2 --nproc-per-node 1`) and its log."""

    def __init__(self, name: str, tmp: Path, data_dir: Path, endpoint: str, run_id: str, **keys):
        self.name, self.out = name, tmp / name / "output"
        self.log = tmp / f"{name}.log"
        args = demo_overrides(tmp / name, data_dir, **{**JOB, **keys})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "1",
               "-m", "trainer", "train", "--config", str(DEMO), *args]
        (tmp / name).mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=tmp / name, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "OMP_NUM_THREADS": "1",
                                              # rank 0 hosts a fresh store at each start (pytorch#135712)
                                              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                                         start_new_session=True)

    def worker(self) -> psutil.Process | None:
        """The agent's training process: its child with torchrun's RANK (once it runs the trainer)."""
        for child in psutil.Process(self.proc.pid).children():
            try:
                if "RANK" in child.environ():
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return None

    def kill(self) -> None:
        """The agent and its workers."""
        kill_tree(self.proc.pid)
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text()


def start_nodes(tmp: Path, data_dir: Path, **keys) -> list[Node]:
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    return [Node(name, tmp, data_dir, endpoint, rdzv_id, **keys) for name in ("node_a", "node_b")]


def wait_all(nodes: list[Node], timeout: float = 300) -> list[int]:
    """Both agents' exit statuses; once one fails, the other is not waited for (it may wait for its peer)."""
    end = time.monotonic() + timeout
    while (codes := [n.proc.poll() for n in nodes]) and None in codes and not any(codes):
        if time.monotonic() > end:
            raise AssertionError(f"not ended within {timeout}s:\n" + "\n".join(n.text()[-3000:] for n in nodes))
        time.sleep(0.1)
    return codes


def rank_of(worker: psutil.Process) -> int:
    return int(worker.environ()["RANK"])


def wait_for(predicate, nodes: list[Node], what: str, timeout: float = 180, poll: float = 0.05):
    end = time.monotonic() + timeout
    while not (value := predicate()):
        ended = [n for n in nodes if n.proc.poll() is not None]
        if ended or time.monotonic() > end:
            why = f"{ended[0].name} ended (exit {ended[0].proc.returncode})" if ended else "timed out"
            raise AssertionError(f"{why} before {what}:\n" + "\n".join(n.text()[-3000:] for n in nodes))
        time.sleep(poll)
    return value


def iterations_done(out: Path) -> int:
    """The newest iteration rank 0 finished (its json_stats.log, LOG_PERIOD 1); -1 before the first."""
    log = out / "json_stats.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return max((json.loads(line)["iter"] for line in lines if line.strip()), default=-1)


def test_a_killed_worker_is_restarted_and_the_job_resumes_in_its_run_with_the_uninterrupted_weights(
        tmp_path, data_dir, mlflow_server):
    # The uninterrupted job: the same two nodes, no kill, no tracking (it does not change the weights).
    baseline = start_nodes(tmp_path / "baseline", data_dir, **{"TRACKING.ENABLED": "false"})
    try:
        assert wait_all(baseline) == [0, 0], "\n".join(n.text()[-3000:] for n in baseline)
    finally:
        for n in baseline:
            n.kill()
    reference = load_checkpoint(next(n.out for n in baseline if n.out.is_dir()) / "model_final.pth")["model"]

    experiment = f"elastic-{uuid.uuid4().hex[:8]}"
    client = MlflowClient(mlflow_server.url)
    nodes = start_nodes(tmp_path / "elastic", data_dir, **{"TRACKING.URI": mlflow_server.url,
                                                          "TRACKING.EXPERIMENT": experiment})
    try:
        first = wait_for(lambda: all(n.worker() for n in nodes) and [n.worker() for n in nodes], nodes, "the workers")
        ranks = [rank_of(w) for w in first]
        main, victim = nodes[ranks.index(0)], first[ranks.index(1)]
        # Rank 1 stops (SIGSTOP) once rank 0 has logged an iteration past the first checkpoint, so rank 0
        # waits for it in the next collective; it is SIGKILLed once the server holds that checkpoint
        # and the steps logged after it.
        wait_for(lambda: (main.out / FIRST).exists() and iterations_done(main.out) >= 4, nodes, "iteration 4")
        victim.send_signal(signal.SIGSTOP)
        run = wait_for(lambda: _run_with(client, experiment, FIRST), nodes, f"{FIRST} on the server")
        wait_for(lambda: max(steps(client, run.info.run_id), default=-1) >= 4, nodes, "step 4 on the server")
        before_kill = steps(client, run.info.run_id)
        killed_at = time.time()
        victim.send_signal(signal.SIGKILL)
        # Both agents start new workers (max-restarts 1): the survivor's is stopped and started again too.
        wait_for(lambda: all(_restarted(n, {w.pid for w in first}) for n in nodes), nodes, "new workers on both nodes")
        codes = wait_all(nodes)
        logs = {n.name: n.text() for n in nodes}
        assert codes == [0, 0], "\n".join(text[-4000:] for text in logs.values())
    finally:
        for n in nodes:
            n.kill()

    # The restarted rank 0 went on in the same run, from the first checkpoint.
    main_log = logs[main.name]
    assert main_log.count(f"MLflow run {run.info.run_id}") == 2, main_log[-4000:]
    assert f"resuming from {main.out / FIRST} at iteration 4" in main_log, main_log[-4000:]
    finished = only_run(client, experiment)
    assert finished.info.run_id == run.info.run_id and finished.info.status == "FINISHED"
    assert "tracktron.status_reason" not in finished.data.tags  # the crash that the restart got over is not why it ended
    # Every step once: those the first workers had sent after the checkpoint were not sent again.
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(MAX_ITER))
    assert max(before_kill) >= 4 and all(m.timestamp < killed_at * 1000 for m in history if m.step in before_kill)

    assert_same_weights(reference, main.out / "model_final.pth")


def _restarted(node: Node, old_pids: set) -> bool:
    worker = node.worker()  # once: between two looks it can be gone
    return worker is not None and worker.pid not in old_pids


def _run_with(client: MlflowClient, experiment: str, checkpoint: str):
    """The experiment's run once `checkpoint` is complete on the server (its sha256 tag is set)."""
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return next((r for r in runs if sha_tag(checkpoint) in r.data.tags), None)
