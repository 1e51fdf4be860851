"""OUTPUT_DIR/log.txt (logs.JobLog): what the job logged, kept with its checkpoints. The end-to-end
checks are with the jobs that make one: test_train (a failed job's), test_tracking (a job moved to
another machine), test_faults (a start over), test_hostile_inputs (a name that is no file),
test_security (no secret in it)."""
from __future__ import annotations

import io
import logging
import shutil
import signal
import urllib.parse
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import demo_overrides, run_trainer
from tests.faultkit import jobs, wait_until  # noqa: F401 - jobs is a fixture
from trainer.logs import JobLog


@pytest.fixture
def logger():
    """A logger of its own, with a console (a StringIO) beside the JobLog, as setup_logging's stderr."""
    log = logging.getLogger(f"test_job_log.{id(object())}")
    log.propagate, log.level = False, logging.INFO
    console = logging.StreamHandler(io.StringIO())
    log.addHandler(console)
    job_log = JobLog()
    log.addHandler(job_log)
    yield log, job_log, console.stream
    job_log.end()
    log.handlers.clear()


def test_lines_wait_until_the_folder_is_settled_then_come_first(logger, tmp_path):
    log, job_log, _ = logger
    path = tmp_path / "log.txt"
    log.info("the dataset: 64 images")
    log.debug("not at INFO")
    assert not path.exists()  # the checks have not passed: nothing written yet
    job_log.open(path)
    log.warning("after open")
    lines = path.read_text().splitlines()
    assert "tracktron] started on " in lines[0]
    assert lines[1].endswith("INFO " + log.name + "] the dataset: 64 images")
    assert lines[2].endswith("WARNING " + log.name + "] after open") and len(lines) == 3


def test_a_job_that_never_opens_it_writes_nothing(logger, tmp_path):
    """A job that fails its checks, or stops before its folder is settled: no log.txt."""
    log, job_log, _ = logger
    log.warning("a check failed")
    job_log.end()
    log.warning("after the end")
    assert list(tmp_path.iterdir()) == []


def test_a_library_that_reconfigures_logging_mid_job_loses_no_line(logger, tmp_path):
    """MLflow up to 3.16 runs logging.config.dictConfig when it is first imported, which closes every
    handler: with MLflow imported during the checks, log.txt lost every line from before its folder was
    settled (the dataset's summary, the run, where the job resumed from). Found with MLflow 3.13."""
    import logging.config

    log, job_log, _ = logger
    path = tmp_path / "log.txt"
    log.info("before the import")
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})  # what `import mlflow` did
    log.info("resuming from model_iter5.pth")
    job_log.open(path)
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    log.info("after open")
    lines = path.read_text().splitlines()
    assert [line.split("] ", 1)[1] for line in lines[1:]] == [
        "before the import", "resuming from model_iter5.pth", "after open"], lines


def test_an_earlier_log_is_appended_to(logger, tmp_path):
    log, job_log, _ = logger
    path = tmp_path / "log.txt"
    path.write_text("[2026-12-01 10:00:00 tracktron] started on elsewhere (pid 7)\n")
    job_log.open(path)
    log.info("this start")
    text = path.read_text()
    assert text.startswith("[2026-12-01 10:00:00 tracktron] started on elsewhere (pid 7)\n") and text.count("started on") == 2


def test_a_full_disk_ends_the_file_says_so_once_and_logging_goes_on(logger, caplog, capsys):
    """/dev/full: every write fails with ENOSPC. Logging's own handling printed `--- Logging error ---`
    and a traceback on stderr for every line."""
    log, job_log, console = logger
    job_log.open(Path("/dev/full"))
    for i in range(3):
        log.info("line %d", i)
    said = [r.getMessage() for r in caplog.records if r.name == "tracktron"]
    assert said == ["cannot write /dev/full (No space left on device): the job goes on without it; its stats are in "
                    "json_stats.log and on the tracking server"]
    assert console.getvalue().splitlines() == ["line 0", "line 1", "line 2"]  # the console goes on
    assert "Logging error" not in capsys.readouterr().err


def test_a_folder_that_cannot_take_it_is_said_once(logger, caplog, tmp_path):
    log, job_log, console = logger
    job_log.open(tmp_path / "gone" / "log.txt")
    log.info("still logged")
    assert [r.name for r in caplog.records if "cannot write" in r.getMessage()] == ["tracktron"]
    assert console.getvalue() == "still logged\n"


