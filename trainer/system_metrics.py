"""MLflow system metrics (CPU, memory, disk, network, GPU) for a training run.

One monitor per node (local rank 0), named `node<N>` under torchrun so the UI keeps the nodes
apart, sampling every 10 s (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL). What it samples is the
machine's, not the process's, so it runs in a helper process of its own (child_process.py): its
MLflow import (2-3 s of CPU, before the first iteration), its sampling and its HTTP calls then take
nothing from the training thread. Where no process can be started it runs on a thread here.
"""
from __future__ import annotations

import logging
import os

from trainer.child_process import Helper, attach, recv, send
from trainer.config import Config
from trainer.logs import setup_logging

log = logging.getLogger(__name__)

FINISH_TIMEOUT_S = 30.0  # its last samples to the server, then it is killed


def wanted(cfg: Config) -> bool:
    import torch  # not at the top: the helper process imports this module

    setting = cfg.TRACKING.SYSTEM_METRICS
    return cfg.TRACKING.ENABLED and (setting == "true" or (setting == "auto" and torch.cuda.is_available()))


class Monitor:
    """The node's monitor: in its helper process (`pid`), or on a thread of this process."""

    def __init__(self, helper: Helper | None, in_process=None):
        self._helper, self._in_process = helper, in_process

    @property
    def pid(self) -> int:
        return self._helper.pid if self._helper is not None else os.getpid()

    def finish(self) -> None:
        """Its last samples go to the run; then it ends."""
        if self._helper is not None:
            self._helper.close(FINISH_TIMEOUT_S)
        elif self._in_process is not None:
            self._in_process.finish()


def start_monitor(cfg: Config, run_id: str | None, uri: str, local_rank: int, world_size: int) -> Monitor | None:
    """A started monitor, or None when off or not this process's job."""
    if not (run_id and wanted(cfg) and local_rank == 0):
        return None
    node = f"node{os.environ.get('GROUP_RANK', '0')}" if world_size > 1 else ""
    try:
        return Monitor(Helper("trainer.system_metrics", run_id, uri, node))
    except OSError as e:
        log.warning("system metrics are sampled by the training process (%s)", e)
    monitor = _start(run_id, uri, node)
    return Monitor(None, monitor) if monitor is not None else None


def _start(run_id: str, uri: str, node: str):
    """MLflow's SystemMetricsMonitor, started; None (and a warning) where it cannot run."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    except ImportError as e:  # psutil missing: say so, train anyway
        log.warning("system metrics off: %s", e)
        return None
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # not its start and stop
    try:
        monitor = SystemMetricsMonitor(run_id, resume_logging=True, node_id=node or None, tracking_uri=uri)
    except Exception as e:  # noqa: BLE001 - no GPU library, a server that fails: the job trains on
        log.warning("system metrics off: %s", e)
        return None
    monitor.start()
    return monitor


def main(argv: list[str]) -> None:
    """The helper process: sample until the job says finish (or is gone)."""
    control, (run_id, uri, node) = attach(argv)
    setup_logging(logging.WARNING)  # its warnings look like the job's
    monitor = _start(run_id, uri, node)
    send(control, "ready" if monitor is not None else "unusable")
    try:
        while recv(control)[0] is not None:
            pass
    except (EOFError, OSError):  # the job is gone: what was not sent yet goes with it
        os._exit(0)
    if monitor is not None:
        monitor.finish()
    os._exit(0)
