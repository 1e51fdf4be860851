"""resume: on an empty machine, process start to the first resumed iteration, vs a raw download plus
model build in a fresh process.

    python -m bench.resume [--quick]
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from bench.common import DEMO, Env, Section, md_table, median

NAME = "resume"
TARGET = 1.5
SNAPSHOT = 4
WHAT = (
    "A job of a mid-size model (torchvision's `fasterrcnn_mobilenet_v3_large_fpn`, random init, on the "
    "demo's synthetic data and training settings: TRAIN.SCALES 128, 4 images per batch, "
    "DATA_LOADER.NUM_THREADS 1) is trained by `python -m trainer train` against the `mlflow server` "
    f"(artifacts proxied to moto S3) until its first checkpoint (iteration {SNAPSHOT - 1}) is uploaded and "
    "tagged, then SIGKILLed: a machine lost. **ours**: `python -m trainer train` with the same "
    "config in a fresh, empty folder, which finds the run by its job tag, downloads and verifies the "
    "checkpoint through the server and resumes; timed from `Popen` to the start of its first resumed "
    "iteration (the moment its `json_stats` line for that iteration is read, minus that iteration's own "
    "`time`), then SIGKILLed again, so every round resumes the same checkpoint. **floor**: a fresh "
    "`python` that imports torch/torchvision/boto3 and the trainer's model builder, downloads the same "
    "S3 object straight from moto with one streamed `boto3 get_object` (5x faster here than "
    "`download_file`'s ranged parts), builds the model with "
    "`trainer.models.build_model` and loads the checkpoint into it (`torch.load(weights_only=True)` + "
    "`load_state_dict`): the least any resume must do, timed from `Popen` to the state being loaded. **ours' "
    "steps**: a third fresh process doing the trainer's resume steps one by one with its own functions "
    "(imports, `transfers.download` through the server, which hashes as it downloads, "
    "`checkpoint.state.load`), timed step by step. The three run in rounds, the order rotating.")

FLOOR = r"""
import json, sys, time
t = {"start": time.time()}
import torch, torchvision, boto3
from trainer.config import load_config
from trainer.models import build_model
t["imported"] = time.time()
cfg_path, bucket, key, endpoint, dest = sys.argv[1:6]
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
with open(dest, "wb") as f:  # one streamed GET: faster against moto than download_file's ranged parts
    body = s3.get_object(Bucket=bucket, Key=key)["Body"]
    for chunk in iter(lambda: body.read(1 << 20), b""):
        f.write(chunk)
