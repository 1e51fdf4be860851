"""Two CPU processes under real torchrun (gloo): a run, and a resume that restores every rank."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import DEMO, demo_overrides, kill_tree, run_trainer, run_tree
from tests.faultkit import Job, wait_until
from tests.servers import free_port
from trainer.checkpoint.state import load as load_checkpoint


def torchrun(args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "trainer", "train", "--config", str(DEMO), *args]
    return run_tree(cmd, timeout=600, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_config_for_several_gpus_run_in_one_process_says_its_batch_is_smaller(tmp_path, data_dir):
    """Detectron's zoo configs say NUM_GPUS 8, and Detectron used 8 GPUs in one process: here one
    process is one GPU, so each iteration takes an eighth of the images the schedule was made for.
    It trained so without a word. Found by the Detectron review of 2026-12-03."""
    args = demo_overrides(tmp_path, data_dir, **{"NUM_GPUS": 8, "TRACKING.ENABLED": "false"})
    plan = run_trainer(["--dry-run", *args], cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert ("NUM_GPUS 8, but this job is one process: each iteration takes 2 images (TRAIN.IMS_PER_BATCH), not "
            "the 16 its schedule") in plan.stderr and "--nproc-per-node 8" in plan.stderr
    one = run_trainer(["--dry-run", *args, "NUM_GPUS", "1"], cwd=tmp_path)
    assert one.returncode == 0 and "NUM_GPUS" not in one.stderr, one.stderr


def test_two_process_run_then_resume_restores_every_rank(tmp_path, data_dir):
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 6, "TRAIN.SNAPSHOT_ITERS": 4,
                                                 "TRACKING.ENABLED": "false", "DETERMINISTIC": "true"})
    first = torchrun(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "output"
    # NUM_GPUS follows the world size: checkpoints every SNAPSHOT_ITERS // NUM_GPUS = 2 iterations.
    assert sorted(p.name for p in out.glob("*.pth")) == ["model_final.pth", "model_iter1.pth", "model_iter3.pth"]
    assert "NUM_GPUS set to the world size, 2" in first.stderr
    straight = load_checkpoint(out / "model_final.pth")["model"]
    assert load_checkpoint(out / "model_final.pth")["config"]["NUM_GPUS"] == 2

    (out / "model_final.pth").unlink()  # as if killed after its model_iter
    resumed = torchrun(args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at iteration 4" in resumed.stderr
    again = load_checkpoint(out / "model_final.pth")["model"]
    # Equal only if both ranks restored weights, optimizer state, RNG and sampler position.
    assert all(torch.equal(straight[k], again[k]) for k in straight)


def test_a_fine_tune_whose_parent_is_gone_resumes_every_rank_from_its_run_on_another_machine(tmp_path, data_dir):
    """Under torchrun the ranks other than 0 read TRAIN.WEIGHTS during their own checks, where no run
    lookup answers: on a new machine (an empty OUTPUT_DIR) with the parent archived they stopped the
    job although rank 0 resumed from the run. They now load the weights only when rank 0's start
    point says the job starts from iteration 0."""
    from mlflow import MlflowClient

    parent_dir = tmp_path / "parent"
    parent_dir.mkdir()
    made = run_trainer(demo_overrides(parent_dir, data_dir, **{"SOLVER.MAX_ITER": 2, "TRACKING.ENABLED": "false"}),
                       cwd=parent_dir)
    assert made.returncode == 0, made.stderr[-2000:]
    parent = (parent_dir / "output" / "model_final.pth").rename(tmp_path / "parent.pth")
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    keys = {"SOLVER.MAX_ITER": 6, "TRAIN.SNAPSHOT_ITERS": 4, "DETERMINISTIC": "true", "TRAIN.WEIGHTS": str(parent),
            "TRACKING.URI": uri, "TEST.DATASETS": "[]"}
    first = tmp_path / "first"
    first.mkdir()
    done = torchrun(demo_overrides(first, data_dir, **keys), first)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(uri)
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    assert any(k.startswith("tracktron.ckpt.model_iter") for k in run.data.tags)  # the first is never superseded
    client.delete_tag(run.info.run_id, "tracktron.ckpt.model_final.pth.sha256")  # as if killed after its model_iter
    parent.rename(tmp_path / "archived.pth")
    second = tmp_path / "second"  # nothing local: the tracking store only
    second.mkdir()
    resumed = torchrun(demo_overrides(second, data_dir, **keys), second)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from run {run.info.run_id} (model_iter" in resumed.stderr
    a, b = (load_checkpoint(d / "output" / "model_final.pth")["model"] for d in (first, second))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed ranks ended elsewhere than the uninterrupted job"


def test_a_job_refused_at_its_folder_lock_says_why_on_every_rank(tmp_path, data_dir):
    """helper-52's red team: under torchrun, rank 0 refused (OUTPUT_DIR in use by another trainer),
    torchrun's agent stopped rank 1 with SIGTERM, and rank 1 said "the job resumes from its last
    checkpoint", where nothing had started. A stop before training began says so."""
    from trainer.output_lock import OutputLock

    out = tmp_path / "output"
    out.mkdir()
    lock = OutputLock(out).acquire()  # another trainer of this folder
    try:
        refused = torchrun(demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 2, "TRACKING.ENABLED": "false"}),
                           tmp_path)
    finally:
        lock.release()
    assert refused.returncode != 0
    assert f"error: OUTPUT_DIR {out} is in use by another trainer" in refused.stderr, refused.stderr[-3000:]
    assert "resumes from its last checkpoint" not in refused.stderr, refused.stderr[-3000:]
    assert not list(out.glob("*.pth"))


