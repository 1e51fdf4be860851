"""GPU checks of the whole job, through the CLI as a user runs it (bench/gpu.sh is the throughput benchmark).

    python -m bench.gpu_checks [--out bench/GPU_CHECKS.md] [--logs DIR] [--only NAME,...] [--allow-cpu]

Each check is a real `python -m trainer ...` process on the demo config (synthetic data, random init,
a sqlite tracking store in a temporary folder), and passes only on what a user would look at:

- train_amp: a tracked AMP job with checkpoints and the final COCO evaluation on the GPU; exit 0,
  model_final, the run FINISHED with its loss curve, bbox/AP, the GPU named in its tags, system/gpu metrics.
- preempt_resume: SIGTERM mid-run (a preempted node), then the same command: exit 143, then 0, one run,
  every iteration's loss logged once.
- deterministic_resume (fp32, AMP): DETERMINISTIC true, a run straight through against one resumed from
  its model_iter; model_final bit-identical (weights, optimizer, AMP scaler, RNG and sampler restored).
- eval_predict_cpu: `tracktron eval` of the GPU checkpoint on the GPU and with no GPU visible, `predict`,
  and the registered model loaded as an MLflow pyfunc on the CPU (trained on a GPU, served without one).
- more_ranks_than_gpus: torchrun with one process more than the host has GPUs: each rank exits 2 with one
  `error:` line naming the GPU count (torchrun itself then exits 1), and no run is made.
- deterministic_heads: DETERMINISTIC true with the mask head (exit 0: roi_align takes torchvision's deterministic
  path on CUDA) and with the keypoint head (refused in one line on a GPU: no deterministic bilinear backward).
- ddp_nccl (2 GPUs or more, else skipped): torchrun on 2 GPUs (NCCL) with AMP, a checkpoint and an evaluation,
  then resumed from its model_iter by one process (another GPU count): both exit 0, one run.
- first_iterations: a fresh process's 60 iterations with CUDNN_BENCHMARK off and on (figures, not a verdict).

The results table goes to --out (and stdout); each check's output to --logs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo.yaml"


class Failed(Exception):
    pass


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise Failed(what)


class Env:
    def __init__(self, work: Path, logs: Path):
        self.work, self.logs = work, logs
        self.uri = f"sqlite:///{work / 'mlflow.db'}"
        self.data = work / "datasets"

    def keys(self, name: str, **keys) -> list[str]:
        base = {"OUTPUT_DIR": self.work / name / "output", "DATA_DIR": self.data, "LOG_PERIOD": 10,
                "TEST.EVAL_PERIOD": 0, "TRACKING.URI": self.uri, "TRACKING.EXPERIMENT": f"gpu-{name}",
                "TRACKING.REGISTERED_MODEL": "''", "DATA_LOADER.NUM_THREADS": 2}
        base.update(keys)
        return [str(x) for kv in base.items() for x in kv]

    def run(self, name: str, args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "trainer", *args]
        result = subprocess.run(cmd, cwd=self.work, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, **(env or {})})
        with open(self.logs / f"{name}.log", "a") as f:
            f.write(f"$ {' '.join(cmd)}\n-> exit {result.returncode}\n{result.stdout}\n{result.stderr}\n\n")
        return result

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(self.uri)

    def runs(self, experiment: str) -> list:
        client = self.client()
        exp = client.get_experiment_by_name(experiment)
        return client.search_runs([exp.experiment_id]) if exp else []


def tail(result) -> str:
    lines = [x for x in result.stderr.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else "(no output)"


def train_amp(env: Env) -> str:
    import torch

    result = env.run("train_amp", ["train", "--config", str(DEMO), *env.keys(
        "train_amp", **{"SOLVER.MAX_ITER": 60, "TRAIN.SNAPSHOT_ITERS": 20, "SOLVER.AMP": "true",
                        "TRAIN.IMS_PER_BATCH": 8, "TRACKING.REGISTERED_MODEL": "tt-gpu"})],
        env={"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"})
    expect(result.returncode == 0, f"exit {result.returncode}: {tail(result)}")
    out = env.work / "train_amp" / "output"
    expect((out / "model_final.pth").is_file(), "no model_final.pth")
    ckpt = torch.load(out / "model_final.pth", map_location="cpu", weights_only=False)
    expect(ckpt.get("scaler") is not None, f"no AMP scaler state in the checkpoint (keys {sorted(ckpt)})")
    (run,) = env.runs("gpu-train_amp")
    expect(run.info.status == "FINISHED", f"run {run.info.status}")
    device = run.data.tags.get("tracktron.device", "")
    expect(device and not device.startswith("cpu"), f"tracktron.device tag {device!r}")
    losses = env.client().get_metric_history(run.info.run_id, "loss")
    expect(len({m.step for m in losses}) == 60, f"{len(losses)} loss points for 60 iterations")
    first, last = losses[0].value, sorted(losses, key=lambda m: m.step)[-1].value
    expect("bbox/AP" in run.data.metrics, "no bbox/AP in the run")
    gpu_metrics = sorted(k for k in run.data.metrics if k.startswith("system/gpu"))
    system = sorted(k for k in run.data.metrics if k.startswith("system/"))
    expect(gpu_metrics, f"no system/gpu metrics (system metrics: {system})")
    return (f"{device}; loss {first:.2f} -> {last:.2f}; bbox/AP {run.data.metrics['bbox/AP']:.3f}; "
            f"{len(gpu_metrics)} system/gpu metrics ({', '.join(gpu_metrics[:3])}, ...)")


def preempt_resume(env: Env) -> str:
    args = ["train", "--config", str(DEMO), *env.keys("preempt", **{"SOLVER.MAX_ITER": 120, "TRAIN.SNAPSHOT_ITERS": 1000,
                                                                  "SOLVER.AMP": "true", "LOG_PERIOD": 5})]
    cmd = [sys.executable, "-m", "trainer", *args]
    log = open(env.logs / "preempt_resume.log", "a")
    proc = subprocess.Popen(cmd, cwd=env.work, stdout=subprocess.PIPE, stderr=log, text=True)  # json_stats: stdout
    seen, lines = -1, []
    for line in proc.stdout:
        lines.append(line)
        if m := re.search(r'"iter": (\d+)', line):
            seen = int(m.group(1))
            if seen >= 40:
                proc.send_signal(signal.SIGTERM)
                break
    lines.extend(proc.stdout)
    rc = proc.wait(120)
    log.write(f"$ {' '.join(cmd)}  (SIGTERM after iteration {seen})\n-> exit {rc}\n{''.join(lines)}\n")
    log.close()
    expect(rc == 143, f"exit {rc} after SIGTERM (sent after iteration {seen})")
    saved = sorted((env.work / "preempt" / "output").glob("model_iter*.pth"))
    expect(saved, "no checkpoint written at the SIGTERM")
    stopped_at = int(re.search(r"model_iter(\d+)", saved[-1].name).group(1))
    again = env.run("preempt_resume", args)
    expect(again.returncode == 0, f"resume exit {again.returncode}: {tail(again)}")
    expect(f"at iteration {stopped_at + 1}" in again.stderr, f"no 'at iteration {stopped_at + 1}' in the resume's log")
    runs = env.runs("gpu-preempt")
    expect(len(runs) == 1 and runs[0].info.status == "FINISHED", f"{len(runs)} runs: {[r.info.status for r in runs]}")
    steps = [m.step for m in env.client().get_metric_history(runs[0].info.run_id, "loss")]
    expect(sorted(steps) == list(range(120)), f"loss steps: {len(steps)} points, {len(set(steps))} distinct of 120")
    return f"SIGTERM after iteration {seen}: exit 143, {saved[-1].name}; resumed at {stopped_at + 1}, one run, steps 0-119 once"


def deterministic_resume(env: Env, amp: bool) -> str:
    import torch

    name = f"determ_{'amp' if amp else 'fp32'}"
    args = ["train", "--config", str(DEMO), *env.keys(name, **{
        "SOLVER.MAX_ITER": 8, "TRAIN.SNAPSHOT_ITERS": 4, "DETERMINISTIC": "true", "SOLVER.AMP": str(amp).lower(),
        "TRACKING.ENABLED": "false", "TEST.DATASETS": "[]"})]
    straight = env.run(name, args)
    expect(straight.returncode == 0, f"exit {straight.returncode}: {tail(straight)}")
    out = env.work / name / "output"
    first = torch.load(out / "model_final.pth", map_location="cpu", weights_only=False)["model"]
    (out / "model_final.pth").unlink()  # as if killed after model_iter3
    resumed = env.run(name, args)
    expect(resumed.returncode == 0, f"resume exit {resumed.returncode}: {tail(resumed)}")
    expect("at iteration 4" in resumed.stderr, "the rerun did not resume at iteration 4")
    again = torch.load(out / "model_final.pth", map_location="cpu", weights_only=False)["model"]
    differ = [k for k in first if not torch.equal(first[k], again[k])]
    expect(not differ, f"{len(differ)} of {len(first)} tensors differ after the resume, e.g. {differ[:2]}")
    return f"straight vs resumed at 4: {len(first)} tensors bit-identical"


def eval_predict_cpu(env: Env) -> str:
    weights = env.work / "train_amp" / "output" / "model_final.pth"
    expect(weights.is_file(), "needs train_amp's model_final")
    keys = ["OUTPUT_DIR", str(env.work / "eval"), "DATA_DIR", str(env.data), "TRACKING.URI", env.uri]
    seen = []
    for label, extra in (("GPU", {}), ("CPU", {"CUDA_VISIBLE_DEVICES": ""})):
        result = env.run("eval_predict_cpu", ["eval", "--config", str(DEMO), "--weights", str(weights), *keys],
                         env=extra)
        expect(result.returncode == 0, f"eval on the {label}: exit {result.returncode}: {tail(result)}")
        ap = re.search(r"\(AP\) @\[ IoU=0.50:0.95 \| area=   all \| maxDets=100 \] = ([-0-9.]+)", result.stdout + result.stderr)
        expect(ap, f"eval on the {label}: no AP line")
        seen.append(float(ap.group(1)))
    expect(abs(seen[0] - seen[1]) < 0.02, f"AP on the GPU {seen[0]} vs the CPU {seen[1]}")
    image = next((env.data / "synth_shapes" / "val" / "images").glob("*.png"))
    pred = env.run("eval_predict_cpu", ["predict", "--weights", str(weights), "--out", str(env.work / "pred"), str(image)])
    expect(pred.returncode == 0, f"predict exit {pred.returncode}: {tail(pred)}")
    found = json.loads(next((env.work / "pred").glob("*.json")).read_text())
    code = ("import sys, mlflow.pyfunc, pandas as pd; m = mlflow.pyfunc.load_model('models:/tt-gpu@final'); "
            "(d,) = m.predict(pd.DataFrame({'image': [open(sys.argv[1], 'rb').read()]})); print(len(d['boxes']))")
    served = subprocess.run([sys.executable, "-c", code, str(image)], cwd=env.work, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "MLFLOW_TRACKING_URI": env.uri})
    with open(env.logs / "eval_predict_cpu.log", "a") as f:
        f.write(f"$ pyfunc on the CPU\n-> exit {served.returncode}\n{served.stdout}\n{served.stderr}\n")
    expect(served.returncode == 0, f"pyfunc on the CPU: exit {served.returncode}: {tail(served)}")
    return (f"AP {seen[0]:.3f} on the GPU, {seen[1]:.3f} on the CPU; predict: {len(found.get('boxes', []))} "
            f"detections (GPU); models:/tt-gpu@final on the CPU: {served.stdout.strip()} boxes")


def more_ranks_than_gpus(env: Env) -> str:
    import torch

    n = torch.cuda.device_count() + 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", "29533",
           "-m", "trainer", "train", "--config", str(DEMO),
           *env.keys("ranks", **{"SOLVER.MAX_ITER": 4, "TEST.DATASETS": "[]"})]
    result = subprocess.run(cmd, cwd=env.work, capture_output=True, text=True, timeout=300)
    with open(env.logs / "more_ranks_than_gpus.log", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n-> exit {result.returncode}\n{result.stdout}\n{result.stderr}\n")
    errors = sorted({x for x in result.stderr.splitlines() if x.startswith("error: ")})
    expect(result.returncode != 0, "exit 0 with more processes than GPUs")
    expect(errors and "GPU" in errors[0], f"exit {result.returncode}; error lines {errors[:2]}; {tail(result)}")
    expect(not env.runs("gpu-ranks"), "a run was made")
    return f"--nproc-per-node {n}: exit {result.returncode}, no run; {errors[0][:160]}"


def deterministic_heads(env: Env) -> str:
    """Every family's CUDA backward under torch.use_deterministic_algorithms: an op with no
    deterministic kernel raises there, never on the CPU (the test suite's)."""
    import torch

    seen = []
    single_stage = {"MODEL.BACKBONE": "resnet18", "MODEL.BACKBONE_WIDTH": 1.0, "MODEL.ANCHOR_SIZES": "[16,32,64,128,256]"}
    keys = {"retinanet_resnet50_fpn": single_stage, "fcos_resnet50_fpn": {**single_stage, "MODEL.FPN_CHANNELS": 64},
            "ssdlite320_mobilenet_v3_large": {"MODEL.BACKBONE": "''", "MODEL.BACKBONE_WIDTH": 1.0,
                                              "MODEL.ANCHOR_SIZES": "[]", "MODEL.FPN_CHANNELS": 256}}
    for model_type in ("fasterrcnn_resnet50_fpn", "maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn", *keys):
        name = f"determ_{model_type.split('_')[0]}"
        result = env.run(name, ["train", "--config", str(DEMO), *env.keys(name, **{
            "MODEL.TYPE": model_type, "SOLVER.MAX_ITER": 4, "TRAIN.SNAPSHOT_ITERS": 1000, "DETERMINISTIC": "true",
            "TRACKING.ENABLED": "false", "TEST.DATASETS": "[]", **keys.get(model_type, {})})])
        refused = model_type.startswith("keypointrcnn") and torch.cuda.is_available()  # preflight.check_deterministic
        if refused:
            expect(result.returncode == 2 and "DETERMINISTIC" in tail(result) and "Traceback" not in result.stderr,
                   f"{model_type}: exit {result.returncode}, not the one-line refusal: {tail(result)}")
        else:
            expect(result.returncode == 0, f"{model_type}: exit {result.returncode}: {tail(result)}")
        seen.append(f"{model_type}: {'refused' if refused else 'trained'}")
    return "; ".join(seen)


def ddp_nccl(env: Env) -> str:
    """The NCCL path: every collective's tensors on the rank's own GPU, DDP's device_ids, the
    checkpoint's RNG states of two ranks resumed by one."""
    import torch

    if torch.cuda.device_count() < 2:
        return f"skipped: {torch.cuda.device_count()} GPU (NCCL needs one per rank)"
    args = ["train", "--config", str(DEMO), *env.keys("ddp", **{
        "SOLVER.MAX_ITER": 20, "TRAIN.SNAPSHOT_ITERS": 20, "TEST.EVAL_PERIOD": 10, "SOLVER.AMP": "true"})]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29534",
           "-m", "trainer", *args]
    result = subprocess.run(cmd, cwd=env.work, capture_output=True, text=True, timeout=300)
    with open(env.logs / "ddp_nccl.log", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n-> exit {result.returncode}\n{result.stdout}\n{result.stderr}\n\n")
    expect(result.returncode == 0, f"torchrun exit {result.returncode}: {tail(result)}")
    guessed = [line for line in result.stderr.splitlines() if "currently unknown" in line]  # NCCL guessed a GPU
    expect(not guessed, f"a rank's process group is not bound to its GPU: {guessed[:1]}")
    out = env.work / "ddp" / "output"
    saved = sorted(out.glob("model_iter*.pth"))  # SNAPSHOT_ITERS 20 // NUM_GPUS 2: model_iter9
    expect(saved and (out / "model_final.pth").is_file(), f"checkpoints {[p.name for p in out.glob('*.pth')]}")
    (run,) = env.runs("gpu-ddp")
    expect(run.data.tags.get("tracktron.world_size") == "2", f"world_size tag {run.data.tags.get('tracktron.world_size')}")
    (out / "model_final.pth").unlink()
    again = env.run("ddp_nccl", args)  # one process resumes the two ranks' checkpoint
    expect(again.returncode == 0, f"resume on one GPU: exit {again.returncode}: {tail(again)}")
    runs = env.runs("gpu-ddp")
    expect(len(runs) == 1 and runs[0].info.status == "FINISHED", f"{len(runs)} runs: {[r.info.status for r in runs]}")
    return f"2 ranks on NCCL: exit 0, {saved[-1].name}, bbox/AP {run.data.metrics.get('bbox/AP')}; resumed on 1 GPU: exit 0"


def first_iterations(env: Env) -> str:
    """Not pass or fail on speed: the figures that decide CUDNN_BENCHMARK's default, the demo's
    many-shaped batches trained from a fresh process with it off and on."""
    seen = []
    for benchmark in ("false", "true"):
        name = f"cudnn_benchmark_{benchmark}"
        t0 = time.monotonic()
        result = env.run("first_iterations", ["train", "--config", str(DEMO), *env.keys(name, **{
            "SOLVER.MAX_ITER": 60, "TRAIN.SNAPSHOT_ITERS": 1000, "TRAIN.IMS_PER_BATCH": 8, "CUDNN_BENCHMARK": benchmark,
            "TRACKING.ENABLED": "false", "TEST.DATASETS": "[]"})])
        expect(result.returncode == 0, f"CUDNN_BENCHMARK {benchmark}: exit {result.returncode}: {tail(result)}")
        stats = [json.loads(line.split("json_stats: ", 1)[1]) for line in result.stdout.splitlines()
                 if line.startswith("json_stats: ")]
        seen.append(f"CUDNN_BENCHMARK {benchmark}: {time.monotonic() - t0:.0f} s for the process, "
                    f"{stats[-1]['time'] * 1000:.0f} ms an iteration at the end")
    return "; ".join(seen)


CHECKS = {"train_amp": train_amp, "preempt_resume": preempt_resume,
          "deterministic_resume_fp32": lambda env: deterministic_resume(env, False),
          "deterministic_resume_amp": lambda env: deterministic_resume(env, True),
          "eval_predict_cpu": eval_predict_cpu, "more_ranks_than_gpus": more_ranks_than_gpus,
          "deterministic_heads": deterministic_heads, "ddp_nccl": ddp_nccl, "first_iterations": first_iterations}


def render(rows: list, started: float) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU smoke test)"
    lines = ["# tracktron GPU checks", "",
             f"`python -m bench.gpu_checks`, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, "
             f"{(time.monotonic() - started) / 60:.1f} min; GPU: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda})",
             "", "| check | result | seconds | what was seen |", "| --- | --- | ---: | --- |"]
    lines += [f"| {name} | **{result}** | {seconds:.0f} | {detail.replace('|', '/')} |" for name, result, seconds, detail in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_checks", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "GPU_CHECKS.md"))
    p.add_argument("--logs", default=None, help="folder for each check's output (default: a temporary one)")
    p.add_argument("--only", default=",".join(CHECKS))
    p.add_argument("--allow-cpu", action="store_true", help="smoke-test this script on the CPU")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("bench.gpu_checks: no CUDA device visible to torch; run it on a GPU machine (or --allow-cpu)", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := [n for n in names if n not in CHECKS]:
        print(f"bench.gpu_checks: unknown checks {unknown} (of {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    started, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="tracktron-gpu-checks-") as tmp:
        logs = Path(args.logs or Path(tmp) / "logs")
        logs.mkdir(parents=True, exist_ok=True)
        env = Env(Path(tmp), logs)
        for name in names:
            t0 = time.monotonic()
            try:
                detail, result = CHECKS[name](env), "PASS"
            except Failed as e:
                detail, result = str(e), "FAIL"
            except Exception as e:  # the check itself broke: say how, go on with the next
                detail, result = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "ERROR"
            rows.append((name, result, time.monotonic() - t0, detail))
            print(f"{name}: {result} ({rows[-1][2]:.0f} s) {detail}", file=sys.stderr, flush=True)
            Path(args.out).write_text(render(rows, started))
        shutil.rmtree(env.work / "datasets", ignore_errors=True)
    print(render(rows, started))
    return 0 if all(r[1] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