t["downloaded"] = time.time()
cfg = load_config(cfg_path)
model = build_model(cfg, 4)
t["built"] = time.time()
state = torch.load(dest, map_location="cpu", weights_only=True)
model.load_state_dict(state["model"])
t["loaded"] = time.time()
print("FLOOR " + json.dumps(t), flush=True)
"""


STEPS = r"""
import json, sys, time
t = {"start": time.time()}
import torch, torchvision
import trainer.cli, trainer.engine
t["imported_torch"] = time.time()
import trainer.tracking.mlflow_tracker
from mlflow import MlflowClient
from trainer.tracking.runs import bound_http
bound_http()  # the trainer's MLflow settings (timeouts, download chunks)
t["imported_mlflow"] = time.time()
from pathlib import Path
from trainer.checkpoint.state import load as load_checkpoint
from trainer.tracking.transfers import download, run_repository
url, run_id, name, dest = sys.argv[1:5]
path, _ = download(run_repository(MlflowClient(url), url, run_id), "checkpoints/" + name, Path(dest))
t["downloaded"] = time.time()
load_checkpoint(path, sha256_checked=True)
t["loaded"] = time.time()
print("STEPS " + json.dumps(t), flush=True)
"""


def write_config(path: Path) -> Path:
    """The demo's data and solver, a mid-size torchvision model (its own builder, its own anchors)."""
    data = yaml.safe_load(DEMO.read_text())
    data["NAME"] = "bench-resume"
    data["MODEL"] = {"TYPE": "fasterrcnn_mobilenet_v3_large_fpn",
                     **{k: v for k, v in data["MODEL"].items() if k.startswith(("RPN_", "ROI_"))}}
    data["SOLVER"]["MAX_ITER"] = 1000
    data["TRAIN"]["SNAPSHOT_ITERS"] = SNAPSHOT
    data["LOG_PERIOD"] = 1  # a json_stats line for every iteration, the first resumed one included
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class Watched:
    """A trainer process whose output lines are stamped with the time they arrive."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict):
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1, start_new_session=True)
        self.lines: list[tuple[float, str, str]] = []
        self._cv = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(s, n), daemon=True)
                         for s, n in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for r in self._readers:
            r.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            with self._cv:
                self.lines.append((time.perf_counter() - self.t0, name, line.rstrip("\n")))
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, predicate, timeout: float):
        """The first (seconds, stream, line) matching predicate(line); None at timeout or exit."""
        end = time.monotonic() + timeout
        seen = 0
        with self._cv:
            while True:
                for item in self.lines[seen:]:
                    if predicate(item[2]):
                        return item
                seen = len(self.lines)
                if self.proc.poll() is not None and not any(r.is_alive() for r in self._readers):
                    return None
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.5))

    def first(self, text: str):
        return next((item for item in self.lines if text in item[2]), None)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the trainer and its loader worker
        self.proc.wait()
        for r in self._readers:
            r.join(5)

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, _, line in self.lines[-n:])


def _json_stats_iter(line: str):
    if not line.startswith("json_stats: "):
        return None
    return json.loads(line[len("json_stats: "):])


def run(env: Env) -> Section:
    from mlflow import MlflowClient

    quick = env.quick
    rounds = 2 if quick else 6
    server, s3 = env.mlflow, env.s3
    cfg_path = write_config(env.workdir / "resume.yaml")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    child_env.update(s3.env)
    child_env.update({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
                      "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"})
    opts = ["DATA_DIR", str(env.data_dir), "OUTPUT_DIR", "output", "TRACKING.URI", server.url,
            "TRACKING.EXPERIMENT", "bench-resume"]
    cmd = [sys.executable, "-m", "trainer", "train", "--config", str(cfg_path), *opts]
    client = MlflowClient(server.url)

    # 1. the job that is lost after its first checkpoint
    first = Watched(cmd, env.scratch("resume-first"), child_env)
    try:
        ckpt_name, run_id = _wait_for_checkpoint(client, first, timeout=600)
    finally:
        first.kill()
    iteration = int(ckpt_name[len("model_iter"):-len(".pth")])
    key = _s3_key(s3, run_id, ckpt_name)
    size = s3.client().head_object(Bucket=s3.bucket, Key=key)["ContentLength"]

    # 2. rounds of (floor, ours, steps), the order rotating
    arms = {"floor": lambda: _floor(env, cfg_path, s3, key, child_env),
            "ours": lambda: _ours(env, cmd, child_env, iteration + 1),
            "steps": lambda: _steps(env, server.url, run_id, ckpt_name, child_env)}
    got: dict[str, list] = {k: [] for k in arms}
    names = list(arms)
    for r in range(rounds):
        for kind in names[r % 3:] + names[:r % 3]:
            got[kind].append(arms[kind]())
            print(f"   round {r} {kind}: {got[kind][-1]['total']:.2f}s", flush=True)
    floors, ours, steps = got["floor"], got["ours"], got["steps"]

    f_med = {k: median(f[k] for f in floors) for k in floors[0]}
    o_med = {k: median(o[k] for o in ours) for k in ours[0]}
    s_med = {k: median(x[k] for x in steps) for k in steps[0]}
    ratio = o_med["total"] / f_med["total"]
    ratios = [o["total"] / f["total"] for o, f in zip(ours, floors)]
    in_process = f_med["download"] + f_med["build"] + f_med["load"]
    rows = [["floor: python start to torch, torchvision, boto3, trainer.models imported",
             f"{f_med['imported']:.2f}", ""],
            ["floor: boto3 get_object from moto, streamed to a file", f"{f_med['download']:.2f}", ""],
            ["floor: build_model", f"{f_med['build']:.2f}", ""],
            ["floor: torch.load + load_state_dict", f"{f_med['load']:.2f}", ""],
            ["floor without the process start: download + build + load, in a warm process",
             f"{in_process:.2f}", f"{in_process / f_med['total']:.2f}"],
            ["**floor total (fresh process)**", f"**{f_med['total']:.2f}**", "1.00"],
            ["ours: start to 'MLflow run' logged (Python, config, MLflow imported; then torch imported and the "
             "job checked on the main thread while the tracker's start thread finds the job's run, whose newest "
             "checkpoint then downloads on a thread of its own; the run reopened once the checks passed)",
             f"{o_med['run_found']:.2f}", ""],
            ["ours: to 'resuming from' logged (the download's end awaited, the checkpoint loaded)",
             f"{o_med['resuming'] - o_med['run_found']:.2f}", ""],
            ["ours: to the first resumed iteration's start (loader, restore)",
             f"{o_med['total'] - o_med['resuming']:.2f}", ""],
            ["**ours total (to the first resumed iteration)**", f"**{o_med['total']:.2f}**", f"**{ratio:.2f}**"],
            ["ours: that first iteration itself (not counted)", f"{o_med['first_iter']:.2f}", ""],
            ["ours' steps one by one: python start to torch + trainer.cli/engine imported",
             f"{s_med['imported_torch']:.2f}", ""],
            ["ours' steps: + import mlflow (trainer.tracking.mlflow_tracker)", f"{s_med['mlflow']:.2f}", ""],
            ["ours' steps: transfers.download through the server's proxy (one streamed GET, hashed as it comes)",
             f"{s_med['download']:.2f}", f"{s_med['download'] / f_med['download']:.1f}x boto3"],
            ["ours' steps: checkpoint.state.load (torch.load weights_only; the sha256 stands for the CRC check)",
             f"{s_med['load']:.2f}", ""]]
    table = md_table(["phase (medians)", "seconds", "vs floor"], rows, "lrr")
    passed = ratio <= TARGET
    headline = (f"resume on an empty machine {o_med['total']:.1f} s to the first resumed iteration vs "
                f"{f_med['total']:.1f} s for a raw download + model build in a fresh process: {ratio:.2f}x "
                f"(target <= {TARGET}x; {o_med['total'] / in_process:.1f}x the download + build alone, in a warm "
                "process)")
    notes = ["The target is judged against the fresh-process floor: download + build alone "
             f"({in_process:.2f} s here) is less than starting Python and importing torch "
             f"({f_med['imported']:.2f} s), which any resume in a new process pays, so 1.5x of it cannot "
             "be met by construction. Its ratio is shown in the headline for completeness.",
             "`ours' steps` is a third process, run in the same rounds, that performs the trainer's own resume "
             "steps one at a time with the trainer's functions, to say where ours' extra time goes.",
             f"Checkpoint {ckpt_name}: {size / 1e6:.0f} MB (model + SGD momentum + state); {rounds} rounds, "
             f"per-round ratios {', '.join(f'{x:.2f}' for x in ratios)}.",
             "Why this model: the demo's checkpoint is 8 MB, whose download is lost in the start-up; "
             "fasterrcnn_mobilenet_v3_large_fpn (torchvision's builder, its 1024-wide box head) makes a "
             "checkpoint large enough for the download to be a real share, while an iteration on the "
             "demo's 128 px images still takes well under a second on the CPU.",
             "Both sides start a new Python process, so interpreter start and imports are in both; ours also "
             "imports MLflow and click, talks to the tracking server (experiment, job run search, tags), "
             "downloads through the server's artifact proxy rather than from S3 directly, hashes the file, "
             "indexes the dataset and starts its loader worker. One process: MLflow is imported first, on the "
             "main thread; then the tracker's start thread finds the run, and from that moment the checkpoint "
             "downloads on a thread of its own (one streamed GET through the server, hashed as it arrives; "
             "before the job's checks, which only read), while the main thread imports torch, checks the job "
             "and builds the dataset and model. Imports hold the GIL, so ours pays MLflow's import (the "
             "`+ import mlflow` row) on top of torch's either way; made first, it lets the lookup and the "
             "download wait on the network while torch loads instead of after it.",
             "What changed (2026-12-01): the download was MLflow's presigned ranged one, whose parts requests "
             "reads in 10 kB pieces (0.7 s of client CPU for this checkpoint, GIL time taken from torch's "
             "import), and MLflow was imported on the start thread alongside torch, so the download began "
             "only once both imports were nearly done: 1.76x. Now a file under MLflow's 500 MB ranged-download "
             "threshold comes in one streamed GET through the server (0.06 s of client CPU), and MLflow loads "
             "before torch.",
             "What changed (2026-12-05): the run's first upload (config.yaml) is now sent before the first "
             "iteration, so that an artifact store that refuses uploads stops the job before it trains; it is "
             "in the 'first resumed iteration's start' row. The commit before it, run minutes earlier on the "
             "same machine: 1.46x, that row 0.14 s (after: 1.48x, 0.15 s). This machine ran about 2x slower "
             "that day than on 2026-12-01 (python start to torch 4.3 s, then 1.9 s), which moved both sides.",
             "What changed (2026-12-07): a resumed job now also fetches the run's log.txt and json_stats.log when "
             "the machine has none (each a listing and a GET, through a hidden folder), after the checkpoint is "
             "loaded and before the first iteration: 1.49x that morning (python start to torch 2.2 s). The job's "
             "start now also asks an http(s) server once whether it has MLflow 3's logged-model API (12 ms, on the "
             "lookup thread). That afternoon, runs alternating on the same machine gave 1.51x, 1.55x and 1.53x "
             "with that question, and 1.52x and 1.56x at acc3fde, the commit before it (log fetch included): "
             "no cost of its own to see, and the target within this machine's noise from one hour to the next."]
    return Section(NAME, "Resume from the tracking server", WHAT, headline,
                   f"resume on an empty machine <= {TARGET}x a raw download + model build (fresh process)", passed,
                   [table], notes)


def _wait_for_checkpoint(client, proc: Watched, timeout: float) -> tuple[str, str]:
    """Poll the server until the job's run has a checkpoint tagged complete."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"the first training process exited with {proc.proc.returncode}:\n{proc.tail()}")
        exp = client.get_experiment_by_name("bench-resume")
        if exp is not None:
            for run in client.search_runs([exp.experiment_id]):
                latest = run.data.tags.get("tracktron.ckpt.latest")
                if latest:
                    return latest, run.info.run_id
        time.sleep(0.5)
    raise TimeoutError(f"no checkpoint within {timeout}s:\n{proc.tail()}")


