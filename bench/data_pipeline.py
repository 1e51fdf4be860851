"""data_pipeline: how long training waits for data, and how fast our dataset decodes.

    python -m bench.data_pipeline [--quick]
"""
from __future__ import annotations

import time

import torch

from bench.common import Env, Section, fresh_loop, md_table, median, quiet_stats

NAME = "data_pipeline"
TARGET = 0.02
WHAT = (
    "**Data wait.** The demo config trained through the engine's own path (`setup_model_for_training`: "
    "the real DataLoader with DATA_LOADER.NUM_THREADS worker processes, the resumable sampler, the "
    "Prefetcher thread; `run_iteration`; tracking off) with NUM_THREADS 0, 1 and 2 side by side: "
    "one trainer per setting, all alive at once, run in alternating blocks. Per iteration the engine "
    "measures `data_time` (the wait in `Prefetcher.next()`) inside its iteration time; the share is "
    "their sums' ratio, the first iterations of each loader (worker start) left out. **Decoding.** "
    "Images/s of `CocoDetection.__getitem__((i, True))` (decode with torchvision.io, kept uint8, "
    "horizontal flip of image and boxes: a worker hands uint8 on, a quarter of float's bytes, and the "
    "images become float on the device) vs plain `PIL.Image.open(...).convert('RGB')` + "
    "`torchvision.transforms.v2.Compose([ToImage(), ToDtype(float32, scale=True), "
    "RandomHorizontalFlip(p=1)])` on the same files with the same boxes (as `tv_tensors.BoundingBoxes`), "
    "one thread as in a loader worker, alternating passes; on the demo's 128 px images and on a "
    "synthetic set at COCO-like size (640 px).")


def _data_wait(env: Env, quick: bool) -> tuple[list, bool]:
    from trainer import engine
    from trainer.tracking import Tracker

    settings = (0, 1, 2)
    cycles, block, warm = (2, 8, 3) if quick else (4, 10, 3)
    trainers = {}
    for k in settings:
        cfg = env.demo_cfg("DATA_LOADER.NUM_THREADS", k, "OUTPUT_DIR", env.scratch(f"data{k}"),
                           "TRACKING.ENABLED", "false", "SOLVER.MAX_ITER", 100_000)
        job, s = fresh_loop(cfg, Tracker())
        quiet_stats(job, s)
        trainers[k] = (job, s, {"iter": 0, "data": [], "time": []})

    def step(k: int, record: bool) -> None:
        job, s, st = trainers[k]
        engine.run_iteration(job, s, st["iter"])
        st["iter"] += 1
        if record:
            st["data"].append(s.stats.data_time.latest)
            st["time"].append(s.stats.iter_timer.diff)

    try:
        for k in settings:
            for _ in range(warm):
                step(k, False)
        for c in range(cycles):
            order = settings[c % 3:] + settings[:c % 3]
            for k in order:
                for _ in range(block):
                    step(k, True)
    finally:
        for _, s, _ in trainers.values():
            s.batches.close()
            s.writer.close(raise_errors=False)

    rows, passed = [], True
    base = median(trainers[0][2]["time"])
    for k in settings:
        st = trainers[k][2]
        share = sum(st["data"]) / sum(st["time"])
        if k > 0:
            passed &= share < TARGET
        rows.append([k if k else "0 (loading on the Prefetcher's thread)", len(st["time"]),
                     f"{median(st['time']) * 1e3:.0f}", f"{median(st['time']) / base:.2f}",
                     f"{median(st['data']) * 1e3:.2f}",
                     f"{max(st['data']) * 1e3:.1f}", f"**{share * 100:.2f}%**" if k else f"{share * 100:.2f}%"])
    return rows, passed


def _make_big_dataset(env: Env):
    from trainer.data.synth import ANNOTATIONS, IMAGES, write_synthetic_dataset

    root = env.workdir / "datasets" / "synth_640"
    write_synthetic_dataset(root, num_images=24, image_size=640, seed=7)
    return root / IMAGES, root / ANNOTATIONS


