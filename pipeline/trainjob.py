"""The pipeline's multi-node train step: a Kubeflow Trainer v2 TrainJob made from trainjob.yaml.

`template()` reads pipeline/trainjob.yaml at compile time and sets the image and the per-node
resources; `launch_trainjob` is the KFP component that fills in one pipeline run (name, nodes,
config, opts, Secret, PVC), creates the TrainJob and waits for it. It is shipped to the cluster as
its source text, so everything it uses is imported inside it.

The MLflow run id comes back through the data volume: the TrainJob's rank 0 writes it into
TRACKTRON_RUN_ID_FILE (a file on the shared PVC, named after the TrainJob), and the launcher pod,
which mounts the same PVC, reads it once the TrainJob is Complete.
"""
from pathlib import Path

import yaml
from kfp import dsl

TEMPLATE = Path(__file__).with_name("trainjob.yaml")
GPU_RESOURCE = "nvidia.com/gpu"
# What the launcher step needs on top of its base image (the tracktron image has no Kubernetes client).
LAUNCHER_PACKAGES = ["kubernetes>=30,<36"]


def template(image: str, gpus: int = 1, cpu: str = "8", memory: str = "32Gi") -> dict:
    """trainjob.yaml with `image` and `gpus` GPUs (= processes) per node: the launcher's template
    (passed to it as JSON text)."""
    job = yaml.safe_load(TEMPLATE.read_text())
    trainer = job["spec"]["trainer"]
    trainer["image"] = image
    # resourcesPerNode replaces the runtime's resources whole, so it lists all of them.
    trainer["resourcesPerNode"] = {"requests": {"cpu": str(cpu), "memory": memory, GPU_RESOURCE: int(gpus)},
                                   "limits": {GPU_RESOURCE: int(gpus)}}
    return job


def launch_trainjob(template: str, job_id: str, num_nodes: int, config: str, opts: str, data_dir: str,
                    experiment: str, data_pvc: str, mlflow_secret: str, namespace: str, poll_s: float,
                    run_id: dsl.OutputPath(str)):
    """Create this pipeline run's TrainJob (or find it again when the step is retried), wait until it
    is Complete and output the MLflow run id it wrote. A Failed TrainJob fails the step; the step's
    retry deletes it and creates it anew, and the trainer resumes the run from its checkpoints."""
    import hashlib
    import json
    import sys
    import time
    from pathlib import Path

    from kubernetes import client
    from kubernetes import config as kube_config
    from kubernetes.client.rest import ApiException

    if num_nodes < 1:
        print(f"error: num_nodes must be >= 1, got {num_nodes}", file=sys.stderr)
        sys.exit(2)
    # One TrainJob per pipeline run, whatever the attempt: an RFC 1035 name short enough for the pods'.
    name = "tracktron-" + hashlib.sha256(job_id.encode()).hexdigest()[:12]
    id_file = Path(data_dir) / ".tracktron" / "trainjobs" / name / "run_id"

    job = json.loads(template)  # JSON text: a KFP dict parameter would turn every int into a float
    job["metadata"]["name"] = name
    job["metadata"].setdefault("annotations", {})["tracktron/pipeline-run"] = job_id
    trainer = job["spec"]["trainer"]
    trainer["numNodes"] = num_nodes
    head = trainer["args"][:trainer["args"].index("train") + 1]  # torchrun's flags, -m trainer train
    head = [f"--rdzv-id={name}" if a.startswith("--rdzv-id=") else a for a in head]
    # opts goes to --opts whole, as in the single-pod step: the trainer splits it (quotes honoured)
    # after DATA_DIR and OUTPUT_DIR, and refuses a flag among them. Kubernetes replaces $(VAR) in a
    # container's args with its environment (the Secret's password among it): the user's words
    # are escaped ($$ is one $), so they never expand.
    words = [w.replace("$", "$$") for w in ("--config", config, "--opts", opts, "--", "DATA_DIR", data_dir)]
    trainer["args"] = head + words + ["OUTPUT_DIR", "/output/train"]
    env = [e for e in trainer["env"] if e["name"] not in ("MLFLOW_EXPERIMENT_NAME", "TRACKTRON_RUN_ID_FILE")]
    for e in env:
        if "secretKeyRef" in e.get("valueFrom", {}):
            e["valueFrom"]["secretKeyRef"]["name"] = mlflow_secret
    if experiment:  # an env value is expanded too, from the entries before it (the Secret's among them)
        env.append({"name": "MLFLOW_EXPERIMENT_NAME", "value": experiment.replace("$", "$$")})
    trainer["env"] = env + [{"name": "TRACKTRON_RUN_ID_FILE", "value": str(id_file)}]
    for patch in job["spec"].get("runtimePatches", []):
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            for volume in rjob["template"]["spec"]["template"]["spec"].get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    volume["persistentVolumeClaim"]["claimName"] = data_pvc

    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:  # outside a cluster: ~/.kube/config or $KUBECONFIG
        kube_config.load_kube_config()
    if not namespace:
        namespace = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
    api = client.CustomObjectsApi()
    where = ("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs")

    def state() -> tuple[str, str]:
        """Complete, Failed, Suspended or Running, and the condition's message; Gone if deleted."""
        try:
            obj = api.get_namespaced_custom_object(*where, name)
        except ApiException as e:
            if e.status == 404:
                return "Gone", ""
            raise
        true = {c["type"]: c.get("message", "") for c in obj.get("status", {}).get("conditions", [])
                if c.get("status") == "True"}
        kind = next((k for k in ("Complete", "Failed", "Suspended") if k in true), "Running")
        return kind, true.get(kind, "")

    try:
        api.create_namespaced_custom_object(*where, job)
        print(f"created TrainJob {namespace}/{name}: {num_nodes} node(s)", flush=True)
    except ApiException as e:
        if e.status != 409:
            raise
        print(f"TrainJob {namespace}/{name} exists (a retried step)", flush=True)
        if state()[0] == "Failed":  # start it again: tracktron resumes the run from its checkpoint
            api.delete_namespaced_custom_object(*where, name, propagation_policy="Foreground")
            while state()[0] != "Gone":
                time.sleep(poll_s)
            api.create_namespaced_custom_object(*where, job)
            print(f"re-created TrainJob {namespace}/{name}", flush=True)

    seen = None
    while True:
        now = state()
        if now != seen:
            print(f"TrainJob {name}: {now[0]} {now[1]}".rstrip(), flush=True)
            seen = now
        if now[0] in ("Complete", "Failed", "Gone"):
            break
        time.sleep(poll_s)
    if now[0] != "Complete":
        sys.exit(f"error: TrainJob {namespace}/{name} {'was deleted' if now[0] == 'Gone' else 'failed'}: {now[1]}")
    if not id_file.is_file():
        sys.exit(f"error: TrainJob {name} is Complete but wrote no MLflow run id to {id_file}")
    Path(run_id).parent.mkdir(parents=True, exist_ok=True)
    Path(run_id).write_text(id_file.read_text().strip())
    print(f"MLflow run {id_file.read_text().strip()}")
