"""What the second and third adversarial passes found, each case as the user met it (docs/FAULTS.md,
rows 72-82 and 83-90; `tracktron status` against a store others wrote: tests/test_status.py).

Every refusal is one line and exit status 2 before anything is written: no run, no store file,
no lock beside somebody else's file, nothing in OUTPUT_DIR damaged. The CLI runs in this process
(tests.test_bad_input.run_cli); the two cases that train run the real loop on the synthetic set.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric
from PIL import Image
import torch

from tests.conftest import DEMO
from tests.test_bad_input import assert_exit_2, run_cli
from trainer.config import load_config
from trainer.redaction import redact_text


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def train(tmp: Path, *opts: str, data_dir: Path | None = None, dry_run: bool = False, flags: tuple = ()):
    base = ["OUTPUT_DIR", str(tmp / "output"), "TRACKING.URI", f"sqlite:///{tmp / 'mlflow.db'}",
            "SOLVER.MAX_ITER", "4", "TRAIN.SNAPSHOT_ITERS", "1", "DATA_LOADER.NUM_THREADS", "0",
            "TRAIN.IMS_PER_BATCH", "2", "TEST.DATASETS", "()", "TRACKING.LOG_MODEL", "false",
            "TRACKING.REGISTERED_MODEL", ""]
    if data_dir is not None:
        base += ["DATA_DIR", str(data_dir)]
    return run_cli(["train", "--config", str(DEMO), *(["--dry-run"] if dry_run else []), *flags, *base, *opts])


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- config values --------------------------------------------------------------------------------

DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("opts, message", [
    (["OUTPUT_DIR", ""], "OUTPUT_DIR must name a folder"),  # it trained into the working directory
    (["OUTPUT_DIR", "out\nput"], "OUTPUT_DIR must be printable"),  # YAML made it `out put`
    (["DATA_DIR", '"data\\n"'], "DATA_DIR must be printable"),  # a folder named with its newline, even by --dry-run
    (["SOLVER.MAX_ITER", "1000000000000000"], "SOLVER.MAX_ITER must be 1 to 1,000,000,000"),  # OverflowError in the ETA
    (["LOG_PERIOD", "99999999999999999999999"], "LOG_PERIOD is out of range"),  # OverflowError in a deque
    (["NUM_GPUS", "99999999999999999999999"], "NUM_GPUS is out of range"),  # accepted silently
    (["TRAIN.DATASETS", "synth_shapes_train #x"], "' #' starts a YAML comment"),  # the rest dropped
    (["TRAIN.SCALES", DEEP], "TRAIN.SCALES: the value is nested too deeply"),  # RecursionError
], ids=["empty-output-dir", "newline-output-dir", "newline-data-dir", "huge-max-iter", "huge-log-period", "huge-num-gpus",
        "yaml-comment", "deep-override"])
def test_config_values_past_what_a_job_can_be(here, opts, message):
    assert_exit_2(train(here, *opts), message)
    assert sorted(p.name for p in here.iterdir()) == []


def test_dry_run_shows_a_name_with_escape_sequences_escaped(here, data_dir):
    """NAME (and the paths and dataset names beside it) reached the terminal raw in the plan: an
    escape sequence cleared the screen or retitled the window. Found by the red team of 2026-12-03."""
    plan = train(here, "NAME", "'job\x1b[2J\x1b]0;pwned\x07'", data_dir=data_dir, dry_run=True)
    assert plan.code is None, plan.stderr[-2000:]
    assert "job\\x1b[2J\\x1b]0;pwned\\x07" in plan.stdout and not set("\x1b\x07") & set(plan.stdout)


def test_a_config_file_nested_hundreds_deep_or_not_a_file_is_one_line(here):
    deep = here / "deep.yaml"
    deep.write_text("DATASET_CATALOG: {x: " + "[" * 400 + "]" * 400 + "}\n")
    assert_exit_2(run_cli(["train", "--config", str(deep)]), "deep.yaml: nested too deeply")
    os.mkfifo(here / "pipe.yaml")  # reading it would wait forever
    assert_exit_2(run_cli(["train", "--config", str(here / "pipe.yaml")]), "pipe.yaml is not a regular file")
    # `tracktron config` drew the file's name raw in its first line: an escape sequence set the title (helper-56)
    titled = here / "ev\x1b]0;PWNED\x07X.yaml"
    titled.write_text(DEMO.read_text())
    out = subprocess.run([sys.executable, "-m", "trainer", "config", "--config", str(titled)], capture_output=True,
                         text=True, timeout=300, cwd=here)
    assert out.returncode == 0 and not set("\x1b\x07") & set(out.stdout + out.stderr), out.stderr
    assert out.stdout.startswith(f"# {here}/ev\\x1b]0;PWNED\\x07X.yaml: a tracktron config"), out.stdout[:200]
    # `mlflow run . -P config=`: the line named `.`, which nobody typed (helper-54)
    for command in (["train"], ["eval", "--weights", "x.pth"], ["config"]):
        assert_exit_2(run_cli([*command, "--config", ""]), "--config is empty: name a YAML config file")


def test_string_keys_keep_the_word_as_typed():
    cfg = load_config(DEMO, ["OUTPUT_DIR", "/tmp/run #2", "TRACKING.RUN_NAME", "*x", "TRAIN.WEIGHTS", "null",
                             "TRAIN.DATASETS", "(synth_shapes_train,)", "TRACKING.EXPERIMENT", "'quoted'"])
    assert cfg.OUTPUT_DIR == "/tmp/run #2"  # was `/tmp/run`: ` #` began a YAML comment
    assert cfg.TRACKING.RUN_NAME == "*x"  # was "YAML aliases are not allowed"
    assert cfg.TRAIN.WEIGHTS == "" and cfg.TRACKING.EXPERIMENT == "quoted"
    assert cfg.TRAIN.DATASETS == ["synth_shapes_train"]  # was ['(synth_shapes_train', ')']


def test_weights_that_are_a_folder_and_a_file_store_say_what_they_are(here):
    (here / "weights").mkdir()
    assert_exit_2(train(here, "TRAIN.WEIGHTS", str(here / "weights"), dry_run=True),
                  "not a weights file (a folder or a device)")  # said "no such file"
    result = train(here, "TRACKING.URI", f"file://{here / 'mlruns'}")  # MLflow's notice, cut at "See htt"
    assert_exit_2(result, "MLflow's file store (a folder such as ./mlruns) takes no new runs; use a database")
    assert not (here / "mlruns").exists()


def test_an_empty_resume_id_is_refused(here):
    result = run_cli(["train", "--config", str(DEMO), "--resume", "", "OUTPUT_DIR", str(here / "output")])
    assert_exit_2(result, "--resume needs a run id")  # an unset $RUN_ID started a new job


# ---- OUTPUT_DIR -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda p: p.mkdir(),
    lambda p: os.mkfifo(p),  # the resume scan hung on it
    lambda p: p.symlink_to("/dev/zero"),  # the resume scan read until the OOM killer came
], ids=["folder", "fifo", "link-to-dev-zero"])
@pytest.mark.parametrize("name", ["model_iter1.pth", "json_stats.log", "config.yaml", "model.txt", "unsent_metrics.json",
                                  "log.txt"])
def test_an_output_name_that_is_no_file_is_refused_before_the_run(here, make, name):
    """Found for json_stats.log, config.yaml and model.txt too: the run made, then a hang at the first
    stats line (a FIFO) or an IsADirectoryError traceback (a folder)."""
    out = here / "output"
    out.mkdir()
    make(out / name)
    for dry_run in (True, False):
        assert_exit_2(train(here, dry_run=dry_run), f"{name} there is not a regular file")
    assert not (here / "mlflow.db").exists()


def test_an_output_dir_too_long_for_the_names_inside_is_refused_before_the_run(here):
    """4,080 bytes passed the checks (the system allows 4,096), then the run was made and writing
    `.config.yaml.tmp.<pid>` in it failed with ENAMETOOLONG: a traceback, the run FAILED."""
    deep = here.joinpath(*["d" * 200] * ((4080 - len(str(here))) // 201))
    deep = deep / ("e" * (4080 - len(str(deep)) - 1))  # 4,080 bytes in all
    for dry_run in (True, False):
        assert_exit_2(train(here, "OUTPUT_DIR", str(deep), dry_run=dry_run), "OUTPUT_DIR is too long: ")
    assert not (here / "mlflow.db").exists() and not (here / ("d" * 200)).exists()


def test_another_jobs_checkpoint_is_refused_before_the_run_and_by_dry_run(here, data_dir):
    first = train(here, "TRACKING.ENABLED", "false", "SOLVER.MAX_ITER", "1", data_dir=data_dir)
    assert first.code is None, first.stderr
    final = here / "output" / "model_final.pth"
    before = digest(final)
    for dry_run in (True, False):  # --dry-run said "model_final.pth is here: nothing to do"
        result = train(here, "SOLVER.BASE_LR", "0.001", "SOLVER.MAX_ITER", "1", data_dir=data_dir, dry_run=dry_run)
        assert_exit_2(result, "model_final.pth is from another job (SOLVER.BASE_LR differ)")
        assert result.stderr.strip().splitlines() == [result.last_line]  # the dataset's INFO line came first
    assert not (here / "mlflow.db").exists()  # a FAILED run was made in a new store first
    assert digest(final) == before


def test_files_named_like_checkpoints_never_push_out_the_jobs_own(here, data_dir):
    """Copies cut short under later names (model_iter100..102) counted as the newest: every new
    checkpoint was deleted as soon as it was written, and a kill would have had nothing to resume.
    Names no checkpoint of a job has (a leading zero, a full-width digit, a newline after `.pth`)
    read as the job's own iterations took their place in pruning, which deleted the job's newest
    checkpoint (helper-51): they are not checkpoints at all."""
    out = here / "output"
    out.mkdir()
    names = [f"model_iter{i}.pth" for i in (100, 101, 102)] + [
        "model_iter02.pth", "model_iter002.pth", "model_iter\uff12.pth", "model_iter2.pth\n", "model_iter1.pth\n"]
    junk = {out / name: os.urandom(3000) for name in names}
    for path, data in junk.items():
        path.write_bytes(data)
    result = train(here, "TRACKING.ENABLED", "false", "TRAIN.CHECKPOINTS_KEEP", "2", data_dir=data_dir)
    assert result.code is None, result.stderr
    assert all(path.read_bytes() == data for path, data in junk.items())  # not ours to delete
    kept = sorted(p.name for p in out.glob("model_*.pth") if p not in junk)
    assert kept == ["model_final.pth", "model_iter1.pth", "model_iter2.pth"]  # the newest 2 + final



@pytest.mark.parametrize("name", ["json_stats.log", "log.txt", "model", "model/detector", "eval", "eval/synth_shapes_val"])
def test_a_link_the_job_would_write_through_is_refused_before_anything_is_written(here, name):
    """helper-51's red team: an `OUTPUT_DIR/json_stats.log` link (a `cp -as` copy of another job's
    folder) had the job append to the file it points at; a `model` link had it overwrite another
    job's model, an `eval` one write detections there. Links the job replaces by name (config.yaml,
    a checkpoint) stay allowed."""
    elsewhere = here / "elsewhere"
    (elsewhere / "detector").mkdir(parents=True)
    (elsewhere / "detector" / "weights.pt").write_bytes(b"another job's")
    (elsewhere / "json_stats.log").write_text('{"iter": 0}\n')
    before = {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    link = here / "output" / name
    link.parent.mkdir(parents=True)
    link.symlink_to(elsewhere / "json_stats.log" if name.endswith((".log", ".txt")) else elsewhere)
    for dry_run in (True, False):
        assert_exit_2(train(here, dry_run=dry_run), f"{name} there is a link to {link.readlink()}, which the job would "
                                                    "write through; move it away")
    assert {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before
    assert not (here / "mlflow.db").exists()



@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir) -> Path:
    """An untracked job's OUTPUT_DIR: model_iter0-2 and model_final of 4 iterations."""
    tmp = tmp_path_factory.mktemp("trained")
    result = train(tmp, "TRACKING.ENABLED", "false", "DETERMINISTIC", "true", data_dir=data_dir)
    assert result.code is None, result.stderr
    return tmp / "output"


