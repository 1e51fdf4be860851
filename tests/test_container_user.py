"""The trainer as a container platform runs it: an arbitrary user id with no passwd entry (OpenShift's
`runAsUser: 1000770000`), HOME unset or naming a folder it cannot write, caches it cannot make
(helper-83). A user id without a passwd entry is played by a subprocess whose `pwd` knows no one
(what `getpwuid` says in such a container), so that the tests need not run as root."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import DEMO, ROOT, demo_overrides, tmpfs_mount, run_trainer, trainer_cmd

# `python -m trainer ...` in a process whose passwd file has no entry for its user.
NO_PASSWD_ENTRY = ("import pwd, runpy, sys\n"
                   "def getpwuid(uid):\n"
                   "    raise KeyError(f'getpwuid(): uid not found: {uid}')\n"
                   "pwd.getpwuid = getpwuid\n"
                   "sys.argv[0] = 'tracktron'\n"
                   "runpy.run_module('trainer', run_name='__main__', alter_sys=True)\n")


def run_as_arbitrary_user(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("HOME", "USER", "LOGNAME") and not k.startswith("MLFLOW_")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", NO_PASSWD_ENTRY, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={**base, **env})


def refused_from(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """The trainer started in `workdir` with no MLFLOW_* of the suite's, which must refuse it: exit 2, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run(trainer_cmd(*args), cwd=workdir, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def test_no_home_folder_is_one_line_before_anything_is_made(tmp_path, data_dir):
    """HOME unset (`env -i`, a launcher that passes no environment) for a user id with no passwd entry:
    MLflow's import asks for the home folder, and the job ended in a 40-line traceback
    (`RuntimeError: Could not determine home directory.`) after its checks had passed."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    for command in (["train", "--config", str(DEMO), "DATA_DIR", str(data_dir), "OUTPUT_DIR", str(cwd / "out")],
                    ["status"]):
        done = run_as_arbitrary_user(command, cwd, {})
        assert done.returncode == 2, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert last_line(done) == ("error: no home folder: HOME is not set and this user (id "
                                   f"{os.getuid()}) has no entry in the passwd file (a container run as an arbitrary "
                                   "user); set HOME to a writable folder"), done.stderr[-3000:]
        assert sorted(p.name for p in cwd.iterdir()) == []


@pytest.fixture
def read_only_home(tmp_path):
    """HOME on a read-only file system (HOME=/ on a container's read-only root, or a home owned by the
    image's user): root may write wherever permissions say no, so only a mount shows it."""
    yield from tmpfs_mount(tmp_path / "home")


@pytest.fixture
def read_only_workdir(tmp_path):
    """The container's WORKDIR on a read-only root file system (`readOnlyRootFilesystem: true`)."""
    yield from tmpfs_mount(tmp_path / "app")


def test_the_default_store_in_a_read_only_working_folder_names_the_folder(tmp_path, data_dir, read_only_workdir):
    """The default `sqlite:///mlflow.db` is the working folder's: on a read-only root file system the
    line said `the store cannot be made in .`, which a user of a container (WORKDIR /app) could not
    place, and not what to set instead."""
    done = refused_from(read_only_workdir, "DATA_DIR", str(data_dir), "OUTPUT_DIR", str(tmp_path / "scratch" / "out"))
    assert last_line(done) == (f"error: tracking URI sqlite:///mlflow.db: the store cannot be made in the working folder "
                               f"{read_only_workdir} (a read-only file system, or no permission to write there); set "
                               "MLFLOW_TRACKING_URI (or TRACKING.URI) to a tracking server or to a store in a writable "
                               "folder"), done.stderr[-3000:]
    assert not (tmp_path / "scratch").exists()


@pytest.mark.parametrize("weights, variable, cache", [
    ("http://127.0.0.1:9/R-50.pkl", "TRACKTRON_CACHE", ".cache/tracktron/weights"),
    ("ResNet18_Weights.IMAGENET1K_V1", "TORCH_HOME", ".cache/torch/hub/checkpoints"),
], ids=["url", "torchvision-name"])
def test_a_weights_cache_that_cannot_be_written_says_so_not_a_failed_download(tmp_path, data_dir, read_only_home,
                                                                              weights, variable, cache):
    """The cache under a home that cannot be written: the line said `download failed (...)` and to fetch
    the file where the network allows, though the network was never tried; it names the folder and the
    variable that moves it."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRACKTRON_CACHE", "TORCH_HOME", "XDG_CACHE_HOME")}
    done = subprocess.run(trainer_cmd("DATA_DIR", str(data_dir), "OUTPUT_DIR", str(tmp_path / "out"), "TRAIN.WEIGHTS",
                                      weights, "TRACKING.URI", f"sqlite:///{tmp_path / 'm.db'}", "MODEL.BACKBONE",
                                      "resnet18", "MODEL.BACKBONE_WIDTH", "1.0", "MODEL.ANCHOR_SIZES", "[16, 32, 64, 128, 256]"),
                          cwd=tmp_path, env={**env, "HOME": str(read_only_home)}, capture_output=True, text=True, timeout=180)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith(f"error: TRAIN.WEIGHTS {weights}: the cache folder {read_only_home / cache} cannot be "
                                "written (OSError: [Errno 30] Read-only file system"), lines[-1]
    assert lines[-1].endswith(f"set {variable} to a writable folder"), lines[-1]
    assert "download failed" not in lines[-1]
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("store", ["new", "existing"])
def test_a_store_on_a_volume_from_a_read_only_working_folder_makes_no_experiment_it_cannot_upload_to(
        tmp_path, data_dir, read_only_workdir, store, monkeypatch):
    """`TRACKING.URI sqlite:////volume/m.db` from a read-only WORKDIR: MLflow's client gives a new
    experiment ./mlruns of the working folder for its artifacts. The job made the store, the experiment
    (for good: every later job of it would fail the same way) and a run, then stopped at its first
    upload (`refuses uploads ... Permission denied: '/app/mlruns'`)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    uri = f"sqlite:///{volume / 'm.db'}"
    if store == "existing":
        from mlflow import MlflowClient

        monkeypatch.chdir(volume)
        MlflowClient(uri).search_experiments()  # the store and its Default experiment
    done = refused_from(read_only_workdir, "DATA_DIR", str(data_dir), "OUTPUT_DIR", str(volume / "out"), "TRACKING.URI", uri)
    assert last_line(done) == (f"error: tracking URI {uri}: a new experiment demo would keep its artifacts in "
                               f"{read_only_workdir / 'mlruns'} (MLflow's default for a database store: ./mlruns in the "
                               "working folder), which cannot be written; start the job in a writable folder, or use a "
                               "tracking server"), done.stderr[-3000:]
    assert not (volume / "out").exists()
    if store == "new":
        assert not (volume / "m.db").exists()
    else:
        from mlflow import MlflowClient

        assert [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]


def test_an_arbitrary_user_with_a_home_trains_and_its_run_says_the_user_is_unknown(tmp_path, data_dir):
    """The same user id with HOME set (as the image sets it) trains; its run's mlflow.user, which MLflow
    takes from the login (a KeyError here, which MLflow's own lookup turns into a warning), is `unknown`,
    and MLFLOW_TRACKING_USERNAME names the user where it is set."""
    from mlflow import MlflowClient

    (tmp_path / "home").mkdir()
    for user in ("", "carol"):
        uri = f"sqlite:///{tmp_path / f'm{user}.db'}"
        done = run_as_arbitrary_user(["train", "--config", str(DEMO), "DATA_DIR", str(data_dir), "OUTPUT_DIR",
                                      str(tmp_path / f"out{user}"), "SOLVER.MAX_ITER", "2", "TRACKING.URI", uri,
                                      "TEST.DATASETS", "()", "TRACKING.LOG_MODEL", "false"], tmp_path,
                                     {"HOME": str(tmp_path / "home"), **({"MLFLOW_TRACKING_USERNAME": user} if user else {})})
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resolving tags" not in done.stderr
        (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("demo").experiment_id])
        assert run.data.tags["mlflow.user"] == (user or "unknown")


