"""What users see: run names, descriptions, experiment kind, system metrics, `tracktron status`."""
from __future__ import annotations

import getpass
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from mlflow import MlflowClient

from tests.conftest import DEMO, demo_overrides, run_trainer
from trainer.tracking.heartbeat import _process_start, beat
from trainer.tracking.system_metrics import start_monitor, stop_monitor
from trainer.config import load_config


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("status")
    uri = f"sqlite:///{tmp / 'store.db'}"
    args = demo_overrides(tmp, data_dir, **{"TRACKING.URI": uri, "TRACKING.SYSTEM_METRICS": "true",
                                            "SOLVER.MAX_ITER": 12})
    result = run_trainer(args, cwd=tmp, env={"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1",
                                             "MLFLOW_RUN_CONTEXT": '{"team": "vision", "pod": {"node": 3}}'})
    assert result.returncode == 0, result.stderr
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("demo")
    (run,) = client.search_runs([exp.experiment_id])
    return tmp, uri, client, exp, run, result


def test_runs_are_named_described_and_in_a_training_experiment(finished_job):
    _, uri, _, exp, run, result = finished_job
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert re.fullmatch(r"demo-\d{8}-\d{6}-" + run.data.tags["tracktron.job"][:6], run.info.run_name)  # a sweep's apart
    note = run.data.tags["mlflow.note.content"]
    assert "fasterrcnn_resnet50_fpn" in note and "synth_shapes_train" in note and "12 iterations" in note
    assert f"see it with: mlflow ui --backend-store-uri {uri}" in result.stderr
    # who and what started it, as mlflow.start_run says (the UI's User and Source columns were empty)
    assert run.data.tags["mlflow.user"] == getpass.getuser() and run.data.tags["mlflow.source.type"] == "LOCAL"
    # and MLflow's MLFLOW_RUN_CONTEXT, a nested value as its JSON (a dict failed the run's creation)
    assert run.data.tags["team"] == "vision" and run.data.tags["pod"] == '{"node": 3}'


def test_system_metrics_are_logged_when_asked(finished_job):
    _, _, _, _, run, _ = finished_job
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert "system/system_memory_usage_megabytes" in run.data.metrics


