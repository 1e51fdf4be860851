"""Fault injection, storage: S3 failing for a while and for good, a full disk while a checkpoint
is written (docs/FAULTS.md has the matrix; tests/test_faults.py the signals and kills)."""
from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import demo_overrides, run_trainer, trainer_cmd
from tests.faultkit import (  # noqa: F401 - jobs, reference, _no_run_id_file are fixtures
    assert_same_weights, job_args, jobs, MAX_ITER, _no_run_id_file, only_run, reference, sha_tag, steps,
    temp_files, wait_until)
from tests.servers import FaultProxy
from trainer.hashing import sha256_of
from trainer.checkpoint.state import load as load_checkpoint


# ---- S3: failing uploads, then back; failing for good ------------------------------------------------

def _direct_s3_experiment(tmp: Path, s3_server, name: str) -> tuple[str, MlflowClient]:
    """The embedded sqlite store with artifacts straight on S3 (boto3 in the trainer)."""
    uri = f"sqlite:///{tmp / 'store.db'}"
    client = MlflowClient(uri)
    client.create_experiment(name, artifact_location=f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:6]}")
    return uri, client


def test_s3_failing_uploads_are_retried_until_it_is_back(tmp_path, data_dir, s3_server, reference, jobs):
    uri, client = _direct_s3_experiment(tmp_path, s3_server, "s3-outage")
    out = tmp_path / "output"
    with FaultProxy(s3_server.url, mode="error") as s3:  # every request: HTTP 503
        args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "s3-outage",
                                               "TRACKING.FLUSH_TIMEOUT_S": 120})
        job = jobs(args, tmp_path, env={**s3_server.env, "MLFLOW_S3_ENDPOINT_URL": s3.url})
        wait_until(lambda: (out / "model_iter5.pth").exists() and s3.errors_sent >= 3, job, "failed uploads")
        run = only_run(client, "s3-outage")
        assert not [t for t in run.data.tags if t.endswith(".sha256")]  # nothing claimed while S3 fails
        s3.set_mode("pass")
        assert job.wait(300) == 0, job.stderr[-3000:]
    assert re.search(r"tracking: upload \S+ failed \(.*\); retrying", job.stderr)
    run = only_run(client, "s3-outage")
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id) == list(range(MAX_ITER))
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    tagged = [n for n in ("model_iter2.pth", "model_iter5.pth", "model_iter8.pth", "model_final.pth")
              if sha_tag(n) in run.data.tags]  # older ones that a newer one superseded are not sent
    assert "model_final.pth" in tagged
    for name in tagged:
        assert run.data.tags[sha_tag(name)] == sha256_of(out / name)
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=s3_server.bucket)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]  # a page holds 1000 of the suite's
    assert any(k.endswith(f"{run.info.run_id}/artifacts/checkpoints/model_final.pth") for k in keys)
    assert_same_weights(reference, out / "model_final.pth")


def test_s3_failing_for_good_claims_nothing_says_what_was_not_uploaded_and_a_rerun_uploads_it(
        tmp_path, data_dir, s3_server, jobs, monkeypatch):
    uri, client = _direct_s3_experiment(tmp_path, s3_server, "s3-down")
    out = tmp_path / "output"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "s3-down",
                                           "SOLVER.MAX_ITER": 4, "TRACKING.FLUSH_TIMEOUT_S": 5})
    with FaultProxy(s3_server.url, mode="error") as s3:
        job = jobs(args, tmp_path, env={**s3_server.env, "MLFLOW_S3_ENDPOINT_URL": s3.url, "AWS_MAX_ATTEMPTS": "2"})
        code = job.wait(120)
    # The job trained, but its run is not complete: exit 1, naming what the server lacks; no claim.
    assert code == 1, job.stderr[-3000:]
    last = job.last_line
    assert last.startswith("error: the tracking server did not get: ") and "model_final.pth" in last, last
    named = last.removeprefix("error: the tracking server did not get: ").split(". The local files")[0].split(", ")
    assert len(named) == len(set(named)), last  # json_stats.log, uploaded twice, was named twice (helper-58)
    assert "Traceback" not in job.stderr
    run = only_run(client, "s3-down")
    assert not [t for t in run.data.tags if t.startswith("tracktron.ckpt.")]
    assert load_checkpoint(out / "model_final.pth")["iteration"] == 3

    # S3 is back: the same command trains nothing and completes the run with the local model_final.
    again = jobs(args, tmp_path, env={**s3_server.env, "MLFLOW_S3_ENDPOINT_URL": s3_server.url}, name="again")
    assert again.wait(120) == 0, again.stderr[-3000:]
    assert "uploading the local one" in again.stderr
    assert ("nothing to train; sent the run what it lacked: model_final.pth, json_stats.log\n"
            in again.out_path.read_text())
    run = only_run(client, "s3-down")
    assert run.info.status == "FINISHED"
    assert run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert run.data.tags[sha_tag("model_final.pth")] == sha256_of(out / "model_final.pth")
    for key, value in s3_server.env.items():  # this process reads the S3 store directly, as the trainer does
        monkeypatch.setenv(key, value)
    got = Path(client.download_artifacts(run.info.run_id, "checkpoints/model_final.pth", str(tmp_path / "dl")))
    assert sha256_of(got) == sha256_of(out / "model_final.pth")


