"""MLflow system metrics (CPU, memory, disk, network, GPU) for a training run.

One monitor per node (local rank 0), named `node<N>` under torchrun so the UI keeps the nodes
apart: MLflow's own SystemMetricsMonitor, a thread that samples every 10 s
(MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL). A monitor MLflow cannot make (no psutil, no GPU library)
turns system metrics off with a warning; the job trains on. MLflow's monitor drops the last, partial
interval (`stop_monitor` sends it, bounded when the server is down), and its loop ends for good at
the first failed request (here it restarts an interval later: a server's blip must not end them).
"""
from __future__ import annotations

import logging
import os
import threading

from trainer.config import Config
from trainer.errors import first_line
from trainer.tracking.runs import tracking_uri

log = logging.getLogger(__name__)


def wanted(cfg: Config, on_gpu: bool) -> bool:
    """`true`; `auto` on a GPU, or where MLflow's own switch, MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING, is on."""
    setting = cfg.TRACKING.SYSTEM_METRICS
    mlflow_on = os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower() in ("true", "1")
    return cfg.TRACKING.ENABLED and (setting == "true" or (setting == "auto" and (on_gpu or mlflow_on)))


def start_monitor(cfg: Config, run_id: str | None, local_rank: int, world_size: int, on_gpu: bool = False):
    """MLflow's SystemMetricsMonitor, started (call `.finish()` at the end); None when it is off,
    not this process's job, or cannot run."""
    if not (run_id and local_rank == 0 and wanted(cfg, on_gpu)):
        return None
    node = f"node{os.environ.get('GROUP_RANK', '0')}" if world_size > 1 else None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    except ImportError as e:  # psutil missing: say so, train anyway
        log.warning("system metrics off: %s", e)
        return None
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # not its start and stop
    logging.getLogger(SystemMetricsMonitor.__module__).addFilter(_not_each_retry)  # the monitor's own logger
    try:
        monitor = _restarting(SystemMetricsMonitor)(run_id, tracking_uri(cfg), resume_logging=True, node_id=node)
    except Exception as e:  # no GPU library, a server that fails: the job trains on
        log.warning("system metrics off: %s", e)
        return None
    monitor.start()
    return monitor


def _not_each_retry(record: logging.LogRecord) -> bool:
    """MLflow's monitor says each failed request; RestartingMonitor says an outage once."""
    return not record.getMessage().startswith(("Failed to get mlflow run", "Failed to log system metrics"))


def _restarting(base):
    """MLflow's monitor whose loop, ended by a failed request, runs again an interval later."""
    class RestartingMonitor(base):
        def __init__(self, run_id: str, uri: str, **kwargs):
            super().__init__(run_id, tracking_uri=uri, **kwargs)
            self.run_id, self.uri = run_id, uri
            self.stopping = threading.Event()
            self.sent = True  # a sample went out since the last warning: one warning an outage, not one a retry

        def monitor(self):
            while True:
                super().monitor()  # returns on finish(), a failed request, or a run no longer RUNNING
                if self.stopping.wait(self.sampling_interval) or not self.running():
                    return
                if self.sent:
                    log.warning("system metrics: the tracking server did not answer; sampling again every %g s",
                                self.sampling_interval)
                self.sent = False

        def running(self) -> bool:
            """The run is RUNNING, or the server does not say (down): MLflow's loop stops at an ended run."""
            from mlflow import MlflowClient

            try:
                return MlflowClient(self.uri).get_run(self.run_id).info.status == "RUNNING"
            except Exception:  # down: sampling goes on once it answers
                return True

        def publish_metrics(self, metrics):
            super().publish_metrics(metrics)
            self.sent = True

        def finish(self):
            self.stopping.set()
            super().finish()

    return RestartingMonitor


def stop_monitor(monitor, timeout_s: float = 5.0) -> None:
    """Stops the monitor and sends what it sampled since it last sent, waiting at most timeout_s."""
    def stop():
        try:
            monitor.finish()  # stops its thread, sends what it had queued
            monitor.collect_metrics()  # the interval that ended with the job
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as e:  # a server that is down: system metrics are not worth an error
            log.warning("system metrics: the last sample was not sent: %s", first_line(e))

    try:
        stopping = threading.Thread(target=stop, name="SystemMetricsStop", daemon=True)
        stopping.start()
    except RuntimeError as e:  # no thread left (a pids limit): the process ends anyway
        log.warning("system metrics: the last sample was not sent: %s", first_line(e))
        return
    stopping.join(timeout_s)
    if stopping.is_alive():
        log.warning("system metrics: the last sample was not sent within %g s; the job ends without it", timeout_s)
