"""tracking_cost: what handing one iteration's metrics to tracking costs the training thread.

Three ways, all against the same real `mlflow server` over HTTP on 127.0.0.1, interleaved in
rounds (the order rotating every round):
  ours   MlflowTracker.log_metrics(metrics, step)     -> MetricSender.put: one deque append
  sync   mlflow.log_metrics(metrics, step=i)           -> one HTTP log_batch per iteration
  async  mlflow.log_metrics(..., synchronous=False)    -> MLflow's own async logging queue
Each call gets a fresh dict of 12 metrics (what TrainingStats.metrics() gives per iteration), built
off the clock, and a short pause between calls (the rest of the iteration, off the clock). Only
the call is timed. Afterwards ours is flushed (tracker.finish) and every point is counted on the
server: the cheap hand-off must not lose anything.

    python -m bench.tracking_cost [--quick]
"""
from __future__ import annotations

import contextlib
import time

from bench.common import Env, Section, fmt_s, md_table, median, percentile

NAME = "tracking_cost"
TARGET_S = 50e-6
KEYS = ["loss", "loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg", "lr", "time",
        "data_time", "eta_seconds", "mem_mb", "mb_qsize", "images_per_sec"]


WHAT = (
    "Three ways of handing one iteration's 12 metrics to tracking, all against the same real "
    "`mlflow server` (sqlite, artifacts proxied to moto S3) over HTTP on 127.0.0.1, interleaved in "
    "rounds whose order rotates: **ours** `MlflowTracker.log_metrics(metrics, step)` (a "
    "`MetricSender.put`: one deque append; a background thread sends `log_batch` calls), **sync** "
    "`mlflow.log_metrics(metrics, step=i)` (one HTTP request per iteration) and **async** "
    "`mlflow.log_metrics(metrics, step=i, synchronous=False)` (MLflow's own async queue), the latter two "
    "logging to their active run as a training script would. Each call gets a fresh dict (what "
    "`TrainingStats.metrics()` returns per iteration) built off the clock, with a short pause between "
    "calls standing in for the rest of the iteration; only the call itself is timed on the training "
    "thread. Afterwards every run is flushed and each of the 12 keys is read back from the server: "
    "all steps must be there.")


def _metrics(i: int) -> dict:
    return {k: 1.0 / (i + 1) + j for j, k in enumerate(KEYS)}


@contextlib.contextmanager
def _active(name: str, run_ids: dict):
    """MLflow's ways: their run is the active one for the round (ours needs none)."""
    import mlflow

    if name == "ours":
        yield
        return
    with mlflow.start_run(run_id=run_ids[name]):
        yield