def _hand_built(here: Path, trained: Path, change, name: str = "model_iter2.pth") -> Path:
    """OUTPUT_DIR with the job's model_iter1.pth and a changed copy of its model_iter2.pth as `name`."""
    out = here / "output"
    out.mkdir()
    shutil.copy(trained / "model_iter1.pth", out)
    state = torch.load(trained / "model_iter2.pth", weights_only=True)
    change(state)
    torch.save(state, out / name)
    return out


UNRESTORABLE = {
    "no optimizer": lambda s: s.pop("optimizer"),
    "no rng": lambda s: s.pop("rng"),
    "weights a tensor": lambda s: s.update(model=torch.zeros(3)),
    "no weights": lambda s: s.update(model={}),
    "a tensor of another shape": lambda s: s["model"].update({next(iter(s["model"])): torch.zeros(1)}),
    "no parameter groups": lambda s: s["optimizer"].update(param_groups=[]),
    "scheduler a string": lambda s: s.update(scheduler="x"),
    "rng of another kind": lambda s: s.update(rng=[{"python": 1}]),
    "the scheduler's iteration a word": lambda s: s["scheduler"].update(last_epoch="x"),  # helper-53
    "an lr that is a word": lambda s: s["optimizer"]["param_groups"][0].update(lr="x"),
    "a GPU random state that is a word": lambda s: s["rng"][0].update(cuda=["x"]),  # a GPU host's set_rng_state fails
    "an AMP scale that is a word": lambda s: s.update(scaler={"scale": "x", "_growth_tracker": 0}),
}