def _s3_key(s3, run_id: str, name: str) -> str:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket)
    keys = [o["Key"] for p in pages for o in p.get("Contents", [])
            if run_id in o["Key"] and o["Key"].endswith(f"checkpoints/{name}")]
    if not keys:
        raise RuntimeError(f"{name} of run {run_id} not found in s3://{s3.bucket}")
    return keys[0]


def _floor(env: Env, cfg_path: Path, s3, key: str, child_env: dict) -> dict:
    dest = env.scratch("floor") / "checkpoint.pth"
    wall0 = time.time()
    out = subprocess.run([sys.executable, "-c", FLOOR, str(cfg_path), s3.bucket, key, s3.url, str(dest)],
                         env=child_env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("FLOOR ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"floor process failed ({out.returncode}):\n{out.stderr[-2000:]}")
    t = json.loads(line[len("FLOOR "):])
    dest.unlink(missing_ok=True)
    return {"imported": t["imported"] - wall0, "download": t["downloaded"] - t["imported"],
            "build": t["built"] - t["downloaded"], "load": t["loaded"] - t["built"], "total": t["loaded"] - wall0}


def _steps(env: Env, url: str, run_id: str, name: str, child_env: dict) -> dict:
    dest = env.scratch("steps")
    wall0 = time.time()
    out = subprocess.run([sys.executable, "-c", STEPS, url, run_id, name, str(dest)], env=child_env,
                         capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("STEPS ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"steps process failed ({out.returncode}):\n{out.stderr[-2000:]}")
    t = json.loads(line[len("STEPS "):])
    for f in dest.rglob("*.pth"):
        f.unlink()
    return {"imported_torch": t["imported_torch"] - wall0, "mlflow": t["imported_mlflow"] - t["imported_torch"],
            "download": t["downloaded"] - t["imported_mlflow"], "load": t["loaded"] - t["downloaded"],
            "total": t["loaded"] - wall0}


def _ours(env: Env, cmd: list[str], child_env: dict, first_iter: int) -> dict:
    proc = Watched(cmd, env.scratch("resume-ours"), child_env)
    try:
        hit = proc.wait_for(lambda line: (_json_stats_iter(line) or {}).get("iter") == first_iter, timeout=600)
        if hit is None:
            raise RuntimeError(f"no resumed iteration {first_iter}:\n{proc.tail()}")
    finally:
        proc.kill()
    stats = _json_stats_iter(hit[2])
    run_found = proc.first("MLflow run")
    resuming = proc.first("resuming from")
    if resuming is None or f"at iteration {first_iter}" not in resuming[2]:
        raise RuntimeError(f"did not resume at iteration {first_iter}:\n{proc.tail()}")
    first_iter_s = float(stats.get("time", 0.0))
    return {"run_found": run_found[0] if run_found else float("nan"), "resuming": resuming[0],
            "first_iter": first_iter_s, "total": hit[0] - first_iter_s}


if __name__ == "__main__":
    from bench.run import main_single

    main_single(run)
