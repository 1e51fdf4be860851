"""big_checkpoint: a 1 GB checkpoint up to S3 and back (a resume's download + sha256), through the
tracking server's proxy and straight to S3, side by side with raw boto3 to the same S3; peak RSS of each.

    python -m bench.big_checkpoint [--quick]
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Env, Section, md_table, median

NAME = "big_checkpoint"
GOALS = {"proxy": 0.8, "direct": 0.9}  # ours' upload throughput / raw boto3's
MB = 1024**2
WHAT = (
    "A checkpoint file of random bytes (1 GiB; `--quick` 256 MiB) is uploaded to moto's S3 and downloaded back, "
    "each transfer in a fresh Python process of its own, timed inside it around the transfer alone (imports, "
    "clients and the run's artifact repository are made first, off the clock). **raw**: boto3's `upload_file` "
    "and `download_file` (default TransferConfig: 8 MB parts, 10 threads), then `sha256_of` of the download. "
    "**ours, proxy**: `trainer.tracking.transfers.upload` (which first checks that the file is still the one "
    "handed over: device, inode, size, mtime, as the tracker calls it) into a run of `mlflow server --artifacts-destination "
    "s3://...` (the server signs a URL per part, the parts go to S3: MLflow's proxied multipart upload, "
    "MLflow's default 10 MB parts), and for the resume `prefetch.download_verified` (`transfers.download`: "
    "one streamed GET through the server, hashed as it arrives, then the sha256 against the tag; the server offers "
    "no ranged downloads, MLflow's default, so the 1 GiB file too comes this way). "
    "**ours, direct**: the same against `mlflow server --no-serve-artifacts --default-artifact-root s3://...`, "
    "where the trainer writes to S3 itself (MLflow's S3 repository: boto3's `upload_file` and `download_file`). "
    "**MLflow's client** (reference): `MlflowClient.log_artifact` through the proxy, as tracktron did before. "
    "Upload rounds put raw before and after the others (each object deleted at once), then download rounds "
    "rotate their order. "
    "Peak RSS: the process's high-water mark (VmHWM), and its growth over the RSS it had just before the transfer.")

CHILD = r"""
import json, os, re, sys, time
from pathlib import Path
kind, path, bucket, key, url, run_id, expected = sys.argv[1:8]
path = Path(path)
import boto3
from mlflow import MlflowClient
from trainer.hashing import sha256_of
from trainer.tracking.prefetch import download_verified
from trainer.tracking.runs import bound_http
from trainer.tracking.transfers import file_identity, run_repository, upload
bound_http()  # as the tracker sets MLflow up
s3 = boto3.client("s3", endpoint_url=os.environ["MLFLOW_S3_ENDPOINT_URL"], region_name="us-east-1")
client = MlflowClient(url) if url != "-" else None
repo = run_repository(client, url, run_id) if kind in ("up_ours", "down_ours") else None
statm = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
base = statm()
t0 = time.perf_counter()
if kind == "up_raw":
    s3.upload_file(str(path), bucket, key)
elif kind == "up_ours":
    upload(repo, path, "checkpoints", file_identity(path))  # as the tracker: still the file it was handed
elif kind == "up_mlflow":
    client.log_artifact(run_id, str(path), "mlflow-client")
elif kind == "down_raw":
    s3.download_file(bucket, key, str(path))
elif kind == "down_ours":
    got, why = download_verified(repo, path.name, path.parent, expected)
    assert got is not None, why
t1 = time.perf_counter()
if kind == "down_raw":
    assert sha256_of(path) == expected
