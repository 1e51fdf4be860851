"""GPU throughput: Faster/Mask R-CNN R50-FPN, trainer path vs bare loop, fp32 and AMP (bench/gpu.sh).

    python -m bench.gpu_bench [--models fasterrcnn_resnet50_fpn,maskrcnn_resnet50_fpn] [--batch 8]
                              [--size 800x1333] [--iters 10] [--blocks 2] [--warmup 5] [--precisions fp32,amp]
                              [--tracking sqlite|none] [--out bench/GPU_RESULTS.md] [--allow-cpu]

Synthetic data, random init (no downloads): a few batches of random images at the given size, 3-8
random boxes each (labels 1..80; box-filled masks for Mask R-CNN), made on the GPU once and fed to both
loops, so neither side loads data. **ours** is the engine's path: `setup_model_for_training` (the
Prefetcher swapped for the in-memory batches), then per iteration `run_iteration` (autocast + GradScaler
when SOLVER.AMP, the one host sync for the loss vector, TrainingStats, metrics handed to the tracker's
metric-sender thread; tracking in a local sqlite store unless --tracking none), `check_finite` and
`maybe_reset_timer`; no checkpoints. **bare** is
`autocast -> sum(losses) -> zero_grad -> scaler.scale(loss).backward() -> scaler.step -> update` on the
same model and optimizer objects, with no host sync at all until the end of its block. Blocks
alternate bare, ours, ours, bare, ...; the clock of a block starts and stops on
torch.cuda.synchronize(). Peak memory is torch.cuda.max_memory_allocated over each side's blocks.

Without CUDA it stops at once with a message (exit 2); --allow-cpu runs it on the CPU anyway, only to
smoke-test this script (use a small --size and --batch).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import InMemoryBatches, fresh_loop, quiet_stats


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="fasterrcnn_resnet50_fpn,maskrcnn_resnet50_fpn")
    p.add_argument("--precisions", default="fp32,amp")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", default="800x1333", help="HEIGHTxWIDTH of the generated images")
    p.add_argument("--iters", type=int, default=10, help="iterations per timed block")
    p.add_argument("--blocks", type=int, default=2, help="timed blocks per side (alternating)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per side first (cuDNN autotuning)")
    p.add_argument("--num-batches", type=int, default=3, help="distinct synthetic batches to cycle through")
    p.add_argument("--tracking", choices=("sqlite", "none"), default="sqlite")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "GPU_RESULTS.md"))
    p.add_argument("--allow-cpu", action="store_true", help="smoke-test on the CPU (no meaningful figures)")
    return p.parse_args(argv)


def synthetic_batches(n: int, batch: int, height: int, width: int, masks: bool, device, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        images, targets = [], []
        for _ in range(batch):
            images.append(torch.rand(3, height, width, generator=g).to(device))
            k = int(torch.randint(3, 9, (1,), generator=g))
            wh = torch.rand(k, 2, generator=g) * torch.tensor([width * 0.4, height * 0.4]) + 16
            xy = torch.rand(k, 2, generator=g) * (torch.tensor([width, height]) - wh)
            boxes = torch.cat([xy, xy + wh], 1)
            target = {"boxes": boxes.to(device), "labels": torch.randint(1, 81, (k,), generator=g).to(device)}
            if masks:
                m = torch.zeros(k, height, width, dtype=torch.uint8)
                for i, (x0, y0, x1, y1) in enumerate(boxes.round().long().tolist()):
                    m[i, y0:y1, x0:x1] = 1
                target["masks"] = m.to(device)
            targets.append(target)
        out.append((images, targets))
    return out


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def bench_one(args, model_type: str, amp: bool, device, workdir: Path) -> dict:
    from trainer import engine
    from trainer.config import load_config
    from trainer.distributed import Context
    from trainer.tracking import Tracker

    height, width = (int(x) for x in args.size.lower().split("x"))
    out = workdir / f"{model_type}-{'amp' if amp else 'fp32'}"
    opts = ["MODEL.TYPE", model_type, "MODEL.NUM_CLASSES", 81, "TRAIN.DATASETS", "('synth_shapes_train',)",
            "TRAIN.SCALES", f"({height},)", "TRAIN.MAX_SIZE", max(height, width), "TRAIN.IMS_PER_BATCH", args.batch,
            "TRAIN.SNAPSHOT_ITERS", 10**7, "SOLVER.MAX_ITER", 10**7, "SOLVER.BASE_LR", 0.002,
            "SOLVER.WARM_UP_ITERS", 0, "SOLVER.AMP", amp, "DATA_LOADER.NUM_THREADS", 0,
            "DATA_DIR", workdir / "datasets", "OUTPUT_DIR", out, "LOG_PERIOD", 20,
            "TRACKING.ENABLED", args.tracking != "none", "TRACKING.URI", f"sqlite:///{workdir / 'mlflow.db'}",
            "TRACKING.EXPERIMENT", "gpu-bench", "TRACKING.LOG_MODEL", False]
    cfg = load_config(None, [str(x) for x in opts])
    ctx = Context(device=device)
    if args.tracking == "none":
        tracker = Tracker()
    else:
        from trainer.tracking.mlflow_tracker import MlflowTracker

        tracker = MlflowTracker(cfg)
        tracker.start(cfg, new_run=True)
    job, t = fresh_loop(cfg, tracker, ctx)
    quiet_stats(job, t)
    t.batches.close()  # the synthetic shapes only satisfied the loader; the batches are ours
    batches = synthetic_batches(args.num_batches, args.batch, height, width, model_type.startswith("maskrcnn"),
                                device)
    t.batches = InMemoryBatches(batches)
    state = {"iter": 0}

    def bare(n: int) -> None:
        model, optimizer, scaler = t.model, t.optimizer, t.scaler
        for _ in range(n):
            images, targets = batches[state["iter"] % len(batches)]
            with torch.autocast(device.type, enabled=scaler.is_enabled()):
                loss = sum(model(images, targets).values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            state["iter"] += 1

    def ours(n: int) -> None:
        for _ in range(n):
            t.batches.index = state["iter"]
            losses, _ = engine.run_iteration(job, t, state["iter"])
            engine.check_finite(losses, state["iter"])
            t.stats.maybe_reset_timer(state["iter"])
            state["iter"] += 1

    sides = {"bare": bare, "ours": ours}
    seconds = {"bare": 0.0, "ours": 0.0}
    peak = {"bare": 0.0, "ours": 0.0}
    try:
        for fn in sides.values():
            fn(args.warmup)
        sync(device)
        for b in range(2 * args.blocks):
            name = ("bare", "ours", "ours", "bare")[b % 4]
            reset_peak(device)
            sync(device)
            t0 = time.perf_counter()
            sides[name](args.iters)
            sync(device)
            seconds[name] += time.perf_counter() - t0
            peak[name] = max(peak[name], peak_gb(device))
    finally:
        t.writer.close(raise_errors=False)
        tracker.finish("FINISHED")
    images = args.iters * args.blocks * args.batch
    result = {"model": model_type, "precision": "AMP (fp16 autocast)" if amp else "fp32",
              "bare": images / seconds["bare"], "ours": images / seconds["ours"],
              "bare_peak": peak["bare"], "ours_peak": peak["ours"]}
    return result


def render(args, rows: list, device, total_s: float) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU smoke test)"
    lines = ["# tracktron GPU benchmark", "",
             f"`bench/gpu.sh` ({' '.join(sys.argv[1:]) or 'defaults'}), "
             f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {total_s / 60:.1f} min.", "",
             f"- GPU: {gpu}; CUDA {torch.version.cuda}; cuDNN {torch.backends.cudnn.version()}",
             f"- torch {torch.__version__}; python {platform.python_version()}; "
             f"host CPU {platform.processor() or platform.machine()}",
             f"- batch {args.batch} images of {args.size} (synthetic, random init), {args.blocks} timed blocks of "
             f"{args.iters} iterations per side after {args.warmup} warm-up iterations, alternating; tracking: "
             f"{args.tracking}", "",
             "| model | precision | bare images/s | ours images/s | ours / bare | bare peak GiB | ours peak GiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['precision']} | {r['bare']:.1f} | {r['ours']:.1f} | "
                     f"**{r['ours'] / r['bare']:.3f}** | {r['bare_peak']:.2f} | {r['ours_peak']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(f"bench.gpu_bench: no CUDA device visible to torch {torch.__version__} "
              f"(torch.version.cuda={torch.version.cuda}); run it on a machine with an NVIDIA GPU "
              "(or --allow-cpu for a smoke test)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("mlflow", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows, t0 = [], time.perf_counter()
    args.out, home = str(Path(args.out).resolve()), os.getcwd()
    with tempfile.TemporaryDirectory(prefix="tracktron-gpu-bench-") as tmp:
        os.chdir(tmp)  # the sqlite store's new experiment keeps artifacts in ./mlruns (MLflow's default): here
        try:
            for model_type in [m.strip() for m in args.models.split(",") if m.strip()]:
                for precision in [p.strip() for p in args.precisions.split(",") if p.strip()]:
                    if precision not in ("fp32", "amp"):
                        print(f"unknown precision {precision!r} (fp32, amp)", file=sys.stderr)
                        return 2
                    print(f"== {model_type} {precision} ...", file=sys.stderr, flush=True)
                    r = bench_one(args, model_type, precision == "amp", device, Path(tmp))
                    gc.collect()  # the model, optimizer and batches of this configuration go before the next
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    print(f"   bare {r['bare']:.1f} img/s, ours {r['ours']:.1f} img/s ({r['ours'] / r['bare']:.3f}); "
                          f"peak {r['bare_peak']:.2f} / {r['ours_peak']:.2f} GiB", file=sys.stderr, flush=True)
                    rows.append(r)
                    # written after every configuration, so a run cut short by gpu.sh's timeout keeps its rows
                    Path(args.out).write_text(render(args, rows, device, time.perf_counter() - t0))
        finally:
            os.chdir(home)
    text = render(args, rows, device, time.perf_counter() - t0)
    Path(args.out).write_text(text)
    print(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