def test_mlflows_system_metrics_switch_is_honoured_by_the_job_not_by_its_model_logging(tmp_path, data_dir, monkeypatch):
    """MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=true: `auto` (a CPU job) logged none while training, then
    MLflow's monitor ran for the seconds the final model took to log, even with SYSTEM_METRICS false
    (helper-58). It now turns `auto` on, as in MLflow, and `false` stays off."""
    from trainer.tracking.checkpoint_models import MODEL_TAG
    from trainer.tracking.system_metrics import wanted

    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")
    assert wanted(load_config(DEMO, []), on_gpu=False)
    assert not wanted(load_config(DEMO, ["TRACKING.SYSTEM_METRICS", "false"]), on_gpu=False)
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"TRACKING.URI": uri, "TRACKING.SYSTEM_METRICS": "false",
                                                 "SOLVER.MAX_ITER": 2, "TEST.DATASETS": "()"})
    done = run_trainer(args, cwd=tmp_path, env={"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("demo").experiment_id])
    assert MODEL_TAG in run.data.tags  # the model was logged
    assert not [k for k in run.data.metrics if k.startswith("system/")], run.data.metrics


def _system_metrics_on_server(uri: str, run_id: str, key: str, within: float = 60.0) -> list:
    client, end = MlflowClient(uri), time.monotonic() + within
    while not (history := client.get_metric_history(run_id, key)) and time.monotonic() < end:
        time.sleep(0.5)
    return history


def test_system_metrics_are_sampled_by_mlflows_monitor_thread_per_node(tmp_path, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    monkeypatch.setenv("GROUP_RANK", "1")  # the second node of a torchrun job
    client = MlflowClient(mlflow_server.url)
    run_id = client.create_run(client.create_experiment(f"sysmetrics-{tmp_path.name}")).info.run_id
    cfg = load_config(DEMO, ["TRACKING.SYSTEM_METRICS", "true", "TRACKING.URI", mlflow_server.url])
    before = set(threading.enumerate())
    monitor = start_monitor(cfg, run_id, local_rank=0, world_size=2)
    try:
        assert set(threading.enumerate()) - before, "no monitor thread"  # a thread here, no process
        assert _system_metrics_on_server(mlflow_server.url, run_id, "system/node1/cpu_utilization_percentage")
    finally:
        monitor.finish()
    assert not any(t.is_alive() for t in set(threading.enumerate()) - before)  # finish() stops it
    assert start_monitor(cfg, run_id, local_rank=1, world_size=2) is None  # one per node
    auto = load_config(DEMO, ["TRACKING.URI", mlflow_server.url])  # auto: on for GPU jobs only
    assert start_monitor(auto, run_id, local_rank=0, world_size=1, on_gpu=False) is None


def test_system_metrics_go_on_after_the_tracking_server_was_down_a_moment(tmp_path, mlflow_server, monkeypatch, caplog):
    """helper-73's soak test: MLflow's monitor loop ends for good at the first request that fails, so
    a 12 s blip of the server ended a days-long job's CPU, memory and GPU curves, with no word."""
    from tests.servers import FaultProxy

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the trainer bounds them (runs.bound_http)
    client, key = MlflowClient(mlflow_server.url), "system/cpu_utilization_percentage"
    run_id = client.create_run(client.create_experiment(f"sysmetrics-blip-{tmp_path.name}")).info.run_id
    with FaultProxy(mlflow_server.url) as proxy:
        monitor = start_monitor(load_config(DEMO, ["TRACKING.SYSTEM_METRICS", "true", "TRACKING.URI", proxy.url]),
                                run_id, local_rank=0, world_size=1)
        try:
            assert _system_metrics_on_server(mlflow_server.url, run_id, key)
            proxy.set_mode("error")  # every request answered 503, as a server restarting
            time.sleep(4)
            down = max(m.step for m in client.get_metric_history(run_id, key))
            proxy.set_mode("pass")
            end = time.monotonic() + 60
            while max(m.step for m in client.get_metric_history(run_id, key)) <= down + 2:
                assert time.monotonic() < end, "no system metrics since the server came back"
                time.sleep(0.5)
            client.set_terminated(run_id)  # an ended run: the monitor stops, as MLflow's does (helper-74)
            while any(t.name == "SystemMetricsMonitor" for t in threading.enumerate()):
                assert time.monotonic() < end + 30, "the monitor of an ended run goes on"
                time.sleep(0.5)
        finally:
            stop_monitor(monitor, timeout_s=30)
    assert caplog.text.count("system metrics: the tracking server did not answer") == 1  # once, not once a second
    assert "Failed to get mlflow run" not in caplog.text  # MLflow's own line for each retry


def test_stopping_the_monitor_sends_the_last_interval_and_never_holds_the_exit(tmp_path, mlflow_server, monkeypatch,
                                                                               caplog):
    """MLflow's monitor drops the samples of the interval a job ends in: a job shorter than one
    interval (10 s by default) had no system metrics, and a CI run whose server answered slowly
    lost them too. Stopping it sends them; a server that stopped answering costs the exit seconds,
    not MLflow's minutes of retries."""
    from tests.servers import FaultProxy

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "600")  # no interval ends while it runs
    client = MlflowClient(mlflow_server.url)
    exp = client.create_experiment(f"sysmetrics-stop-{tmp_path.name}")
    cfg = load_config(DEMO, ["TRACKING.SYSTEM_METRICS", "true", "TRACKING.URI", mlflow_server.url])
    short = client.create_run(exp).info.run_id
    stop_monitor(start_monitor(cfg, short, local_rank=0, world_size=1), timeout_s=60)  # a server busy with the other worker
    assert "system/cpu_utilization_percentage" in client.get_run(short).data.metrics

    with FaultProxy(mlflow_server.url) as proxy:
        cfg = load_config(DEMO, ["TRACKING.SYSTEM_METRICS", "true", "TRACKING.URI", proxy.url])
        hung = client.create_run(exp).info.run_id
        monitor = start_monitor(cfg, hung, local_rank=0, world_size=1)
        proxy.set_mode("hang")
        started = time.monotonic()
        stop_monitor(monitor, timeout_s=2)
        assert time.monotonic() - started < 10
    assert "the last sample was not sent within 2 s" in caplog.text
    assert not [k for k in client.get_run(hung).data.metrics if k.startswith("system/")]


def test_status_lists_the_job_with_iteration_checkpoint_and_loss(finished_job):
    tmp, uri, _, _, run, _ = finished_job
    out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", uri], capture_output=True, text=True,
                         cwd=tmp)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.strip().splitlines()
    assert header.split()[:7] == ["RUN", "NAME", "EXPERIMENT", "MODEL", "STATUS", "ITERATION", "CHECKPOINT"]
    assert row.split()[:7] == [run.info.run_id, run.info.run_name, "demo", run.data.params["MODEL.TYPE"], "FINISHED",
                               "12/12", "model_final.pth"]
    assert run.data.params["MODEL.TYPE"] == load_config(DEMO, []).MODEL.TYPE  # the family, as the job's config has it
    assert f"{run.data.metrics['loss']:.4f}" in row


@pytest.mark.parametrize("server", ["down", "plain HTTP"])
@pytest.mark.parametrize("experiment", [[], ["--experiment", "demo"]])
def test_status_of_a_server_it_cannot_reach_says_why_in_one_line(server, experiment):
    """As a job's start says it. It printed MLflow's exception cut at 200 characters, mid-URL, before
    its cause (`Max retries exceeded with url: /api/2.0/mlflow/experiments/`; FAULTS row 347)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as plain:
        threading.Thread(target=plain.serve_forever, daemon=True).start()
        uri = "http://127.0.0.1:9" if server == "down" else f"https://127.0.0.1:{plain.server_port}"
        out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", uri, *experiment], capture_output=True,
                             text=True, timeout=120, env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "PATH": ""})
        plain.shutdown()
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    if server == "down":
        assert line == "error: cannot reach the tracking server at http://127.0.0.1:9 (is it running?)"
    else:
        assert line.startswith(f"error: the tracking server at {uri}: TLS failed ([SSL"), line


def test_no_resume_starts_a_new_run_and_nan_marks_it_failed_with_the_reason(finished_job, data_dir):
    tmp, uri, client, exp, first, _ = finished_job
    args = demo_overrides(tmp / "again", data_dir, **{"TRACKING.URI": uri, "SOLVER.MAX_ITER": 12,
                                                      "TRACKING.SYSTEM_METRICS": "true"})
    bad = run_trainer(args + ["--no-resume", "SOLVER.BASE_LR", "1e6", "SOLVER.WARM_UP_ITERS", "0"], cwd=tmp)
    assert bad.returncode == 1
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    assert len(runs) == 2 and runs[1].info.run_id == first.info.run_id
    assert runs[0].info.status == "FAILED"
    assert runs[0].data.tags["tracktron.status_reason"].startswith("loss is nan at iteration")


def test_data_synth_writes_a_coco_dataset(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trainer", "data", "synth", "--out", str(tmp_path / "shapes"),
                          "--num-images", "5", "--size", "64"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    import json

    coco = json.loads((tmp_path / "shapes" / "annotations.json").read_text())
    assert len(coco["images"]) == 5 and coco["annotations"] and len(coco["categories"]) == 3
    assert len(list((tmp_path / "shapes" / "images").glob("*.png"))) == 5


@pytest.mark.parametrize("kind", ["an unrelated SQLite database", "not a database", "no file"])
def test_status_reads_only_and_refuses_what_is_not_a_tracking_store(tmp_path, kind):
    """Pointed at the wrong file, `status` says so in one line and leaves it as it was: MLflow would
    create its tables in any SQLite file it opens."""
    import sqlite3

    path = tmp_path / "other.db"
    if kind == "an unrelated SQLite database":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE inventory (item TEXT, count INTEGER)")
    elif kind == "not a database":
        path.write_text("just some notes\n")
    before = path.read_bytes() if path.exists() else None
    out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", f"sqlite:///{path}"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert ("does not exist" if kind == "no file" else "is not an MLflow tracking store") in lines[0]
    assert (path.read_bytes() if path.exists() else None) == before  # untouched, and not created
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if kind == "no file" else ["other.db"])


def test_status_against_a_server_that_never_answers_ends_in_bounded_time(tmp_path):
    from tests.servers import FaultProxy

    with FaultProxy("http://127.0.0.1:9", mode="hang") as proxy:
        start = time.monotonic()
        out = _status("--uri", proxy.url, "--timeout", "3", cwd=tmp_path)
        took = time.monotonic() - start
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"error: cannot read jobs from {proxy.url}: no complete answer within 3s"
    assert took < 20, f"{took:.0f}s"


def test_status_against_a_server_that_sends_a_byte_every_second_gives_up_at_its_timeout(tmp_path):
    """Each byte restarts a read timeout, so a dripping server held `status` for as long as it kept
    dripping; --timeout bounds the whole answer."""
    from tests.servers import drip_server

    with drip_server() as url:
        start = time.monotonic()
        out = _status("--uri", url, "--timeout", "4", cwd=tmp_path)
        took = time.monotonic() - start
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == f"error: cannot read jobs from {url}: no complete answer within 4s"
    assert took < 20, f"{took:.0f}s"
    bad = _status("--uri", url, "--timeout", "nan", cwd=tmp_path)
    assert bad.returncode == 2 and "is not a valid integer" in bad.stderr


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """An MLflow store with no runs, made once; each test works on a copy of the file."""
    path = tmp_path_factory.mktemp("empty-store") / "store.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def _copy(store, tmp_path):
    import shutil

    path = tmp_path / "store.db"
    shutil.copyfile(store, path)
    return path, f"sqlite:///{path}"


def _status(*args, cwd):
    return subprocess.run([sys.executable, "-m", "trainer", "status", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_status_shows_what_others_wrote_to_the_store_as_plain_text(empty_store, tmp_path):
    """Names, tags and params are anyone's to write: their escape sequences, carriage returns and
    newlines are shown escaped, a credential in them hidden, and an ETA or loss no clock or column
    holds (NaN, inf, 1e300) is a dash or a short number instead of a traceback."""
    _, uri = _copy(empty_store, tmp_path)
    client = MlflowClient(uri)
    exp = client.create_experiment("exp\x1b[31mRED\x1b[0m\nline2")
    hostile = {"ansi\x1b]0;TITLE\x07\x1b[2J\rX": float("nan"), "https://bob:SECRETPW@host/": float("inf"),
               "plain": 1e300}
    for name, value in hostile.items():
        run = client.create_run(exp, run_name=name, tags={"tracktron.job": "j", "tracktron.ckpt.latest": "a\nb",
                                                          "tracktron.heartbeat": beat()})  # a live trainer
        client.log_param(run.info.run_id, "SOLVER.MAX_ITER", "\x1b[41m9")
        client.log_metric(run.info.run_id, "loss", value, step=3)
        client.log_metric(run.info.run_id, "eta_seconds", value, step=3)  # the runs stay RUNNING
    out = _status("--uri", uri, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert not set("\x1b\x07\r") & set(out.stdout + out.stderr)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 + len(hostile)  # a header and one line per run: no newline of theirs splits one
    assert "SECRETPW" not in out.stdout and "https://***@host/" in out.stdout
    assert all(" RUNNING " in line and line.split()[-1] == "-" for line in lines[1:])  # no ETA shown
    assert "1.798e+308" in out.stdout and len(max(lines, key=len)) < 400  # inf as MLflow keeps it, short


def test_every_page_of_a_search_is_read(empty_store, tmp_path):
    """A search returns a page at a time (1,000 by default): a store with more jobs or models than
    that is listed whole, not cut short without a word."""
    from trainer.tracking.search import every_page

    _, uri = _copy(empty_store, tmp_path)
    client = MlflowClient(uri)
    exp = client.create_experiment("many")
    made = {client.create_run(exp, tags={"tracktron.job": "j"}).info.run_id for _ in range(5)}
    found = every_page(client.search_runs, experiment_ids=[exp], max_results=2)
    assert {r.info.run_id for r in found} == made and len(found) == 5


def test_status_never_migrates_a_store_of_an_older_mlflow(empty_store, tmp_path):
    """MLflow runs every migration on a store that lacks one of its tables; `status` only reads."""
    import sqlite3

    path, uri = _copy(empty_store, tmp_path)
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE tags")  # as a store from before that table was added
    before = path.read_bytes()
    out = _status("--uri", uri, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: {path} is a tracking store of an older MLflow (it lacks the tags table); "
        f"`mlflow db upgrade {uri}` brings it up to date (back it up first)"]
    assert path.read_bytes() == before


def test_a_store_being_set_up_is_waited_for_then_given_up_on(empty_store, tmp_path, monkeypatch):
    """A job creating the store holds its lock: a reader says it waits, and gives up in bounded
    time (a job stopped with Ctrl-Z holds it for good). A FIFO as the lock file is refused at once."""
    import fcntl

    from trainer.errors import UserError
    from trainer.tracking import sqlite_store
    from trainer.tracking.search import job_runs

    def outcome(within: float = 30):  # on a thread, so that a reader that hangs fails the test instead
        result = []
        reader = threading.Thread(target=lambda: result.append(_raised(job_runs, uri)), daemon=True)
        reader.start()
        reader.join(within)
        assert result, f"status still waiting after {within} s"
        return result[0]

    path, uri = _copy(empty_store, tmp_path)
    lock = tmp_path / "store.db.lock"
    monkeypatch.setattr(sqlite_store, "READ_WAIT_S", 1)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        error = outcome()
        assert isinstance(error, UserError) and "another process has held" in str(error) and "for 1 s" in str(error)
    assert outcome() == []  # released: read at once
    lock.unlink()
    os.mkfifo(lock)
    error = outcome()
    assert isinstance(error, UserError) and "is not the lock file tracktron keeps beside store.db" in str(error)


def test_status_timeout_covers_a_held_store_and_a_write_locked_one_is_called_busy(empty_store, tmp_path):
    """--timeout was not applied while status waited for another job's store lock (up to 5 minutes),
    and a database in the middle of another process's write was called 'not an MLflow tracking store'."""
    import fcntl
    import sqlite3

    path, uri = _copy(empty_store, tmp_path)
    with open(tmp_path / "store.db.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        start = time.monotonic()
        out = _status("--uri", uri, "--timeout", "3", cwd=tmp_path)
        took = time.monotonic() - start
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].endswith("no complete answer within 3s"), out.stderr
    assert took < 20, f"{took:.0f}s"
    writer = sqlite3.connect(path)
    try:
        writer.execute("BEGIN EXCLUSIVE")
        out = _status("--uri", uri, "--timeout", "60", cwd=tmp_path)
    finally:
        writer.close()
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (f"error: the tracking store {path} is locked by another process's "
                                                   "write (for over 5 s); try again when it is done")
    assert _status("--uri", uri, cwd=tmp_path).stdout.strip() == "no tracktron jobs found"  # nothing damaged


def _raised(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e


@pytest.mark.parametrize("uri, shown, hidden", [
    ("sqlite:///", "names no database file", None),
    ("http://127.0.0.1:9/?t=SECRETVAL", "cannot reach the tracking server at http://127.0.0.1:9/?t=***", "SECRETVAL"),
    ("mlruns", "tracking URI mlruns: MLflow's file store (a folder such as ./mlruns) takes no new runs", None),
    # helper-56: printed whole (the `/` ended what was redacted); an empty --uri read MLFLOW_TRACKING_URI's store
    ("http://alice:se/cret99@127.0.0.1:9", "cannot read jobs from http://***@127.0.0.1:9", "cret99"),
    ("", "--uri needs a tracking URI (it was empty)", None),
    # SQLAlchemy opens pct%41.db as pctA.db: status made that store (read-only command) and said no jobs
    ("sqlite:///pct%41.db", "no tracking store at sqlite:///pct%41.db (pctA.db does not exist)", None),
])
def test_status_uris_that_cannot_be_read_are_one_line(tmp_path, uri, shown, hidden):
    out = subprocess.run([sys.executable, "-m", "trainer", "status", "--uri", uri], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, env={**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert shown in line and (hidden is None or hidden not in out.stderr)
    assert list(tmp_path.iterdir()) == []  # no store made


def test_status_shows_a_run_whose_trainer_stopped_beating_as_lost(empty_store, tmp_path):
    """A trainer killed by SIGKILL leaves its run RUNNING for good: an old heartbeat, or none, says it
    is gone; one from far ahead of this clock says nothing either way."""
    import json

    _, uri = _copy(empty_store, tmp_path)
    client = MlflowClient(uri)
    exp = client.create_experiment("beats")
    old = json.dumps({**json.loads(beat()), "time": time.time() - 100})
    ahead = json.dumps({**json.loads(beat()), "time": time.time() + 1e9})  # a trainer whose clock is 31 years fast
    trainer = subprocess.Popen(["sleep", "60"])
    dead = json.dumps({**json.loads(beat()), "pid": trainer.pid, "started": _process_start(trainer.pid)})
    trainer.kill()
    trainer.wait()
    huge = '{"time": 1' + "0" * 400 + "}"  # helper-56: an OverflowError's traceback, every job unreadable
    for name, tags in (("live", {"tracktron.heartbeat": beat()}), ("killed", {"tracktron.heartbeat": old}), ("none", {}),
                       ("huge", {"tracktron.heartbeat": huge}), ("edited", {"tracktron.heartbeat": "alive, I promise"}),
                       ("deep", {"tracktron.heartbeat": "[" * 100_000}),  # a tag anyone may edit: not JSON, or too deep
                       ("ahead", {"tracktron.heartbeat": ahead}), ("sigkilled", {"tracktron.heartbeat": dead})):
        run = client.create_run(exp, run_name=name, tags={"tracktron.job": "j", **tags})
        client.log_metric(run.info.run_id, "eta_seconds", 600, step=1)
    out = _status("--uri", uri, cwd=tmp_path)
    rows = {line.split()[1]: " ".join(line.split()[4:]) for line in out.stdout.strip().splitlines()[1:]}
    assert rows["live"] == "RUNNING -/? - - 0:10:00", out.stdout
    killed = re.fullmatch(r"LOST -/\? - - - no heartbeat for (\d+) s", rows["killed"])
    assert killed and 100 <= int(killed[1]) < 400, out.stdout
    assert rows["none"] == rows["huge"] == rows["edited"] == rows["deep"] == "LOST -/? - - - no heartbeat", out.stdout
    # a beat seconds old from a process of this machine that is gone: RUNNING for 80 s (red team of 2026-12-03, third)
    assert rows["sigkilled"] == "LOST -/? - - - its trainer's process on this machine has ended", out.stdout
    # shown RUNNING with an ETA for as long as the clocks differ (red team of 2026-12-03, second)
    assert re.fullmatch(r"UNKNOWN -/\? - - - its heartbeat is 11574 days, \d+:\d\d:\d\d ahead of this clock: a "
                        r"trainer's clock is wrong", rows["ahead"]), out.stdout


def test_status_of_a_misspelt_or_deleted_experiment_is_an_error(empty_store, tmp_path):
    _, uri = _copy(empty_store, tmp_path)
    client = MlflowClient(uri)
    client.create_experiment("empty")
    client.delete_experiment(gone := client.create_experiment("gone"))
    assert _status("--uri", uri, "--experiment", "empty", cwd=tmp_path).stdout.strip() == "no tracktron jobs found"
    for name, error in (("emtpy", f"no experiment named 'emtpy' on {uri}"), ("gone", f"experiment 'gone' on {uri} is "
                        f"deleted (MLFLOW_TRACKING_URI={uri} mlflow experiments restore --experiment-id {gone} brings it back)"),
                        ("", "--experiment needs a name (it was empty); leave it out for every experiment")):  # it listed all
        out = _status("--uri", uri, "--experiment", name, cwd=tmp_path)
        assert (out.returncode, out.stderr.strip().splitlines()) == (2, [f"error: {error}"])


@pytest.mark.parametrize("store", ["sqlite", "server"])
def test_status_timeout_is_the_stores_not_mlflows_import_time(store, empty_store, tmp_path, request):
    """MLflow's imports take seconds on a busy host (10 s here): --timeout times the requests alone."""
    uri = _copy(empty_store, tmp_path)[1] if store == "sqlite" else request.getfixturevalue("mlflow_server").url
    slow = ("import sys, time\nclass Slow:\n    def find_spec(self, name, *_):\n        if name == 'mlflow':\n"
            "            time.sleep(10)\nsys.meta_path.insert(0, Slow())\nfrom trainer.cli import main\n"
            f"main(['status', '--uri', {uri!r}, '--timeout', '8'])")
    out = subprocess.run([sys.executable, "-c", slow], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr


def test_status_never_adds_mlflows_default_experiment_to_a_store(empty_store, tmp_path):
    """MLflow adds its Default experiment (id 0) to a store it opens that lacks one; `status` only reads."""
    import sqlite3

    path, uri = _copy(empty_store, tmp_path)
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM experiments WHERE experiment_id = 0")
    before = path.read_bytes()
    out = _status("--uri", uri, cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"error: {path} has no Default experiment (id 0)") and path.read_bytes() == before


def test_a_store_whose_name_holds_a_percent_escape_is_the_one_mlflow_opens(empty_store, tmp_path):
    """helper-56: `my%20store.db` names `my store.db` to SQLAlchemy, which MLflow reads; tracktron
    looked for a file literally named so and refused it."""
    import shutil

    shutil.copyfile(empty_store, tmp_path / "my store.db")
    MlflowClient(f"sqlite:///{tmp_path / 'my store.db'}").create_experiment("spaced")
    out = _status("--uri", f"sqlite:///{tmp_path}/my%20store.db", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "no tracktron jobs found", out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my store.db"]


def test_a_store_a_killed_process_left_mid_write_is_rolled_back_and_read(empty_store, tmp_path):
    """helper-70: a trainer SIGKILLed inside a write leaves the store's hot journal, which SQLite
    rolls back only on a read-write open: the read-only look before MLflow's made every command
    (`status`, a resume, `--dry-run`) say `attempt to write a readonly database`, for good."""
    from mlflow.entities import Metric

    path, uri = _copy(empty_store, tmp_path)
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("killed"), tags={"tracktron.job": "j"}).info.run_id
    client.log_batch(run, metrics=[Metric("loss", 1.0, 0, step) for step in range(3000)])
    writer = ("import os, signal, sqlite3, sys\n"
              "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
              "db.execute('PRAGMA cache_size=1')\n"  # the change spills into the file: the journal is hot
              "db.execute('BEGIN IMMEDIATE')\n"
              "db.execute('UPDATE metrics SET value = value + 1')\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", writer, str(path)], timeout=60)
    assert killed.returncode == -9 and (tmp_path / "store.db-journal").is_file()
    out = _status("--uri", uri, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 2 and not (tmp_path / "store.db-journal").exists()
    assert {m.value for m in client.get_metric_history(run, "loss")} == {1.0}  # the half write undone