def run(env: Env) -> Section:
    import mlflow
    from mlflow import MlflowClient

    from trainer.mlflow_tracking import MlflowTracker

    quick = env.quick
    rounds = 4 if quick else 10
    per_round = {"ours": 100, "async": 100, "sync": 10 if quick else 20}
    pause = 0.005  # the rest of an iteration, off the clock

    server = env.mlflow
    cfg = env.demo_cfg("TRACKING.URI", server.url, "TRACKING.EXPERIMENT", "bench-tracking-cost",
                       "TRACKING.RUN_NAME", "ours", "TRACKING.FLUSH_TIMEOUT_S", 60)
    tracker = MlflowTracker(cfg)
    tracker.start(cfg, new_run=True)
    client = MlflowClient(server.url)
    exp_id = client.get_experiment_by_name("bench-tracking-cost").experiment_id
    run_ids = {"ours": tracker.run.run_id,
               "sync": client.create_run(exp_id, run_name="mlflow-sync").info.run_id,
               "async": client.create_run(exp_id, run_name="mlflow-async").info.run_id}
    mlflow.set_tracking_uri(server.url)

    # MLflow's ways log to the active run, as a training script would: mlflow.log_metrics(run_id=...)
    # would cost a synchronous get_run() round trip per call on top (MLflow 3 looks the run up).
    calls = {
        "ours": lambda m, i: tracker.log_metrics(m, i),
        "sync": lambda m, i: mlflow.log_metrics(m, step=i),
        "async": lambda m, i: mlflow.log_metrics(m, step=i, synchronous=False),
    }
    samples: dict[str, list[float]] = {k: [] for k in calls}
    steps = dict.fromkeys(calls, 0)
    # one warm-up call each (connection set-up, lazy imports), not counted as samples
    for name, call in calls.items():
        with _active(name, run_ids):
            call(_metrics(0), steps[name])
        steps[name] += 1
    order = list(calls)
    for r in range(rounds):
        for name in order[r % 3:] + order[:r % 3]:
            call = calls[name]
            with _active(name, run_ids):  # start_run/end_run are off the clock
                for _ in range(per_round[name]):
                    m = _metrics(steps[name])
                    t0 = time.perf_counter()
                    call(m, steps[name])
                    samples[name].append(time.perf_counter() - t0)
                    steps[name] += 1
                    time.sleep(pause)

    t0 = time.perf_counter()
    tracker.finish("FINISHED")  # flushes the MetricSender (and the uploader)
    flush_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    mlflow.flush_async_logging()
    flush_async = time.perf_counter() - t0

    delivered, complete = {}, {}
    for name, run_id in run_ids.items():
        counts, ok = [], True
        for key in KEYS:
            history = client.get_metric_history(run_id, key)
            counts.append(len(history))
            ok &= sorted(m.step for m in history) == list(range(steps[name]))
        delivered[name] = min(counts)
        complete[name] = ok and delivered[name] == steps[name]
    sender = tracker._sender  # noqa: SLF001 - its counters, for the report
    dropped = getattr(sender, "dropped", 0)

    batch_rows = _server_cost_by_batch(env, client, exp_id, quick)

    med = {k: median(v) for k, v in samples.items()}
    p99 = {k: percentile(v, 99) for k, v in samples.items()}
    rows = []
    labels = {"ours": "ours: `MlflowTracker.log_metrics` (MetricSender.put)",
              "sync": "`mlflow.log_metrics(step=i)` synchronous",
              "async": "`mlflow.log_metrics(synchronous=False)`"}
    flush = {"ours": fmt_s(flush_ours), "async": fmt_s(flush_async), "sync": "-"}
    for name in ("ours", "async", "sync"):
        rows.append([labels[name], len(samples[name]), f"{med[name] * 1e6:.1f}", f"{p99[name] * 1e6:.1f}",
                     f"{med[name] / med['ours']:.0f}x" if name != "ours" else "1x",
                     f"{delivered[name]}/{steps[name]} {'all' if complete[name] else 'MISSING'}",
                     flush[name]])
    table = md_table(["way", "calls timed", "median µs/iter", "p99 µs/iter", "median vs ours",
                      "iterations on the server (every key, every step)", "final flush"], rows)
    passed = med["ours"] < TARGET_S and complete["ours"] and dropped == 0
    headline = (f"ours {med['ours'] * 1e6:.1f} µs/iter median (p99 {p99['ours'] * 1e6:.1f} µs); "
                f"sync mlflow {med['sync'] / med['ours']:.0f}x, async mlflow {med['async'] / med['ours']:.0f}x "
                f"that; ours delivered {delivered['ours']}/{steps['ours']} iterations x 12 metrics")
    notes = [f"{rounds} rounds; per round {per_round['ours']} ours, {per_round['async']} async, "
             f"{per_round['sync']} sync calls, a {pause * 1e3:.0f} ms pause between calls (off the clock); "
             "the order of the three rotates every round.",
             "All three runs live on the same `mlflow server --workers 1` (sqlite) on 127.0.0.1, so the "
             "synchronous figure is a loopback round trip: over a real network it only grows."]
    if dropped:
        notes.append(f"MetricSender dropped {dropped} iterations on overflow.")
    notes.append("Second table: what the same server spends (CPU seconds of the `mlflow server` process "
                 "group, read from /proc) per `log_batch` of 12-metric iterations, by iterations per request: "
                 "the MetricSender sends once a second, i.e. as many iterations per request as the job runs "
                 "per second.")
    batch_table = md_table(["iterations per log_batch", "metrics", "requests", "server CPU ms per request",
                            "server CPU ms per iteration"], batch_rows)
    return Section(NAME, "Tracking cost on the training thread", WHAT, headline,
                   "ours < 50 µs/iteration (median), every point delivered", passed, [table, batch_table], notes)


def _server_cost_by_batch(env: Env, client, exp_id: str, quick: bool) -> list:
    """Server CPU per log_batch request and per iteration, for a few batch sizes."""
    from mlflow.entities import Metric

    run_id = client.create_run(exp_id, run_name="server-cost").info.run_id
    rows, step = [], 0
    for iters in (1, 5, 25, 80):
        requests = (6 if quick else 15) if iters < 80 else (3 if quick else 6)
        client.log_batch(run_id, metrics=[Metric(k, 0.0, 0, step) for k in KEYS])  # warm
        step += 1
        time.sleep(0.2)
        cpu0 = env.server_cpu_seconds()
        for _ in range(requests):
            metrics = []
            for _ in range(iters):
                ts = int(time.time() * 1000)
                metrics += [Metric(k, 1.0, ts, step) for k in KEYS]
                step += 1
            client.log_batch(run_id, metrics=metrics)
        time.sleep(0.2)  # the server's bookkeeping after its reply
        cpu = env.server_cpu_seconds() - cpu0
        rows.append([iters, iters * len(KEYS), requests, f"{cpu / requests * 1e3:.1f}",
                     f"{cpu / (requests * iters) * 1e3:.2f}"])
    return rows


if __name__ == "__main__":
    from bench.run import main_single

    main_single(run)
