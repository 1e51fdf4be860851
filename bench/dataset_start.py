"""dataset_start: how long a job waits for a COCO-sized training set before its first iteration.

    python -m bench.dataset_start [--quick]
"""
from __future__ import annotations

import contextlib
import io
import json
import time

import numpy as np

from bench.common import Env, Section, md_table, median

NAME = "dataset_start"
IMAGES, ANNOTATIONS = 118_287, 860_001  # COCO train2017
WHAT = (
    "A training set of COCO train2017's size is generated (118,287 images listed, 860,001 annotations, each "
    "with one polygon of 6 to 40 points, as COCO's average of about 23; the image files empty, since no "
    "pixel is read before training). Side by side, interleaved: pycocotools' `COCO(annotation_file)`, the "
    "load torchvision's detection references start with, against tracktron's `CocoDetection` as a job "
    "builds it at every start, resume and torchrun rank (parse, the up-front checks of docs/FAULTS.md, "
    "pycocotools' index, the training records), for a box model and a mask model (whose polygons are "
    "checked too). The check alone is timed beside, on the parsed file. `--quick`: a tenth of the size.")


def _write_coco(root, num_images: int, num_annotations: int):
    rng = np.random.default_rng(0)
    images = [{"id": i + 1, "file_name": f"{i + 1:012d}.jpg", "width": 640, "height": 480} for i in range(num_images)]
    xy = rng.uniform([0, 0, 2, 2], [500, 380, 140, 100], (num_annotations, 4)).round(2)
    points = rng.integers(6, 41, num_annotations)
    annotations = []
    for k, ((x, y, w, h), n) in enumerate(zip(xy.tolist(), points.tolist())):
        poly = np.empty(2 * n)
        poly[0::2], poly[1::2] = rng.uniform(x, x + w, n), rng.uniform(y, y + h, n)
        annotations.append({"id": k + 1, "image_id": int(rng.integers(1, num_images + 1)), "category_id": k % 80 + 1,
                            "iscrowd": 0, "area": round(w * h, 2), "bbox": [x, y, w, h],
                            "segmentation": [poly.round(2).tolist()]})
    image_dir, ann = root / "images", root / "annotations.json"
    image_dir.mkdir(parents=True, exist_ok=True)
    for im in images:
        (image_dir / im["file_name"]).touch()
    categories = [{"id": c + 1, "name": f"c{c + 1}"} for c in range(80)]
    ann.write_text(json.dumps({"images": images, "categories": categories, "annotations": annotations}))
    return image_dir, ann


def run(env: Env) -> Section:
    from pycocotools.coco import COCO

    from trainer.data import CocoDetection
    from trainer.data.checks import check, read_json
    from trainer.data.images import MAX_PIXELS

    scale = 10 if env.quick else 1
    image_dir, ann = _write_coco(env.workdir / "coco_sized", IMAGES // scale, ANNOTATIONS // scale)
    sizes = (800, 1333, "TRAIN.SCALES 800 and TRAIN.MAX_SIZE 1333")
    parsed = read_json(ann)

    def pycocotools():
        with contextlib.redirect_stdout(io.StringIO()):
            COCO(str(ann))

    def ours(masks: bool):
        return lambda: CocoDetection(image_dir, ann, train=True, masks=masks, sizes=sizes)

    def check_only(masks: bool):
        return lambda: check(ann, parsed, image_dir, masks=masks, sizes=sizes, max_pixels=MAX_PIXELS)

    runs = {"pycocotools": pycocotools, "box model": ours(False), "mask model": ours(True),
            "check, box model": check_only(False), "check, mask model": check_only(True)}
    seconds: dict = {name: [] for name in runs}
    for r in range(3 if env.quick else 2):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            t0 = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - t0)
    base = median(seconds["pycocotools"])
    rows = [[name, f"{median(s):.1f}", f"**{median(s) / base:.2f}**" if name in ("box model", "mask model")
             else f"{median(s) / base:.2f}"] for name, s in seconds.items()]
    size = f"{ann.stat().st_size / 1e6:.0f} MB"
    headline = (f"{IMAGES // scale:,} images, {ANNOTATIONS // scale:,} polygons ({size}): a box model's training set "
                f"ready in {median(seconds['box model']):.0f} s, a mask model's {median(seconds['mask model']):.0f} s, "
                f"{median(seconds['box model']) / base:.2f}x and {median(seconds['mask model']) / base:.2f}x "
                f"pycocotools' COCO() load ({base:.0f} s)")
    table = md_table(["what", "median s", "vs COCO() load"], rows)
    notes = ["No target: it says what a start costs on a real dataset's size, and where it goes. Each rank of a "
             "torchrun job pays it, at once.",
             "2026-12-05: the mask model's check went from 26.5-28.5 s to 10-12 s on the full-size set (checks.py's "
             "polygon numbers in C's loops: `set(map(type, ...))`, `sum`, `min`, `max`; the exact outline only "
             "where a bound says it could pass the cap), measured against the previous checks.py on one parsed "
             "file, alternating."]
    return Section(NAME, "Dataset start: a COCO-sized training set", WHAT, headline, "none (a measure)", None,
                   [table], notes)


if __name__ == "__main__":
    from bench.run import main_single

    main_single(run)