@pytest.mark.parametrize("change", UNRESTORABLE.values(), ids=UNRESTORABLE.keys())
def test_a_checkpoint_the_engine_cannot_restore_is_skipped_for_the_one_before_it(here, data_dir, trained, change):
    """helper-51's red team: checkpoints built by hand that load() accepts (a dict with `model` and
    `iteration`) were a traceback after the run was reopened (KeyError: 'optimizer', size mismatch,
    ...), tracked ones uploaded first as the checkpoint the run lacked, and every rerun failed the
    same way. The engine's restore is tried before: such a file is skipped, as a corrupt one is."""
    _hand_built(here, trained, change)
    result = train(here, "TRACKING.ENABLED", "false", "DETERMINISTIC", "true", data_dir=data_dir, dry_run=True)
    assert result.code is None, result.stderr
    assert "model_iter2.pth: it does not restore into this job's network and optimizer" in result.stderr
    assert "newest checkpoint model_iter1.pth: resumes at iteration 2" in result.stdout


def test_a_job_resumes_bit_identically_from_the_checkpoint_before_one_it_cannot_restore(here, data_dir, trained):
    out = _hand_built(here, trained, UNRESTORABLE["no optimizer"])
    result = train(here, "TRACKING.ENABLED", "false", "DETERMINISTIC", "true", data_dir=data_dir)
    assert result.code is None, result.stderr
    final, reference = (torch.load(p / "model_final.pth", weights_only=True)["model"] for p in (out, trained))
    assert all(torch.equal(final[k], reference[k]) for k in reference)