def test_an_artifact_store_that_refuses_uploads_stops_the_job_before_it_trains(tmp_path, data_dir, s3_server):
    """A bucket that does not exist, or no credentials for S3 (a server run with --no-serve-artifacts
    and a client without keys): every checkpoint failed to upload, as a warning, and the job said so
    only at its end, hours of training later, exit 1 (helper-58). The run's first upload (config.yaml)
    is now sent before training: one line, exit 2, the run FAILED with that line, nothing trained. Nor is
    the job's log.txt then sent to that store at its end: it was retried until TRACKING.FLUSH_TIMEOUT_S."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    client.create_experiment("no-bucket", artifact_location="s3://tracktron-no-such-bucket/runs")
    client.create_experiment("no-keys", artifact_location=f"s3://{s3_server.bucket}/no-keys")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    no_keys = {**env, "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
               "AWS_EC2_METADATA_DISABLED": "true", "MLFLOW_S3_ENDPOINT_URL": s3_server.url}
    for experiment, job_env, said in (("no-bucket", {**env, **s3_server.env}, "NoSuchBucket"),
                                      ("no-keys", no_keys, "Unable to locate credentials")):
        out = tmp_path / experiment
        args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": experiment,
                                                     "OUTPUT_DIR": str(out), "TRACKING.FLUSH_TIMEOUT_S": 3600})
        done = subprocess.run(trainer_cmd(*args), cwd=tmp_path, env=job_env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("error: the run's artifact store s3://") and "refuses uploads (" in last and said in last, last
        assert "Traceback" not in done.stderr
        assert "log.txt" not in done.stderr, done.stderr[-3000:]  # no upload of it tried, nor retried
        run = only_run(client, experiment)
        assert run.info.status == "FAILED"
        assert run.data.tags["tracktron.status_reason"] == last.removeprefix("error: ")
        assert not list(out.glob("model_*.pth"))  # it stopped before iteration 0
        assert "loss" not in run.data.metrics


def test_a_proxy_body_limit_is_said_per_checkpoint_and_not_retried_to_the_deadline(tmp_path, data_dir, mlflow_server):
    """nginx (or ingress-nginx) in front of the server with its default 1 MB body limit answers 413 to
    every checkpoint: each was retried with backoff until the flush deadline, then the job ended 1
    saying only what the server lacked (helper-65's red team). A 413 is final: each upload says why
    and what to raise, once, and the job ends without waiting out the deadline."""
    with FaultProxy(mlflow_server.url) as proxy:
        proxy.max_body = 1 << 20
        args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": proxy.url, "TRACKING.EXPERIMENT": "body-limit",
                                                     "SOLVER.MAX_ITER": 6, "TRAIN.SNAPSHOT_ITERS": 3,
                                                     "TEST.EVAL_PERIOD": 0, "TRACKING.FLUSH_TIMEOUT_S": 600})
        done = run_trainer(args, cwd=tmp_path, timeout=900)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    for name in ("model_iter2.pth", "model_final.pth"):
        said = [line for line in lines[:-1] if name in line and "(HTTP 413)" in line]  # the last line sums up, below
        skipped = [line for line in lines if f"not uploading {name}: a newer checkpoint supersedes it" in line]
        if name == "model_iter2.pth" and skipped and not said:  # model_final came before its upload began
            continue
        assert len(said) == 1 and "WARNING" in said[0] and "client_max_body_size" in said[0], done.stderr[-3000:]
    assert not [line for line in lines if "413" in line and "retrying" in line]
    assert "not done before the deadline" not in done.stderr
    assert lines[-1].startswith("error: the tracking server did not get: ") and "model_final.pth" in lines[-1]
    assert "(HTTP 413): raise its body limit" in lines[-1], lines[-1]  # what to mend before the rerun
    run = only_run(MlflowClient(mlflow_server.url), "body-limit")
    assert "tracktron.ckpt.latest" not in run.data.tags  # nothing claimed complete without its bytes
    assert (tmp_path / "output" / "model_final.pth").is_file()  # the local checkpoints are intact


def test_a_run_deleted_while_the_job_trains_is_said_with_how_to_restore_it(tmp_path, data_dir, mlflow_server, jobs):
    """The run deleted in the UI mid-job: every send failed, the last line promised that the same
    command would send what the run lacks, and that command started a new, empty run (helper-65's red
    team). The last line now says the run was deleted and how to restore it, and that works."""
    client, args, run_id, job = _run_deleted_mid_job(tmp_path, data_dir, mlflow_server, jobs, "deleted-mid-job")
    assert job.wait(600) == 1, job.stderr[-3000:]
    assert job.last_line.startswith("error: the tracking server did not get: "), job.last_line
    assert job.last_line.endswith(f"Run {run_id} was deleted while the job ran: restore it (`mlflow runs restore "
                                  f"--run-id {run_id}`) and run the same command again, which sends what it lacks "
                                  "(the local files are intact)"), job.last_line
    client.restore_run(run_id)
    again = jobs(args, tmp_path, name="again")
    assert again.wait(600) == 0, again.stderr[-3000:]
    run = only_run(client, "deleted-mid-job")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert steps(client, run_id) == list(range(60))


def test_a_run_deleted_for_good_while_the_job_trains_is_said_and_the_rerun_makes_a_new_run(tmp_path, data_dir,
                                                                                            mlflow_server, jobs):
    """The run deleted, then `mlflow gc` mid-job: the last line promised that the same command would
    send what the run lacks (helper-77's red team). The run is gone for good: the line says so, and
    what the same command does, which is true: it trains the job into a new run."""
    exp = f"gc-mid-job-{uuid.uuid4().hex[:6]}"
    client, args, run_id, job = _run_deleted_mid_job(tmp_path, data_dir, mlflow_server, jobs, exp, max_iter=300)
    gc = subprocess.run([str(Path(sys.executable).parent / "mlflow"), "gc", "--backend-store-uri",
                         f"sqlite:///{mlflow_server.db}", "--run-ids", run_id], capture_output=True, text=True,
                        timeout=120, env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_server.url})
    assert gc.returncode == 0, gc.stderr[-2000:]
    assert job.wait(600) == 1, job.stderr[-3000:]
    assert job.last_line.startswith("error: the tracking server did not get: "), job.last_line
    assert job.last_line.endswith(f"Run {run_id} no longer exists on the tracking server (deleted for good while the "
                                  "job ran): what it lacks cannot be sent; the local files are intact, and running "
                                  "the same command again logs the job into a new run"), job.last_line
    assert "model_final.pth" in job.last_line and "model_iter" not in job.last_line  # not 60 failed uploads
    again = jobs(args, tmp_path, name="again")
    assert again.wait(600) == 0, again.stderr[-3000:]
    run = only_run(client, exp)
    assert run.info.run_id != run_id and run.info.status == "FINISHED"
    assert "tracktron.ckpt.latest" in run.data.tags


def _run_deleted_mid_job(tmp_path, data_dir, mlflow_server, jobs, exp, max_iter=60):
    """A job on the server, its run deleted once model_iter4 is written. Its FLUSH_TIMEOUT_S of an hour
    must not be waited out: no send to a deleted run can succeed (the job's wait() would time out)."""
    client = MlflowClient(mlflow_server.url)
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": mlflow_server.url, "TRACKING.EXPERIMENT": exp,
                                           "SOLVER.MAX_ITER": max_iter, "TRAIN.SNAPSHOT_ITERS": 5,
                                           "TRACKING.FLUSH_TIMEOUT_S": 3600})
    job = jobs(args, tmp_path)
    wait_until(lambda: (tmp_path / "output" / "model_iter4.pth").exists(), job, "model_iter4")
    run_id = only_run(client, exp).info.run_id
    client.delete_run(run_id)
    return client, args, run_id, job


# ---- a full disk while writing a checkpoint ----------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """OUTPUT_DIR on a 12 MiB tmpfs (one checkpoint fits, the second does not); where mounting is
    not allowed, a 4 MiB RLIMIT_FSIZE on the trainer (SIGXFSZ ignored, so write() fails with EFBIG)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = os.environ.get("TRACKTRON_TEST_DISK") != "rlimit" and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True).returncode == 0

    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))

    def grow():
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)

    yield {"dir": mount, "tmpfs": mounted, "preexec": None if mounted else preexec, "grow": grow}
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_while_writing_a_checkpoint_fails_clearly_and_damages_nothing(tmp_path, data_dir, small_disk,
                                                                               reference):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = small_disk["dir"] / "output"
    args = job_args(tmp_path, data_dir, **{"OUTPUT_DIR": out, "TRACKING.URI": uri, "TRACKING.EXPERIMENT": "disk",
                                           "LOG_PERIOD": 100})
    failing = "model_iter5.pth" if small_disk["tmpfs"] else "model_iter2.pth"
    reason = "No space left on device" if small_disk["tmpfs"] else "File too large"
    result = subprocess.run(trainer_cmd(*args), cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            preexec_fn=small_disk["preexec"])
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"cannot write checkpoint {out / failing}: {reason}" in last, last
    assert not temp_files(out) and not (out / failing).exists()
    client = MlflowClient(uri)
    run = only_run(client, "disk")
    assert run.info.status == "FAILED"
    assert reason in run.data.tags["tracktron.status_reason"]
    if small_disk["tmpfs"]:  # the checkpoint written before the disk filled up is whole, and is the server's
        assert load_checkpoint(out / "model_iter2.pth")["iteration"] == 2
        assert run.data.tags[sha_tag("model_iter2.pth")] == sha256_of(out / "model_iter2.pth")

    # Space again (the tmpfs grows; the file size limit is not set): the job resumes and finishes.
    small_disk["grow"]()
    resumed = run_trainer(args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    if small_disk["tmpfs"]:
        assert "model_iter2.pth at iteration 3" in resumed.stderr
    assert only_run(client, "disk").info.status == "FINISHED"
    assert_same_weights(reference, out / "model_final.pth")


def test_a_working_folder_deleted_mid_run_fails_in_a_few_clear_lines(tmp_path, data_dir):
    """`rm -rf` of the folder a job runs in, relative OUTPUT_DIR and SQLite store inside it: every
    retry of the metric sender put MLflow's logged traceback of the SQLite error on stderr (about
    1,000 lines), and the lock's release then failed on the missing OUTPUT_DIR, so its traceback
    replaced the job's own error."""
    work, err_path = tmp_path / "work", tmp_path / "job.stderr"
    work.mkdir()
    args = job_args(work, data_dir, **{"OUTPUT_DIR": "output", "SOLVER.MAX_ITER": 2000, "TRAIN.SNAPSHOT_ITERS": 5,
                                       "TRACKING.FLUSH_TIMEOUT_S": 5})
    with open(err_path, "w") as err:
        proc = subprocess.Popen(trainer_cmd(*args), cwd=work, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 240
        while not (work / "output" / "model_iter4.pth").exists():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-2000:]
            time.sleep(0.05)
        while work.exists():  # the trainer may write a file into it meanwhile: rm -rf again
            shutil.rmtree(work, ignore_errors=True)
        assert proc.wait(timeout=240) == 1  # a fault: OUTPUT_DIR is gone
    finally:
        proc.kill()
    stderr = err_path.read_text()
    assert "SQLAlchemy database error" not in stderr and len(stderr.splitlines()) < 120, stderr[-3000:]
    assert "No such file or directory" in stderr.strip().splitlines()[-1]
    assert "output_lock" not in stderr


# ---- the artifact store lost a checkpoint --------------------------------------------------------------

def test_a_finished_job_whose_model_final_is_gone_from_the_store_trains_its_last_iterations_again(tmp_path, data_dir):
    """The red team's: a finished job rerun on an empty machine, its model_final lost from the
    artifact store (a lifecycle rule, a GC), said "nothing to do" and left OUTPUT_DIR empty."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    keys = {"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "lost", "SOLVER.MAX_ITER": 4, "TRAIN.SNAPSHOT_ITERS": 2,
            "TEST.DATASETS": "()", "TRACKING.LOG_MODEL": "false", "TRACKING.FLUSH_TIMEOUT_S": 120}
    first = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (stored,) = (tmp_path / "mlruns").rglob("checkpoints/model_final.pth")
    stored.unlink()
    shutil.rmtree(tmp_path / "output")  # another machine
    again = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "has no such file: the tag goes" in again.stderr  # the run no longer claims it
    assert re.search(r"resuming from run \w+ \(model_iter1\.pth\) at iteration 2", again.stderr), again.stderr[-2000:]
    assert (tmp_path / "output" / "model_final.pth").is_file() and stored.is_file()  # back in the store too
    run = only_run(MlflowClient(uri), "lost")
    assert run.info.status == "FINISHED" and run.data.tags[sha_tag("model_final.pth")] == sha256_of(stored)

    # Every checkpoint gone: the job is not trained over from iteration 0 in its run, it stops and says why.
    for path in (tmp_path / "mlruns").rglob("checkpoints/*.pth"):
        path.unlink()
    shutil.rmtree(tmp_path / "output")
    lost = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path)
    assert lost.returncode == 2, lost.stderr[-2000:]
    assert "has checkpoints (model_iter1.pth" in lost.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "output" / "model_final.pth").exists()
