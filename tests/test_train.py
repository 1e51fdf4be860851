"""The trainer end to end, as a user runs it: real processes, real files, the embedded sqlite store."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import DEMO, demo_overrides, run_trainer, trainer_cmd
from tests.servers import FileServer
from trainer.checkpoint.files import remove_stale_temps
from trainer.hashing import sha256_of
from trainer.checkpoint.state import load as load_checkpoint, save_atomic
from trainer.engine import NonFiniteLoss, check_finite


def json_stats(output):
    return [json.loads(line) for line in (output / "json_stats.log").read_text().splitlines()]


def test_demo_job_trains_checkpoints_and_a_rerun_has_nothing_to_do(tmp_path, data_dir):
    args = demo_overrides(tmp_path, data_dir)
    first = run_trainer(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "output"
    # SNAPSHOT_ITERS 3: after iterations 2 and 5 (Detectron's zero-based names); 7 is the final one.
    assert sorted(p.name for p in out.glob("*.pth")) == ["model_final.pth", "model_iter2.pth", "model_iter5.pth"]
    assert [e["iter"] for e in json_stats(out)] == [0, 4, 7]
    assert "json_stats: {" in first.stdout
    assert "parameters:" in (out / "model.txt").read_text()
    final = load_checkpoint(out / "model_final.pth")
    assert final["iteration"] == 7 and final["sampler"]["next_iter"] == 8
    assert set(final) >= {"model", "optimizer", "scheduler", "scaler", "config", "rng"}
    assert (tmp_path / "mlflow.db").exists()  # the embedded default tracking store

    stamp = (out / "model_final.pth").stat().st_mtime_ns
    again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout
    assert (out / "model_final.pth").stat().st_mtime_ns == stamp


def _kill_after(cmd, cwd, marker, timeout=240):
    """Start the trainer, SIGKILL it as soon as `marker` exists (a complete checkpoint)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, "the trainer ended before the checkpoint to kill it at"
        assert time.monotonic() < end
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def final_weights(output):
    return load_checkpoint(output / "model_final.pth")["model"]