def _decode(env: Env, quick: bool) -> list:
    from PIL import Image
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    from trainer.data import CocoDetection, resolve_dataset

    plain = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.RandomHorizontalFlip(p=1.0)])
    sets = [("demo, 128 px (synth_shapes_train)", resolve_dataset(env.demo_cfg(), "synth_shapes_train")),
            ("COCO-like, 640 px (synthetic)", _make_big_dataset(env))]
    rounds = 3 if quick else 6
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader worker
    try:
        for label, (im_dir, ann) in sets:
            ds = CocoDetection(im_dir, ann, train=True)
            images = [ds.coco.imgs[image_id] for image_id in ds.image_ids]  # in the dataset's order
            records = [(im_dir / im["file_name"], im["width"], im["height"], ds[(i, False)][1])
                       for i, im in enumerate(images)]  # the same files and boxes

            def ours():
                for i in range(len(ds)):
                    ds[(i, True)]

            def torchvision_v2():
                for path, w, h, target in records:
                    image = Image.open(path).convert("RGB")
                    boxes = tv_tensors.BoundingBoxes(target["boxes"], format="XYXY", canvas_size=(h, w))
                    plain(image, {"boxes": boxes, "labels": target["labels"]})

            ours(), torchvision_v2()  # warm-up: file cache, lazy imports
            speed = {"ours": [], "v2": []}
            for r in range(rounds):
                for name, fn in ((("ours", ours), ("v2", torchvision_v2)) if r % 2 == 0
                                 else (("v2", torchvision_v2), ("ours", ours))):
                    t0 = time.perf_counter()
                    fn()
                    speed[name].append(len(ds) / (time.perf_counter() - t0))
            ratios = [o / p for o, p in zip(speed["ours"], speed["v2"])]
            rows.append([label, len(ds), f"{median(speed['ours']):.0f}", f"{median(speed['v2']):.0f}",
                         f"**{median(ratios):.2f}**"])
    finally:
        torch.set_num_threads(threads)
    return rows


def run(env: Env) -> Section:
    wait_rows, passed = _data_wait(env, env.quick)
    decode_rows = _decode(env, env.quick)
    t1 = md_table(["DATA_LOADER.NUM_THREADS", "iterations", "median iteration ms", "vs 0", "median data_time ms",
                   "max data_time ms", "data_time / iteration time"], wait_rows)
    t2 = md_table(["images", "count", "ours images/s", "PIL + transforms.v2 images/s", "ours / v2 (median)"],
                  decode_rows)
    shares = {str(r[0])[0]: r[-1].strip("*") for r in wait_rows}
    headline = (f"data wait {shares['1']} of iteration time with 1 worker, {shares['2']} with 2; decode+flip "
                f"ours/v2 {decode_rows[0][-1].strip('*')}x (128 px), {decode_rows[1][-1].strip('*')}x (640 px)")
    notes = ["The decoding comparison has no target: it says whether our loader's per-image work is in line "
             "with the usual torchvision recipe. Ours decodes with `torchvision.io.decode_image` (libpng/"
             "libjpeg straight into a tensor) where the recipe goes through PIL.",
             "A worker per iteration has 4 tiny images to decode here, so the data wait mostly measures "
             "hand-off latency (worker -> pinned queue -> Prefetcher thread -> training thread).",
             "Since 2026-12-07 a worker hands on uint8 pixels (float on the device, a quarter of the bytes "
             "through /dev/shm and to the GPU). The code before, run the same hour on the same machine: "
             "ours/v2 0.80x (128 px) and 0.59x (640 px), against 0.91x and 0.65x after; the 2026-12-06 "
             "figures (1.37x, 1.11x) came from a faster hour of this VM (iterations of 63 ms, now 108 ms)."]
    return Section(NAME, "Data pipeline", WHAT, headline,
                   f"data wait < {TARGET * 100:.0f}% of iteration time (1 and 2 workers)", passed, [t1, t2], notes)


if __name__ == "__main__":
    from bench.run import main_single

    main_single(run)