def test_an_artifact_root_from_the_environment_is_named_as_such(tmp_path, monkeypatch):
    """MLflow's client takes _MLFLOW_SERVER_ARTIFACT_ROOT before ./mlruns: a new experiment's folder
    that cannot be written because of it said it was MLflow's default, ./mlruns in the working folder,
    and to start the job elsewhere, which changes nothing."""
    from trainer.errors import UserError
    from trainer.tracking.sqlite_store import check_new_experiment_artifacts

    (tmp_path / "arts").write_text("a file, not a folder")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", "arts")
    with pytest.raises(UserError) as e:
        check_new_experiment_artifacts("sqlite:////v/m.db", "demo")
    assert f"in {tmp_path / 'arts'} (_MLFLOW_SERVER_ARTIFACT_ROOT=arts)" in str(e.value)
    assert "set _MLFLOW_SERVER_ARTIFACT_ROOT to a writable folder" in str(e.value) and "./mlruns" not in str(e.value)
    monkeypatch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", "s3://bucket/arts")  # a URI: not judged here
    check_new_experiment_artifacts("sqlite:////v/m.db", "demo")


@pytest.fixture
def small_tmp(tmp_path):
    """A container's small /tmp (`--tmpfs /tmp:size=1m`, an emptyDir with a sizeLimit) as TMPDIR."""
    yield from tmpfs_mount(tmp_path / "tmp", "size=1m")


