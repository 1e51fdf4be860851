"""Every check of a job before a run is made for it (issue 16): a job that fails one leaves the
tracking store as it was (no run, no experiment, not even a store file), and a finished job still
has nothing to do whatever became of its data."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import demo_overrides, run_trainer


def _runs(uri: str) -> list:
    client = MlflowClient(uri)
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def test_a_job_that_fails_its_checks_makes_no_run(tmp_path, data_dir):
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    # No store yet: a typo in TEST.DATASETS (found before, but after the run and the store were made).
    typo = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "TEST.DATASETS": "('synth_shapes_vla',)"}),
                       cwd=tmp_path)
    assert typo.returncode == 2 and "synth_shapes_vla" in typo.stderr.strip().splitlines()[-1], typo.stderr[-2000:]
    assert "Traceback" not in typo.stderr and not db.exists()

    # A store with a finished job in it: a second job whose training set is broken touches nothing.
    done = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 2,
                                                             "TRACKING.EXPERIMENT": "first"}), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    before = [(r.info.run_id, r.info.status, r.data.tags) for r in _runs(uri)]
    broken = tmp_path / "broken"
    shutil.copytree(data_dir / "synth_shapes" / "train", broken)
    (broken / "annotations.json").write_text("{")
    bad = run_trainer(demo_overrides(tmp_path, data_dir, **{
        "TRACKING.URI": uri, "TRACKING.EXPERIMENT": "second", "TRAIN.DATASETS": f"('{broken}',)",
        "OUTPUT_DIR": tmp_path / "second"}), cwd=tmp_path)
    assert bad.returncode == 2 and "annotations.json" in bad.stderr.strip().splitlines()[-1], bad.stderr[-2000:]
    assert [(r.info.run_id, r.info.status, r.data.tags) for r in _runs(uri)] == before
    assert MlflowClient(uri).get_experiment_by_name("second") is None
    assert not (tmp_path / "second").exists() or not any((tmp_path / "second").glob("*.pth"))


def test_a_finished_job_has_nothing_to_do_whatever_became_of_its_data(tmp_path, data_dir):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mine = tmp_path / "mine"
    shutil.copytree(data_dir / "synth_shapes" / "train", mine)
    keys = {"TRACKING.URI": uri, "SOLVER.MAX_ITER": 2, "TRAIN.DATASETS": f"('{mine}',)"}
    first = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    final = (tmp_path / "output" / "model_final.pth").read_bytes()
    shutil.rmtree(mine)
    shutil.rmtree(tmp_path / "output")  # another machine: only the tracking server knows the job finished
    again = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-2000:]
    # the job's product is back where Detectron's train.py leaves it, byte for byte, with its record (the
    # run's json_stats.log) and nothing else but log.txt: the run's, this start's lines added (uploaded at
    # the end, this start's alone replaced it)
    assert (tmp_path / "output" / "model_final.pth").read_bytes() == final
    assert sorted(p.name for p in (tmp_path / "output").iterdir()) == [".lock", "json_stats.log", "log.txt",
                                                                       "model_final.pth"]
    log_txt = (tmp_path / "output" / "log.txt").read_text()
    assert log_txt.count(" tracktron] started on ") == 2 and log_txt.count("the job ends FINISHED") == 2, log_txt
    client = MlflowClient(uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert Path(client.download_artifacts(run.info.run_id, "log.txt", str(tmp_path))).read_text() == log_txt


def _with_a_star(data_dir: Path, tmp_path: Path) -> Path:
    """A copy of the synthetic data whose training set has a fourth category."""
    other = tmp_path / "other-data"
    shutil.copytree(data_dir, other)
    ann = other / "synth_shapes" / "train" / "annotations.json"
    data = json.loads(ann.read_text())
    data["categories"].append({"id": 4, "name": "star", "keypoints": data["categories"][0]["keypoints"]})
    ann.write_text(json.dumps(data))
    return other


def test_a_resume_on_a_training_set_with_other_categories_is_refused_before_the_run(tmp_path, data_dir):
    """DATA_DIR is not part of the job: the same job resumed on a copy of its data with a category
    more loaded the checkpoint into a model it did not fit, after its run was reopened (exit 1, a
    size-mismatch traceback, the run FAILED)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    keys = {"TRACKING.URI": uri, "SOLVER.MAX_ITER": 4, "TRAIN.SNAPSHOT_ITERS": 2, "TEST.DATASETS": "()"}
    first = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    out = tmp_path / "output"
    (out / "model_final.pth").unlink()  # as if killed after model_iter1
    other = _with_a_star(data_dir, tmp_path)
    before = [(r.info.run_id, r.info.status, r.data.tags, r.data.metrics) for r in _runs(uri)]
    files = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != ".lock"}  # the lock: each trainer's
    again = run_trainer(demo_overrides(tmp_path, other, **keys), cwd=tmp_path)
    assert again.returncode == 2, again.stderr[-2000:]
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {out / 'model_iter1.pth'} was trained on 3 categories (square, circle, triangle) "
                           "and the training set now has 4 (square, circle, triangle, star)"), line
    assert [(r.info.run_id, r.info.status, r.data.tags, r.data.metrics) for r in _runs(uri)] == before
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != ".lock"} == files