def test_a_folder_whose_checkpoints_all_fail_to_restore_stops_before_writing_over_them(here, data_dir, trained):
    """Skipped with none left to resume from, the job started from iteration 0 and wrote its own
    model_iter2.pth over the one it could not restore (helper-53): one line, exit 2, the file kept."""
    out = _hand_built(here, trained, UNRESTORABLE["no rng"])
    (out / "model_iter1.pth").unlink()
    before = (out / "model_iter2.pth").read_bytes()
    for dry_run in (True, False):
        assert_exit_2(train(here, "TRACKING.ENABLED", "false", "DETERMINISTIC", "true", data_dir=data_dir,
                            dry_run=dry_run), "no checkpoint in OUTPUT_DIR does: move them out of it, or --no-resume")
    assert (out / "model_iter2.pth").read_bytes() == before


@pytest.mark.parametrize("name, iteration, message", [
    ("model_iter2.pth", 2.0, "holds iteration 2.0, not the 2 its name says"),  # a float: `seed must be integer`
    ("model_iter2.pth", torch.tensor(2), "holds iteration tensor(2), not the 2 its name says"),
    ("model_iter15.pth", 15, "holds iteration 15, past this job's last (3, SOLVER.MAX_ITER 4)"),  # trained to 16 of 4
])
def test_a_checkpoint_whose_iteration_is_no_iteration_of_the_job_is_refused(here, data_dir, trained, name, iteration,
                                                                            message):
    out = _hand_built(here, trained, lambda s: s.update(iteration=iteration), name)
    before = (out / name).read_bytes()
    for dry_run in (True, False):
        assert_exit_2(train(here, "TRACKING.ENABLED", "false", "DETERMINISTIC", "true", data_dir=data_dir,
                            dry_run=dry_run), message)
    assert (out / name).read_bytes() == before


# ---- tracking stores --------------------------------------------------------------------------------

def test_a_sqlite_file_that_is_no_mlflow_store_is_never_written(here, data_dir):
    db = here / "people.db"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE experiments (id INTEGER, name TEXT)")  # MLflow's migrations altered it
        c.execute("INSERT INTO experiments VALUES (1, 'mine')")
    before = digest(db)
    result = train(here, "TRACKING.URI", f"sqlite:///{db}", data_dir=data_dir)
    assert_exit_2(result, "people.db is not an MLflow tracking store")
    assert digest(db) == before and sorted(p.name for p in here.iterdir()) == ["people.db"]  # no .lock beside it


def test_a_folder_as_the_sqlite_file_is_one_line_at_once(here):
    (here / "store").mkdir()  # MLflow retried opening it for two minutes
    assert_exit_2(train(here, "TRACKING.URI", f"sqlite:///{here / 'store'}"), "store is a folder or a device")
    result = run_cli(["status", "--uri", f"sqlite:///{here / 'store'}"])
    assert_exit_2(result, "store is a folder or a device")  # said "does not exist"


@pytest.mark.parametrize("weights", ["runs:/0123456789abcdef0123456789abcdef/model", "models:/nope@best"])
def test_weights_from_mlflow_never_make_a_store(here, weights):
    for dry_run in (True, False):
        assert_exit_2(train(here, "TRAIN.WEIGHTS", weights, dry_run=dry_run), "no tracking store at")
    Image.new("RGB", (32, 32)).save(here / "x.png")
    result = run_cli(["predict", "--weights", weights, "--out", str(here / "p"), str(here / "x.png"),
                      "TRACKING.URI", f"sqlite:///{here / 'mlflow.db'}"])
    assert_exit_2(result, "no tracking store at")  # predict and eval made one, 218 tables
    assert not (here / "mlflow.db").exists()


