"""MLflow end to end: a real `mlflow server` (sqlite) with moto's S3 as the artifact store.

What a user checks in the UI: every iteration's metrics, the checkpoints and model_final, the
status; and that a job killed on one machine continues on another from the server alone.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import mlflow
import torch
from mlflow import MlflowClient

from tests.conftest import DEMO, demo_overrides, run_trainer, trainer_cmd
from tests.servers import FaultProxy, MlflowServer
from trainer.checkpoint.files import iteration_of
from trainer.hashing import sha256_of
from trainer.checkpoint.state import load as load_checkpoint

METRIC_KEYS = {"loss", "loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg", "lr", "time",
               "data_time", "eta_seconds", "mem_mb", "mb_qsize", "images_per_sec"}


def tracked(tmp, data_dir, server, experiment, **keys):
    return demo_overrides(tmp, data_dir, **{"TRACKING.URI": server.url, "TRACKING.EXPERIMENT": experiment,
                                            "TRACKING.FLUSH_TIMEOUT_S": 60, **keys})


def only_run(client, experiment):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"expected one run for the job, found {len(runs)}"
    return runs[0]


def steps(client, run_id, key="loss"):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def s3_keys(s3_server, prefix=""):
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=s3_server.bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]  # a page holds 1000: the suite's bucket holds more


def test_job_logs_every_iteration_checkpoints_and_final_model(tmp_path, data_dir, mlflow_server, s3_server):
    exp = f"e2e-{uuid.uuid4().hex[:6]}"
    args = tracked(tmp_path, data_dir, mlflow_server, exp, **{"TRACKING.REGISTERED_MODEL": exp})
    result = run_trainer(args, cwd=tmp_path,
                         env={**s3_server.env, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})  # config wins
    assert result.returncode == 0, result.stderr
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, exp)
    assert run.info.status == "FINISHED"
    assert f"{mlflow_server.url}/#/experiments/" in result.stderr  # the UI link at start
    for key in METRIC_KEYS:
        assert steps(client, run.info.run_id, key) == list(range(8)), key
    tags = run.data.tags
    assert tags["tracktron.ckpt.latest"] == "model_final.pth"
    out = tmp_path / "output"
    tagged = [n for n in ("model_iter2.pth", "model_iter5.pth", "model_final.pth")
              if f"tracktron.ckpt.{n}.sha256" in tags]  # an older one that a newer one superseded is not sent
    assert "model_final.pth" in tagged
    for name in tagged:
        assert tags[f"tracktron.ckpt.{name}.sha256"] == sha256_of(out / name)
    sent = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert sent == set(tagged)  # on the server: exactly the checkpoints tagged complete
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "model.txt", "json_stats.log", "checkpoints"} <= artifacts
    assert run.data.params["SOLVER.MAX_ITER"] == "8"
    assert tags["tracktron.job"] and tags["tracktron.torch"] == torch.__version__
    stored = s3_keys(s3_server)  # the bytes really are on S3, put there by the server
    assert any(k.endswith(f"{run.info.run_id}/artifacts/checkpoints/model_final.pth") for k in stored)

    # The final model is registered, and loads from models:/ as a pyfunc that takes an encoded image.
    import mlflow.pyfunc
    import pandas as pd

    mlflow.set_tracking_uri(mlflow_server.url)
    os.environ.update(s3_server.env)
    model = mlflow.pyfunc.load_model(f"models:/{exp}@final")
    png = next((data_dir / "synth_shapes" / "val" / "images").glob("*.png")).read_bytes()
    (detections,) = model.predict(pd.DataFrame({"image": [png]}))
    assert {"boxes", "scores", "category_ids", "category_names"} <= set(detections)


def test_a_job_in_a_workspace_links_to_its_run_in_that_workspace(tmp_path, data_dir, monkeypatch):
    """MLflow 3.18's workspaces (`mlflow server --enable-workspaces`, the client's MLFLOW_WORKSPACE): the
    UI link at start and status's UI column name the job's workspace, as MLflow's own link does; without
    it the UI opens the default workspace, where the run is not (FAULTS row 343)."""
    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server", extra_args=("--enable-workspaces",)).start()
    try:
        MlflowClient(server.url).create_workspace("team-a")
        env = {"MLFLOW_WORKSPACE": "team-a"}
        result = run_trainer(tracked(tmp_path, data_dir, server, "ws", **{"SOLVER.MAX_ITER": 2, "TEST.DATASETS": "()",
                                                                          "TRACKING.LOG_MODEL": "false"}),
                             cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
        monkeypatch.setenv("MLFLOW_WORKSPACE", "team-a")  # this client's workspace, as the job's
        run = only_run(MlflowClient(server.url), "ws")
        link = f"{server.url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workspace=team-a"
        assert link in result.stderr
        status = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", server.url], capture_output=True,
                                text=True, env={**os.environ, **env}, timeout=120)
        assert link in status.stdout, status.stdout + status.stderr
    finally:
        server.stop()


def test_a_job_or_dry_run_in_a_workspace_the_server_lacks_says_so_in_one_line(tmp_path, data_dir):
    """MLflow's lookup of an experiment by name in a workspace the server lacks finds none, as for a new
    experiment: `--dry-run` said `experiment … (new), a new run`, and the job then stopped (FAULTS row 344);
    the job itself warned first that it `could not look for experiment … under another name`."""
    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server", extra_args=("--enable-workspaces",)).start()
    try:
        for extra in (["--dry-run"], []):
            result = subprocess.run([*trainer_cmd(*tracked(tmp_path, data_dir, server, "ws")), *extra],
                                    capture_output=True, text=True, env={**os.environ, "MLFLOW_WORKSPACE": "nope"},
                                    timeout=120)
            assert result.returncode == 2, result.stderr
            said = [line for line in result.stderr.splitlines() if "warning" in line.lower() or "error" in line.lower()]
            assert said == [f"error: tracking server {server.url}: no workspace 'nope' (MLFLOW_WORKSPACE)"], extra
        assert not (tmp_path / "output").exists() or not any((tmp_path / "output").iterdir())
    finally:
        server.stop()


def _resume_setup(tmp_path, data_dir, mlflow_server, exp, **keys):
    keys = {"DETERMINISTIC": "true", "SOLVER.MAX_ITER": 60, "TRAIN.SNAPSHOT_ITERS": 3, **keys}
    first = tmp_path / "machine1"
    first.mkdir()
    args = tracked(first, data_dir, mlflow_server, exp, **keys)
    return first, args, keys


def _wait_for_tag(client, experiment, tag, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp else []
        if runs and tag in runs[0].data.tags:
            return runs[0]
        time.sleep(0.1)
    raise TimeoutError(tag)


def _start_and_kill_after_upload(tmp, args, client, exp, artifact: str | None = None):
    """Run the job on 'machine 1' and SIGKILL it once a model_iter checkpoint is complete on the
    server (which one depends on timing: one superseded before its upload starts is never sent),
    and `artifact` is in the run too."""
    import signal
    import subprocess

    proc = subprocess.Popen(trainer_cmd(*args), cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 120
    try:
        while time.monotonic() < end:
            exp_obj = client.get_experiment_by_name(exp)
            runs = client.search_runs([exp_obj.experiment_id]) if exp_obj else []
            if runs and runs[0].data.tags.get("tracktron.ckpt.latest", "").startswith("model_iter") and (
                    artifact is None or artifact in {a.path for a in client.list_artifacts(runs[0].info.run_id)}):
                return runs[0]
            time.sleep(0.05)
        raise TimeoutError("no model_iter checkpoint completed on the server")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_killed_job_resumes_from_the_server_on_an_empty_machine(tmp_path, data_dir, mlflow_server, s3_server):
    exp = f"resume-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server.url)
    first, args, keys = _resume_setup(tmp_path, data_dir, mlflow_server, exp)
    run = _start_and_kill_after_upload(first, args, client, exp, artifact="log.txt")

    second = tmp_path / "machine2"  # nothing local: only the tracking URI
    second.mkdir()
    resumed = run_trainer(tracked(second, data_dir, mlflow_server, exp, **keys), cwd=second, env=s3_server.env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from run {run.info.run_id} (model_iter" in resumed.stderr
    assert "watching it" not in resumed.stderr  # its trainer, on this machine, is known to be gone
    run = only_run(client, exp)  # the same run, continued
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id) == list(range(60))  # one unbroken curve, no step twice

    straight = tmp_path / "straight"
    straight.mkdir()
    ref = run_trainer(tracked(straight, data_dir, mlflow_server, exp + "-ref", **keys), cwd=straight,
                      env=s3_server.env)
    assert ref.returncode == 0, ref.stderr
    a = load_checkpoint(straight / "output" / "model_final.pth")["model"]
    b = load_checkpoint(second / "output" / "model_final.pth")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    entries = [json.loads(x)["iter"] for x in (second / "output" / "json_stats.log").read_text().splitlines()]
    assert entries == sorted(set(entries)) and entries[-1] == 59
    # log.txt goes on too: the killed start's, from the run (sent with its first checkpoint), then this one's
    log_txt = (second / "output" / "log.txt").read_text()
    starts = re.findall(r"tracktron\] started on \S+ \(pid (\d+)\)", log_txt)
    assert len(starts) == 2 and starts[0] != starts[1], log_txt[:2000]
    assert log_txt.index("resuming from run") > log_txt.rindex("started on") and log_txt.endswith("the job ends FINISHED\n")
    assert client.download_artifacts(run.info.run_id, "log.txt", str(tmp_path)) and \
        (tmp_path / "log.txt").read_text() == log_txt  # the run's copy is the whole of it


def test_a_resume_from_a_copied_checkpoint_keeps_the_runs_logs(tmp_path, data_dir, mlflow_server, s3_server):
    """A killed job's newest checkpoint copied by hand to another machine, its logs left behind: the job
    resumes from the copy, and json_stats.log and log.txt go on from the run's copies. json_stats.log was
    fetched only beside a checkpoint downloaded from the run, so the run's copy lost the lines before."""
    exp = f"copied-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server.url)
    first, args, keys = _resume_setup(tmp_path, data_dir, mlflow_server, exp)
    run = _start_and_kill_after_upload(first, args, client, exp, artifact="json_stats.log")
    newest = max((first / "output").glob("model_iter*.pth"), key=lambda p: iteration_of(p.name))

    second = tmp_path / "machine2"
    (second / "output").mkdir(parents=True)
    shutil.copy(newest, second / "output")
    resumed = run_trainer(tracked(second, data_dir, mlflow_server, exp, **keys), cwd=second, env=s3_server.env)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(rf"resuming from \S*/{newest.name} at iteration", resumed.stderr), resumed.stderr[-3000:]
    server_copy = tmp_path / "run"
    server_copy.mkdir()
    for name in ("json_stats.log", "log.txt"):
        client.download_artifacts(run.info.run_id, name, str(server_copy))
    for folder in (second / "output", server_copy):
        entries = [json.loads(x)["iter"] for x in (folder / "json_stats.log").read_text().splitlines()]
        assert entries[0] == 0 and entries[-1] == 59 and entries == sorted(set(entries)), (folder, entries)
        assert len(re.findall(r"tracktron\] started on", (folder / "log.txt").read_text())) == 2, folder


