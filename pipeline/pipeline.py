"""Kubeflow Pipelines v2: check -> prepare data -> train -> evaluate -> register, on the tracktron image.

    python pipeline/pipeline.py --out pipeline/tracktron_pipeline.yaml [--image REGISTRY/tracktron:TAG]
    python pipeline/pipeline.py --trainjob ...    # + train_backend: pod | trainjob (multi-node, Trainer v2)

Every step is a container component running the image built from the repository's Dockerfile
(ENTRYPOINT tracktron; the components set their own command). The cluster provides:

- a PersistentVolumeClaim with the datasets, mounted at /data (parameter `data_pvc`);
- a Secret with the tracking settings (parameter `mlflow_secret`, mounted as a volume, never put in
  the pods' environment: SECRET_MOUNT): MLFLOW_TRACKING_URI (required),
  and, when the server needs them, MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD /
  MLFLOW_TRACKING_TOKEN, and for an S3 artifact store AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
  MLFLOW_S3_ENDPOINT_URL (all optional keys).

The train step hands its MLflow run id to the next steps through an output parameter: tracktron
writes the id into the file named by TRACKTRON_RUN_ID_FILE (rank 0, right after it has found or
created the run, also when there is nothing left to train). A failed train step is retried and
the trainer resumes the same run from its newest checkpoint on the tracking server
(TRAIN.AUTO_RESUME); a preempted pod is killed with KFP's launcher, before a SIGTERM checkpoint
(pipeline/README.md).

Compiled with `trainjob=True` (`--trainjob`), the pipeline has a `train_backend` parameter: `pod`
trains as above, `trainjob` on `num_nodes` nodes as a Kubeflow Trainer v2 TrainJob made from
pipeline/trainjob.yaml by a launcher step that waits for it (pipeline/trainjob.py).
"""

import argparse
import json
import os
import sys

from kfp import compiler, dsl, kubernetes

if __package__:
    from . import trainjob as trainjob_step
    from .steps import BAD_BACKEND_SH, CHECK_PY, EVAL_SH, PREPARE_SH, REGISTER_PY, SECRET_MOUNT, TRAIN_SH, with_tracking
else:  # run as a script: python pipeline/pipeline.py
    import trainjob as trainjob_step
    from steps import BAD_BACKEND_SH, CHECK_PY, EVAL_SH, PREPARE_SH, REGISTER_PY, SECRET_MOUNT, TRAIN_SH, with_tracking

DEFAULT_IMAGE = os.environ.get("TRACKTRON_IMAGE", "ghcr.io/tracktron/tracktron:latest")
GPU_RESOURCE = "nvidia.com/gpu"
DATA_MOUNT = "/data"
OUTPUT_MOUNT = "/output"
# The TrainJob launcher's base image: any Python that pip can add the Kubernetes client to.
LAUNCHER_IMAGE = os.environ.get("TRACKTRON_LAUNCHER_IMAGE", "python:3.12-slim")