def test_a_launchers_run_id_that_does_not_exist_is_refused(here, monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "0123456789abcdef0123456789abcdef")  # it trained in a new run
    assert_exit_2(train(here), "MLFLOW_RUN_ID 0123456789abcdef0123456789abcdef does not exist")
    assert not (here / "mlflow.db").exists()
    MlflowClient(f"sqlite:///{here / 'mlflow.db'}").search_experiments()  # now a store, without that run
    assert_exit_2(train(here), "MLFLOW_RUN_ID 0123456789abcdef0123456789abcdef does not exist on sqlite:///")


def test_a_launchers_run_id_of_another_job_is_refused_and_its_run_untouched(here, monkeypatch):
    """MLFLOW_RUN_ID (left exported, or `mlflow run --run-id`) of another job's run: the job said
    'nothing to do' when that run was finished, and otherwise resumed the other job's checkpoint,
    trained it at its own settings and set the other job's run FINISHED. --resume refused it."""
    uri = f"sqlite:///{here / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("demo")
    theirs = client.create_run(exp, tags={"tracktron.job": "0123456789abcdef"})
    client.set_terminated(theirs.info.run_id, "KILLED")
    monkeypatch.setenv("MLFLOW_RUN_ID", theirs.info.run_id)
    for dry_run in (True, False):
        assert_exit_2(train(here, dry_run=dry_run), f"MLFLOW_RUN_ID {theirs.info.run_id} is another job's (job "
                                                     "0123456789abcdef; this config is job ")
    after = client.get_run(theirs.info.run_id)
    assert after.info.status == "KILLED" and not after.data.metrics and not (here / "output").exists()


def test_a_launchers_run_id_of_a_foreign_run_is_refused_and_its_run_untouched(here, monkeypatch):
    """MLFLOW_RUN_ID left exported from another project's run (no tracktron.job tag): the job adopted
    it, wrote its tags, metrics and checkpoints into it and set its status. A launcher's run
    (`mlflow run`) is RUNNING with no metrics yet; an ended one, or one with metrics, is refused."""
    client = MlflowClient(f"sqlite:///{here / 'mlflow.db'}")
    exp = client.create_experiment("demo")
    for status, metrics in (("FINISHED", {"accuracy": 0.9}), ("FAILED", {}), ("RUNNING", {"accuracy": 0.5})):
        theirs = client.create_run(exp, tags={"team": "nlp"}).info.run_id
        client.log_batch(theirs, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        if status != "RUNNING":
            client.set_terminated(theirs, status)
        before = client.get_run(theirs)
        monkeypatch.setenv("MLFLOW_RUN_ID", theirs)
        for dry_run in (True, False):
            assert_exit_2(train(here, dry_run=dry_run), f"MLFLOW_RUN_ID {theirs} is not a tracktron run (no "
                          f"tracktron.job tag) and is {status} with {len(metrics)} metrics: only an empty, unfinished "
                          "run is adopted; unset MLFLOW_RUN_ID to start this job's run in a new one")
        after = client.get_run(theirs)
        assert (after.info.status, after.data.tags, after.data.metrics) == (status, before.data.tags, metrics)
    assert len(client.search_runs([exp])) == 3 and not (here / "output").exists()


def test_a_launchers_run_id_of_this_jobs_run_with_no_resume_is_refused(here, monkeypatch, data_dir):
    """MLFLOW_RUN_ID of the job's own run with --no-resume ("start over in a new run"): the job
    resumed that run from its checkpoint, silently. --resume RUN_ID --no-resume was refused.
    Found by the red team of 2026-12-03."""
    first = train(here, data_dir=data_dir)
    assert first.code is None, first.stderr
    client = MlflowClient(f"sqlite:///{here / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    before = client.get_run(run.info.run_id)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    refused = train(here, data_dir=data_dir, flags=("--no-resume",))
    assert_exit_2(refused, f"MLFLOW_RUN_ID {run.info.run_id} is this job's run, which --no-resume would not continue: "
                           "unset MLFLOW_RUN_ID to start the job over in a new run, or drop --no-resume")
    after = client.get_run(run.info.run_id)
    assert (after.info.status, after.data.tags) == (before.info.status, before.data.tags)


def test_mlflow_experiment_id_is_read_as_mlflow_reads_it(here, monkeypatch, data_dir):
    """MLFLOW_EXPERIMENT_ID was ignored: the job went to the experiment named after its config."""
    uri = f"sqlite:///{here / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "999")
    assert_exit_2(train(here), f"MLFLOW_EXPERIMENT_ID 999 does not exist on {uri} (there is no store yet)")
    assert not (here / "mlflow.db").exists()
    client = MlflowClient(uri)
    chosen = client.create_experiment("chosen")
    for dry_run in (True, False):
        assert_exit_2(train(here, dry_run=dry_run), f"MLFLOW_EXPERIMENT_ID 999 does not exist on {uri}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", chosen)
    assert "experiment chosen, a new run" in train(here, "SOLVER.MAX_ITER", "1", dry_run=True).stdout
    done = train(here, "SOLVER.MAX_ITER", "1", data_dir=data_dir)
    assert done.code is None, done.stderr
    (run,) = client.search_runs([chosen])
    assert run.info.status == "FINISHED"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "by-name")  # a name comes first, as in MLflow
    assert "experiment by-name (new), a new run" in train(here, "SOLVER.MAX_ITER", "1", dry_run=True).stdout


def test_a_tracking_uri_read_from_a_secrets_file_keeps_no_trailing_newline(here, monkeypatch):
    """`MLFLOW_TRACKING_URI=$(cat /secrets/uri)` keeps no newline, but one mounted as an env var from
    a Kubernetes Secret does: it was refused as `Invalid url` with the newline inside the line."""
    uri = f"sqlite:///{here / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"{uri}\n")
    plan = train(here, "TRACKING.URI", "", dry_run=True)
    assert plan.code is None and f"tracking: {uri}: a new store" in plan.stdout, plan.stderr
    plan = train(here, "TRACKING.URI", f" {uri}\n", dry_run=True)
    assert plan.code is None and f"tracking: {uri}: a new store" in plan.stdout, plan.stderr


# ---- secrets ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, secret", [
    ("TRAIN.WEIGHTS", "http://127.0.0.1:9/w.pth?X-Amz-Credential=AKIAX&X-Amz-Signature=SIGSECRET2", "SIGSECRET2"),
    ("TRAIN.WEIGHTS", "http://u:PW@SECRET4@127.0.0.1:9/w.pth", "SECRET4"),  # an unescaped @ in the password
    ("TRACKING.URI", "http://127.0.0.1:9/?token=QTOKSECRET", "QTOKSECRET"),
    ("TRACKING.URI", "HTTPS://127.0.0.1:9/?token=QTOKSECRET", "QTOKSECRET"),
], ids=["presigned-url", "at-in-password", "token-in-query", "token-in-query-capital-scheme"])
def test_a_secret_in_a_url_never_reaches_the_error_line(here, key, value, secret):
    result = train(here, key, value)
    assert result.code == 2 and secret not in result.stderr + result.stdout, result.stderr
    assert "***" in result.last_line


