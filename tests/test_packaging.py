"""Packaging: python_env.yaml, Dockerfile, console script, the Kubeflow
pipeline (compiled with the kfp SDK) and the PyTorchJob manifest.

Nothing here needs Docker, a GPU or a cluster: the files are parsed with the tools that consume
them (mlflow's project loader, kfp's compiler, yaml), and the shell the commands go through is
run with stand-ins for tracktron / torchrun that print what they were given.
"""
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _torch_pins() -> dict[str, str]:
    """The Makefile's TORCH_PINS: the torch/torchvision pair the project is tested with."""
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("TORCH_PINS"))
    return dict(re.findall(r"(torch|torchvision)==([\w.]+)", line))


def _req_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _stub_bin(tmp_path: Path, *names: str) -> dict:
    """An environment whose PATH starts with stand-ins that print argv and some env as JSON."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        stub = bin_dir / name
        stub.write_text(
            f"#!{sys.executable}\n"
            "import json, os, sys\n"
            "keys = ('TRACKTRON_RUN_ID_FILE', 'MLFLOW_EXPERIMENT_NAME', 'MLFLOW_RUN_ID')\n"
            "print(json.dumps({'prog': os.path.basename(sys.argv[0]), 'argv': sys.argv[1:],\n"
            "                  'env': {k: os.environ.get(k) for k in keys}}))\n")
        stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "TRACKTRON_RUN_ID_FILE"):
        env.pop(key, None)
    return env


def _bash(script: str, *args: str, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script, "test", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=60)


# ---- python_env.yaml (MLproject's own tests: tests/test_mlproject.py) ----

def test_python_env_pins_torch_and_lists_the_package_requirements():
    env = yaml.safe_load((ROOT / "python_env.yaml").read_text())
    assert env["python"] == "3.11"
    assert "pip" in [_req_name(d) for d in env["build_dependencies"]]
    deps = env["dependencies"]
    for name, version in _torch_pins().items():
        assert f"{name}=={version}" in deps
    # the rest as pyproject.toml has them, version ranges included (mlflow's floor is what the code needs)
    wanted = {r for r in PYPROJECT["project"]["dependencies"] if _req_name(r) not in _torch_pins()}
    assert wanted <= set(deps), f"python_env.yaml differs from pyproject.toml in {sorted(wanted - set(deps))}"


# ---- Dockerfile ----

def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_builds_on_a_pytorch_cuda_runtime_image_matching_the_torch_pin():
    instructions = _dockerfile()
    args = dict(re.match(r"(\w+)=(\S+)", a).groups() for i, a in instructions if i == "ARG" and "=" in a)
    base = next(a for i, a in instructions if i == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base).split()[0]
    m = re.fullmatch(r"pytorch/pytorch:(?P<torch>[\d.]+)-cuda(?P<cuda>[\d.]+)-cudnn\d+-runtime", base)
    assert m, f"FROM {base} is not an official pytorch/pytorch CUDA runtime image"
    assert m["torch"] == _torch_pins()["torch"]
    # torch is not reinstalled: pip runs under a constraint file made from the base's packages
    runs = " ".join(a for i, a in instructions if i == "RUN")
    assert "pip install -c" in runs and "--no-deps" in runs
    # ... and MLflow, moto, boto3 at the versions `make setup` installs, which the suite is run against
    assert "-c constraints.txt" in runs and ("COPY", "pyproject.toml constraints.txt ./") in instructions


def test_dockerfile_user_entrypoint_volumes_and_default_command():
    instructions = _dockerfile()
    users = [a for i, a in instructions if i == "USER"]
    assert users, "no USER: the container would run as root"
    args = dict(re.match(r"(\w+)=(\S+)", a).groups() for i, a in instructions if i == "ARG" and "=" in a)
    user = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], users[-1]).split(":")[0]
    assert user not in ("root", "0") and user.isdigit() and int(user) > 0  # numeric: runAsNonRoot can check it
    assert json.loads(next(a for i, a in instructions if i == "ENTRYPOINT")) == ["tracktron"]
    cmd = json.loads(next(a for i, a in instructions if i == "CMD"))
    assert cmd[:3] == ["train", "--config", "configs/demo.yaml"] and (ROOT / cmd[2]).is_file()
    assert dict(zip(cmd[3::2], cmd[4::2])) == {"DATA_DIR": "/data", "OUTPUT_DIR": "/output/demo"}
    volumes = set(json.loads(next(a for i, a in instructions if i == "VOLUME")))
    assert volumes == {"/data", "/output"}
    assert [a for i, a in instructions if i == "WORKDIR"] == ["/app"]
    for i, a in instructions:
        if i == "COPY":
            for src in a.split()[:-1]:
                if not src.startswith("--") and not any(c in src for c in "*?["):
                    assert (ROOT / src).exists(), f"COPY {src}: no such file"


def test_the_folders_the_image_writes_are_writable_by_an_arbitrary_user_of_group_0():
    """OpenShift runs the image as an arbitrary user id of group 0 (`runAsUser: 1000770000`): /app (the
    default store), /output and HOME (TORCH_HOME, TRACKTRON_CACHE) owned by the image's user alone, the
    default command ended at once (`cannot write to OUTPUT_DIR /output/demo`), and TRAIN.WEIGHTS could
    not be cached (helper-83). The code in /app stays read-only."""
    runs = " ".join(a for i, a in _dockerfile() if i == "RUN")
    home = dict(re.match(r"(\w+)=(\S+)", kv).groups() for i, a in _dockerfile() if i == "ENV" for kv in a.split())["HOME"]
    assert re.search(r'chown "\$\{UID\}:0" /data /output /app;', runs), runs
    assert "chmod g=u /data /output /app;" in runs, runs  # not -R: the code is root's, and stays so
    assert f"chgrp -R 0 {home};" in runs and f"chmod -R g=u {home}" in runs, runs


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = {x.strip() for x in (ROOT / ".dockerignore").read_text().splitlines()
               if x.strip() and not x.startswith("#")}
    for entry in (".venv", "output", "datasets", "mlflow.db", "mlruns", ".git"):
        assert entry in ignored
    assert "**/__pycache__" in ignored or "__pycache__" in ignored
    for needed in ("trainer", "configs", "pyproject.toml"):
        assert needed not in ignored


def test_tracktron_console_script_resolves_to_a_callable():
    assert PYPROJECT["project"]["scripts"]["tracktron"] == "trainer.cli:main"
    eps = importlib.metadata.entry_points(group="console_scripts", name="tracktron")
    assert eps, "the tracktron console script is not installed (pip install -e .)"
    (ep,) = eps
    assert ep.value == "trainer.cli:main"
    assert callable(ep.load())


# ---- Kubeflow Pipelines ----

def _pipeline_module():
    pytest.importorskip("kfp", reason="kfp is not installed (pip install -e '.[test]')")
    pytest.importorskip("kfp.kubernetes", reason="kfp-kubernetes is not installed (pip install -e '.[test]')")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("pipeline.pipeline")


def _compiled(tmp_path: Path, **kwargs) -> tuple[dict, dict]:
    mod = _pipeline_module()
    out = tmp_path / "tracktron_pipeline.yaml"
    mod.compile_pipeline(str(out), **kwargs)
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    spec = next(d for d in docs if "pipelineInfo" in d)
    platform = next((d["platforms"]["kubernetes"]["deploymentSpec"]["executors"] for d in docs
                     if "platforms" in d), {})
    return spec, platform


def test_pipeline_compiles_to_five_steps_in_order(tmp_path):
    spec, _ = _compiled(tmp_path)
    assert set(spec["components"]) == {"comp-check-parameters", "comp-prepare-data", "comp-train", "comp-evaluate",
                                       "comp-register-model"}
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"check-parameters", "prepare-data", "train", "evaluate", "register-model"}
    assert "dependentTasks" not in tasks["check-parameters"]  # first, before a GPU is taken
    assert tasks["prepare-data"]["dependentTasks"] == ["check-parameters"]
    assert tasks["train"]["dependentTasks"] == ["prepare-data"]
    assert "train" in tasks["evaluate"]["dependentTasks"]
    assert {"train", "evaluate"} <= set(tasks["register-model"]["dependentTasks"])
    # the run id flows from train to evaluate and register
    for name in ("evaluate", "register-model"):
        src = tasks[name]["inputs"]["parameters"]["run_id"]["taskOutputParameter"]
        assert src == {"outputParameterKey": "run_id", "producerTask": "train"}
    assert tasks["train"]["retryPolicy"]["maxRetryCount"] >= 1


def test_pipeline_train_and_eval_get_a_gpu_and_the_tracking_secret(tmp_path):
    spec, platform = _compiled(tmp_path, image="registry.example/tracktron:1.2", gpus=2, memory="48Gi")
    executors = spec["deploymentSpec"]["executors"]
    for name in ("exec-prepare-data", "exec-train", "exec-evaluate", "exec-register-model"):
        assert executors[name]["container"]["image"] == "registry.example/tracktron:1.2"
    train = executors["exec-train"]["container"]
    acc = train["resources"]["accelerator"]
    assert acc.get("resourceType", acc.get("type")) == "nvidia.com/gpu"
    assert str(acc.get("resourceCount", acc.get("count"))) == "2"
    assert train["resources"]["resourceMemoryRequest"] == "48Gi"
    assert "resourceCpuRequest" in train["resources"]
    ev = executors["exec-evaluate"]["container"]["resources"]["accelerator"]
    assert ev.get("resourceType", ev.get("type")) == "nvidia.com/gpu"
    assert "accelerator" not in executors["exec-register-model"]["container"].get("resources", {})

    _pipeline_module()
    mod = importlib.import_module("pipeline.steps")
    for name in ("exec-train", "exec-evaluate", "exec-register-model"):
        assert [v["mountPath"] for v in platform[name]["secretAsVolume"]] == [mod.SECRET_MOUNT]
        assert _step(spec, name)[:4] == ["bash", "-c", mod.WITH_TRACKING_SH, "tracking"]
    # helper-54: KFP's driver puts every parameter into the pod's command, where Kubernetes replaces
    # $(NAME) from the container's environment: no step has the Secret there.
    assert not [name for name, ex in platform.items() if "secretAsEnv" in ex]
    for name in ("exec-check-parameters", "exec-prepare-data", "exec-train", "exec-evaluate"):  # a config may be there
        assert [m["mountPath"] for m in platform[name]["pvcMount"]] == ["/data"]
    shm = [m for m in platform["exec-train"]["emptyDirMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm and shm[0]["medium"] == "Memory"
    assert any(t["key"] == "nvidia.com/gpu" for t in platform["exec-train"]["tolerations"])


def test_pipeline_cli_writes_the_yaml(tmp_path):
    _pipeline_module()
    out = tmp_path / "p.yaml"
    run = subprocess.run([sys.executable, str(ROOT / "pipeline" / "pipeline.py"), "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "comp-train" in out.read_text()
    bad_args = ((["--gpus", "0"], "--gpus must be 1 or more, got 0"), (["--train-memory", "lots"], "Invalid memory string"),
                # helper-54: a traceback; a pipeline whose pods could never start
                (["--out", str(tmp_path / "no" / "b.yaml")], f"cannot write --out {tmp_path / 'no' / 'b.yaml'}: No such"),
                (["--image", ""], "--image must name an image"), (["--image", "my image"], "--image must name an image"))
    for bad, says in bad_args:
        run = subprocess.run([sys.executable, str(ROOT / "pipeline" / "pipeline.py"), "--out", str(tmp_path / "b.yaml"),
                              *bad], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 2 and "Traceback" not in run.stderr and says in run.stderr.splitlines()[-1], run.stderr
        assert not (tmp_path / "b.yaml").exists()


def _step(spec: dict, name: str) -> list[str]:
    return spec["deploymentSpec"]["executors"][name]["container"]["command"]


def _own(spec: dict, name: str) -> list[str]:
    """A step's own command, without the wrapper that exports the Secret's tracking settings."""
    command = _step(spec, name)
    return command[4:] if command[3:4] == ["tracking"] else command


def test_pipeline_steps_take_the_tracking_settings_from_the_secrets_files(tmp_path):
    """The wrapper the tracked steps run in: each key of the Secret's volume that is there becomes
    its variable; no MLFLOW_TRACKING_URI is one line, exit 2."""
    _pipeline_module()
    mod = importlib.import_module("pipeline.steps")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "MLFLOW_TRACKING_URI").write_text("https://mlflow.example")
    (secret / "MLFLOW_TRACKING_PASSWORD").write_text("pw $(x) `y`\n")  # kubectl --from-file keeps a newline
    (secret / "OTHER_KEY").write_text("not a tracking setting")
    script = mod.WITH_TRACKING_SH.replace(mod.SECRET_MOUNT, str(secret))
    show = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('MLFLOW_TRACKING_URI', " \
           "'MLFLOW_TRACKING_PASSWORD', 'AWS_ACCESS_KEY_ID', 'OTHER_KEY')}))"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
    out = _bash(script, sys.executable, "-c", show, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"MLFLOW_TRACKING_URI": "https://mlflow.example",
                                      "MLFLOW_TRACKING_PASSWORD": "pw $(x) `y`", "AWS_ACCESS_KEY_ID": None,
                                      "OTHER_KEY": None}
    (secret / "MLFLOW_TRACKING_URI").unlink()
    out = _bash(script, sys.executable, "-c", show, env=env)
    assert out.returncode == 2 and out.stderr.strip() == "error: the Secret has no MLFLOW_TRACKING_URI"


def test_pipeline_train_step_runs_tracktron_and_names_the_run_id_file(tmp_path):
    spec, _ = _compiled(tmp_path)
    command = _own(spec, "exec-train")
    assert command[:2] == ["bash", "-c"]
    env = _stub_bin(tmp_path, "tracktron", "torchrun")
    run_id_file = tmp_path / "outputs" / "run_id" / "data"
    opts = "SOLVER.MAX_ITER 200 SOLVER.STEPS [0,400] TRACKING.RUN_NAME 'my run' X $(touch pwned) *"
    (tmp_path / "0").touch()
    out = _bash(command[2], "/app/configs/demo.yaml", opts, "/data", "coco-r50", "1", run_id_file, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["prog"] == "tracktron"
    # opts whole (the trainer splits it, quotes honoured): neither split at spaces, globbed nor run here
    assert got["argv"] == ["train", "--config", "/app/configs/demo.yaml", "--opts", opts, "--", "DATA_DIR", "/data",
                           "OUTPUT_DIR", "/output/train"]
    assert not (tmp_path / "pwned").exists()
    assert got["env"]["TRACKTRON_RUN_ID_FILE"] == str(run_id_file)
    assert got["env"]["MLFLOW_EXPERIMENT_NAME"] == "coco-r50"
    assert run_id_file.parent.is_dir()

    out = _bash(command[2], "c.yaml", "", "/data", "", "4", run_id_file, env=env, cwd=tmp_path)
    got = json.loads(out.stdout)
    assert got["prog"] == "torchrun" and got["env"]["MLFLOW_EXPERIMENT_NAME"] is None
    assert got["argv"][:4] == ["--standalone", "--nnodes=1", "--nproc-per-node=4", "-m"]
    assert got["argv"][4:7] == ["trainer", "train", "--config"] and got["argv"][8:11] == ["--opts", "", "--"]


def test_pipeline_train_step_refuses_a_flag_in_opts_instead_of_taking_it_as_an_option(tmp_path):
    """`opts="--config other.yaml"` silently replaced the step's config (and `--dry-run` trained
    nothing): the step now hands opts to the real trainer after `--`, where a flag is an error."""
    spec, _ = _compiled(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tracktron").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m trainer "$@"\n')
    (bin_dir / "tracktron").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for opts in ("--config configs/other.yaml", "SOLVER.MAX_ITER 5 --dry-run"):
        out = _bash(_own(spec, "exec-train")[2], ROOT / "configs" / "demo.yaml", opts, tmp_path / "data", "", "1",
                    tmp_path / "run_id", env=env, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "options go before them" in out.stderr.strip().splitlines()[-1]
        assert not (tmp_path / "output").exists() and not (tmp_path / "mlflow.db").exists()


def test_pipeline_prepare_and_eval_steps(tmp_path):
    spec, _ = _compiled(tmp_path)
    env = _stub_bin(tmp_path, "tracktron")
    prepare = _own(spec, "exec-prepare-data")[2]
    out_file = tmp_path / "o" / "prepared_dir"
    out = _bash(prepare, "synth", tmp_path / "data", "8", out_file, env=env)
    assert out.returncode == 0, out.stderr
    calls = [json.loads(x)["argv"] for x in out.stdout.splitlines()]
    assert calls[0] == ["data", "synth", "--out", f"{tmp_path}/data/synth_shapes/train", "--num-images", "8",
                        "--seed", "0"]
    assert calls[1][:4] == ["data", "synth", "--out", f"{tmp_path}/data/synth_shapes/val"]
    assert out_file.read_text() == str(tmp_path / "data")
    out = _bash(prepare, "coco", tmp_path / "data", "8", out_file, env=env)
    assert out.returncode == 2 and "instances_train2017.json" in out.stderr
    assert _bash(prepare, "imagenet", tmp_path / "data", "8", out_file, env=env).returncode == 2

    # the run's opts too (helper-54): without them a model they changed did not load, and test settings
    # they changed were not those of the AP logged into the run
    evaluate = _own(spec, "exec-evaluate")[2]
    opts = "MODEL.FPN_CHANNELS 16 TEST.SCALE 96 TRACKING.RUN_NAME 'a b'"
    out = _bash(evaluate, "/app/configs/demo.yaml", opts, "/data", "abc123", "checkpoints/model_final.pth", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["argv"] == [
        "eval", "--config", "/app/configs/demo.yaml", "--weights", "runs:/abc123/checkpoints/model_final.pth",
        "--opts", opts, "--", "DATA_DIR", "/data", "OUTPUT_DIR", "/output/eval"]
    assert _bash(evaluate, "c.yaml", "", "/data", "", "x", env=env).returncode == 2
    tasks = spec["root"]["dag"]["tasks"]
    assert tasks["evaluate"]["inputs"]["parameters"]["opts"] == {"componentInputParameter": "opts"}


def _register_step(tmp_path, monkeypatch):
    """The compiled register step's script, run in this process against a sqlite store holding one
    run with bbox/AP 0.25 and a model: register(min_score, alias, name, run_id) -> 0 or its exit message."""
    spec, _ = _compiled(tmp_path)
    command = _own(spec, "exec-register-model")
    assert command[:2] == ["python3", "-c"]
    import mlflow
    import torch

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)  # the sqlite store's artifacts go to ./mlruns
    with mlflow.start_run() as run:
        mlflow.log_metric("bbox/AP", 0.25)
        mlflow.pytorch.log_model(torch.nn.Linear(2, 1), name="model", serialization_format="pickle",
                                 pip_requirements=["torch"])
    code = compile(command[2], "register-model", "exec")
    out_file = tmp_path / "out" / "version"

    def register(min_score, alias="", name="det", run_id=run.info.run_id):
        monkeypatch.setattr(sys, "argv", ["-c", run_id, name, "bbox/AP", str(min_score), alias, str(out_file)])
        try:
            exec(code, {"__name__": "__main__"})
        except SystemExit as e:
            return str(e.code)
        return 0

    return register, out_file, uri


def test_pipeline_register_step_registers_once_and_gates_on_the_metric(tmp_path, monkeypatch, capsys):
    import mlflow

    register, out_file, uri = _register_step(tmp_path, monkeypatch)
    assert "is not an MLflow run id" in register(0.0, run_id="x' OR name = 'y")  # spliced into a search filter
    assert not out_file.exists()
    assert "below 0.5" in register(0.5) and not out_file.exists()
    assert register(0.2, alias="candidate") == 0
    assert out_file.read_text() == "1"
    assert register(0.0) == 0 and out_file.read_text() == "1"
    assert "already holds run" in capsys.readouterr().out
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert str(client.get_model_version_by_alias("det", "candidate").version) == "1"
    assert len(client.search_model_versions("name = 'det'")) == 1


@pytest.mark.parametrize("params, says", [
    # a quote broke the search filter the name was spliced into (at register, after the training)
    ({"model_name": "it's"}, "model_name \"it's\": a registered model name has no"),
    ({"model_name": "team/detector"}, "model_name 'team/detector'"),
    ({"min_score": "nan"}, "min_score 'nan' is not a finite number"),  # it turned the gate off
    ({"alias": "a b"}, "alias 'a b': letters, digits, _ and - only"),
    # MLflow reserves these: register made the version, then failed setting the alias
    *(({"alias": a}, f"alias {a!r} is reserved by MLflow") for a in ("latest", "Latest", "v2", "V1")),
    ({"opts": "SOLVER.MAX_ITER -3"}, "SOLVER.MAX_ITER must be 1 to 1,000,000,000"),  # found in the train pod
    ({"opts": "MODEL.NOPE 1"}, "unknown config key MODEL.NOPE"),
    ({"config": "/app/configs/nope.yaml"}, "config file not found: /app/configs/nope.yaml"),
    # trained for hours, then evaluate failed 3 times (helper-57)
    ({"opts": "TEST.DATASETS '[]'"}, "TEST.DATASETS is empty: the pipeline's evaluate step scores"),
])
def test_the_first_step_refuses_what_a_later_step_would_before_anything_runs(tmp_path, params, says):
    """helper-54: a typo in model_name or alias was found by the register step, after the training
    and evaluation; bad opts in the train pod, retried 3 times. The check step runs first: one line
    on stderr, exit 2."""
    spec, _ = _compiled(tmp_path)
    command = _step(spec, "exec-check-parameters")
    assert command[:2] == ["python3", "-c"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tracktron").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m trainer "$@"\n')
    (bin_dir / "tracktron").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    values = {"config": str(ROOT / "configs" / "demo.yaml"), "opts": "SOLVER.MAX_ITER 200 TRACKING.RUN_NAME 'a b'",
              "model_name": "tracktron-detector", "min_score": "0.0", "alias": "best"}

    def check(**change):
        args = [{**values, **change}[k] for k in ("config", "opts", "model_name", "min_score", "alias")]
        return subprocess.run([sys.executable, "-c", command[2], *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)

    good = check()
    assert good.returncode == 0 and not good.stderr.strip(), good.stderr
    bad = check(**params)
    assert bad.returncode == 2 and says in bad.stderr.strip().splitlines()[-1], bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr  # one line, no traceback
    assert not list(tmp_path.glob("*.db")) and not (tmp_path / "output").exists()


# ---- PyTorchJob ----

def test_pytorchjob_has_master_and_workers_running_torchrun():
    docs = [d for d in yaml.safe_load_all((ROOT / "pipeline" / "pytorchjob.yaml").read_text()) if d]
    (job,) = docs
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    nproc = job["spec"]["nprocPerNode"]
    assert isinstance(nproc, str) and nproc.isdigit()
    for role, replica in specs.items():
        assert replica["restartPolicy"] == "OnFailure"
        pod = replica["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        words = container.get("command", []) + container.get("args", [])
        assert words[0] == "torchrun"
        line = " ".join(words)
        assert re.search(r"(-m trainer|tracktron) train --config \S+", line)
        config = re.search(r"train --config (\S+)", line).group(1)
        assert config.startswith("/app/configs/") and (ROOT / "configs" / Path(config).name).is_file()
        assert "--nnodes=$(PET_NNODES)" in words
        assert "--nproc-per-node=$(PET_NPROC_PER_NODE)" in words or "--nproc_per_node=$(PET_NPROC_PER_NODE)" in words
        assert any(w.startswith("--rdzv-endpoint=$(PET_MASTER_ADDR)") or w.startswith("--rdzv_endpoint=$(PET_MASTER_ADDR)")
                   for w in words)
        assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == nproc
        assert any(p.get("name") == "pytorchjob-port" for p in container["ports"])
        assert any("secretRef" in e for e in container.get("envFrom", []))
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "persistentVolumeClaim" in volumes[mounts["/data"]]
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert pod["securityContext"]["runAsNonRoot"] is True and "runAsUser" not in pod["securityContext"]