def test_a_torchrun_job_whose_output_dir_is_moved_stops_every_rank_in_one_line(tmp_path, data_dir):
    """Row 223 under torchrun: OUTPUT_DIR a link re-pointed while the job trains. Rank 0 alone holds
    the lock and checks it; its answer is broadcast, so every rank stops at the same checkpoint in
    one line (rank 1 died in the next collective with a gloo traceback before), nothing written
    into the new folder."""
    (tmp_path / "r1").mkdir()
    (tmp_path / "r2").mkdir()
    (tmp_path / "cur").symlink_to("r1")
    args = demo_overrides(tmp_path, data_dir, **{"OUTPUT_DIR": tmp_path / "cur", "SOLVER.MAX_ITER": 400,
                                                 "TRACKING.ENABLED": "false"})
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "--no-python")
    job = Job(args, tmp_path, env={"OMP_NUM_THREADS": "1"}, launcher=launcher)
    try:
        wait_until(lambda: (tmp_path / "r1" / "model_iter2.pth").exists(), job, "its third checkpoint")
        (tmp_path / "next").symlink_to("r2")
        os.replace(tmp_path / "next", tmp_path / "cur")
        code = job.wait(240)
    finally:
        if job.proc.poll() is None:
            kill_tree(job.pid)  # torchrun's workers: sessions of their own
    assert code != 0
    line = f"error: OUTPUT_DIR {tmp_path / 'cur'} is no longer the folder this job locked"
    assert job.stderr.count(line) == 2, job.stderr[-3000:]  # each rank, in one line
    assert "/trainer/" not in job.stderr, job.stderr[-3000:]  # no traceback of ours
    assert "exitcode  : 2 " in job.stderr and "exitcode  : 1 " not in job.stderr, job.stderr[-2000:]
    assert not list((tmp_path / "r2").iterdir())
    assert (tmp_path / "r1" / "model_iter2.pth").exists()


def test_a_test_image_one_rank_cannot_read_stops_every_rank_with_its_line(tmp_path, data_dir):
    """A test image whose pixels are broken (its header passed the check at start) in rank 1's shard of
    the final evaluation: every rank stops with that image's line, and the run is FAILED with it, not
    with rank 0's "Connection closed by peer" from the collective rank 1 left."""
    from mlflow import MlflowClient

    from tests.faultkit import garble_image_data

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    image = sorted((data / "synth_shapes" / "val" / "images").iterdir())[1]  # rank 1's shard: 1::2
    garble_image_data(image)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = torchrun(demo_overrides(tmp_path, data, **{"SOLVER.MAX_ITER": 4, "TRACKING.URI": uri,
                                                      "DATA_LOADER.NUM_THREADS": 1}), tmp_path)
    assert done.returncode != 0
    line = (f"error: cannot decode image {image}: cannot decode the image (broken data stream when reading image "
            "file) (model_final.pth is saved; once the test set is fixed, the same command evaluates it into the run)")
    errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]  # each rank's, but torchrun may stop
    assert line in errors and set(errors) == {line}, done.stderr[-3000:]  # rank 0 once rank 1 has exited
    assert "Connection closed by peer" not in done.stderr
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED" and run.data.tags["tracktron.status_reason"] == line.removeprefix("error: ")