def _uninterrupted(tmp_path, data_dir, keys: dict):
    """The job trained without a stop (untracked) in tmp_path/a, beside tmp_path/b for the one a
    test stops: the weights the stopped one must end with."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = run_trainer(demo_overrides(tmp_path / "a", data_dir, **{**keys, "TRACKING.ENABLED": "false"}),
                           cwd=tmp_path / "a")
    assert straight.returncode == 0, straight.stderr
    return tmp_path / "a" / "output"


def test_killed_job_resumes_to_bit_identical_weights(tmp_path, data_dir):
    keys = dict(DETERMINISTIC="true", **{"SOLVER.MAX_ITER": 14, "TRAIN.SNAPSHOT_ITERS": 4,
                                         "TRACKING.ENABLED": "false", "DATA_LOADER.NUM_THREADS": 1})
    straight = _uninterrupted(tmp_path, data_dir, keys)
    args = demo_overrides(tmp_path / "b", data_dir, **keys)
    out = tmp_path / "b" / "output"
    _kill_after(trainer_cmd(*args), tmp_path / "b", out / "model_iter3.pth")
    assert not (out / "model_final.pth").exists()
    resumed = run_trainer(args, cwd=tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr

    a, b = final_weights(straight), final_weights(out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    iters = [e["iter"] for e in json_stats(out)]
    assert iters == sorted(set(iters)) == [e["iter"] for e in json_stats(straight)]


def test_a_job_continues_in_its_run_with_another_snapshot_iters(tmp_path, data_dir):
    """TRAIN.SNAPSHOT_ITERS changed between starts (a killed job moved to a preemptible host, which
    checkpoints more often) was "another job": its checkpoints and its run refused. It is no part of
    the job now: the job continues in its run, checkpoints at the new cadence, and ends with the
    uninterrupted job's weights. A run tagged by an earlier tracktron (whose hash held the key) is
    still found, and retagged. Found by the red team of 2026-12-03 (second)."""
    from mlflow import MlflowClient

    from trainer.config import load_config
    from trainer.job_identity import job_hash, job_hashes

    keys = dict(DETERMINISTIC="true", **{"SOLVER.MAX_ITER": 14, "TRAIN.SNAPSHOT_ITERS": 4,
                                         "DATA_LOADER.NUM_THREADS": 1})
    straight = _uninterrupted(tmp_path, data_dir, keys)
    uri = f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"
    args = demo_overrides(tmp_path / "b", data_dir, **keys, **{"TRACKING.URI": uri})
    out = tmp_path / "b" / "output"
    _kill_after(trainer_cmd(*args), tmp_path / "b", out / "model_iter3.pth")
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    cfg = load_config(DEMO, args)
    client.set_tag(run.info.run_id, "tracktron.job", job_hashes(cfg)[1])  # as tracktron tagged it until now

    _kill_after(trainer_cmd(*args), tmp_path / "b", out / "model_iter7.pth")
    assert client.get_run(run.info.run_id).data.tags["tracktron.job"] == job_hash(cfg)
    other = run_trainer(args + ["TRAIN.SNAPSHOT_ITERS", "5"], cwd=tmp_path / "b")  # model_iter9, not 11
    assert other.returncode == 0, other.stderr[-3000:]
    assert "resuming from" in other.stderr and "another job" not in other.stderr
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert {p.name for p in out.glob("*.pth")} == {"model_iter3.pth", "model_iter7.pth", "model_iter9.pth",
                                                   "model_final.pth"}
    finished = client.get_run(run.info.run_id)
    assert finished.info.status == "FINISHED" and "tracktron.ckpt.model_iter9.pth.sha256" in finished.data.tags
    a, b = final_weights(straight), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"


def _parent_weights(tmp_path, data_dir):
    """tmp_path/parent.pth: the model_final of a 2-iteration job, to fine-tune from."""
    (tmp_path / "p").mkdir()
    done = run_trainer(demo_overrides(tmp_path / "p", data_dir, **{"SOLVER.MAX_ITER": 2, "TRACKING.ENABLED": "false"}),
                       cwd=tmp_path / "p")
    assert done.returncode == 0, done.stderr[-2000:]
    return (tmp_path / "p" / "output" / "model_final.pth").rename(tmp_path / "parent.pth")


def test_a_fine_tune_resumes_after_its_parent_weights_are_gone(tmp_path, data_dir):
    """A job fine-tuned from TRAIN.WEIGHTS, killed after a checkpoint, whose parent file was then
    archived (or whose models:/name@alias was moved): the rerun refused the missing weights, and
    --no-resume threw the progress away. Its checkpoints hold its weights: it resumes to the
    uninterrupted job's weights, as Detectron, whose resume never reads TRAIN.WEIGHTS. Found by the
    red team of 2026-12-03 (third)."""
    parent = _parent_weights(tmp_path, data_dir)
    keys = dict(DETERMINISTIC="true", **{"SOLVER.MAX_ITER": 10, "TRAIN.SNAPSHOT_ITERS": 4, "TRACKING.ENABLED": "false",
                                         "TRAIN.WEIGHTS": str(parent)})
    straight = _uninterrupted(tmp_path, data_dir, keys)
    args = demo_overrides(tmp_path / "b", data_dir, **keys)
    out = tmp_path / "b" / "output"
    _kill_after(trainer_cmd(*args), tmp_path / "b", out / "model_iter3.pth")
    parent.rename(tmp_path / "archived.pth")
    plan = run_trainer(["--dry-run", *args], cwd=tmp_path / "b")
    assert plan.returncode == 0 and "model_iter3.pth: resumes at iteration 4" in plan.stdout, plan.stdout + plan.stderr
    resumed = run_trainer(args, cwd=tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "TRAIN.WEIGHTS" not in resumed.stderr  # not read: not said
    a, b = final_weights(straight), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    fresh = run_trainer(demo_overrides(tmp_path / "c", data_dir, **keys), cwd=tmp_path)  # nothing to resume
    assert fresh.returncode == 2 and f"TRAIN.WEIGHTS {parent}: no such file" in fresh.stderr.splitlines()[-1]


def test_two_parents_at_urls_with_a_port_and_an_at_sign_are_two_jobs(tmp_path, data_dir):
    """`http://host:port/a/parent@v1.pth` was taken for a password typed with a `/` (`host:port/a/parent`)
    and hidden: every such parent was `http://***@v1.pth`, so a fine-tune of another parent found the
    first one's finished run ("nothing to do") and got its model; the run's TRAIN.WEIGHTS said
    `***`, and a job started before the redaction was not found again (helper-67's red team).
    A weights URL carries no credentials (they are refused), so it is kept whole."""
    parent = _parent_weights(tmp_path, data_dir)
    served = tmp_path / "served"
    for folder, scale in (("a", 1.0), ("b", 1.01)):
        state = torch.load(parent, weights_only=True)
        state["model"] = {k: v * scale if v.is_floating_point() else v for k, v in state["model"].items()}
        (served / folder).mkdir(parents=True)
        torch.save(state, served / folder / "parent@v1.pth")
    server = FileServer(served)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"TRACKTRON_CACHE": str(tmp_path / "cache"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    urls = {name: f"{server.url}/{name}/parent@v1.pth" for name in ("a", "b")}
    try:
        for name, url in urls.items():
            done = run_trainer(demo_overrides(tmp_path / name, data_dir, **{"SOLVER.MAX_ITER": 3, "TRACKING.URI": uri,
                                                                             "TRAIN.WEIGHTS": url}),
                               cwd=tmp_path, env=env)
            assert done.returncode == 0, done.stderr[-3000:]
            assert "nothing to train" not in done.stderr and "already exists" not in done.stderr, done.stderr[-3000:]
    finally:
        server.stop()
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert sorted(r.data.params["TRAIN.WEIGHTS"] for r in runs) == sorted(urls.values())
    assert all(r.info.status == "FINISHED" for r in runs)


def test_a_resume_on_another_image_list_says_its_batches_differ(tmp_path, data_dir):
    """A job resumed on a training set that changed since its checkpoint (an annotation file edited;
    a tracktron that drops other boxes, as helper-67 found across versions) silently trained on other
    batches than the uninterrupted job: not bit-identical, and nothing said. The checkpoint keeps
    its image list's count and digest; a resume on another says so, and one on the same is silent."""
    import shutil

    edited = tmp_path / "edited-data"
    shutil.copytree(data_dir, edited)
    annotations = edited / "synth_shapes" / "train" / "annotations.json"
    data = json.loads(annotations.read_text())
    data["annotations"] = [a for a in data["annotations"] if a["image_id"] != 1]  # image 1 is no longer trained on
    annotations.write_text(json.dumps(data))
    said = "the training set is not the image list this checkpoint was trained on"
    out = tmp_path / "output"
    first = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.ENABLED": "false"}), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    for data_root, differs in ((data_dir, False), (edited, True)):
        for name in ("model_final.pth", "model_iter5.pth"):  # killed after model_iter2, as it were
            (out / name).unlink()
        done = run_trainer(demo_overrides(tmp_path, data_root, **{"TRACKING.ENABLED": "false"}), cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resuming from" in done.stderr and (said in done.stderr) == differs, done.stderr[-3000:]
    assert f"({len(data['images'])} images then, {len(data['images']) - 1} now" in done.stderr


def test_checkpoints_that_do_not_load_are_no_resume_and_missing_weights_stop_the_job_before_its_run(tmp_path,
                                                                                                  data_dir):
    """OUTPUT_DIR holds only checkpoints that do not load (a full disk, a torn copy): the job starts
    from iteration 0, so it needs its TRAIN.WEIGHTS. Their existence was taken for a resume, the
    missing weights were not checked, and the job made a new store and run, then failed it.
    Found by the red team of 2026-12-03 (sixth session)."""
    out = tmp_path / "output"
    out.mkdir()
    torn = os.urandom(1000)
    (out / "model_iter5.pth").write_bytes(torn)
    gone = tmp_path / "gone.pth"
    args = demo_overrides(tmp_path, data_dir, **{"TRAIN.WEIGHTS": str(gone)})
    for extra in (["--dry-run"], []):
        done = run_trainer([*extra, *args], cwd=tmp_path)
        assert done.returncode == 2 and f"TRAIN.WEIGHTS {gone}: no such file" in done.stderr.splitlines()[-1], \
            done.stdout + done.stderr[-2000:]
    assert not (tmp_path / "mlflow.db").exists(), "a job that failed its checks made a tracking store"
    assert (out / "model_iter5.pth").read_bytes() == torn


def test_a_fine_tune_whose_parent_is_gone_resumes_from_its_run_on_another_machine(tmp_path, data_dir):
    """The same on a new machine, whose OUTPUT_DIR is empty: the job's checkpoints are in its run
    alone. The weights were checked before the run lookup said the job resumes, so the rerun exited
    2 on the missing parent. Found by the red team of 2026-12-03 (third)."""
    from mlflow import MlflowClient

    parent = _parent_weights(tmp_path, data_dir)
    keys = dict(DETERMINISTIC="true", **{"SOLVER.MAX_ITER": 16, "TRAIN.SNAPSHOT_ITERS": 4, "TRAIN.WEIGHTS": str(parent),
                                         "TRACKING.EXPERIMENT": "fine-tune"})
    straight = _uninterrupted(tmp_path, data_dir, keys)
    tracked = {**keys, "TRACKING.URI": f"sqlite:///{tmp_path / 'shared.db'}"}
    first = tmp_path / "b"
    done = run_trainer(demo_overrides(first, data_dir, **tracked), cwd=first)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(tracked["TRACKING.URI"])
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert any(k.startswith("tracktron.ckpt.model_iter") for k in run.data.tags)  # the first is never superseded
    client.delete_tag(run.info.run_id, "tracktron.ckpt.model_final.pth.sha256")  # as if killed after its model_iter
    parent.rename(tmp_path / "archived.pth")
    second = tmp_path / "c"  # nothing local: the tracking store only
    second.mkdir()
    args = demo_overrides(second, data_dir, **tracked)
    plan = run_trainer(["--dry-run", *args], cwd=second)
    assert plan.returncode == 0 and "continues run" in plan.stdout, plan.stdout + plan.stderr
    resumed = run_trainer(args, cwd=second)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from run" in resumed.stderr and "TRAIN.WEIGHTS" not in resumed.stderr
    a, b = final_weights(straight), final_weights(second / "output")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"


def test_partial_newest_checkpoint_is_skipped(tmp_path, data_dir):
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 6, "TRACKING.ENABLED": "false"})
    out = tmp_path / "output"
    _kill_after(trainer_cmd(*args), tmp_path, out / "model_iter2.pth")
    good = (out / "model_iter2.pth").read_bytes()
    (out / "model_iter9.pth").write_bytes(good[: len(good) // 2])  # a torn, newer-looking file
    resumed = run_trainer(args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "skipping unusable checkpoint" in resumed.stderr
    assert "at iteration 3" in resumed.stderr


def test_a_checkpoint_copied_over_model_final_is_refused_and_the_run_keeps_its_model(tmp_path, data_dir):
    """model_iter2.pth copied over model_final.pth: it passed for the finished job, and a rerun whose
    run lacked model_final uploaded and logged iteration 2 as the job's model (2026-12-04's red team).
    Now one line, exit 2, before anything is sent; the real model_final put back, the rerun is done."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 4, "TRAIN.SNAPSHOT_ITERS": 3,
                                                 "TRACKING.URI": uri, "TRACKING.EXPERIMENT": "copied"})
    out = tmp_path / "output"
    first = run_trainer(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    final = (out / "model_final.pth").read_bytes()
    (out / "model_final.pth").write_bytes((out / "model_iter2.pth").read_bytes())
    for extra in ([], ["--dry-run"]):
        again = run_trainer([*args, *extra], cwd=tmp_path)
        assert again.returncode == 2, again.stderr[-3000:]
        assert again.stderr.strip().splitlines()[-1] == (
            f"error: {out / 'model_final.pth'} holds iteration 2, not the 3 its name says (a file copied or "
            "renamed): move it out of OUTPUT_DIR")
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("copied").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["tracktron.ckpt.model_final.pth.sha256"] == hashlib.sha256(final).hexdigest()
    (out / "model_final.pth").write_bytes(final)
    assert "nothing to do" in run_trainer(args, cwd=tmp_path).stdout


def test_a_rerun_puts_back_a_model_final_gone_from_the_artifact_store(tmp_path, data_dir):
    """The run's model_final.pth deleted from its artifact store (by hand, a lifecycle rule) while
    its sha256 tag stays: the rerun said "nothing to do" and the run kept a tag without its file
    (2026-12-04's red team). Now the tag goes and the local model_final is uploaded again."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 3, "TRACKING.URI": uri,
                                                 "TRACKING.EXPERIMENT": "gone", "TRACKING.LOG_MODEL": "false"})
    first = run_trainer(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (stored,) = [p for p in tmp_path.rglob("model_final.pth") if p.parent.name == "checkpoints"]
    stored.unlink()
    again = run_trainer(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "artifact store has no such file: the tag goes" in again.stderr
    assert stored.read_bytes() == (tmp_path / "output" / "model_final.pth").read_bytes()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gone").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["tracktron.ckpt.model_final.pth.sha256"] == hashlib.sha256(stored.read_bytes()).hexdigest()
    assert "nothing to do" in run_trainer(args, cwd=tmp_path).stdout


def test_nan_loss_stops_the_job_naming_iteration_and_terms(tmp_path, data_dir):
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.BASE_LR": 1e6, "SOLVER.WARM_UP_ITERS": 0,
                                                 "SOLVER.MAX_ITER": 30, "TRAIN.SNAPSHOT_ITERS": 100,
                                                 "TRACKING.ENABLED": "false"})
    result = run_trainer(args, cwd=tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: loss is nan at iteration") or last.startswith("error: loss is inf")
    assert "loss_classifier=" in last
    assert not list((tmp_path / "output").glob("*.pth"))  # no NaN weights saved
    log_txt = (tmp_path / "output" / "log.txt").read_text().splitlines()  # untracked: log.txt is the job's record
    assert " tracktron] started on " in log_txt[0] and log_txt[-1].endswith(f"the job ends FAILED: {last[len('error: '):]}")


def test_check_finite_accepts_numbers_and_rejects_nan_and_inf():
    check_finite({"loss": 1.5, "loss_box_reg": 0.5}, 3)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(NonFiniteLoss, match="at iteration 3"):
            check_finite({"loss": bad}, 3)


@pytest.mark.parametrize("args, message", [
    (["SOLVER.BASE_LRR", "0.1"], "error: unknown config key SOLVER.BASE_LRR (did you mean SOLVER.BASE_LR?)"),
    (["TRAIN.DATASETS", "('coco_2071_train',)"], "error: unknown dataset 'coco_2071_train' (did you mean coco_2017_train?)"),
    (["MODEL.TYPE", "fasterrcnn_resnet51_fpn"], "error: unknown MODEL.TYPE"),
    (["TEST.DATASETS", "('synth_shapes_vall',)"], "error: unknown dataset 'synth_shapes_vall'"),  # before training
    (["MODEL.NUM_CLASSES", "3"], "error: MODEL.NUM_CLASSES 3 is fewer than the dataset's 4"),
    (["TRAIN.IMS_PER_BATCH", "1000000000"], "error: TRAIN.IMS_PER_BATCH 1000000000 is more than the training set's"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, data_dir, args, message):
    result = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.ENABLED": "false"}) + args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "output").glob("*.pth")) and not (tmp_path / "output" / "json_stats.log").exists()


def test_missing_config_file_is_exit_2(tmp_path):
    result = subprocess.run(trainer_cmd(config=tmp_path / "nope.yaml"), cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: config file not found: {tmp_path / 'nope.yaml'}"


def test_old_local_checkpoints_are_pruned_to_checkpoints_keep(tmp_path, data_dir):
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 10, "TRAIN.SNAPSHOT_ITERS": 2,
                                                 "TRAIN.CHECKPOINTS_KEEP": 2, "TRACKING.ENABLED": "false"})
    result = run_trainer(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "output").glob("*.pth"))
    assert names == ["model_final.pth", "model_iter5.pth", "model_iter7.pth"]


def test_another_jobs_checkpoints_in_output_dir_are_left_alone(tmp_path, data_dir):
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 4, "TRACKING.ENABLED": "false"})
    assert run_trainer(args, cwd=tmp_path).returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "output").glob("*.pth")}
    other = run_trainer(args + ["SOLVER.BASE_LR", "0.05"], cwd=tmp_path)
    assert other.returncode == 2
    assert "is from another job (SOLVER.BASE_LR differ)" in other.stderr.strip().splitlines()[-1]
    assert {p.name: p.read_bytes() for p in (tmp_path / "output").glob("*.pth")} == before


