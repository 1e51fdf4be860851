"""What users see: run names, descriptions, experiment kind, system metrics, `tracktron status`."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from mlflow import MlflowClient

from tests.conftest import DEMO, demo_overrides, run_trainer
from trainer.tracking.system_metrics import start_monitor
from trainer.config import load_config


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("status")
    uri = f"sqlite:///{tmp / 'store.db'}"
    args = demo_overrides(tmp, data_dir, **{"TRACKING.URI": uri, "TRACKING.SYSTEM_METRICS": "true",
                                            "SOLVER.MAX_ITER": 12})
    result = run_trainer(args, cwd=tmp, env={"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"})
    assert result.returncode == 0, result.stderr
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("demo")
    (run,) = client.search_runs([exp.experiment_id])
    return tmp, uri, client, exp, run, result


def test_runs_are_named_described_and_in_a_training_experiment(finished_job):
    _, uri, _, exp, run, result = finished_job
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.info.run_name.startswith("demo-2")  # config name + start time
    note = run.data.tags["mlflow.note.content"]
    assert "fasterrcnn_resnet50_fpn" in note and "synth_shapes_train" in note and "12 iterations" in note
    assert f"see it with: mlflow ui --backend-store-uri {uri}" in result.stderr


def test_system_metrics_are_logged_when_asked(finished_job):
    _, _, _, _, run, _ = finished_job
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert "system/system_memory_usage_megabytes" in run.data.metrics


def _system_metrics_on_server(uri: str, run_id: str, key: str, within: float = 60.0) -> list:
    client, end = MlflowClient(uri), time.monotonic() + within
    while not (history := client.get_metric_history(run_id, key)) and time.monotonic() < end:
        time.sleep(0.5)
    return history


def test_system_metrics_are_sampled_by_mlflows_monitor_thread_per_node(tmp_path, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    monkeypatch.setenv("GROUP_RANK", "1")  # the second node of a torchrun job
    client = MlflowClient(mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"sysmetrics-{tmp_path.name}")).info.run_id
    cfg = load_config(DEMO, ["TRACKING.SYSTEM_METRICS", "true", "TRACKING.URI", mlflow_server.url])
    before = set(threading.enumerate())
    monitor = start_monitor(cfg, run_id, local_rank=0, world_size=2)
    try:
        assert set(threading.enumerate()) - before, "no monitor thread"  # a thread here, no process
        assert _system_metrics_on_server(mlflow_server.url, run_id, "system/node1/cpu_utilization_percentage")
    finally:
        monitor.finish()
    assert not any(t.is_alive() for t in set(threading.enumerate()) - before)  # finish() stops it
    assert start_monitor(cfg, run_id, local_rank=1, world_size=2) is None  # one per node
    auto = load_config(DEMO, ["TRACKING.URI", mlflow_server.url])  # auto: on for GPU jobs only
    assert start_monitor(auto, run_id, local_rank=0, world_size=1, on_gpu=False) is None


def test_status_lists_the_job_with_iteration_checkpoint_and_loss(finished_job):
    tmp, uri, _, _, run, _ = finished_job
    out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", uri], capture_output=True, text=True,
                         cwd=tmp)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.strip().splitlines()
    assert header.split()[:6] == ["RUN", "NAME", "EXPERIMENT", "STATUS", "ITERATION", "CHECKPOINT"]
    assert row.split()[:6] == [run.info.run_id, run.info.run_name, "demo", "FINISHED", "12/12", "model_final.pth"]
    assert f"{run.data.metrics['loss']:.4f}" in row


def test_status_of_an_unknown_store_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", "http://127.0.0.1:9"],
                         capture_output=True, text=True, env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "PATH": ""})
    assert out.returncode == 2
    assert out.stderr.startswith("error: cannot read jobs from http://127.0.0.1:9")


def test_no_resume_starts_a_new_run_and_nan_marks_it_failed_with_the_reason(finished_job, data_dir):
    tmp, uri, client, exp, first, _ = finished_job
    args = demo_overrides(tmp / "again", data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 12,
                                                      "TRACKING.SYSTEM_METRICS": "true"})
    bad = run_trainer(args + ["--no-resume", "SOLVER.BASE_LR", "1e6", "SOLVER.WARM_UP_ITERS", "0"], cwd=tmp)
    assert bad.returncode == 1
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    assert len(runs) == 2 and runs[1].info.run_id == first.info.run_id
    assert runs[0].info.status == "FAILED"
    assert runs[0].data.tags["tracktron.status_reason"].startswith("loss is nan at iteration")


def test_data_synth_writes_a_coco_dataset(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trainer", "data", "synth", "--out", str(tmp_path / "shapes"),
                          "--num-images", "5", "--size", "64"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    import json

    coco = json.loads((tmp_path / "shapes" / "annotations.json").read_text())
    assert len(coco["images"]) == 5 and coco["annotations"] and len(coco["categories"]) == 3
    assert len(list((tmp_path / "shapes" / "images").glob("*.png"))) == 5


@pytest.mark.parametrize("kind", ["an unrelated SQLite database", "not a database", "no file"])
def test_status_reads_only_and_refuses_what_is_not_a_tracking_store(tmp_path, kind):
    """Pointed at the wrong file, `status` says so in one line and leaves it as it was: MLflow would
    create its tables in any SQLite file it opens."""
    import sqlite3

    path = tmp_path / "other.db"
    if kind == "an unrelated SQLite database":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE inventory (item TEXT, count INTEGER)")
    elif kind == "not a database":
        path.write_text("just some notes\n")
    before = path.read_bytes() if path.exists() else None
    out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", f"sqlite:///{path}"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert ("does not exist" if kind == "no file" else "is not an MLflow tracking store") in lines[0]
    assert (path.read_bytes() if path.exists() else None) == before  # untouched, and not created
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if kind == "no file" else ["other.db"])


def test_status_against_a_server_that_never_answers_ends_in_bounded_time(tmp_path):
    from tests.servers import FaultProxy

    with FaultProxy("http://127.0.0.1:9", mode="hang") as proxy:
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", proxy.url],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
        took = time.monotonic() - start
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: cannot read jobs from {proxy.url}")
    assert took < 60, f"{took:.0f}s"