def test_weights_on_the_first_nodes_disk_alone_train_every_node(tmp_path, data_dir):
    """Two torchrun nodes, TRAIN.WEIGHTS a file on the first one's disk only (a path relative to its
    working folder): the second node's rank loaded the file itself and failed once training started
    (2026-12-04's open point). It now starts from rank 0's weights, which DDP broadcasts."""
    parent_dir = tmp_path / "parent"
    parent_dir.mkdir()
    made = run_trainer(demo_overrides(parent_dir, data_dir, **{"SOLVER.MAX_ITER": 1, "TRACKING.ENABLED": "false"}),
                       cwd=parent_dir)
    assert made.returncode == 0, made.stderr[-2000:]
    port, nodes = free_port(), []
    for rank in (0, 1):
        folder = tmp_path / f"node{rank}"
        folder.mkdir()
        if rank == 0:
            shutil.copy(parent_dir / "output" / "model_final.pth", folder / "parent.pth")
        args = demo_overrides(folder, data_dir, **{"SOLVER.MAX_ITER": 2, "TRAIN.WEIGHTS": "parent.pth",
                                                   "TRACKING.ENABLED": "false", "TEST.DATASETS": "[]"})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "trainer", "train", "--config", str(DEMO), *args]
        nodes.append(subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        results = [node.communicate(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node.pid)
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    assert "weights parent.pth: loaded" in results[0][1]
    assert not (tmp_path / "node1" / "parent.pth").exists()
    assert (tmp_path / "node0" / "output" / "model_final.pth").is_file()


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "two"}, "torchrun environment: WORLD_SIZE='two' is not an integer"),
    ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "do not fit"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "WORLD_SIZE > 1 needs MASTER_ADDR and a MASTER_PORT of 1 to 65535"),
    ({"LOCAL_RANK": "-1"}, "do not fit"),
    ({"LOCAL_RANK": str(10**20), "LOCAL_WORLD_SIZE": "0"}, "do not fit"),  # trained on the CPU; cuda.set_device after the run
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, "got 'http'"),
    # torch's own check came only at the join, after the run was made (left FAILED in a new store)
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "got '99999'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "\u00b2"}, "MASTER_PORT of 1 to 65535"),
])
def test_a_malformed_torchrun_environment_is_one_line_before_any_run_exists(tmp_path, data_dir, env, message):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    result = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri}), cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert message in lines[-1] and lines[-1].startswith("error: ") and "Traceback" not in result.stderr
    assert not (tmp_path / "store.db").exists()  # no run made, so none left RUNNING
    assert not (tmp_path / "output").exists()


def _with_a_star(data_dir, to):
    """A copy of the synthetic data with a fourth category (in the training and the test set, so
    that the rank given it passes its own checks)."""
    shutil.copytree(data_dir, to)
    for ann in to.glob("synth_shapes/*/annotations.json"):
        data = json.loads(ann.read_text())
        data["categories"].append({**data["categories"][0], "id": 4, "name": "star"})
        ann.write_text(json.dumps(data))


def _without_an_image(data_dir, to):
    """A copy of the synthetic data whose training set has one image fewer."""
    shutil.copytree(data_dir, to)
    ann = next(to.glob("synth_shapes/train*/annotations.json"))
    data = json.loads(ann.read_text())
    gone = data["images"].pop()["id"]
    data["annotations"] = [a for a in data["annotations"] if a["image_id"] != gone]
    ann.write_text(json.dumps(data))


