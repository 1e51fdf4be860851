"""MLflow system metrics (CPU, memory, disk, network, GPU) for a training run.

One monitor per node (local rank 0), named `node<N>` under torchrun so the UI keeps the nodes
apart. These are sampled on MLflow's own thread every 10 s (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL).
"""
from __future__ import annotations

import logging
import os

import torch

from trainer.config import Config

log = logging.getLogger(__name__)


def wanted(cfg: Config) -> bool:
    setting = cfg.TRACKING.SYSTEM_METRICS
    return cfg.TRACKING.ENABLED and (setting == "true" or (setting == "auto" and torch.cuda.is_available()))


def start_monitor(cfg: Config, run_id: str | None, uri: str, local_rank: int, world_size: int):
    """A started SystemMetricsMonitor, or None when off, not this process's job, or unavailable."""
    if not (run_id and wanted(cfg) and local_rank == 0):
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    except ImportError as e:  # psutil missing: say so, train anyway
        log.warning("system metrics off: %s", e)
        return None
    node = f"node{os.environ.get('GROUP_RANK', '0')}" if world_size > 1 else None
    monitor = SystemMetricsMonitor(run_id, resume_logging=True, node_id=node, tracking_uri=uri)
    monitor.start()
    return monitor