def test_the_sha256_of_a_saved_checkpoint_is_that_of_its_bytes(tmp_path):
    """save_atomic hashes the bytes as torch writes them; the tag on the server must still be the
    file's own sha256, or every resume from the server would reject it."""
    state = {"model": {"w": torch.randn(300, 700), "b": torch.arange(5)}, "iteration": 7,
             "big": torch.zeros(3 << 20, dtype=torch.uint8), "rng": {"torch": torch.get_rng_state()}}
    path = tmp_path / "model_iter7.pth"
    assert save_atomic(state, path) == sha256_of(path)
    assert load_checkpoint(path)["iteration"] == 7


def test_leftovers_of_killed_jobs_are_removed_and_those_of_live_ones_kept(tmp_path):
    """Checkpoints' and the job's other files' temporary files (helper-51: `.json_stats.log.tmp.<pid>`
    left by a SIGKILL mid-rewrite stayed for good) and download folders."""
    from trainer.atomic_write import HOST

    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = [tmp_path / f".model_iter5.pth.tmp.{HOST}.{dead.pid}", tmp_path / f".download.{HOST}.{dead.pid}.x1y2",
            *(tmp_path / f".{name}.tmp.{HOST}.{dead.pid}" for name in ("json_stats.log", "config.yaml",
                                                                        "unsent_metrics.json", "model.txt"))]
    kept = [tmp_path / f".model_iter8.pth.tmp.{HOST}.{os.getpid()}", tmp_path / f".download.{HOST}.{os.getpid()}.z3",
            tmp_path / f".json_stats.log.tmp.{HOST}.{os.getpid()}", tmp_path / ".json_stats.log.tmp.1",
            tmp_path / ".download.otherhost.1.q4", tmp_path / "model_iter2.pth", tmp_path / f".notes.txt.tmp.{HOST}.1"]
    (tmp_path / "eval" / "synth_shapes_val").mkdir(parents=True)  # an evaluation killed mid-write (helper-57)
    gone.append(tmp_path / "eval" / "synth_shapes_val" / f".detections.json.tmp.{HOST}.{dead.pid}")
    kept.append(tmp_path / "eval" / "synth_shapes_val" / f".detections.json.tmp.{HOST}.{os.getpid()}")
    # A container's trainer is PID 1 in every life: one killed left a file with this process's pid, older
    # than this process (helper-61: it was kept for good).
    earlier_life = tmp_path / f".model_iter3.pth.tmp.{HOST}.{os.getpid()}"
    gone.append(earlier_life)
    for path in gone + kept:
        if path.name.startswith(".download"):
            path.mkdir()
            (path / "model_iter9.pth").write_bytes(b"half")
        else:
            path.write_bytes(b"half")
    os.utime(earlier_life, (time.time() - 3600, time.time() - 3600))
    assert sorted(remove_stale_temps(tmp_path)) == sorted(gone)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in gone)


