"""tracking_cost: what tracking costs the training thread per iteration.

Four ways, all against the same real `mlflow server` over HTTP on 127.0.0.1, interleaved in rounds
(the order rotating every round):
  path   the engine's per-iteration tracking on the training thread, as run_iteration does it:
         TrainingStats.update, MlflowTracker.log_metrics(stats.metrics(i), i), TrainingStats.log
  ours   MlflowTracker.log_metrics(metrics, step) alone  -> MetricSender.put: one deque append
  sync   mlflow.log_metrics(metrics, step=i)              -> one HTTP log_batch per iteration
  async  mlflow.log_metrics(..., synchronous=False)       -> MLflow's own async logging queue
Each call gets fresh values, made off the clock, and a short pause between calls (the rest of the
iteration, off the clock). Only the call is timed. Afterwards every run is flushed and every point
is counted on the server: the cheap hand-off must not lose anything.

    python -m bench.tracking_cost [--quick]
"""
from __future__ import annotations

import contextlib
import os
import time

from bench.common import Env, Section, fmt_s, md_table, median, percentile

NAME = "tracking_cost"
TARGET_S = 50e-6
LOSSES = ["loss", "loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"]
KEYS = [*LOSSES, "lr", "time", "data_time", "eta_seconds", "mem_mb", "mb_qsize", "images_per_sec"]
WAYS = ("path", "ours", "async", "sync")
LABELS = {"path": "**path**: `TrainingStats.update` + `log_metrics(stats.metrics(i), i)` + `TrainingStats.log`",
          "ours": "ours: `MlflowTracker.log_metrics` alone (MetricSender.put)",
          "async": "`mlflow.log_metrics(synchronous=False)`",
          "sync": "`mlflow.log_metrics(step=i)` synchronous"}
WHAT = (
    "What tracking costs the training thread per iteration, against a real `mlflow server` (sqlite, "
    "artifacts proxied to moto S3) over HTTP on 127.0.0.1. **path**: the engine's per-iteration tracking, "
    "as `run_iteration` does it on rank 0 after the step: `TrainingStats.update(losses, lr, data_time, "
    "qsize, images)`, `MlflowTracker.log_metrics(stats.metrics(i), i)` (12 metrics; `metrics()` reads the "
    "peak memory) and `TrainingStats.log(i)` (a `json_stats` line printed and appended to json_stats.log "
    "every LOG_PERIOD = 20 iterations; printed to /dev/null here). **ours**: `log_metrics` alone (a "
    "`MetricSender.put`: one deque append; the `metric-sender` thread sends `log_batch` calls every 5 s). "
    "For comparison, **sync** `mlflow.log_metrics(metrics, step=i)` (one HTTP request per iteration) and "
    "**async** `mlflow.log_metrics(metrics, step=i, synchronous=False)` (MLflow's own async queue), the "
    "latter two logging to their active run as a training script would. The four run in rounds whose "
    "order rotates; each call gets fresh values built off the clock, with a short pause between calls "
    "standing in for the rest of the iteration (our background threads do their work in it, as they "
    "would during the step); only the calls themselves are timed on the training thread. Afterwards "
    "every run is flushed and each of the 12 keys is read back from the server: all steps must be there.")


def _metrics(i: int) -> dict:
    return {k: 1.0 / (i + 1) + j for j, k in enumerate(KEYS)}


def _losses(i: int) -> dict:
    return {k: 1.0 / (i + 1) + j for j, k in enumerate(LOSSES)}


@contextlib.contextmanager
def _active(name: str, run_ids: dict):
    """MLflow's ways: their run is the active one for the round (ours need none)."""
    import mlflow

    if name in ("path", "ours"):
        yield
        return
    with mlflow.start_run(run_id=run_ids[name]):
        yield


