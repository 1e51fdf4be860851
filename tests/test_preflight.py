"""Every check of a job before a run is made for it (issue 16): a job that fails one leaves the
tracking store as it was (no run, no experiment, not even a store file), and a finished job still
has nothing to do whatever became of its data."""
from __future__ import annotations

import shutil

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
    shutil.rmtree(mine)
    shutil.rmtree(tmp_path / "output")  # another machine: only the tracking server knows the job finished
    again = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-2000:]