def test_a_resume_from_the_run_on_other_categories_is_one_line(tmp_path, data_dir):
    """The same, on another machine: the checkpoint comes from the run, after the run was reopened;
    one line and exit 2 instead of a size-mismatch traceback, and no iteration trained."""
    from tests.faultkit import Job, sha_tag, steps, wait_until

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    keys = {"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "cats", "SOLVER.MAX_ITER": 400, "TRAIN.SNAPSHOT_ITERS": 2,
            "TEST.DATASETS": "()", "LOG_PERIOD": 1}
    job = Job(demo_overrides(tmp_path, data_dir, **keys), tmp_path)
    wait_until(lambda: (tmp_path / "output" / "model_iter3.pth").exists(), job, "model_iter3")  # the store is made
    client = MlflowClient(uri)

    def tagged():
        exp = client.get_experiment_by_name("cats")
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs and sha_tag("model_iter3.pth") in runs[0].data.tags and runs[0]
    run = wait_until(tagged, job, "model_iter3 on the server")
    job.signal_group(signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM, job.stderr[-2000:]
    shutil.rmtree(tmp_path / "output")  # another machine
    logged = steps(client, run.info.run_id)
    again = run_trainer(demo_overrides(tmp_path, _with_a_star(data_dir, tmp_path), **keys), cwd=tmp_path)
    assert again.returncode == 2, again.stderr[-2000:]
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: run {run.info.run_id}'s model_iter") and "was trained on 3 categories" in line, line
    assert steps(client, run.info.run_id) == logged


def test_a_keypoint_model_is_not_resumed_on_keypoints_in_another_order(tmp_path, data_dir):
    """The same categories with their keypoint names reversed were resumed: the keypoint head went on
    learning "top" at the channel it had learnt "left" at. A box model never reads them."""
    from trainer.data import CocoDetection
    from trainer.errors import UserError
    from trainer.inference import categories_of
    from trainer.preflight import check_same_categories

    src = data_dir / "synth_shapes" / "train"
    data = json.loads((src / "annotations.json").read_text())
    ours = CocoDetection(src / "images", src / "annotations.json", keypoints=True)
    trained = categories_of(ours)
    check_same_categories("model_iter9.pth", {"categories": trained}, ours)
    names = trained["keypoint_names"]
    for c in data["categories"]:
        c["keypoints"] = names[::-1]
    (tmp_path / "annotations.json").write_text(json.dumps(data))
    reversed_ = CocoDetection(src / "images", tmp_path / "annotations.json", keypoints=True)
    with pytest.raises(UserError) as refused:
        check_same_categories("model_iter9.pth", {"categories": trained}, reversed_)
    assert str(refused.value).startswith("the training set now has other keypoints than model_iter9.pth was trained "
                                         f"with (category 1 {data['categories'][0]['name']!r}'s keypoint 1 is "
                                         f"{names[-1]!r} against {names[0]!r}): resume it on its own data")
    boxes = CocoDetection(src / "images", tmp_path / "annotations.json")
    check_same_categories("model_iter9.pth", {"categories": trained}, boxes)


def test_a_deleted_experiment_or_run_is_refused_before_the_checks(tmp_path, data_dir):
    """A job whose experiment was deleted (`mlflow experiments delete`): --dry-run said "a new run" and
    the job itself failed with the server's `must be in the 'active' state` only after all its checks.
    The same for `--resume` of a deleted run. Found by the red team of 2026-12-02."""
    from mlflow.entities import ViewType

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    gone = client.create_experiment("gone")
    client.delete_experiment(gone)
    kept = client.create_run(client.create_experiment("kept")).info.run_id
    client.delete_run(kept)
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "gone"})
    for extra in (["--dry-run"], []):
        refused = run_trainer([*extra, *args], cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines()[-1] == (
            f"error: experiment {gone} on {uri} is deleted: restore it "
            f"(`mlflow experiments restore --experiment-id {gone}`) or name another experiment")
    resumed = run_trainer(["--resume", kept, *demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri})],
                          cwd=tmp_path)
    assert resumed.returncode == 2 and resumed.stderr.strip().splitlines()[-1] == (
        f"error: run {kept} on {uri} is deleted: restore it (`mlflow runs restore --run-id {kept}`) or name another run")
    assert client.search_runs([gone], run_view_type=ViewType.ALL) == []
    assert not (tmp_path / "output").exists()


def test_a_test_set_with_other_categories_makes_no_run(tmp_path, data_dir):
    """A test set whose categories are not the training set's was accepted: the job trained to its
    end and its final evaluation crashed (a KeyError), or scored detections under swapped names."""
    db = tmp_path / "mlflow.db"
    swapped = tmp_path / "swapped"
    shutil.copytree(data_dir / "synth_shapes" / "val", swapped)
    data = json.loads((swapped / "annotations.json").read_text())
    data["categories"][0]["name"], data["categories"][1]["name"] = "circle", "square"
    (swapped / "annotations.json").write_text(json.dumps(data))
    done = run_trainer(demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": f"sqlite:///{db}",
                                                             "TEST.DATASETS": f"('{swapped}',)"}), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: test set {swapped / 'annotations.json'} has other categories than the training set "
        f"{data_dir / 'synth_shapes' / 'train' / 'annotations.json'} (category 1 'circle' against 1 'square')")
    assert "Traceback" not in done.stderr and not db.exists() and not (tmp_path / "output").exists()