def test_url_redaction_keeps_what_is_not_secret():
    assert redact_text("see http://h/x.pth?a=1&b=two") == "see http://h/x.pth?a=***&b=***"
    assert redact_text("models:/name@best and s3://bucket/key") == "models:/name@best and s3://bucket/key"
    assert redact_text("http://host:5000/#/experiments/1") == "http://host:5000/#/experiments/1"


# ---- data synth ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", ["16", "100000"])  # a traceback (low >= high); 224 GiB asked of numpy
def test_synth_sizes_it_cannot_draw_are_refused(here, size):
    result = run_cli(["data", "synth", "--out", str(here / "s"), "--num-images", "2", "--size", size])
    assert_exit_2(result, "Invalid value for '--size'")
    assert not (here / "s").exists()


# ---- datasets (third pass) ------------------------------------------------------------------------

@pytest.fixture
def dataset(here, data_dir):
    """A copy of the synthetic training set, to damage."""
    import shutil

    cfg = load_config(DEMO, ["DATA_DIR", str(data_dir)])
    from trainer.data import resolve_dataset

    images, _ = resolve_dataset(cfg, "synth_shapes_train")
    return Path(shutil.copytree(images.parent, here / "ds"))


@pytest.mark.parametrize("make", [
    lambda p: os.mkfifo(p),  # the loader waited for a writer forever, the run left RUNNING
    lambda p: p.mkdir(),
    lambda p: p.symlink_to("/dev/zero"),  # read until a MemoryError
], ids=["a FIFO", "a folder", "a link to /dev/zero"])
def test_dataset_images_that_are_no_files_are_refused_before_the_run(here, dataset, make):
    first = sorted((dataset / "images").iterdir())[0]
    first.unlink()
    make(first)
    result = train(here, "TRAIN.DATASETS", f"('{dataset}',)")
    assert_exit_2(result, f"1 of 64 images listed in {dataset / 'annotations.json'} are no image files (a folder, "
                          f"a FIFO, a device, a broken link) in {dataset / 'images'}, e.g. {first.name}")
    assert sorted(p.name for p in here.iterdir()) == ["ds"]  # no store, no run, no OUTPUT_DIR


