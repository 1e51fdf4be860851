"""`mlflow run . --env-manager local` end to end against a real tracking server."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from mlflow import MlflowClient

from tests.conftest import ROOT, demo_overrides


def mlflow_run(server, experiment, opts):
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.url, "PATH": f"{venv_bin}:{os.environ['PATH']}"}
    cmd = [f"{venv_bin}/mlflow", "run", ".", "--env-manager", "local", "--experiment-name", experiment,
           "-P", "config=configs/demo.yaml", "-P", f"opts={' '.join(opts)}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # as users do


def test_mlflow_run_trains_in_its_run_and_a_second_one_points_at_the_job_run(tmp_path, data_dir, mlflow_server,
                                                                             s3_server):
    os.environ.update(s3_server.env)  # the server proxies artifacts to S3; the trainer needs no keys
    exp = f"mlproject-{uuid.uuid4().hex[:6]}"
    opts = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 4})
    first = mlflow_run(mlflow_server, exp, opts)
    assert first.returncode == 0, first.stderr[-3000:]
    client = MlflowClient(mlflow_server.url)
    exp_id = client.get_experiment_by_name(exp).experiment_id
    (job_run,) = client.search_runs([exp_id])
    assert job_run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(job_run.info.run_id, "loss")) == [0, 1, 2, 3]
    assert job_run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert "tracktron.job" in job_run.data.tags  # adopted: a later plain `tracktron train` finds it
    assert [e.name for e in client.search_experiments()].count("demo") == 0  # no stray experiment

    second = mlflow_run(mlflow_server, exp, opts)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "nothing to do" in second.stdout + second.stderr
    runs = client.search_runs([exp_id])
    launcher = next(r for r in runs if r.info.run_id != job_run.info.run_id)
    assert launcher.data.tags["tracktron.job_run_id"] == job_run.info.run_id
    assert not client.get_metric_history(launcher.info.run_id, "loss")  # one job, one loss curve
