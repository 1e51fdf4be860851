"""MLproject: `mlflow run . --env-manager local` end to end against a real tracking server, and the
commands MLflow computes from MLproject and docker/MLproject (parsed with mlflow's project loader,
run by bash with a stand-in trainer that prints the words it was given)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import ROOT, demo_overrides


def mlflow_run(server, experiment, opts):
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.url, "PATH": f"{venv_bin}:{os.environ['PATH']}"}
    cmd = [f"{venv_bin}/mlflow", "run", ".", "--env-manager", "local", "--experiment-name", experiment,
           "-P", "config=configs/demo.yaml", "-P", f"opts={' '.join(opts)}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # as users do


def test_mlflow_run_trains_in_its_run_and_a_second_one_points_at_the_job_run(tmp_path, data_dir, mlflow_server,
                                                                             s3_server):
    os.environ.update(s3_server.env)  # the server proxies artifacts to S3; the trainer needs no keys
    exp = f"mlproject-{uuid.uuid4().hex[:6]}"
    opts = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 4})
    first = mlflow_run(mlflow_server, exp, opts)
    assert first.returncode == 0, first.stderr[-3000:]
    client = MlflowClient(mlflow_server.url)
    exp_id = client.get_experiment_by_name(exp).experiment_id
    (job_run,) = client.search_runs([exp_id])
    assert job_run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(job_run.info.run_id, "loss")) == [0, 1, 2, 3]
    assert job_run.data.tags["tracktron.ckpt.latest"] == "model_final.pth"
    assert "tracktron.job" in job_run.data.tags  # adopted: a later plain `tracktron train` finds it
    assert [e.name for e in client.search_experiments()].count("demo") == 0  # no stray experiment

    second = mlflow_run(mlflow_server, exp, opts)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "nothing to do" in second.stdout + second.stderr
    runs = client.search_runs([exp_id])
    launcher = next(r for r in runs if r.info.run_id != job_run.info.run_id)
    assert launcher.data.tags["tracktron.job_run_id"] == job_run.info.run_id
    assert not client.get_metric_history(launcher.info.run_id, "loss")  # one job, one loss curve


def test_mlflow_run_opts_take_quoted_values_with_spaces(tmp_path, data_dir, mlflow_server, s3_server):
    """-P opts='OUTPUT_DIR "a b" TRAIN.SCALES "(128, 160)"': the shell split opts at every space
    ('overrides come in KEY VALUE pairs'); quotes now hold a value together, as in a shell. The
    run MLflow made (named at random) takes TRACKING.RUN_NAME (2026-12-04's README walk: it kept
    MLflow's name)."""
    os.environ.update(s3_server.env)
    out, exp = tmp_path / "out dir", f"mlproject-{uuid.uuid4().hex[:6]}"
    opts = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 1, "TEST.DATASETS": '"()"',
                                                 "OUTPUT_DIR": f'"{out}"', "TRAIN.SCALES": '"(128, 160)"',
                                                 "TRACKING.RUN_NAME": '"my run"'})
    done = mlflow_run(mlflow_server, exp, opts)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model_final.pth").is_file()
    assert yaml.safe_load((out / "config.yaml").read_text())["TRAIN"]["SCALES"] == [128, 160]
    client = MlflowClient(mlflow_server.url)
    (run,) = client.search_runs([client.get_experiment_by_name(exp).experiment_id])
    assert run.info.run_name == "my run" and run.data.tags["mlflow.runName"] == "my run"


# ---- the commands MLflow computes from MLproject and docker/MLproject ----

def _load_project(directory: Path):
    from mlflow.projects._project_spec import load_project

    return load_project(str(directory))


def test_mlproject_parses_with_mlflow_and_has_the_entry_points():
    from mlflow.projects import env_type

    project = _load_project(ROOT)
    assert project.name == "tracktron"
    assert project.env_type == env_type.PYTHON
    assert Path(project.env_config_path).resolve() == ROOT / "python_env.yaml"

    main = project.get_entry_point("main")
    assert main.parameters["config"].type == "string"
    assert main.parameters["config"].default == "configs/demo.yaml"
    assert (ROOT / main.parameters["config"].default).is_file()
    assert main.parameters["opts"].type == "string" and main.parameters["opts"].default == ""
    assert main.command == "python -m trainer train --config {config} --opts {opts}"

    ev = project.get_entry_point("eval")
    assert set(ev.parameters) == {"config", "weights"}
    assert ev.parameters["weights"].default is None  # required
    assert re.search(r"(tracktron|python -m trainer) eval --config \{config\} --weights \{weights\}", ev.command)

    synth = project.get_entry_point("synth")
    assert set(synth.parameters) == {"out", "num_images"}
    assert synth.parameters["num_images"].type == "int"
    assert re.search(r"data synth --out \{out\} --num-images \{num_images\}", synth.command)