def test_a_second_trainer_on_the_same_output_dir_stops_at_once_naming_the_first(tmp_path, data_dir):
    """Two trainers on one OUTPUT_DIR would train into the same files (and run): the second one
    stops before it touches anything. A SIGKILLed first one leaves no stale lock behind."""
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 400, "TRACKING.ENABLED": "false",
                                                 "LOG_PERIOD": 1})
    out = tmp_path / "output"
    first = subprocess.Popen(trainer_cmd(*args), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 240
        while not (out / "json_stats.log").exists():  # the first one is training
            assert first.poll() is None and time.monotonic() < end
            time.sleep(0.05)
        logged = (out / "json_stats.log").read_text()
        second = run_trainer(args, cwd=tmp_path)
        assert second.returncode == 2, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: OUTPUT_DIR {out} is in use by another trainer (host ")
        assert f"pid {first.pid})" in last
        (out / ".lock").unlink()  # deleted by hand: the folder's own lock still keeps them out
        for extra in ([], ["--dry-run"]):
            late = run_trainer([*extra, *args], cwd=tmp_path)
            assert late.returncode == 2, late.stderr
            assert late.stderr.strip().splitlines()[-1].startswith(
                f"error: OUTPUT_DIR {out} is in use by another trainer (another process)")
        assert not (out / ".lock").exists()
        assert (out / "json_stats.log").read_text().startswith(logged)  # the first one's log, not rewritten
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
        first.wait()
    third = run_trainer(["--no-resume", *demo_overrides(tmp_path, data_dir, **{"TRACKING.ENABLED": "false"})],
                        cwd=tmp_path)
    assert third.returncode == 0, third.stderr  # the killed one's lock went with it


def test_dry_run_checks_everything_says_what_it_would_do_and_writes_nothing(tmp_path, data_dir):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri})
    plan = run_trainer(["--dry-run", *args], cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["model", "train", "test", "schedule", "tracking", "output"]
    assert "parameters, from random initialisation" in lines[1] and "64 images" in lines[2]
    assert lines[3] == "test: synth_shapes_val: 16 images; evaluated after model_final"
    assert "8 iterations" in lines[4] and "a checkpoint every 3 iterations (2 model_iter files" in lines[4]
    assert lines[5].endswith("a new store, experiment demo, a new run") and lines[6].endswith("no checkpoint here")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no OUTPUT_DIR, no store

    assert run_trainer(args, cwd=tmp_path).returncode == 0  # the job itself
    again = run_trainer(["--dry-run", *args], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "has model_final: nothing to do" in again.stdout and "model_final.pth is here: nothing to do" in again.stdout

    bad = run_trainer(["--dry-run", *args, "TEST.DATASETS", "('synth_shapes_vall',)"], cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: unknown dataset")


def test_a_job_whose_experiment_was_renamed_in_the_ui_is_found_there(tmp_path, data_dir):
    """The experiment renamed (the UI's Rename): the job found no experiment of its name, and
    started over in a new one. An experiment tracktron makes now says which name it was made under.
    A config that names another experiment still starts a new run there."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 4})
    assert run_trainer(args, cwd=tmp_path).returncode == 0
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    client.rename_experiment(run.info.experiment_id, "demo (baseline)")

    elsewhere = [*args, "OUTPUT_DIR", str(tmp_path / "elsewhere")]  # no local model_final: the store decides
    plan = run_trainer(["--dry-run", *elsewhere], cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert f"run {run.info.run_id} has model_final: nothing to do" in plan.stdout
    assert f"the job's run {run.info.run_id} is in experiment demo (baseline) (made as demo, renamed since)" in plan.stderr
    again = run_trainer(elsewhere, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert client.get_experiment_by_name("demo") is None
    assert [r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])] == \
        [run.info.run_id]

    other = run_trainer(["--dry-run", *elsewhere, "TRACKING.EXPERIMENT", "ablation"], cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    assert "experiment ablation (new), a new run" in other.stdout


def test_a_new_job_trains_from_a_local_weights_file(tmp_path, data_dir):
    """TRAIN.WEIGHTS a file (a checkpoint, a Detectron .pkl, a torchvision name: what preflight
    loads): every such job failed at its start with a TypeError, after its run was made, while
    --dry-run passed. One iteration later its weights are the file's, but for that step."""
    first = run_trainer(demo_overrides(tmp_path / "a", data_dir, **{"SOLVER.MAX_ITER": 4, "TEST.DATASETS": "()",
                                                                     "TRACKING.ENABLED": "false"}), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    weights = tmp_path / "a" / "output" / "model_final.pth"
    tuned = run_trainer(demo_overrides(tmp_path / "b", data_dir, **{"SOLVER.MAX_ITER": 1, "RNG_SEED": 7, "TEST.DATASETS": "()",
                                                                     "TRAIN.WEIGHTS": weights}), cwd=tmp_path)
    assert tuned.returncode == 0, tuned.stderr[-2000:]
    assert f"weights {weights}: loaded" in tuned.stderr
    given, got = load_checkpoint(weights)["model"], load_checkpoint(tmp_path / "b" / "output" / "model_final.pth")["model"]
    common = [k for k in got if k in given]  # fine-tuning freezes BatchNorm: no num_batches_tracked
    assert len(common) == len(got) and all((got[k].float() - given[k].float()).abs().max() < 0.01 for k in common)
    assert sum(torch.equal(got[k], given[k]) for k in common) > len(common) // 2  # the frozen layers, untouched


def test_a_resume_says_which_iterations_of_its_run_it_does_not_log(caplog):
    """Metrics go out every few seconds and a step is never logged twice: a resume from a checkpoint
    older than the run's newest metrics (a SIGKILL after a batch was sent; a newer checkpoint that
    failed its sha256) trains those iterations again without sending them. It said nothing of that,
    only of the opposite gap. Found by the red team of 2026-12-02."""
    from trainer.resume import warn_of_missing_metrics
    from trainer.tracking.base import RunInfo

    caplog.set_level("INFO", logger="trainer.resume")
    for last_step, start_iter in ((19, 20), (-1, 0)):  # the run ends where the job starts: nothing to say
        warn_of_missing_metrics(RunInfo(run_id="r1", last_step=last_step), start_iter)
    assert caplog.messages == []
    warn_of_missing_metrics(RunInfo(run_id="r1", last_step=24), 10)
    assert caplog.messages == ["run r1 has metrics up to iteration 24 from an earlier start: this one trains "
                               "iterations 10-24 again without sending them, so the run keeps the earlier values"]
    warn_of_missing_metrics(RunInfo(run_id="r1", last_step=4, resumed=True), 10)
    assert caplog.messages[-1].startswith("run r1 has no metrics for iterations 5-9 (the job stopped before it sent")
    # A new run for a job that resumes from its folder: its earlier run is elsewhere, perhaps in the
    # default sqlite:///mlflow.db of the folder it was started from (helper-58).
    warn_of_missing_metrics(RunInfo(run_id="r2", last_step=-1, resumed=False), 10)
    assert caplog.messages[-1].startswith("run r2 has no metrics for iterations 0-9 (it is a new run: the job's earlier "
                                          "one, if tracked, is in another store or experiment; a relative store such "
                                          "as the default sqlite:///mlflow.db is found from the working folder)")
    caplog.clear()
    warn_of_missing_metrics(RunInfo(run_id=None, last_step=-1), 10)  # untracked: no run to speak of
    assert caplog.messages == []