class Ways:
    """The four ways, each logging into a run of its own."""

    def __init__(self, env: Env):
        import mlflow
        from mlflow import MlflowClient

        from trainer.stats import TrainingStats
        from trainer.tracking.mlflow_tracker import MlflowTracker

        server = env.mlflow
        self.trackers = {}
        for name in ("path", "ours"):
            cfg = env.demo_cfg("TRACKING.URI", server.url, "TRACKING.EXPERIMENT", "bench-tracking-cost",
                               "TRACKING.RUN_NAME", name, "TRACKING.FLUSH_TIMEOUT_S", 60, "SOLVER.MAX_ITER", 10**6)
            self.trackers[name] = MlflowTracker(cfg)
            self.trackers[name].start(cfg, new_run=True)
            self.trackers[name].run  # one after the other: two at once would both create the experiment
        self.stats = TrainingStats(cfg, 0, env.scratch("tracking") / "json_stats.log",
                                   stream=open(os.devnull, "w"), progress_stream=open(os.devnull, "w"))
        self.client = MlflowClient(server.url)
        self.exp_id = exp_id = self.client.get_experiment_by_name("bench-tracking-cost").experiment_id
        self.run_ids = {**{k: t.run.run_id for k, t in self.trackers.items()},
                        "sync": self.client.create_run(exp_id, run_name="mlflow-sync").info.run_id,
                        "async": self.client.create_run(exp_id, run_name="mlflow-async").info.run_id}
        mlflow.set_tracking_uri(server.url)

    def call(self, name: str):
        """(make the call's input off the clock, the call)."""
        import mlflow

        if name == "path":
            return _losses, self._path
        # MLflow's ways log to the active run, as a training script would: mlflow.log_metrics(run_id=...)
        # would cost a synchronous get_run() round trip per call on top (MLflow 3 looks the run up).
        return _metrics, {"ours": self.trackers["ours"].log_metrics,
                          "sync": lambda m, i: mlflow.log_metrics(m, step=i),
                          "async": lambda m, i: mlflow.log_metrics(m, step=i, synchronous=False)}[name]

    def _path(self, losses: dict, i: int) -> None:
        """run_iteration's tracking on rank 0, after the step (lr, data time, queue size, images)."""
        self.stats.update(losses, 0.005, 0.001, 2, 4)
        self.trackers["path"].log_metrics(self.stats.metrics(i), i)
        self.stats.log(i)

    def flush(self) -> dict[str, float]:
        """Seconds each way's final flush took."""
        import mlflow

        took = {"sync": float("nan")}
        for name, tracker in self.trackers.items():
            t0 = time.perf_counter()
            tracker.finish("FINISHED")  # flushes the MetricSender (and the uploader)
            took[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        mlflow.flush_async_logging()
        took["async"] = time.perf_counter() - t0
        return took

    def delivered(self, name: str, steps: int) -> tuple[int, bool]:
        """(iterations whose every key is on the server, whether every key has every step)."""
        counts, ok = [], True
        for key in KEYS:
            history = self.client.get_metric_history(self.run_ids[name], key)
            counts.append(len(history))
            ok &= sorted(m.step for m in history) == list(range(steps))
        return min(counts), ok and min(counts) == steps


def _measure(ways: Ways, rounds: int, per_round: dict, pause: float) -> tuple[dict, dict]:
    """({way: [(step, seconds of its call)]}, {way: steps logged, the warm-up's included})."""
    samples: dict[str, list[tuple[int, float]]] = {k: [] for k in WAYS}
    steps = dict.fromkeys(WAYS, 0)
    for name in WAYS:  # one warm-up call each (connection set-up, lazy imports), not counted
        make, call = ways.call(name)
        with _active(name, ways.run_ids):
            call(make(0), 0)
        steps[name] = 1
    for r in range(rounds):
        for name in WAYS[r % 4:] + WAYS[:r % 4]:
            make, call = ways.call(name)
            with _active(name, ways.run_ids):  # start_run/end_run are off the clock
                for _ in range(per_round[name]):
                    step = steps[name]
                    values = make(step)
                    t0 = time.perf_counter()
                    call(values, step)
                    samples[name].append((step, time.perf_counter() - t0))
                    steps[name] += 1
                    time.sleep(pause)
    return samples, steps


def _row(label: str, secs: list[float], ours_median: float, delivered: str = "", flush: str = "") -> list:
    return [label, len(secs), f"{median(secs) * 1e6:.1f}", f"**{sum(secs) / len(secs) * 1e6:.1f}**",
            f"{percentile(secs, 99) * 1e6:.1f}", f"{median(secs) / ours_median:.1f}x", delivered, flush]


def _table(samples: dict, steps: dict, delivery: dict, flush: dict, log_period: int) -> str:
    secs = {k: [x for _, x in v] for k, v in samples.items()}
    ours = median(secs["ours"])
    rows = []
    for k in WAYS:
        got, complete = delivery[k]
        rows.append(_row(LABELS[k], secs[k], ours, f"{got}/{steps[k]} {'all' if complete else 'MISSING'}",
                         fmt_s(flush[k])))
        if k == "path":  # where its mean comes from: the iterations that print a json_stats line
            logs = [x for step, x in samples[k] if step % log_period == 0]
            plain = [x for step, x in samples[k] if step % log_period != 0]
            rows.append(_row("... path, the iterations without a json_stats line", plain, ours))
            rows.append(_row(f"... path, the json_stats iterations (1 in {log_period})", logs, ours))
    return md_table(["way", "calls timed", "median µs/iter", "mean µs/iter", "p99 µs/iter", "median vs ours alone",
                     "iterations on the server (every key, every step)", "final flush"], rows)


def run(env: Env) -> Section:
    quick = env.quick
    rounds = 4 if quick else 10
    per_round = {"path": 100, "ours": 100, "async": 100, "sync": 10 if quick else 20}
    pause = 0.005  # the rest of an iteration, off the clock

    ways = Ways(env)
    samples, steps = _measure(ways, rounds, per_round, pause)
    flush = ways.flush()
    delivery = {name: ways.delivered(name, steps[name]) for name in WAYS}
    batch_rows = _server_cost_by_batch(env, ways.client, ways.exp_id, quick)

    table = _table(samples, steps, delivery, flush, ways.stats.log_period)
    secs = {k: [x for _, x in v] for k, v in samples.items()}
    med = {k: median(v) for k, v in secs.items()}
    mean = sum(secs["path"]) / len(secs["path"])
    passed = mean < TARGET_S and delivery["path"][1] and delivery["ours"][1]
    headline = (f"tracking on the training thread (stats + log_metrics) {mean * 1e6:.1f} µs/iter mean "
                f"(median {med['path'] * 1e6:.1f}) against < {TARGET_S * 1e6:.0f}; log_metrics alone "
                f"{med['ours'] * 1e6:.1f} µs median, sync mlflow {med['sync'] / med['ours']:.0f}x and async mlflow "
                f"{med['async'] / med['ours']:.0f}x that; delivered {delivery['path'][0]}/{steps['path']} "
                "iterations x 12 metrics")
    notes = [f"{rounds} rounds; per round {per_round['path']} path, {per_round['ours']} ours, {per_round['async']} "
             f"async and {per_round['sync']} sync calls, a {pause * 1e3:.0f} ms pause between calls (off the "
             "clock); the order of the four rotates every round.",
             "Verdict: the path's MEAN per iteration, so that the json_stats line of every "
             f"{ways.stats.log_period}th iteration (medians of the smoothed values, the line printed and "
             f"appended to the file) counts at its share, < {TARGET_S * 1e6:.0f} µs, and every point of path "
             "and ours on the server. The path's figure holds all the training thread spends on tracking and "
             "stats per iteration: the MetricSender's batching and HTTP run on its own thread (its GIL "
             "holds included, when they fall inside a timed call).",
             "All runs live on the same `mlflow server --workers 1` (sqlite) on 127.0.0.1, so the synchronous "
             "figure is a loopback round trip: over a real network it only grows.",
             "Second table: what the same server spends (CPU seconds of the `mlflow server` process group, read "
             "from /proc) per `log_batch` of 12-metric iterations, by iterations per request: the MetricSender "
             "sends every 5 s, i.e. 5 s worth of iterations per request."]
    batch_table = md_table(["iterations per log_batch", "metrics", "requests", "server CPU ms per request",
                            "server CPU ms per iteration"], batch_rows)
    return Section(NAME, "Tracking cost on the training thread", WHAT, headline,
                   f"tracking on the training thread < {TARGET_S * 1e6:.0f} µs per iteration (stats + log_metrics, "
                   "mean), every point delivered", passed, [table, batch_table], notes)


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