def test_a_temporary_folder_too_small_for_the_model_is_named_with_tmpdir_and_not_retried(tmp_path, data_dir, small_tmp):
    """MLflow copies the final model through TMPDIR: a 1 MiB one failed its logging with `The following
    failures occurred while downloading one or more artifacts from …/model:` (no cause, no folder) 24
    times over the 5-minute flush timeout (helper-86)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.FLUSH_TIMEOUT_S": 30})
    done = run_trainer(args, cwd=tmp_path, env={"TMPDIR": str(small_tmp)})
    assert done.returncode == 1, done.stderr[-3000:]
    assert ("tracking: log the final model failed: cannot log the model: MLflow copies it ("
            in done.stderr), done.stderr[-3000:]
    assert f"twice through the folder for temporary files {small_tmp}, which has " in done.stderr
    assert "set TMPDIR to a folder with room" in done.stderr
    assert "log the final model failed (" not in done.stderr, "retried: no retry makes room"
    last = done.stderr.strip().splitlines()[-1]  # what to mend before the rerun, where a pipeline shows it
    assert last.startswith("error: the tracking server did not get: log the final model (cannot log the model:"), last
    assert "set TMPDIR to a folder with room" in last, last
    assert (tmp_path / "output" / "model_final.pth").is_file()

    again = run_trainer(args, cwd=tmp_path)  # room to copy it: the rerun logs the model
    assert again.returncode == 0, again.stderr[-3000:]
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("demo").experiment_id
    (run,) = client.search_runs([experiment])
    assert run.info.status == "FINISHED"
    models = client.search_logged_models(experiment_ids=[experiment], filter_string=f"source_run_id = '{run.info.run_id}'")
    assert ("model", "READY") in [(m.name, str(m.status)) for m in models], [(m.name, str(m.status)) for m in models]


def test_a_server_error_while_the_temporary_folder_is_small_is_not_blamed_on_it(tmp_path, small_tmp, monkeypatch):
    """Only an error that says the disk is full is a NoRoom (not retried): a 503 is retried as ever."""
    from trainer.tracking.logged_model import short_of_temp_space

    monkeypatch.setattr(tempfile, "tempdir", str(small_tmp))
    folder = tmp_path / "detector"
    folder.mkdir()
    (folder / "weights.pt").write_bytes(b"\0" * 2**21)  # 2 MiB: more than the 1 MiB folder holds
    assert short_of_temp_space(RuntimeError("API request failed with error code 503"), folder) is None
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("The following failures occurred while downloading one or more artifacts")
    wrapped.__cause__ = full
    assert f"temporary files {small_tmp}, which has" in str(short_of_temp_space(wrapped, folder))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # room there: the full disk is another's
    assert short_of_temp_space(wrapped, folder) is None