@pytest.mark.parametrize("weights, override, differ", [
    ("w$LOCAL_RANK.pth", "", "--weights"),  # one score of two models' detections
    ("w0.pth", "TEST.SCALE $((128 + LOCAL_RANK * 32))", "TEST.SCALE"),  # rank 1's shard at another size
], ids=["weights", "test-scale"])
def test_eval_ranks_with_other_weights_or_settings_stop_in_one_line(tmp_path, data_dir, weights, override, differ):
    """`tracktron eval` under torchrun merged every rank's detections into one score, logged into the
    run of a runs:/ checkpoint, without checking that the ranks evaluated the same thing: rank 1 with
    other weights or another TEST.SCALE moved the AP. Found by the red team of 2026-12-03 (third)."""
    from trainer.config import load_config
    from trainer.models import build_model

    cfg = load_config(DEMO, ["DATA_DIR", str(data_dir)])
    for seed in (0, 1):
        torch.manual_seed(seed)
        torch.save(build_model(cfg, 4).state_dict(), tmp_path / f"w{seed}.pth")
    words = " ".join(f"'{a}'" for a in [sys.executable, "-m", "trainer", "eval", "--config", str(DEMO)])
    rest = " ".join(f"'{a}'" for a in ["DATA_DIR", str(data_dir), "OUTPUT_DIR", str(tmp_path / "out"),
                                       "TRACKING.ENABLED", "false"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--no-python", "sh", "-c", f"exec {words} --weights {tmp_path}/{weights} {rest} {override}"]
    result = run_tree(cmd, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "| bbox |" not in result.stdout
    message = f"error: rank 1 was started with another config than rank 0 ({differ} differ)"
    assert result.stderr.count(message) == 2, result.stderr[-3000:]
    assert "exitcode  : 2 " in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("override, message", [
    # another SOLVER.MAX_ITER waited in a collective forever, another BASE_LR trained at its own, silently
    ("SOLVER.BASE_LR 0.00$((LOCAL_RANK + 1))", "another config than rank 0 (SOLVER.BASE_LR differ)"),
    # rank 1 evaluated after iteration 3 alone (TEST is no part of the job's hash): a collective no other rank joins
    ("TEST.EVAL_PERIOD $((LOCAL_RANK * 3))", "another config than rank 0 (TEST.EVAL_PERIOD differ)"),
    # a checkpoint gathers every rank's RNG states: a rank checkpointing at another cadence waits alone
    ("TRAIN.SNAPSHOT_ITERS $((LOCAL_RANK + 2))", "another config than rank 0 (TRAIN.SNAPSHOT_ITERS differ)"),
    # DATA_DIR is each node's own: rank 1's set has a category more (DDP's model mismatch, or other labels silently)
    ("DATA_DIR {tmp}/data$LOCAL_RANK", "other training data than rank 0 (categories, num_classes differ)"),
    # a node whose copy of the data is short: its sampler shards another list, so ranks train on overlapping images
    ("DATA_DIR {tmp}/data$LOCAL_RANK", "other training data than rank 0 (images differ)"),
], ids=["base-lr", "eval-period", "snapshot-iters", "categories", "images"])
def test_ranks_started_with_different_configs_stop_before_training_and_fail_the_run(tmp_path, data_dir, override,
                                                                                     message):
    """Each rank gets its own overrides (a launcher script gone wrong) or its own data: every rank
    stops at the join with the same line, before training."""
    if override.startswith("DATA_DIR"):
        shutil.copytree(data_dir, tmp_path / "data0")
        (_with_a_star if "categories" in message else _without_an_image)(data_dir, tmp_path / "data1")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 6, "TRACKING.URI": uri})
    words = " ".join(f"'{a}'" for a in [sys.executable, "-m", "trainer", "train", "--config", str(DEMO), *args])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--no-python", "sh", "-c", f"exec {words} {override.format(tmp=tmp_path)}"]
    result = run_tree(cmd, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    message = f"rank 1 was started with {message}"
    assert result.stderr.count(f"error: {message}") == 2, result.stderr[-3000:]  # each rank says it, in one line
    # exit status 2 (torchrun's summary), on every rank: the slower one was stopped by torchrun's SIGTERM (-15)
    # while its interpreter tore down
    assert "exitcode  : 2 " in result.stderr, result.stderr[-2000:]
    assert "exitcode  : 1 " not in result.stderr and "exitcode  : -15 " not in result.stderr, result.stderr[-2000:]
    assert "/trainer/" not in result.stderr  # no traceback of ours (torchrun prints its own ChildFailedError)
    assert not list((tmp_path / "output").glob("*.pth"))
    from mlflow import MlflowClient

    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("demo").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["tracktron.status_reason"].startswith(message)


def test_sigterm_stops_a_join_whose_other_processes_never_come_and_the_run_is_killed(tmp_path, data_dir):
    """Rank 0 of two, with no rank 1 ever: torch waits 30 minutes for it in C++, where no signal
    handler runs, so a cancelled job (SIGTERM) kept waiting and left its run RUNNING."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    job = Job(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri}), tmp_path, env=env)
    try:
        wait_until(lambda: "joining the job's 2 processes" in job.stderr, job, "the join")
        time.sleep(1.0)  # well inside torch's wait
        sent = time.monotonic()
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(60) == 128 + signal.SIGTERM, job.stderr[-3000:]
    finally:
        job.kill_group()
    assert time.monotonic() - sent < 20  # not torch's 30 minutes, nor the grace period's watchdog
    assert "Traceback" not in job.stderr and "stopped by SIGTERM" in job.last_line, job.stderr[-3000:]
    from mlflow import MlflowClient

    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("demo").experiment_id])
    assert run.info.status == "KILLED"  # not left RUNNING: the next start resumes it


def _workers(launcher: int) -> dict[int, int]:
    """torchrun's worker processes by RANK."""
    found = {}
    for task in os.listdir(f"/proc/{launcher}/task"):
        for pid in open(f"/proc/{launcher}/task/{task}/children").read().split():
            env = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
            if "RANK" in env:
                found[int(env["RANK"])] = int(pid)
    return found


def test_sigterm_to_a_rank_stuck_in_a_collective_exits_at_the_grace_period_and_the_run_is_killed(tmp_path, data_dir):
    """Rank 1 stops answering (SIGSTOP: a hung GPU, a dead host), so rank 0 waits in a collective, in
    C++, where Python runs no signal handler. torchrun or Kubernetes then sends it SIGTERM: it kept
    waiting until SIGKILL, and its run stayed RUNNING. The signal now reaches a watch thread."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 100_000, "TRAIN.SNAPSHOT_ITERS": 100_000,
                                                 "LOG_PERIOD": 1, "TRAIN.PREEMPT_GRACE_S": 6, "TRACKING.URI": uri})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "trainer", "train", "--config", str(DEMO), *args]
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        launcher = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=err, start_new_session=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks = {}
    try:
        end = time.monotonic() + 240
        while (tmp_path / "stdout").read_text().count("json_stats") < 3:
            assert launcher.poll() is None and time.monotonic() < end, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.2)
        ranks = _workers(launcher.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(1.5)  # rank 0 is in the next iteration's collective by now
        sent = time.monotonic()
        os.kill(ranks[0], signal.SIGTERM)
        while os.path.exists(f"/proc/{ranks[0]}") and open(f"/proc/{ranks[0]}/stat").read().split(") ")[1][0] != "Z":
            assert time.monotonic() - sent < 30, "rank 0 still running 30 s after SIGTERM"
            time.sleep(0.1)
        took = time.monotonic() - sent
    finally:  # torchrun starts each rank in a session of its own: the launcher's group is not theirs
        for pid in [*ranks.values(), launcher.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert 5 < took < 11, f"rank 0 exited {took:.1f}s after SIGTERM (grace period 6 s)"  # not before it; torch's exit is slow
    assert "grace period of 6s over: exiting now" in stderr
    from mlflow import MlflowClient

    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("demo").experiment_id])
    assert run.info.status == "KILLED", stderr[-3000:]
    assert run.data.tags["tracktron.status_reason"] == "stopped by SIGTERM: still running when its 6s grace period ended"


@pytest.mark.parametrize("env, gpus, refused", [
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 1, "2 processes on this node, but it has 1 GPU visible"),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, 2, "start at most torchrun --nproc-per-node 2"),  # rank 0 too
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "3"}, 1, r"1 GPU visible \(CUDA_VISIBLE_DEVICES='3'\)"),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2, None),
    ({}, 1, None),
])
def test_more_processes_on_a_node_than_it_has_gpus_is_refused_on_every_rank(monkeypatch, env, gpus, refused):
    """Written for the first H200 session: torchrun --nproc-per-node 2 on a one-GPU node reached rank 1's
    cuda.set_device(1) ("invalid device ordinal") only at the join, after rank 0 had made the run, which
    torchrun then killed. Unit test of the check alone; bench/gpu_checks.py (more_ranks_than_gpus)
    ran it on the H200: one error line, no run."""
    from trainer import distributed
    from trainer.errors import UserError

    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if refused is None:
        distributed.check_devices()
    else:
        with pytest.raises(UserError, match=refused):
            distributed.check_devices()