t2 = time.perf_counter()
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec
peak = int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
print("RESULT " + json.dumps({"transfer": t1 - t0, "total": t2 - t0, "base_mb": base, "peak_mb": peak}), flush=True)
"""


def run(env: Env) -> Section:
    from mlflow import MlflowClient

    from tests.servers import MlflowServer
    from trainer.hashing import sha256_of

    size, rounds = (256 * MB, (2, 1)) if env.quick else (1024 * MB, (5, 1))  # (upload, download) rounds
    s3, proxy = env.s3, env.mlflow
    direct = MlflowServer(env.scratch("direct-server"), artifacts=f"s3://{s3.bucket}/direct", proxy=False,
                          env=s3.env).start()
    try:
        path = _random_file(env.scratch("big") / "model_iter999.pth", size)
        sha = sha256_of(path)
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | s3.env
        if env.quick:  # MLflow takes the multipart path from 500 MB on; the quick file is smaller
            child_env["MLFLOW_MULTIPART_UPLOAD_MINIMUM_FILE_SIZE"] = str(64 * MB)
        runs = {name: _new_run(MlflowClient(server.url), server.url, name) for name, server in
                (("proxy", proxy), ("direct", direct))}
        got = _rounds(env, rounds, path, sha, runs, child_env, s3)
    finally:
        direct.stop()
    return _section(got, size, rounds)


def _random_file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        for _ in range(size // (64 * MB)):
            f.write(os.urandom(64 * MB))
    return path


def _new_run(client, url: str, name: str) -> dict:
    exp = client.create_experiment(f"bench-big-{name}-{int(time.time())}")
    run = client.create_run(exp)
    prefix = "proxied" if name == "proxy" else "direct"
    root = run.info.artifact_uri.split(":/", 1)[1].lstrip("/")  # <exp>/<run>/artifacts, or <bucket>/direct/...
    root = root.split("/", 1)[1] if name == "direct" else f"{prefix}/{root}"
    return {"url": url, "run_id": run.info.run_id, "key": f"{root}/checkpoints/model_iter999.pth",
            "mlflow_key": f"{root}/mlflow-client/model_iter999.pth"}


def _rounds(env: Env, counts: tuple[int, int], path: Path, sha: str, runs: dict, child_env: dict, s3) -> dict:
    rounds, download_rounds = counts
    raw_key = "raw/model_iter999.pth"
    ups = {"raw": lambda: _child("up_raw", path, s3.bucket, raw_key, "-", "-", sha, child_env),
           "proxy": lambda: _child("up_ours", path, s3.bucket, "-", runs["proxy"]["url"], runs["proxy"]["run_id"], sha,
                                   child_env),
           "direct": lambda: _child("up_ours", path, s3.bucket, "-", runs["direct"]["url"], runs["direct"]["run_id"],
                                    sha, child_env),
           "mlflow": lambda: _child("up_mlflow", path, s3.bucket, "-", runs["proxy"]["url"], runs["proxy"]["run_id"],
                                    sha, child_env)}
    dest = env.scratch("downloads") / path.name
    downs = {"raw": lambda: _child("down_raw", dest, s3.bucket, raw_key, "-", "-", sha, child_env),
             "proxy": lambda: _child("down_ours", dest, s3.bucket, "-", runs["proxy"]["url"], runs["proxy"]["run_id"],
                                     sha, child_env),
             "direct": lambda: _child("down_ours", dest, s3.bucket, "-", runs["direct"]["url"],
                                      runs["direct"]["run_id"], sha, child_env)}
    keys = {"raw": raw_key, "proxy": runs["proxy"]["key"], "direct": runs["direct"]["key"],
            "mlflow": runs["proxy"]["mlflow_key"]}
    got: dict = {"up": {k: [] for k in ups}, "down": {k: [] for k in downs}, "etag": {}}
    client = s3.client()
    for r in range(rounds):  # raw on both sides of ours; each object deleted at once (moto keeps them in memory)
        for name in ["raw", *_rotated(["proxy", "direct", "mlflow"], r), "raw"]:
            got["up"][name].append(ups[name]())
            got["etag"][name] = client.head_object(Bucket=s3.bucket, Key=keys[name])["ETag"].strip('"')
            client.delete_object(Bucket=s3.bucket, Key=keys[name])
            print(f"   round {r} upload {name}: {got['up'][name][-1]['transfer']:.2f}s", file=sys.stderr, flush=True)
    for name in ("raw", "proxy", "direct"):  # the objects to resume from
        ups[name]()
    for r in range(download_rounds):
        for name in _rotated(list(downs), r):
            got["down"][name].append(downs[name]())
            dest.unlink(missing_ok=True)
            shutil.rmtree(dest.parent / "checkpoints", ignore_errors=True)  # where download_artifacts put ours
            print(f"   round {r} download {name}: {got['down'][name][-1]['total']:.2f}s", file=sys.stderr, flush=True)
    for name in ("raw", "proxy", "direct"):
        client.delete_object(Bucket=s3.bucket, Key=keys[name])
    return got


def _rotated(names: list[str], r: int) -> list[str]:
    return names[r % len(names):] + names[:r % len(names)]


def _child(kind: str, path: Path, bucket: str, key: str, url: str, run_id: str, sha: str, child_env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(path), bucket, key, url, run_id, sha],
                         env=child_env, capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{kind} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _section(got: dict, size: int, rounds: tuple[int, int]) -> Section:
    up, down = got["up"], got["down"]
    raw = [(a["transfer"] + b["transfer"]) / 2 for a, b in zip(up["raw"][::2], up["raw"][1::2])]  # each round's
    per_round = {k: [r / o["transfer"] for r, o in zip(raw, up[k])] for k in up if k != "raw"}
    up_ratio = {"raw": 1.0, **{k: median(v) for k, v in per_round.items()}}
    down_ratio = {k: median(r["total"] / o["total"] for r, o in zip(down["raw"], down[k])) for k in down}
    labels = {"raw": "raw boto3", "proxy": "**ours, through the server's proxy**", "direct": "**ours, direct to S3**",
              "mlflow": "MLflow's client.log_artifact, through the proxy (reference)"}
    up_rows = [[labels[k], f"{median(x['transfer'] for x in v):.2f}", f"{size / MB / median(x['transfer'] for x in v):.0f}",
                f"**{up_ratio[k]:.2f}**" if k in GOALS else f"{up_ratio[k]:.2f}", _parts(got["etag"][k]),
                f"{median(x['peak_mb'] for x in v):.0f}", f"{median(x['peak_mb'] - x['base_mb'] for x in v):.0f}"]
               for k, v in up.items()]
    down_rows = [[labels[k], f"{median(x['total'] for x in v):.2f}",
                  f"{size / MB / median(x['total'] for x in v):.0f}", f"{down_ratio[k]:.2f}",
                  f"{median(x['peak_mb'] for x in v):.0f}", f"{median(x['peak_mb'] - x['base_mb'] for x in v):.0f}"]
                 for k, v in down.items()]
    tables = [md_table(["upload", "seconds (median)", "MB/s", "throughput vs raw", "parts (S3 ETag)", "peak RSS MB",
                        "RSS growth MB"], up_rows, "lrrrrrr"),
              md_table(["resume: download + sha256", "seconds (median)", "MB/s", "throughput vs raw", "peak RSS MB",
                        "RSS growth MB"], down_rows, "lrrrrr")]
    passed = all(up_ratio[k] >= goal for k, goal in GOALS.items())
    headline = (f"{size / MB:.0f} MiB upload, ours/raw boto3 throughput: through the server {up_ratio['proxy']:.2f}x "
                f"(goal >= {GOALS['proxy']}), direct {up_ratio['direct']:.2f}x (goal >= {GOALS['direct']}); resume "
                f"download + sha256 {down_ratio['proxy']:.2f}x / {down_ratio['direct']:.2f}x; uploader RSS growth "
                f"{median(x['peak_mb'] - x['base_mb'] for x in up['proxy']):.0f} / "
                f"{median(x['peak_mb'] - x['base_mb'] for x in up['direct']):.0f} MB")
    notes = [f"{rounds[0]} upload rounds, {rounds[1]} download round(s); per-round upload ratios: " + "; ".join(
                 f"{k} " + ", ".join(f"{x:.2f}" for x in per_round[k]) for k in GOALS),
             "A round is raw, the three others in rotating order, raw again; each of ours is compared with the mean "
             "of its round's two raw uploads. Verdict: PASS when the median per-round ratio (raw seconds / ours) "
             "reaches its goal for both ways. "
             "The resume's figures have no goal; raw's download alone took "
             f"{median(x['transfer'] for x in down['raw']):.2f} s of its {median(x['total'] for x in down['raw']):.2f} s "
             "(ours hashes inside `download_verified`).",
             "Memory: through the proxy at most `PART_WORKERS` parts (min(8, 2 x cores)) of "
             "MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE are in memory, each read from the open file when its turn comes; "
             "direct, boto3 holds at most 10 parts of 8 MB. The resume's GET through the server is read 1 MB at a time; "
             "MLflow's ranged download, where a server offers it, holds one MLFLOW_MULTIPART_DOWNLOAD_CHUNK_SIZE chunk "
             "per thread (ours: 8 MB; MLflow's default: 100 MB).",
             "Timeouts: idle timeouts (no byte moved for that long), so a transfer that moves never times out. "
             "A part's request waits only for the store to take that part: MLFLOW_HTTP_REQUEST_TIMEOUT plus the "
             "part at 8 MB/s (31 s for 10 MB). A single PUT through the proxy (files under "
             "MLFLOW_MULTIPART_UPLOAD_MINIMUM_FILE_SIZE, or a store without multipart uploads) is answered only "
             "once the server has stored the whole file onward: its timeout is the base plus the file at 8 MB/s "
             "(about 2.5 minutes for 1 GB) instead of a flat 30 s. MLflow's own part upload has no timeout.",
             "Direct runs the very code raw runs (MLflow's S3 repository calls boto3's `upload_file` with the"
             " default TransferConfig), so the spread of its per-round ratios is this machine's noise, not ours.",
             "All on one machine: moto's S3, both MLflow servers and the transfer process share its cores, so "
             "the figures are ratios of neighbours, not what a real S3 would give. Downloads are slow here because "
             "moto reads the whole object for every ranged GET (1 GB per 8 MB part); both sides pay it alike."]
    return Section(NAME, "Checkpoints of real size: upload and resume throughput, memory", WHAT, headline,
                   f"upload throughput >= {GOALS['proxy']}x raw boto3 through the server, >= {GOALS['direct']}x direct",
                   passed, tables, notes)


def _parts(etag: str) -> str:
    return etag.rsplit("-", 1)[1] if "-" in etag else "1 (single PUT)"


if __name__ == "__main__":
    from bench.run import main_single

    main_single(run)