@pytest.mark.parametrize("change, message", [
    ('"annotations": null', None),  # a test set's file without annotations: none
    ('"bbox": [1' + "0" * 400 + ", 1, 2, 3]", "x, y, w, h must be finite numbers"),  # OverflowError in isfinite
    ('"width": 1' + "0" * 5000, "Exceeds the limit (4300 digits)"),  # a ValueError json raised, not a JSONDecodeError
])
def test_annotation_numbers_past_what_json_and_float32_hold_are_one_line(dataset, change, message):
    import json

    from trainer.data import CocoDetection
    from trainer.errors import UserError

    ann = dataset / "annotations.json"
    data = json.loads(ann.read_text())
    key = change.split('"')[1]
    text = json.dumps({**data, "annotations": "@"} if key == "annotations" else data)
    if key == "annotations":
        text = text.replace('"annotations": "@"', change)
    else:  # the first image's or annotation's value, as another tool wrote it
        old = json.dumps({key: data["annotations" if key == "bbox" else "images"][0][key]})[1:-1]
        text = text.replace(old, change, 1)
    ann.write_text(text)
    if message is None:
        assert len(CocoDetection(dataset / "images", ann, train=False)) == 64
    else:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            CocoDetection(dataset / "images", ann, train=True)


def test_test_sets_with_missing_masks_or_keypoints_are_evaluated_as_training_reads_them(tmp_path):
    """COCOeval crashed on a ground truth without a segmentation (or with [] or a 4-number polygon,
    which pycocotools takes for a box) and on keypoints without num_keypoints, after the whole
    training; the rerun then had nothing to do. They count as an empty mask and no visible point."""
    import contextlib
    import io
    import json

    from trainer.data import CocoDetection
    from trainer.evaluation import run_cocoeval

    (tmp_path / "images").mkdir()
    Image.new("RGB", (64, 48)).save(tmp_path / "images" / "a.png")
    flawed = [{}, {"segmentation": None}, {"segmentation": []}, {"segmentation": [[]]},
              {"segmentation": [[1, 2, 3, 4]]}, {"segmentation": [[1, 2, 3, 4], [10, 10, 30, 10, 30, 30]]},
              {"keypoints": None}, {"keypoints": [5, 5, 2, 9, 9, 0]}]  # none has num_keypoints
    anns = [{"id": i + 1, "image_id": 1, "category_id": 1, "bbox": [8, 8, 20, 20], **f} for i, f in enumerate(flawed)]
    ann = tmp_path / "annotations.json"
    ann.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png", "width": 64, "height": 48}],
                               "categories": [{"id": 1, "name": "x", "keypoints": ["l", "r"]}], "annotations": anns}))
    for kind, needs in (("segm", {"masks": True}), ("keypoints", {"keypoints": True})):
        gt = CocoDetection(tmp_path / "images", ann, train=False, **needs).coco
        found = {"image_id": 1, "category_id": 1, "bbox": [8, 8, 20, 20], "score": 0.9}
        found.update({"segmentation": gt.annToRLE(gt.anns[6])} if kind == "segm" else {"keypoints": [5, 5, 1, 9, 9, 1]})
        with contextlib.redirect_stdout(io.StringIO()):
            evaluation = run_cocoeval(gt, [found], kind)
        assert evaluation.stats[0] >= 0  # a number, not -1 (no ground truth) and not a crash
    assert [a["num_keypoints"] for a in gt.dataset["annotations"]][-2:] == [0, 1]


def test_options_after_the_overrides_are_refused_not_taken(here):
    """MLproject passes `opts` after `--`: a flag in them (`--dry-run --config other.yaml`) is an
    error, not an option that changes the job the launcher recorded."""
    result = run_cli(["train", "--config", str(DEMO), "--", "--dry-run", "--config", "other.yaml"])
    assert_exit_2(result, "'--dry-run' among the KEY VALUE overrides: options go before them")


def test_names_hide_a_urls_credentials_but_are_never_changed_by_other_secrets():
    """A run or experiment name is an identity: a URL's password or token in it is hidden, but a
    word that happens to equal a secret this process holds (an env password) stays as typed, or
    every job would land in an experiment named ***."""
    from trainer.redaction import remember
    from trainer.tracking.job_run import _run_name
    from trainer.tracking.runs import experiment_name

    remember("words-that-are-also-a-password")
    cfg = load_config(DEMO, ["TRACKING.EXPERIMENT", "words-that-are-also-a-password",
                             "TRACKING.RUN_NAME", "https://bob:SECRETPW@host/x?token=SECRETTOK"])
    assert experiment_name(cfg) == "words-that-are-also-a-password"
    assert _run_name(cfg) == "https://***@host/x?token=***"


