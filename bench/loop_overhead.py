"""loop_overhead: the trainer's loop body vs a bare loop, same model, same batches, with a checkpoint
every 100, 20 and 5 iterations, and without checkpoints.

    python -m bench.loop_overhead [--quick]
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass

import torch

from trainer import engine
from trainer.evaluation import eval_due

from bench.common import (UNRESOLVED, Env, InMemoryBatches, Section, fresh_loop, md_table, median, place_threads,
                          quiet_stats, thread_cpu_seconds)

NAME = "loop_overhead"
TARGET = 0.98
JUDGED = (100, 20)  # the checkpoint periods the target is about: the demo's SNAPSHOT_ITERS, and 20
REPORTED = 5  # a checkpoint every 5 iterations: shown beside them, no target
ALONE = ("training core alone", {0})
SHARED = ("all on all cores", None)
N_BATCHES = 16
WHAT = (
    "The demo model (configs/demo.yaml: Faster R-CNN, MobileNetV3 at half width, 4 images of 128 px per "
    "batch; constant LR 0.005 here, so that both sides compute the very same numbers) trained in one "
    "process on the same batches, pre-loaded into memory once (16 batches from the real loader; the "
    "engine's Prefetcher is replaced by an in-memory source, so data loading costs no side anything). "
    "**bare**: `loss = sum(model(images, targets).values()); zero_grad; backward; step`. **ours**: "
    "`train_model`'s loop body, the engine's own functions: `run_iteration` (timer, LR scheduler, the "
    "loss vector's host sync, `TrainingStats.update/log`, per-iteration metrics through `MlflowTracker` "
    "to the `mlflow server` over HTTP), `check_finite`, `is_snapshot_iter`/`save_snapshot` (the state "
    "built and copied to host memory on the training thread; then, on the `checkpoint-writer` thread, "
    "torch.save + fsync + sha256 + rename and the local pruning; on the tracker's `uploader` thread, the "
    "file through the server to moto S3 and the sha256/latest tags), `eval_due` (a no-op "
    "check here) and `maybe_reset_timer`. Both use the same model and optimizer objects, reset to the "
    "same initial state and RNG seed before every block (a warm-up block checks that bare and ours "
    "produce bit-identical losses). Checkpoint periods of 100 iterations (the demo's SNAPSHOT_ITERS), 20 "
    "and 5: blocks of `period` iterations, in cycles of bare, ours, bare, "
    "ours' one checkpoint falling on the first iteration of its block (its iteration numbers are chosen "
    "so), so that the background write and upload overlap the iterations after it as in a real run; "
    "ours' clock stops only when all it started is written, uploaded and tagged (`writer.wait()`, "
    "`tracker.wait()`: the drain column). Metrics go out as in a job: every 5 s, and before a checkpoint "
    "is tagged complete. Then **the per-iteration path** (ours without checkpoints) in cycles of single "
    "iterations. All of these with the training (main) thread on core 0 and every other thread (ours: "
    "the checkpoint writer, uploader and metric sender; the mlflow server's and moto's processes) on "
    "the other core, as on a training host whose servers run elsewhere and whose spare cores take the "
    "trainer's background threads. Last, a checkpoint every 20 iterations with **all on all cores**: "
    "no pinning, the co-located servers competing with training for the 2 cores. CPU seconds are "
    "counted too, per thread of this process (from /proc) and for the mlflow server's and moto's "
    "processes, after each block has drained.")


@dataclass
class Phase:
    label: str
    placement: tuple  # (name, the training thread's cores or None)
    block: int  # iterations per timed block
    period: int | None  # ours checkpoints once per block, every `period` iterations; None: never
    cycles: int


def phases(quick: bool) -> list[Phase]:
    """Cycle counts (3 blocks a cycle): about 4,200 demo iterations in all, 5 minutes at 65 ms an
    iteration, 13 at 180 ms, which keeps `python -m bench.run` under 20 minutes on 2 cores."""
    n = {100: 2, 20: 4, 5: 8, "path": 30, "shared": 2} if quick else \
        {100: 6, 20: 20, 5: 30, "path": 120, "shared": 6}
    return [*(Phase(f"checkpoint every {p}", ALONE, p, p, n[p]) for p in (*JUDGED, REPORTED)),
            Phase("no checkpoints (per-iteration path)", ALONE, 1, None, n["path"]),
            Phase(f"checkpoint every {JUDGED[1]}", SHARED, JUDGED[1], JUDGED[1], n["shared"])]


class LoopBench:
    """The trainer's loop state on the demo config, with bare and ours blocks over the same batches."""

    def __init__(self, env: Env):
        from trainer.tracking.mlflow_tracker import MlflowTracker

        self.env = env
        self.out = env.scratch("loop")
        self.cfg = env.demo_cfg("TRACKING.URI", env.mlflow.url, "TRACKING.EXPERIMENT", "bench-loop-overhead",
                                "OUTPUT_DIR", self.out, "DATA_LOADER.NUM_THREADS", 0, "SOLVER.MAX_ITER", 1_000_000,
                                "TRACKING.LOG_MODEL", False, "TRACKING.REGISTERED_MODEL", "",
                                # a constant LR: bare (no scheduler) and ours then compute the same numbers
                                "SOLVER.BASE_LR", 0.005, "SOLVER.WARM_UP_ITERS", 0)
        self.tracker = MlflowTracker(self.cfg)
        self.tracker.start(self.cfg, new_run=True)
        self.job, self.s = fresh_loop(self.cfg, self.tracker)
        quiet_stats(self.job, self.s)
        self.batches = [self.s.batches.next() for _ in range(N_BATCHES)]
        self.s.batches.close()
        self.s.batches = InMemoryBatches(self.batches)
        s = self.s
        self.init = copy.deepcopy((s.model.state_dict(), s.optimizer.state_dict(), s.scheduler.state_dict()))
        self.iter = 0  # ours' next iteration number, going on from block to block
        self.ran = self.checkpoints = 0
        self.trace: dict | None = None  # when set: per iteration (position in block, wall, thread CPU), by side

    def reset(self, offset: int) -> None:
        self.s.model.load_state_dict(self.init[0])
        self.s.optimizer.load_state_dict(self.init[1])
        self.s.scheduler.load_state_dict(self.init[2])
        torch.manual_seed(self.cfg.RNG_SEED)
        self.s.batches.index = offset

    def bare(self, offset: int, n: int, losses: list | None = None) -> None:
        model, optimizer = self.s.model, self.s.optimizer
        for k in range(n):
            mark = self._mark()
            images, targets = self.batches[(offset + k) % N_BATCHES]
            loss = sum(model(images, targets).values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if losses is not None:  # the untimed check only
                losses.append(float(loss.detach()))
            self._record("bare", k, mark)

    def ours(self, n: int, period: int | None, losses: list | None = None) -> None:
        """train_model's loop body; with a period, the block starts on a checkpoint iteration (the
        iteration numbers skip ahead to one: metrics' steps only need to go up)."""
        job, s, cfg = self.job, self.s, self.cfg
        if period:
            self.iter += -(self.iter + 1) % period
        for k in range(n):
            mark = self._mark()
            cur_iter = self.iter
            out, _ = engine.run_iteration(job, s, cur_iter)
            if losses is not None:
                losses.append(out["loss"])
            engine.check_finite(out, cur_iter)
            if period and engine.is_snapshot_iter(cfg, cur_iter, 0, period):
                engine.save_snapshot(job, s, cur_iter)
                self.checkpoints += 1
            eval_due(cfg, cur_iter)  # the engine's check (TEST.EVAL_PERIOD 0 here: never due)
            s.stats.maybe_reset_timer(cur_iter)
            self.iter += 1
            self.ran += 1
            self._record("ours", k, mark)

    def _mark(self) -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def _record(self, side: str, k: int, mark: tuple[float, float]) -> None:
        if self.trace is not None:
            self.trace[side].append((k, time.perf_counter() - mark[0], time.thread_time() - mark[1]))

    def timed(self, kind: str, offset: int, n: int, period: int | None = None, losses: list | None = None) -> dict:
        """One block, "bare" or "ours"; ours' clock runs until what it started is written and uploaded."""
        self.reset(offset)
        th0, cpu0, srv0 = thread_cpu_seconds(), time.process_time(), self.env.server_cpu_seconds()
        main0 = time.thread_time()  # the training thread's, to the ns; /proc's are in 10 ms ticks
        t0 = time.perf_counter()
        drain = 0.0
        if kind == "bare":
            self.bare(offset, n, losses)
        else:
            self.ours(n, period, losses)
            t1 = time.perf_counter()
            self.s.writer.wait()
            self.tracker.wait(600)
            drain = time.perf_counter() - t1
        wall = time.perf_counter() - t0
        main = time.thread_time() - main0
        threads = {k: v - th0.get(k, 0.0) for k, v in thread_cpu_seconds().items()}
        threads["MainThread"] = main
        return {"wall": wall, "drain": drain, "cpu": time.process_time() - cpu0,
                "server_cpu": self.env.server_cpu_seconds() - srv0, "threads": threads}

    def warm_up(self) -> tuple[bool, dict]:
        """Not timed: allocator, HTTP connections, the first checkpoint's write and upload. Also
        says whether bare and ours compute bit-identical losses."""
        check = {"bare": [], "ours": []}
        self.timed("bare", 0, 4, losses=check["bare"])
        self.timed("ours", 0, 4, losses=check["ours"])
        self.timed("ours", 0, REPORTED, REPORTED)
        return check["bare"] == check["ours"], check

    def cycle(self, phase: Phase, c: int) -> dict:
        """bare, ours, bare: ours is compared with the mean of the bare blocks either side, which
        cancels the machine's drift across the cycle; bare against bare is the measurement's own noise."""
        offset = (c * phase.block) % N_BATCHES
        return {"bare1": self.timed("bare", offset, phase.block),
                "ours": self.timed("ours", offset, phase.block, phase.period),
                "bare2": self.timed("bare", offset, phase.block)}

    def finish(self) -> tuple[int, int]:
        """Close the writer and the run; (iterations with `loss` on the server, checkpoints tagged)."""
        self.s.writer.close()
        self.tracker.finish("FINISHED")
        client, run_id = self.tracker.client, self.tracker.run.run_id
        logged = len(client.get_metric_history(run_id, "loss"))
        tagged = [n for n in client.get_run(run_id).data.tags if n.endswith(".sha256")]
        return logged, len(tagged)


def run(env: Env) -> Section:
    bench = LoopBench(env)
    identical, check = bench.warm_up()
    results, by_position = [], ""
    try:
        for phase in phases(env.quick):
            place_threads(phase.placement[1], env.server_groups())
            traced = phase.period == JUDGED[1] and phase.placement is ALONE
            bench.trace = {"bare": [], "ours": []} if traced else None
            cycles = [bench.cycle(phase, c) for c in range(phase.cycles)]
            if traced:
                by_position = _by_position(bench.trace, phase.block)
            results.append((phase, cycles))
            print(f"   {phase.label}, {phase.placement[0]}: ours/bare {median(_ratios(cycles)):.3f}", flush=True)
    finally:
        place_threads(None, env.server_groups())
    logged, tagged = bench.finish()
    return _report(bench, results, by_position, identical, check, logged, tagged)


def _by_position(trace: dict, block: int) -> str:
    """Where the checkpoint's cost lands: per position in the block, ours' median iteration against
    bare's at the same position, in wall time and in training-thread CPU (the rest is waiting: for
    the GIL, since nothing else in the loop blocks)."""
    def med(side: str, k: int, i: int) -> float:
        return median(r[i] for r in trace[side] if r[0] == k) * 1e3

    groups = [("0 (the checkpoint: state, host copy, handed to the writer)", [0]), ("1", [1]), ("2", [2]),
              ("3", [3]), (f"4-{block - 1}, summed", list(range(4, block))), ("the whole block", list(range(block)))]
    rows = []
    for label, ks in groups:
        bw, ow = sum(med("bare", k, 1) for k in ks), sum(med("ours", k, 1) for k in ks)
        bc, oc = sum(med("bare", k, 2) for k in ks), sum(med("ours", k, 2) for k in ks)
        rows.append([label, f"{bw:.1f}", f"{ow:.1f}", f"{ow - bw:+.1f}", f"{oc - bc:+.1f}", f"{(ow - bw) - (oc - bc):+.1f}"])
    return md_table([f"iteration of the block (checkpoint every {block}, training core alone), medians",
                     "bare ms", "ours ms", "ours - bare: wall ms", "training-thread CPU ms", "waiting ms"], rows)


def _report(bench: LoopBench, results: list, by_position: str, identical: bool, check: dict, logged: int,
            tagged: int) -> Section:
    figures = {(p.label, p.placement[0]): _figure(cycles) for p, cycles in results}
    table = md_table(["ours", "placement", "cycles x iterations", "bare it/s", "ours it/s",
                      "ours/bare: median of cycles", "95% CI", "pooled", "bare/bare (noise): median", "95% CI",
                      "by training-thread CPU", "ours' end-of-block drain s"],
                     [_row(p, cycles) for p, cycles in results], "ll" + "r" * 10)
    reported = next((p, cycles) for p, cycles in results if p.period == REPORTED)
    thread_table, costs = _cpu_by_thread(*reported)

    def fig(period: int | None, placement: str = ALONE[0]) -> str:
        label = f"checkpoint every {period}" if period else "no checkpoints (per-iteration path)"
        m, (a, b) = figures[(label, placement)]
        return f"{m:.3f} ({a:.3f}-{b:.3f})"

    passed = _judge([figures[(f"checkpoint every {p}", ALONE[0])] for p in JUDGED])
    headline = (f"ours/bare it/s (95% CI), training thread on a core of its own, a checkpoint every "
                f"{JUDGED[0]} iterations: {fig(JUDGED[0])}, every {JUDGED[1]}: {fig(JUDGED[1])}; every {REPORTED} "
                f"(no target): {fig(REPORTED)}; without checkpoints {fig(None)}; every {JUDGED[1]} with the "
                f"servers on the same 2 cores {fig(JUDGED[1], SHARED[0])}")
    bare_it = median(c["bare1"]["wall"] / p.block for p, cycles in results if p.placement is ALONE for c in cycles)
    notes = _notes(bench, bare_it, costs, identical, check, logged, tagged)
    return Section(NAME, "Trainer path vs bare loop", WHAT, headline,
                   f"ours/bare iterations/s >= {TARGET} with a checkpoint every {JUDGED[0]} and every {JUDGED[1]} "
                   "iterations (training thread on a core of its own)", passed, [table, by_position, thread_table], notes)


def _figure(cycles: list[dict]) -> tuple[float, tuple[float, float]]:
    ratios = _ratios(cycles)
    return median(ratios), median_ci(ratios)


def _judge(figures: list) -> bool | str:
    """PASS when every median reaches the target; FAIL when one's whole 95% CI lies below it;
    otherwise UNRESOLVED (the run cannot tell the trainer from the noise at that resolution)."""
    each = [True if m >= TARGET else (False if hi < TARGET else UNRESOLVED) for m, (_, hi) in figures]
    if any(e is False for e in each):
        return False
    return True if all(e is True for e in each) else UNRESOLVED


def _row(phase: Phase, cycles: list[dict]) -> list:
    n = phase.block
    ours, noise = _ratios(cycles), [c["bare1"]["wall"] / c["bare2"]["wall"] for c in cycles]
    bare_s = sum(c["bare1"]["wall"] + c["bare2"]["wall"] for c in cycles) / 2
    ours_s = sum(c["ours"]["wall"] for c in cycles)
    main_cpu = [(c["bare1"]["threads"]["MainThread"] + c["bare2"]["threads"]["MainThread"]) / 2
                / c["ours"]["threads"]["MainThread"] for c in cycles]
    return [phase.label, phase.placement[0], f"{len(cycles)} x {n}", f"{len(cycles) * n / bare_s:.3f}",
            f"{len(cycles) * n / ours_s:.3f}", f"**{median(ours):.3f}**", "{:.3f}-{:.3f}".format(*median_ci(ours)),
            f"{bare_s / ours_s:.3f}", f"{median(noise):.3f}", "{:.3f}-{:.3f}".format(*median_ci(noise)),
            f"{median(main_cpu):.3f}", f"{sum(c['ours']['drain'] for c in cycles) / len(cycles):.2f}"]


def _notes(bench: LoopBench, bare_it: float, costs: dict, identical: bool, check: dict, logged: int,
           tagged: int) -> list[str]:
    return [
        f"Each cycle is bare, ours, bare, all doing the same arithmetic; its ratio is ours against the mean of its "
        f"two bare blocks. Blocks of {JUDGED[0]}, {JUDGED[1]} and {REPORTED} iterations (one checkpoint each) and "
        f"of 1 (the per-iteration path). Bare iteration {bare_it * 1e3:.0f} ms (median, training core alone): "
        f"a checkpoint every {JUDGED[0]} iterations is one every {JUDGED[0] * bare_it:.0f} s of training here. "
        "95% confidence intervals: bootstrap over the cycles of the median (with few cycles, as for a checkpoint "
        "every 100, the interval is coarse). Training-thread CPU: `time.thread_time()` of the main thread, bare "
        "over ours (median of cycles).",
        "Noise: the two bare blocks of a cycle do the very same arithmetic, yet differ by the bare/bare figures "
        "(the hypervisor's other tenants; CPU time varies as much as wall time). That noise, not the trainer, "
        "sets how finely a few minutes of cycles resolve a ratio, and its bursts last seconds, so the bootstrap "
        "intervals are if anything too narrow.",
        f"Verdict: a checkpoint every {JUDGED[0]} and every {JUDGED[1]} iterations, with the training thread on a "
        "core of its own, as on a training host (whatever slows the training thread there is ours: its own "
        f"work, and the GIL our background threads hold). PASS when both medians are >= {TARGET}; FAIL when "
        "either whole 95% CI lies below it; otherwise UNRESOLVED: this run cannot tell the trainer from the "
        f"noise at that resolution. Every {REPORTED} iterations and the all-on-all-cores row are reported only.",
        f"Per checkpoint of the demo model ({_ckpt_mb(bench.out):.1f} MB), CPU from ours minus bare blocks (a "
        f"checkpoint every {REPORTED}, training core alone): {costs['process'] * 1e3:.0f} ms in the training "
        f"process (of which {costs['main'] * 1e3:+.0f} ms on the training thread: building the state, the host "
        f"copy, the per-iteration path of {REPORTED} iterations) + {costs['servers'] * 1e3:.0f} ms in the mlflow "
        "server and moto (proxying the upload to S3, tags). The background threads' share runs on the other "
        "core; it slows training only through the GIL they take while holding it (torch.save's pickling, "
        "MLflow's client code).",
        "Where a checkpoint's cost lands (the per-position table): the checkpoint iteration itself pays for "
        "building the state and its host copy; the iteration after it runs while the writer thread pickles the "
        "state (torch.save's pickler holds the GIL: about 8 ms of Python for the demo's 522 tensors, measured "
        "alone), so it takes longer by far more than its own CPU: its training thread waits for the GIL. "
        "Tried against it, measured and dropped: a 0.5 ms GIL switch interval (0.962 against "
        "0.965 at a checkpoint every 20); torch.save into a buffered file with the sha256 read back, no Python "
        "call per write (0.966); the write held until the training thread's backward, which runs without the "
        "GIL (that iteration still waited 13 ms instead of 16); torch.save into memory on the training thread, "
        "the writer thread only writing the bytes (the checkpoint iteration took 28 ms longer: the first four "
        "iterations of a block +38 ms over bare against +15 ms, 14 cycles). With the write replaced by torch.save into "
        "memory it still waits about 7 ms, and with no upload about 9: the pickler and MLflow's client hold the "
        "GIL whichever thread runs them (torch's CRC-32 is 1.3 of torch.save's 9 ms). That cost is fixed per "
        "checkpoint, so its share falls with the period: a checkpoint every few minutes makes it a per mille. "
        "Kept: a single PUT sends the file mapped as one buffer, one sendall without the GIL, instead of "
        "urllib3's 16 kB reads of a file object (the uploader's CPU per checkpoint 7 ms -> 5 ms; every 20: "
        "0.962-0.966 in three runs before, 0.973 after).",
        "With the servers on the same 2 cores, the CPU they spend receiving metrics and checkpoints competes with "
        "training, and the scheduler now and then runs them on the training core; with the servers on other "
        "machines it would not.",
        "Same arithmetic: the warm-up block's losses of bare and ours are "
        + ("bit-identical." if identical else f"NOT identical ({check['bare']} vs {check['ours']})."),
        f"Delivery: {logged} of {bench.ran} ours iterations have `loss` on the server; {tagged} of "
        f"{bench.checkpoints} checkpoints tagged complete.",
    ]


def _ratios(cycles: list[dict]) -> list[float]:
    """ours' iterations/s over bare's, per cycle (bare: the mean of the blocks either side)."""
    return [(c["bare1"]["wall"] + c["bare2"]["wall"]) / 2 / c["ours"]["wall"] for c in cycles]


def _cpu_by_thread(phase: Phase, cycles: list[dict]) -> tuple[str, dict]:
    """Where ours' CPU goes, per thread, against bare; and per-checkpoint totals (one per block)."""
    names = ["MainThread", "checkpoint-writer", "uploader", "metric-sender"]
    other, rest, servers = ("other Python threads", "rest of the process (native threads, exited threads)",
                            "mlflow server + moto (other processes)")
    keys = [*names, other, rest, servers]
    sums = {"bare": dict.fromkeys(keys, 0.0), "ours": dict.fromkeys(keys, 0.0)}
    for c in cycles:
        for kind, sides in (("bare", (c["bare1"], c["bare2"])), ("ours", (c["ours"],))):
            for side in sides:  # bare: the mean of its two blocks
                add = sums[kind]
                for name, sec in side["threads"].items():
                    add[name if name in names else other] += sec / len(sides)
                add[rest] += (side["cpu"] - sum(side["threads"].values())) / len(sides)
                add[servers] += side["server_cpu"] / len(sides)
    iters, n = len(cycles) * phase.block, len(cycles)
    rows = [[k, f"{sums['bare'][k] / iters * 1e3:.1f}", f"{sums['ours'][k] / iters * 1e3:.1f}",
             f"{(sums['ours'][k] - sums['bare'][k]) / n * 1e3:+.0f}"] for k in keys]
    diff = {k: sums["ours"][k] - sums["bare"][k] for k in keys}
    costs = {"main": diff["MainThread"] / n, "servers": diff[servers] / n,
             "process": sum(v for k, v in diff.items() if k != servers) / n}
    table = md_table([f"CPU by thread ({phase.label}, {phase.placement[0]})", "bare ms/it", "ours ms/it",
                      "per checkpoint ms (ours - bare, per block)"], rows)
    return table, costs


def median_ci(values: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap confidence interval of the median (seeded: the same data, the same interval)."""
    rng = random.Random(0)
    meds = sorted(median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def _ckpt_mb(out) -> float:
    files = sorted(out.glob("model_iter*.pth"))
    return files[-1].stat().st_size / 1e6 if files else float("nan")


if __name__ == "__main__":
    from bench.run import main_single

    main_single(run)