def test_tampered_newest_checkpoint_falls_back_to_the_previous(tmp_path, data_dir, mlflow_server, s3_server):
    """The newest checkpoint complete on the server when the job was killed is overwritten on S3: the
    resume skips it (sha256 mismatch) for the one before. Which ones are complete depends on where
    the kill lands (a checkpoint superseded before its upload starts is never sent), so the test reads
    the run's tags rather than assuming names."""
    from trainer.tracking.runs import checkpoints_from

    exp = f"tamper-{uuid.uuid4().hex[:6]}"
    client = MlflowClient(mlflow_server.url)
    first, args, keys = _resume_setup(tmp_path, data_dir, mlflow_server, exp)
    run = _start_and_kill_after_upload(first, args, client, exp)
    complete = checkpoints_from(client.get_run(run.info.run_id).data.tags)  # newest first
    assert complete and "model_final.pth" not in complete
    newest, older = complete[0], (complete[1] if len(complete) > 1 else None)
    key = next(k for k in s3_keys(s3_server) if k.endswith(f"{run.info.run_id}/artifacts/checkpoints/{newest}"))
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=key, Body=b"not the checkpoint you uploaded")

    second = tmp_path / "machine2"
    second.mkdir()
    resumed = run_trainer(tracked(second, data_dir, mlflow_server, exp, **keys), cwd=second, env=s3_server.env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{newest} from the tracking server does not match its sha256 tag" in resumed.stderr
    if older is not None:
        assert f"resuming from run {run.info.run_id} ({older}) at iteration {iteration_of(older) + 1}" in resumed.stderr
    else:
        assert "resuming from" not in resumed.stderr  # nothing else complete: from the start, in the same run


def test_tracking_server_down_mid_run_loses_no_point(tmp_path, data_dir, s3_server):
    import subprocess

    from tests.servers import MlflowServer

    server = MlflowServer(tmp_path, artifacts=f"s3://{s3_server.bucket}/outage", env=s3_server.env).start()
    exp = "outage"
    args = tracked(tmp_path, data_dir, server, exp, **{"SOLVER.MAX_ITER": 200, "TRAIN.SNAPSHOT_ITERS": 10,
                                                       "LOG_PERIOD": 1})
    with open(tmp_path / "trainer.err", "w") as err_log:  # a file, not a pipe nobody drains while we wait
        proc = subprocess.Popen(trainer_cmd(*args), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err_log)
    log = tmp_path / "output" / "json_stats.log"
    try:
        client = MlflowClient(server.url)
        _wait_for_tag(client, exp, "tracktron.ckpt.latest")  # a checkpoint complete (which: the machine's pace)
        server.stop()
        before = len(log.read_text().splitlines())
        time.sleep(8)
        trained_while_down = len(log.read_text().splitlines()) - before
        server.start()
        proc.wait(timeout=300)
        assert proc.returncode == 0, (tmp_path / "trainer.err").read_text()[-3000:]
        assert trained_while_down >= 5, f"training paused while the server was down ({trained_while_down} its in 8 s)"
        run = only_run(client, exp)
        assert run.info.status == "FINISHED"
        for key in ("loss", "lr", "time"):
            assert steps(client, run.info.run_id, key) == list(range(200)), key
        assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    finally:
        proc.kill()
        server.stop()


def test_artifacts_straight_to_s3_with_the_embedded_store(tmp_path, data_dir, s3_server):
    """No server: sqlite tracking, an experiment whose artifact location is s3:// (boto3 direct)."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    client.create_experiment("direct", artifact_location=f"s3://{s3_server.bucket}/direct")
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "direct",
                                                 "SOLVER.MAX_ITER": 4})
    result = run_trainer(args, cwd=tmp_path, env=s3_server.env)
    assert result.returncode == 0, result.stderr
    run = only_run(client, "direct")
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert f"direct/{run.info.run_id}/artifacts/checkpoints/model_final.pth" in s3_keys(s3_server, "direct/")


def test_unreachable_tracking_server_is_one_line_exit_2(tmp_path, data_dir):
    env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}
    result = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": "http://127.0.0.1:9"}),
                         cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot reach the tracking server at http://127.0.0.1:9")
    assert not (tmp_path / "output").exists()


def test_unknown_resume_run_id_is_exit_2(tmp_path, data_dir):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    result = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri}) + ["--resume", "0" * 32],
                         cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: run {'0' * 32} does not exist on {uri} (there is no store yet)"
    assert not (tmp_path / "store.db").exists()  # looking for it made none


def test_resume_of_another_jobs_run_is_refused_before_anything_is_touched(tmp_path, data_dir):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    first = run_trainer(demo_overrides(tmp_path / "a", data_dir, **{"TRACKING.URI": uri}), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    client = MlflowClient(uri)
    (theirs,) = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    other = demo_overrides(tmp_path / "b", data_dir, **{"TRACKING.URI": uri, "SOLVER.BASE_LR": 0.001})
    result = run_trainer(other + ["--resume", theirs.info.run_id], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: run {theirs.info.run_id} is another job's (job ")
    after = client.get_run(theirs.info.run_id)
    assert after.info.status == "FINISHED" and after.data.tags == theirs.data.tags
    assert len(client.search_runs([theirs.info.experiment_id])) == 1
    assert not (tmp_path / "b" / "output").exists()  # nothing written for the refused job

    untracked = run_trainer(demo_overrides(tmp_path / "c", data_dir, **{"TRACKING.ENABLED": "false"})
                            + ["--resume", theirs.info.run_id], cwd=tmp_path)
    assert untracked.returncode == 2
    assert untracked.stderr.strip().splitlines()[-1].startswith("error: --resume RUN_ID continues a tracked run")


def test_resume_of_a_foreign_run_is_refused_and_it_stays_as_it_was(tmp_path, data_dir):
    """--resume of a run no tracktron job made (here another project's FINISHED run, with its own
    metrics) was adopted: our tags, metrics and checkpoints written into it, its status overwritten.
    Found by the red team."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("another-project", str(tmp_path / "artifacts"))  # not ./mlruns of the suite
    theirs = client.create_run(exp, tags={"team": "nlp"}).info.run_id
    client.log_metric(theirs, "accuracy", 0.91, step=3)
    client.set_terminated(theirs, "FINISHED")
    before = client.get_run(theirs)
    result = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri}) + ["--resume", theirs],
                         cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: run {theirs} is not a tracktron run (no tracktron.job tag) and is FINISHED with 1 metrics: only an "
        "empty, unfinished run is adopted; drop --resume to start this job's run in a new one"]
    after = client.get_run(theirs)
    assert (after.info.status, after.info.end_time, after.data.tags, after.data.metrics, after.data.params) == (
        before.info.status, before.info.end_time, before.data.tags, before.data.metrics, before.data.params)
    assert sorted(e.name for e in client.search_experiments()) == ["Default", "another-project"]  # none made
    assert len(client.search_runs([before.info.experiment_id])) == 1 and not client.list_artifacts(theirs)
    assert not (tmp_path / "output").exists()


