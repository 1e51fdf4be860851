"""The console is a view of the job: when it goes away (the reader of a pipe ended, the terminal hung
up), the job goes on, or stops as a signal asks, with its record intact."""
from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

from mlflow import MlflowClient

from tests.conftest import ROOT, trainer_cmd
from tests.faultkit import HUP_DEFAULT, MAX_ITER, job_args, logged_iters, only_run
from trainer.checkpoint.state import load as load_checkpoint


def test_a_pipe_whose_reader_ends_does_not_fail_the_job(tmp_path, data_dir):
    """`tracktron train ... | head`, or a `tee` or log shipper that dies: the next json_stats line
    raised BrokenPipeError, and the job ended FAILED."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "piped"})
    with open(tmp_path / "stderr", "w") as err:
        job = subprocess.Popen(trainer_cmd(*args), cwd=tmp_path, stdout=subprocess.PIPE, stderr=err)
        for line in job.stdout:  # the reader takes the first line of stats, then goes
            if line.startswith(b"json_stats: "):
                break
        job.stdout.close()
        code = job.wait(240)
    stderr = (tmp_path / "stderr").read_text()
    assert code == 0, stderr[-3000:]
    assert "the console's stdout is gone ([Errno 32] Broken pipe): the job goes on" in stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    assert logged_iters(tmp_path / "output") == list(range(MAX_ITER))
    assert only_run(MlflowClient(uri), "piped").info.status == "FINISHED"


def test_a_job_whose_stderr_reader_ends_registers_its_model_and_ends_0(tmp_path, data_dir):
    """`tracktron train ... 2>&1 | head -3`: MLflow prints to stderr while it registers the model, and
    that print failed (EPIPE) until the flush timeout: exit 1, no version, no alias (helper-61)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "piped-stderr", "SOLVER.MAX_ITER": 3,
                                           "TRACKING.LOG_MODEL": "true", "TRACKING.REGISTERED_MODEL": "piped",
                                           "TRACKING.FLUSH_TIMEOUT_S": 60})
    job = subprocess.Popen(trainer_cmd(*args), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for _ in range(3):  # `head -3`
        job.stdout.readline()
    job.stdout.close()
    assert job.wait(240) == 0
    client = MlflowClient(uri)
    run = only_run(client, "piped-stderr")
    assert run.info.status == "FINISHED"
    assert client.get_model_version_by_alias("piped", "final").run_id == run.info.run_id


def test_a_terminal_that_hangs_up_stops_the_job_cleanly(tmp_path, data_dir):
    """The ssh session closes: the terminal goes (every write to it is EIO) and SIGHUP comes. The
    stop used to fail on its first write to the terminal: the run FAILED, the iteration lost."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "hung-up",
                                           "SOLVER.MAX_ITER": 200, "TRAIN.SNAPSHOT_ITERS": 100})
    terminal, tty = pty.openpty()
    job = subprocess.Popen([*HUP_DEFAULT, *trainer_cmd(*args)], cwd=tmp_path, stdin=tty, stdout=tty, stderr=tty,
                           start_new_session=True)
    os.close(tty)
    try:
        seen, end = b"", time.monotonic() + 240
        while seen.count(b"json_stats: ") < 2:  # the progress line is drawn too: stdout is a terminal
            assert select.select([terminal], [], [], max(0.0, end - time.monotonic()))[0], "no second iteration"
            seen += os.read(terminal, 4096)
        os.close(terminal)  # the terminal is gone
        terminal = None
        os.killpg(job.pid, signal.SIGHUP)
        code = job.wait(60)
    finally:
        if terminal is not None:
            os.close(terminal)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert code == 128 + signal.SIGHUP
    out = tmp_path / "output"
    done = logged_iters(out)[-1]
    assert done >= 1 and load_checkpoint(out / f"model_iter{done}.pth")["iteration"] == done
    run = only_run(MlflowClient(uri), "hung-up")
    assert run.info.status == "KILLED" and run.data.tags["tracktron.status_reason"] == "stopped by SIGHUP"


def test_a_job_started_with_its_console_closed_trains_and_logs_its_model(tmp_path, data_dir):
    """`tracktron train ... >&- 2>&- <&-`: Python's sys.stdout and sys.stderr are None, and MLflow's
    model logging failed writing to them (exit 1); the first files opened took descriptors 1 and 2,
    where a library's C-level write to stdout would have landed."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = job_args(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.EXPERIMENT": "closed",
                                           "TRACKING.LOG_MODEL": "true"})
    job = subprocess.Popen(["sh", "-c", 'exec "$0" "$@" <&- >&- 2>&-', *trainer_cmd(*args)], cwd=tmp_path)
    out = tmp_path / "output"
    try:
        end = time.monotonic() + 240
        while not logged_iters(out) and job.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        assert job.poll() is None and logged_iters(out), f"no iteration, then exit {job.poll()}"
        assert {os.readlink(f"/proc/{job.pid}/fd/{fd}") for fd in (0, 1, 2)} == {os.devnull}
        code = job.wait(240)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert code == 0
    assert logged_iters(out) == list(range(MAX_ITER))
    run = only_run(MlflowClient(uri), "closed")
    assert run.info.status == "FINISHED" and "tracktron.model_id" in run.data.tags


def test_a_console_that_cannot_encode_a_path_gets_it_escaped():
    """PYTHONIOENCODING=ascii and OUTPUT_DIR /tmp/ündër: the job trained and FINISHED, then
    `training finished: ...` raised UnicodeEncodeError and the job exited 1."""
    import io

    from trainer.logs import write_or_drop

    console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    write_or_drop(console, "training finished: /tmp/ündër/model_final.pth\n")
    assert console.buffer.getvalue() == b"training finished: /tmp/\\xfcnd\\xebr/model_final.pth\n"


def test_an_unverified_tls_warning_is_said_once_not_per_request():
    """MLFLOW_TRACKING_INSECURE_TLS=true: urllib3 warns of each request (two lines each, 281 in a
    180-iteration job, found by helper-65's red team); the job says it once per host."""
    code = ("import urllib3, warnings\n"
            "from trainer.logs import setup_logging\n"
            "setup_logging()\n"
            "for host in ('10.0.0.1', '10.0.0.1', '10.0.0.2'):\n"
            "    warnings.warn(f\"Unverified HTTPS request is being made to host '{host}'. Adding certificate "
            "verification is strongly advised.\", urllib3.exceptions.InsecureRequestWarning)\n"
            "warnings.warn('another warning', UserWarning)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("host '10.0.0.1'") == 1, done.stderr  # once per host (urllib3: every request)
    assert done.stderr.count("host '10.0.0.2'") == 1, done.stderr
    assert "another warning" in done.stderr  # other warnings are as they were