def build(image: str = DEFAULT_IMAGE, gpus: int = 1, cpu: str = "8", memory: str = "32Gi",
          trainjob: bool = False, launcher_image: str = LAUNCHER_IMAGE):
    """The pipeline function for `image` and the train step's resources.

    These are compile-time settings: a component binds its image when it is defined, and KFP
    backends before 2.4 take resource requests only as constants. `gpus` > 1 runs torchrun with one
    process per GPU on the train pod (on each node of a TrainJob). `trainjob` adds the run-time
    choice between the single pod and a multi-node TrainJob.
    """
    if int(gpus) < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")

    @dsl.container_component
    def check_parameters(config: str, opts: str, model_name: str, min_score: float, alias: str):
        """Every parameter a later step would refuse, before anything runs: one line, exit 2."""
        return dsl.ContainerSpec(image=image, command=["python3", "-c", CHECK_PY],
                                 args=[config, opts, model_name, min_score, alias])

    @dsl.container_component
    def prepare_data(dataset: str, data_dir: str, num_images: int, prepared_dir: dsl.OutputPath(str)):
        """Write the synthetic dataset onto the data volume, or check that COCO is there."""
        return dsl.ContainerSpec(image=image, command=["bash", "-c", PREPARE_SH, "prepare"],
                                 args=[dataset, data_dir, num_images, prepared_dir])

    @dsl.container_component
    def train(config: str, opts: str, data_dir: str, experiment: str, gpus: int,
              run_id: dsl.OutputPath(str)):
        """tracktron train; outputs the MLflow run id of the job."""
        return dsl.ContainerSpec(image=image, command=with_tracking("bash", "-c", TRAIN_SH, "train"),
                                 args=[config, opts, data_dir, experiment, gpus, run_id])

    @dsl.container_component
    def evaluate(config: str, opts: str, data_dir: str, run_id: str, weights_artifact: str):
        """tracktron eval of the run's final weights; metrics are logged to that run."""
        return dsl.ContainerSpec(image=image, command=with_tracking("bash", "-c", EVAL_SH, "evaluate"),
                                 args=[config, opts, data_dir, run_id, weights_artifact])

    @dsl.container_component
    def register_model(run_id: str, model_name: str, metric: str, min_score: float, alias: str,
                       model_version: dsl.OutputPath(str)):
        """Register runs:/<run_id>/model in the MLflow Model Registry (gated on `metric`)."""
        return dsl.ContainerSpec(image=image, command=with_tracking("python3", "-c", REGISTER_PY),
                                 args=[run_id, model_name, metric, min_score, alias, model_version])

    def tracking_secret(task, secret):
        kubernetes.use_secret_as_volume(task, secret_name=secret, mount_path=SECRET_MOUNT)
        return task

    def on_gpu(task, gpus, cpu: str, memory: str):
        task.set_accelerator_type(GPU_RESOURCE).set_accelerator_limit(gpus)
        task.set_cpu_request(cpu).set_memory_request(memory)
        kubernetes.add_toleration(task, key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")
        # DataLoader workers pass batches through shared memory: the default 64 MiB is too small.
        kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory")
        return task

    @dsl.container_component
    def invalid_train_backend(train_backend: str):
        """Fails the run: train_backend is neither pod nor trainjob."""
        return dsl.ContainerSpec(image=image, command=["bash", "-c", BAD_BACKEND_SH, "check"], args=[train_backend])

    launch_trainjob = dsl.component(base_image=launcher_image, packages_to_install=trainjob_step.LAUNCHER_PACKAGES)(
        trainjob_step.launch_trainjob)
    job_template = json.dumps(trainjob_step.template(image, gpus, cpu, memory))

    def on_one_pod(p: dict, data_dir):
        trn = train(config=p["config"], opts=p["opts"], data_dir=data_dir, experiment=p["experiment"], gpus=gpus)
        trn.set_display_name("train").set_caching_options(False)
        trn.set_retry(num_retries=3, backoff_duration="60s", backoff_factor=2.0)
        on_gpu(trn, gpus, cpu, memory)
        tracking_secret(trn, p["mlflow_secret"])
        kubernetes.mount_pvc(trn, pvc_name=p["data_pvc"], mount_path=DATA_MOUNT)
        kubernetes.empty_dir_mount(trn, volume_name="output", mount_path=OUTPUT_MOUNT)
        return trn.outputs["run_id"]

    def on_trainjob(p: dict, data_dir):
        # The step only waits: its retries re-create a Failed TrainJob, which resumes from the checkpoint.
        job = launch_trainjob(template=job_template, job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, num_nodes=p["num_nodes"],
                              config=p["config"], opts=p["opts"], data_dir=data_dir, experiment=p["experiment"],
                              data_pvc=p["data_pvc"], mlflow_secret=p["mlflow_secret"],
                              namespace=p["trainjob_namespace"], poll_s=30.0)
        job.set_display_name("train (TrainJob)").set_caching_options(False)
        job.set_retry(num_retries=3, backoff_duration="60s", backoff_factor=2.0)
        job.set_cpu_request("100m").set_memory_request("256Mi")
        kubernetes.mount_pvc(job, pvc_name=p["data_pvc"], mount_path=DATA_MOUNT)  # where rank 0 leaves the run id
        return job.outputs["run_id"]

    def on_backend(p: dict, data_dir):
        with dsl.If(p["train_backend"] == "pod"):
            pod_run = on_one_pod(p, data_dir)
        with dsl.Elif(p["train_backend"] == "trainjob"):
            job_run = on_trainjob(p, data_dir)
        with dsl.Else():
            invalid_train_backend(train_backend=p["train_backend"])
        return dsl.OneOf(pod_run, job_run)

    def steps(p: dict, train_step):
        check = check_parameters(config=p["config"], opts=p["opts"], model_name=p["model_name"],
                                 min_score=p["min_score"], alias=p["alias"])
        check.set_display_name("check parameters").set_caching_options(False)
        check.set_cpu_request("1").set_memory_request("2Gi")
        kubernetes.mount_pvc(check, pvc_name=p["data_pvc"], mount_path=DATA_MOUNT)  # a config kept on the volume
        prep = prepare_data(dataset=p["dataset"], data_dir=DATA_MOUNT, num_images=p["num_images"])
        prep.set_display_name("prepare data").set_caching_options(False).after(check)
        prep.set_cpu_request("1").set_memory_request("2Gi")
        kubernetes.mount_pvc(prep, pvc_name=p["data_pvc"], mount_path=DATA_MOUNT)

        run_id = train_step(p, prep.outputs["prepared_dir"])

        ev = evaluate(config=p["config"], opts=p["opts"], data_dir=prep.outputs["prepared_dir"], run_id=run_id,
                      weights_artifact=p["weights_artifact"])
        ev.set_display_name("evaluate").set_caching_options(False)
        ev.set_retry(num_retries=2)
        on_gpu(ev, 1, "4", "16Gi")
        tracking_secret(ev, p["mlflow_secret"])
        kubernetes.mount_pvc(ev, pvc_name=p["data_pvc"], mount_path=DATA_MOUNT)
        kubernetes.empty_dir_mount(ev, volume_name="output", mount_path=OUTPUT_MOUNT)

        reg = register_model(run_id=run_id, model_name=p["model_name"], metric=p["metric"],
                             min_score=p["min_score"], alias=p["alias"])
        reg.set_display_name("register model").set_caching_options(False).after(ev)
        reg.set_cpu_request("500m").set_memory_request("1Gi")
        tracking_secret(reg, p["mlflow_secret"])

    if not trainjob:  # the decorator builds the graph: build only the one asked for
        @dsl.pipeline(name="tracktron", description="check -> prepare data -> train -> evaluate -> register, "
                      "tracked in MLflow")
        def tracktron_pipeline(
            config: str = "/app/configs/demo.yaml",
            opts: str = "",
            dataset: str = "synth",
            num_images: int = 64,
            data_pvc: str = "tracktron-data",
            mlflow_secret: str = "tracktron-mlflow",
            experiment: str = "",
            weights_artifact: str = "checkpoints/model_final.pth",
            model_name: str = "tracktron-detector",
            metric: str = "bbox/AP",
            min_score: float = 0.0,
            alias: str = "",
        ):
            steps(locals(), on_one_pod)
        return tracktron_pipeline

    @dsl.pipeline(name="tracktron", description="check -> prepare data -> train (one pod, or a multi-node Kubeflow "
                  "Trainer TrainJob) -> evaluate -> register, tracked in MLflow")
    def tracktron_multinode_pipeline(
        config: str = "/app/configs/demo.yaml",
        opts: str = "",
        dataset: str = "synth",
        num_images: int = 64,
        data_pvc: str = "tracktron-data",
        mlflow_secret: str = "tracktron-mlflow",
        experiment: str = "",
        weights_artifact: str = "checkpoints/model_final.pth",
        model_name: str = "tracktron-detector",
        metric: str = "bbox/AP",
        min_score: float = 0.0,
        alias: str = "",
        train_backend: str = "trainjob",  # pod | trainjob
        num_nodes: int = 2,
        trainjob_namespace: str = "",     # default: the pipeline run's namespace
    ):
        steps(locals(), on_backend)

    return tracktron_multinode_pipeline


tracktron_pipeline = build()


def compile_pipeline(out: str, image: str = DEFAULT_IMAGE, gpus: int = 1, cpu: str = "8",
                     memory: str = "32Gi", trainjob: bool = False, launcher_image: str = LAUNCHER_IMAGE) -> str:
    compiler.Compiler().compile(build(image, gpus, cpu, memory, trainjob, launcher_image), package_path=out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="pipeline/tracktron_pipeline.yaml", help="where to write the YAML")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="the tracktron image (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of the train pod (default: %(default)s)")
    parser.add_argument("--train-cpu", default="8", help="CPU request of the train pod (default: %(default)s)")
    parser.add_argument("--train-memory", default="32Gi", help="memory request of the train pod (default: %(default)s)")
    parser.add_argument("--trainjob", action="store_true",
                        help="add the train_backend parameter: pod, or trainjob (multi-node, Kubeflow Trainer v2)")
    parser.add_argument("--launcher-image", default=LAUNCHER_IMAGE,
                        help="base image of the TrainJob launcher step (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        parser.error(f"--gpus must be 1 or more, got {args.gpus}")
    if not args.image.strip() or any(c.isspace() for c in args.image):  # the pods would fail to start, at run time
        parser.error(f"--image must name an image (REGISTRY/NAME:TAG, no spaces), got {args.image!r}")
    try:
        compile_pipeline(args.out, args.image, args.gpus, args.train_cpu, args.train_memory, args.trainjob,
                         args.launcher_image)
    except ValueError as e:  # KFP's own checks of resources (`--train-memory lots`)
        parser.error(str(e).splitlines()[0])
    except OSError as e:  # --out in a folder that is not there, or not writable
        parser.error(f"cannot write --out {args.out}: {e.strerror or e}")
    per = " per node" if args.trainjob else ""
    print(f"wrote {args.out} (image {args.image}, {args.gpus} GPU(s){per} for training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