def test_resume_of_a_bare_running_run_without_metrics_still_adopts_it(tmp_path, data_dir):
    """A run made for the job (as `mlflow run` leaves it: RUNNING, params and mlflow.* tags, no
    metrics) is still adopted by --resume and trained into."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("made-for-it", str(tmp_path / "artifacts"))
    made = client.create_run(exp, tags={"mlflow.source.type": "PROJECT"})
    client.log_param(made.info.run_id, "opts", "")
    result = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 2})
                         + ["--resume", made.info.run_id], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run = client.get_run(made.info.run_id)
    assert run.info.status == "FINISHED" and "tracktron.job" in run.data.tags
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth" and run.data.params["opts"] == ""
    assert steps(client, made.info.run_id) == [0, 1]
    assert len(client.search_runs([made.info.experiment_id])) == 1


def test_sigterm_checkpoints_the_current_iteration_and_marks_the_run_killed(tmp_path, data_dir, mlflow_server,
                                                                            s3_server):
    import signal
    import subprocess

    exp = f"sigterm-{uuid.uuid4().hex[:6]}"
    keys = {"SOLVER.MAX_ITER": 500, "TRAIN.SNAPSHOT_ITERS": 1000, "LOG_PERIOD": 1}
    args = tracked(tmp_path, data_dir, mlflow_server, exp, **keys)
    proc = subprocess.Popen(trainer_cmd(*args), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **s3_server.env})
    log = tmp_path / "output" / "json_stats.log"
    while not log.exists() or len(log.read_text().splitlines()) < 5:
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, exp)
    assert run.info.status == "KILLED"
    saved = run.data.tags["tracktron.ckpt.latest"]
    done = iteration_of(saved)
    assert steps(client, run.info.run_id) == list(range(done + 1))  # every finished iteration is on the server

    resumed = subprocess.Popen(trainer_cmd(*tracked(tmp_path / "m2", data_dir, mlflow_server, exp, **keys)),
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **s3_server.env})
    line = ""
    while "resuming from" not in line:
        line = resumed.stderr.readline()
        assert line, "the resumed job ended without resuming"
    resumed.kill()
    resumed.wait()
    assert f"({saved}) at iteration {done + 1}" in line


def test_a_tracked_job_is_one_process_and_its_loader_workers(tmp_path, data_dir, mlflow_server):
    """Checkpoints, uploads, metrics, system metrics: threads of the trainer. Its only child processes,
    watched all through training (from model.txt to model_final.pth), are its data loader's workers
    (forked: the trainer's command line). Around training, the run's creation and MLflow's log_model
    ask `git` about the source, a command that comes and goes."""
    import subprocess

    exp = f"one-process-{uuid.uuid4().hex[:6]}"
    args = tracked(tmp_path, data_dir, mlflow_server, exp, **{"DATA_LOADER.NUM_THREADS": 2, "SOLVER.MAX_ITER": 20,
                                                              "TRACKING.SYSTEM_METRICS": "true"})
    env = {**os.environ, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "600"}  # its last interval is sent at the end
    job = subprocess.Popen(trainer_cmd(*args), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    seen: dict[int, bytes] = {}
    most, cmdline = 0, b""
    try:
        while job.poll() is None and not (tmp_path / "output" / "model_final.pth").exists():
            if not (tmp_path / "output" / "model.txt").exists():
                time.sleep(0.02)
                continue
            cmdline = cmdline or Path(f"/proc/{job.pid}/cmdline").read_bytes()  # exec'd by now
            children = _children_of(job.pid)
            most = max(most, len(children))
            for pid in children:
                try:
                    seen.setdefault(pid, Path(f"/proc/{pid}/cmdline").read_bytes())
                except OSError:  # gone meanwhile
                    pass
            time.sleep(0.05)
        stderr = job.communicate(timeout=300)[1]
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert seen, "no loader worker was ever seen"
    assert all(c == cmdline for c in seen.values() if c), ({p: c for p, c in seen.items() if c != cmdline}, cmdline)
    assert most <= 2  # DATA_LOADER.NUM_THREADS: nothing else
    run = only_run(MlflowClient(mlflow_server.url), exp)
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert "system/cpu_utilization_percentage" in run.data.metrics, stderr[-3000:]


def _children_of(pid: int) -> list[int]:
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(p) for p in (task / "children").read_text().split()]
    except OSError:  # the job ended meanwhile
        pass
    return found


def test_two_jobs_starting_at_once_on_a_new_sqlite_store_both_work(tmp_path, data_dir):
    """Both would create the store's tables at once (which left it unusable): one does, under a
    lock beside the database, and the other finds them."""
    import subprocess

    uri = f"sqlite:///{tmp_path / 'new.db'}"
    jobs = [subprocess.Popen(trainer_cmd(*demo_overrides(tmp_path / name, data_dir, **{
                "TRACKING.URI": uri, "TRACKING.EXPERIMENT": "together", "SOLVER.MAX_ITER": 6 + i})),
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i, name in enumerate(("a", "b"))]
    results = [(job.wait(300), job.stderr.read()) for job in jobs]
    for code, stderr in results:
        assert code == 0, stderr[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("together").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    assert all(r.data.tags["tracktron.ckpt.latest"] == "model_final.pth" for r in runs)


def test_a_model_tag_no_model_can_have_names_none_on_a_server(mlflow_server):
    """`tracktron.model_id` rewritten to a path: the server answers 404 for the URL it makes, which
    read as "cannot say", so the tag was kept and every rerun tried to register that model."""
    from trainer.tracking.job_run import _holds_model

    client = MlflowClient(mlflow_server.url)
    experiment = client.create_experiment(f"model-tag-{uuid.uuid4().hex[:6]}")
    run_id = client.create_run(experiment).info.run_id
    model = client.create_logged_model(experiment, name="model", source_run_id=run_id)
    assert _holds_model(client, run_id, model.model_id)
    for tag in ("", "a/b", "../x", f"{model.model_id}/..", "m-1?x=1"):
        assert not _holds_model(client, run_id, tag), tag


def _without_logged_models(target: str) -> FaultProxy:
    """An MLflow 3 server as a hosted endpoint without MLflow 3's logged-model API shows it (Azure ML's;
    an MLflow 2 server answers alike, with an HTML body): every `/logged-models` request answered 404
    with an empty body, everything else passed to the real server."""
    proxy = FaultProxy(target)
    proxy.missing = re.compile(rb"/logged-models")
    return proxy


def test_a_server_without_the_logged_model_api_is_refused_before_the_run_is_made(tmp_path, data_dir, mlflow_server):
    """An MLflow 2.22 server (or a hosted one without MLflow 3's logged-model API) took the job's
    metrics and checkpoints, then failed its evaluations and model after training, on every rerun too
    (exit 1). Now the start asks first: one line, exit 2, no run, no experiment, no OUTPUT_DIR; --dry-run
    says the same. A job that logs no model nor evaluation needs none of it, and starts."""
    experiment = f"no-logged-models-{uuid.uuid4().hex[:6]}"
    with _without_logged_models(mlflow_server.url) as server:
        args = tracked(tmp_path, data_dir, server, experiment, **{"TRACKING.REGISTERED_MODEL": "detector"})
        for extra in ([], ["--dry-run"]):
            result = run_trainer(args + extra, cwd=tmp_path)
            assert result.returncode == 2, result.stderr
            assert result.stderr.strip().splitlines()[-1] == (
                f"error: the tracking server at {server.url} has no logged-model API (/api/2.0/mlflow/logged-models "
                f"answers 404; it reports MLflow {mlflow.__version__}), which the job's model, evaluations and "
                "checkpoint pruning need: use an MLflow 3 server (upgrade this one), or train without them "
                "(TRACKING.LOG_MODEL false TEST.DATASETS '()')")
        assert [r for r in server.requests_seen if b"/logged-models" in r], "the start never asked for the logged-model API"
        assert MlflowClient(mlflow_server.url).get_experiment_by_name(experiment) is None  # nor a run in it
        assert not (tmp_path / "output").exists()
        plain = run_trainer(args + ["TRACKING.LOG_MODEL", "false", "TEST.DATASETS", "()", "--dry-run"], cwd=tmp_path)
        assert plain.returncode == 0, plain.stderr
        assert f"tracking: {server.url}: experiment {experiment} (new), a new run" in plain.stdout


def test_status_says_in_one_line_that_a_server_lacks_the_logged_model_api(tmp_path, mlflow_server):
    """`status` reads runs alone, which such a server serves: it lists them, and says in one warning
    why their models are missing."""
    with _without_logged_models(mlflow_server.url) as server:
        out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", server.url], capture_output=True,
                             text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "logged-model API" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"the tracking server at {server.url} has no logged-model API (/api/2.0/mlflow/logged-models answers 404; it "
        f"reports MLflow {mlflow.__version__}): its jobs' models and evaluations cannot be logged there, and a job that "
        "would log them is refused at its start; use an MLflow 3 server"), out.stderr


def test_eval_into_a_run_on_a_server_without_the_logged_model_api_prints_the_scores(tmp_path, data_dir, mlflow_server):
    """`tracktron eval --weights runs:/...` attaches to the run without the training start's lookup: it
    evaluated, then failed to link the scores to the checkpoint's model (exit 1). Now it says so before it
    evaluates, prints the scores and logs nothing into the run."""
    experiment = f"eval-no-logged-models-{uuid.uuid4().hex[:6]}"
    job = run_trainer(tracked(tmp_path, data_dir, mlflow_server, experiment, **{
        "SOLVER.MAX_ITER": 4, "TEST.DATASETS": "()", "TRACKING.LOG_MODEL": "false"}), cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, experiment)
    run_id = run.info.run_id
    with _without_logged_models(mlflow_server.url) as server:
        out = subprocess.run([sys.executable, "-m", "trainer", "eval", "--config", str(DEMO),
                              "--weights", f"runs:/{run_id}/checkpoints/model_final.pth", "DATA_DIR", str(data_dir),
                              "OUTPUT_DIR", str(tmp_path / "eval"), "TRACKING.URI", server.url],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"has no logged-model API (/api/2.0/mlflow/logged-models answers 404; it reports MLflow {mlflow.__version__}): " \
           f"these scores are printed, not logged into run {run_id}; use an MLflow 3 server" in out.stderr, out.stderr
    assert f"evaluation of runs:/{run_id}/checkpoints/model_final.pth\n| | AP | AP50 |" in out.stdout  # the scores
    assert not client.get_metric_history(run_id, "bbox/AP")
    assert client.get_run(run_id).data.tags == run.data.tags  # nor its test sets taken as the run's own


def test_the_logged_model_api_refusal_keeps_a_password_in_the_uri_secret(tmp_path, data_dir, mlflow_server):
    """The refusal names the server: a password in its URI (http://user:password@host) stays out of it."""
    with _without_logged_models(mlflow_server.url) as server:
        uri = server.url.replace("http://", "http://alice:s3cret-Pw99@")
        result = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri}) + ["--dry-run"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: the tracking server at {server.url} has no logged-model API"), result.stderr  # credentials go apart
    assert "s3cret-Pw99" not in result.stderr + result.stdout