@pytest.mark.parametrize("entry", ["main", "eval"])
def test_mlflow_run_of_the_project_from_another_folder_takes_the_projects_config(tmp_path, monkeypatch, entry):
    """`mlflow run <git URL or folder>` runs from the caller's folder: a `path` parameter was looked
    up there, so the default configs/demo.yaml failed (helper-49's review), or a file of that name
    in the caller's folder went in instead of the project's."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text("the caller's own file\n")
    monkeypatch.chdir(tmp_path)
    params = {"weights": "runs:/0123/checkpoints/model_final.pth"} if entry == "eval" else {}
    command = _load_project(ROOT).get_entry_point(entry).compute_command(params, storage_dir=str(tmp_path))
    assert "--config configs/demo.yaml " in command  # read in the project's folder, where MLflow runs it
    assert str(tmp_path) not in command


def _run_entry(tmp_path, directory: Path, opts: str, program: str) -> list[str]:
    """The main entry point's command as MLflow computes it, run by bash in `tmp_path` after
    `program` (a stand-in trainer that prints the words it was given as json)."""
    command = _load_project(directory).get_entry_point("main").compute_command({"opts": opts}, storage_dir=None)
    (tmp_path / "trainer").mkdir(exist_ok=True)
    (tmp_path / "trainer" / "__main__.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(tmp_path))  # the stand-in, whatever PYTHONPATH the suite runs with
    out = subprocess.run(["bash", "-c", f"{program} {command}"], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# What users type into -P opts=..., the hostile ones included: globs, command substitutions, `;`.
HOSTILE_OPTS = ["", "SOLVER.MAX_ITER 200 TRAIN.IMS_PER_BATCH 4", "TRAIN.SCALES (800,) SOLVER.STEPS [0,400] OUTPUT_DIR *",
                "TRACKING.RUN_NAME \"my run\" TRAIN.SCALES '(640, 800)' TRACKING.REGISTERED_MODEL '' "
                "A $(touch pwned) B \"`touch pwned`\"; touch pwned"]


@pytest.mark.parametrize("opts", HOSTILE_OPTS)
def test_mlproject_main_hands_opts_to_the_trainer_whole(tmp_path, opts):
    # MLflow shell-quotes each parameter value: `opts` reaches --opts as one word, never globbed
    # (`*`, `[0,400]` as written even where files match them) and never run.
    (tmp_path / "0").touch()
    (tmp_path / "x").touch()
    assert _run_entry(tmp_path, ROOT, opts, "") == ["train", "--config", "configs/demo.yaml", "--opts", opts]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("opts", HOSTILE_OPTS)
def test_docker_mlproject_hands_opts_through_docker_run_whole(tmp_path, opts):
    """The command follows `docker run ... IMAGE` on the host's shell: opts used to be split there at
    every space, so a quoted value with a space could not be passed."""
    (tmp_path / "0").touch()
    got = _run_entry(tmp_path, ROOT / "docker", opts, "python -m trainer")  # the stand-in for docker run IMAGE
    assert got == ["train", "--config", "/app/configs/demo.yaml", "--opts", opts,
                   "--", "DATA_DIR", "/data", "OUTPUT_DIR", "/output/demo"]
    assert not (tmp_path / "pwned").exists()


def _tracktron(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


def test_opts_split_as_a_shell_user_writes_them_and_nothing_in_them_runs(tmp_path):
    """The trainer's --opts: quotes hold a value with a space, an empty value stays a value, and
    words that would run something in a shell stay words, which the trainer refuses as overrides."""
    result = _tracktron(["config", "--config", str(ROOT / "configs" / "demo.yaml"), "SOLVER.MAX_ITER", "7",
                      "--opts", "TRACKING.RUN_NAME 'my run' TRAIN.SCALES \"(160, 128)\" TRACKING.REGISTERED_MODEL '' "
                                "SOLVER.MAX_ITER 9"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout.split("## resolved config\n")[1].split("\n## ")[0])
    assert (cfg["TRACKING"]["RUN_NAME"], cfg["TRAIN"]["SCALES"], cfg["TRACKING"]["REGISTERED_MODEL"]) == (
        "my run", [160, 128], "")
    assert cfg["SOLVER"]["MAX_ITER"] == 9  # after the trailing pairs: a launcher's defaults come first
    result = _tracktron(["config", "--config", str(ROOT / "configs" / "demo.yaml"), "--opts", HOSTILE_OPTS[-1]],
                     cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: overrides come in KEY VALUE pairs"), result.stderr
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("opts", ['TRACKING.RUN_NAME "my run', "A 'b", "A b\\"])
def test_an_unbalanced_quote_in_opts_is_one_line(tmp_path, opts):
    out = _tracktron(["train", "--config", str(ROOT / "configs" / "demo.yaml"), "--opts", opts], cwd=tmp_path)
    assert out.returncode == 2 and not out.stdout  # nothing started
    assert out.stderr.splitlines() == [out.stderr.strip()] and out.stderr.startswith("error: --opts: "), out.stderr
    assert not list(tmp_path.iterdir())


def test_docker_mlproject_runs_tracktron_subcommands_in_the_image():
    from mlflow.projects import env_type

    project = _load_project(ROOT / "docker")
    assert project.name == "tracktron"
    assert project.env_type == env_type.DOCKER
    assert project.docker_env["image"].split(":")[0] == "tracktron"
    for name, sub in (("main", "train"), ("eval", "eval"), ("synth", "data synth")):
        entry = project.get_entry_point(name)
        # ENTRYPOINT ["tracktron"]: the command is appended to `docker run IMAGE`.
        assert entry.command.startswith(f"{sub} "), entry.command
        for param in entry.parameters.values():
            assert param.type != "path", "a path parameter would be checked on the host, not in the image"
    config = project.get_entry_point("main").parameters["config"].default
    assert config.startswith("/app/configs/") and (ROOT / "configs" / Path(config).name).is_file()