def test_the_closing_line_is_redacted_as_log_records_are(logger, tmp_path):
    """The end's reason is written to the file alone, outside logging's record factory: a reason that
    quotes a URL with its password (a tracking server refused) must not put it in the file the run keeps."""
    _, job_log, _ = logger
    job_log.open(tmp_path / "log.txt")
    job_log.note("the job ends FAILED: cannot reach http://alice:s3cret-pw@127.0.0.1:9/api")
    text = (tmp_path / "log.txt").read_text()
    assert "s3cret-pw" not in text and "the job ends FAILED: cannot reach http://" in text


# ---- with a job: the run's copy of log.txt ----

def _store(tmp_path: Path) -> tuple[str, MlflowClient]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, MlflowClient(uri)


def _artifacts_of(client: MlflowClient) -> tuple[str, Path]:
    """The run of the store's one job, and the folder its artifacts are in (a local artifact store)."""
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return run.info.run_id, Path(urllib.parse.urlparse(run.info.artifact_uri).path)


def test_a_runs_log_txt_that_is_a_folder_stays_in_the_run_and_out_of_output_dir(tmp_path, data_dir):
    """Someone's `mlflow artifacts log-artifacts` of a folder named log.txt into the run: MLflow
    downloaded it whole into OUTPUT_DIR, where log.txt could not be written, and every later start
    in that folder was refused (log.txt there is not a regular file)."""
    uri, client = _store(tmp_path)
    keys = {"TRACKING.URI": uri, "SOLVER.MAX_ITER": 2}
    assert run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path).returncode == 0
    run_id, artifacts = _artifacts_of(client)
    (artifacts / "log.txt").unlink()
    (artifacts / "log.txt" / "sub").mkdir(parents=True)
    (artifacts / "log.txt" / "sub" / "notes.md").write_text("not tracktron's\n")
    shutil.rmtree(tmp_path / "output")  # another machine: the finished job's rerun fetches the run's log
    again = run_trainer(demo_overrides(tmp_path, data_dir, **keys), cwd=tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-2000:]
    assert "cannot fetch the run's log.txt (the run's log.txt is a folder, not a file tracktron wrote)" in again.stderr
    log_txt = (tmp_path / "output" / "log.txt").read_text()  # a file, this start's alone
    assert log_txt.count(" tracktron] started on ") == 1 and log_txt.endswith("the job ends FINISHED\n")
    assert [p.name for p in (artifacts / "log.txt").rglob("*")] == ["sub", "notes.md"]  # the run's, as it was


def _long_job(start, tmp_path: Path, data_dir: Path):
    """A tracked job of 300 iterations (a checkpoint every 10, log.txt sent with the first), and its store."""
    uri, client = _store(tmp_path)
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 300, "TRAIN.SNAPSHOT_ITERS": 10})
    return start(args, tmp_path), client


def test_a_log_txt_deleted_while_the_job_runs_fails_nothing_and_the_run_keeps_its_copy(jobs, tmp_path, data_dir):  # noqa: F811 - the fixture
    """A clean-up of *.txt in OUTPUT_DIR as the job trains: its end's upload of log.txt failed, and
    the job exited 1 (`the tracking server did not get: upload log.txt`) with model_final saved."""
    job, client = _long_job(jobs, tmp_path, data_dir)
    wait_until(lambda: list(tmp_path.glob("mlruns/*/*/artifacts/log.txt")), job,  # the store's artifact root: ./mlruns
               "log.txt in the run", timeout=120)
    (tmp_path / "output" / "log.txt").unlink()
    assert job.wait(300) == 0 and "training finished" in job.out_path.read_text(), job.stderr[-2000:]
    assert job.stderr.count("log.txt (it was deleted or replaced while the job ran)") == 1, job.stderr[-2000:]
    assert " tracktron] started on " in (_artifacts_of(client)[1] / "log.txt").read_text()  # the run's copy


def test_a_stopped_job_s_log_txt_ends_with_how_it_ended_as_the_runs_copy_does(jobs, tmp_path, data_dir):  # noqa: F811 - the fixture
    """The stop's advice (`…; the job resumes from its last checkpoint`) was written after the closing
    line, locally alone: the file's last line was not how the job ended, and it was not the run's copy."""
    job, client = _long_job(jobs, tmp_path, data_dir)
    wait_until((tmp_path / "output" / "model_iter9.pth").exists, job, "model_iter9.pth", timeout=120)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(120) == 128 + signal.SIGTERM and "the job resumes from its last checkpoint" in job.stderr, \
        job.stderr[-2000:]
    log_txt = (tmp_path / "output" / "log.txt").read_text()
    assert log_txt.endswith("the job ends KILLED: stopped by SIGTERM\n"), log_txt[-500:]
    assert (_artifacts_of(client)[1] / "log.txt").read_text() == log_txt