def test_an_annotation_file_past_the_memory_limit_is_one_line(tmp_path):
    """A 2 GB sparse file (no disk used) under a memory limit, as a container's: a MemoryError
    traceback. `tracktron train --dry-run` in a process whose address space may grow 1 GB past
    what its imports took."""
    import subprocess
    import sys

    (tmp_path / "images").mkdir()
    with open(tmp_path / "annotations.json", "wb") as f:
        f.truncate(2 << 30)
    code = ("import resource, re, sys; from trainer import cli; import torch, torchvision, mlflow; "
            "size = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024; "
            "resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), size + (1 << 30))); cli.main(sys.argv[1:])")
    result = subprocess.run(
        [sys.executable, "-c", code, "train", "--dry-run", "--config", str(DEMO), "TRACKING.ENABLED", "false",
         "DATASET_CATALOG.big.IM_DIR", str(tmp_path / "images"),
         "DATASET_CATALOG.big.ANN_FN", str(tmp_path / "annotations.json"), "TRAIN.DATASETS", "('big',)"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (f"error: annotation file {tmp_path / 'annotations.json'} (2,147,483,648 bytes) does not fit "
                         "in this process's memory") and "Traceback" not in result.stderr


def test_the_demos_rpn_keys_under_retinanet_are_said_to_be_ignored(here, data_dir):
    """configs/demo.yaml with MODEL.TYPE retinanet: its RPN and R-CNN head keys do nothing there.
    The job trains as before (a config shared across types is no mistake), with one warning."""
    result = train(here, "MODEL.TYPE", "retinanet_resnet50_fpn", "MODEL.ANCHOR_SIZES", "[16,32,64,128]",
                   data_dir=data_dir, dry_run=True)
    assert result.code is None, result.stderr[-2000:]
    (line,) = [x for x in result.stderr.splitlines() if "mean nothing" in x]
    assert line.endswith("7 of the MODEL keys set mean nothing for retinanet_resnet50_fpn and are ignored: "
                         "MODEL.REPRESENTATION_SIZE, MODEL.ROI_BATCH_SIZE_PER_IMAGE, MODEL.RPN_BATCH_SIZE_PER_IMAGE, "
                         "MODEL.RPN_POST_NMS_TOP_N_TEST, MODEL.RPN_POST_NMS_TOP_N_TRAIN, MODEL.RPN_PRE_NMS_TOP_N_TEST, "
                         "MODEL.RPN_PRE_NMS_TOP_N_TRAIN")
    plain = train(here, data_dir=data_dir, dry_run=True)
    assert plain.code is None and "mean nothing" not in plain.stderr


def test_the_demos_fpn_and_box_head_widths_under_c4_are_said_to_be_ignored(here, data_dir):
    """helper-94's red team: configs/demo.yaml switched to MODEL.FEATURES c4 keeps its FPN_CHANNELS 32 and
    REPRESENTATION_SIZE 64, which C4 (res5 as the box head, no FPN) never reads: it trained without a word."""
    result = train(here, "MODEL.BACKBONE", "resnet50", "MODEL.BACKBONE_WIDTH", "1.0", "MODEL.FEATURES", "c4",
                   "MODEL.ANCHOR_SIZES", "[]", data_dir=data_dir, dry_run=True)
    assert result.code is None, result.stderr[-2000:]
    (line,) = [x for x in result.stderr.splitlines() if "mean nothing" in x]
    assert line.endswith("2 of the MODEL keys set mean nothing for fasterrcnn_resnet50_fpn and are ignored: "
                         "MODEL.FPN_CHANNELS, MODEL.REPRESENTATION_SIZE"), line


def test_a_registered_model_with_no_model_logged_is_said_to_be_ignored(here, data_dir):
    """TRACKING.REGISTERED_MODEL with TRACKING.LOG_MODEL false: nothing is logged, so nothing can be
    registered; the job trains (the demo names a model, a user turns logging off) and says so once.
    It said nothing (2026-12-04's red team)."""
    result = train(here, "TRACKING.LOG_MODEL", "false", "TRACKING.REGISTERED_MODEL", "mine", data_dir=data_dir,
                   dry_run=True)
    assert result.code is None, result.stderr[-2000:]
    (line,) = [x for x in result.stderr.splitlines() if "REGISTERED_MODEL" in x]
    assert line.endswith("TRACKING.REGISTERED_MODEL 'mine' is ignored: TRACKING.LOG_MODEL is false, so no model is "
                         "logged to register")


@pytest.mark.parametrize("where, message", [
    ("folder", "is a folder: name the file the job's run id is written to"),
    ("under-a-file", "cannot be made: {file} is no folder"),
])
def test_a_run_id_file_that_cannot_be_written_is_refused_before_the_run(here, data_dir, monkeypatch, where, message):
    """helper-54: TRACKTRON_RUN_ID_FILE (a pipeline's output parameter) naming a folder was found
    once the run was made: a traceback, and the run left RUNNING."""
    (here / "folder").mkdir()
    (here / "file").write_text("x")
    target = here / "folder" if where == "folder" else here / "file" / "run_id"
    monkeypatch.setenv("TRACKTRON_RUN_ID_FILE", str(target))
    for dry_run in (True, False):
        assert_exit_2(train(here, data_dir=data_dir, dry_run=dry_run),
                      f"TRACKTRON_RUN_ID_FILE {target} {message.format(file=here / 'file')}")
    assert not (here / "mlflow.db").exists() and not (here / "output").exists()
