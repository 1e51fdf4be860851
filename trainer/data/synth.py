"""A tiny synthetic COCO-format dataset of coloured shapes, for tests and the demo (no network).

One category per shape of _GEOMETRY, boxes, polygon masks and 4 keypoints per shape (its
top/right/bottom/left extreme points). Every fourth image is portrait, so aspect grouping sees two
groups. Output is a pure function of the arguments: the same seed writes the same bytes.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import uuid
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from pycocotools import mask as mask_utils

from trainer.atomic_write import FULL, free_space
from trainer.errors import UserError

ANNOTATIONS = "annotations.json"
IMAGES = "images"
MAX_IMAGES = 1_000_000  # ~40 GB of PNGs at the default size: more is a typo that would fill the disk
KEYPOINTS = ["top", "right", "bottom", "left"]
SKELETON = [[1, 2], [2, 3], [3, 4], [4, 1]]  # 1-based, as COCO writes it


def write_synthetic_dataset(out_dir, num_images: int = 64, image_size: int = 128, seed: int = 0,
                            stoppable: bool = False) -> Path:
    """Write out_dir/images/*.png and out_dir/annotations.json unless out_dir already holds them.
    stoppable (the `data synth` command, main thread): SIGTERM or SIGHUP removes what was written
    and exits 128 + the signal; a trainer has its own handlers, left alone."""
    out = Path(out_dir)
    if (out / ANNOTATIONS).is_file():
        return out
    if not 1 <= num_images <= MAX_IMAGES:
        raise UserError(f"the synthetic dataset takes 1 to {MAX_IMAGES:,} images, not {num_images:,}")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"{out} exists but holds no {ANNOTATIONS}; remove it or choose another folder")
    if os.path.lexists(out) and not out.is_dir():  # found after the images were made, it was a traceback
        raise UserError(f"cannot write the synthetic dataset to {out}: it is no folder (a file, a device or a "
                        "link to nothing)")
    _check_room(out, num_images, image_size)
    if out.is_symlink():  # a link to an empty folder: the dataset goes there (no rename replaces a link's folder)
        out = out.resolve()
    # Build in a hidden sibling and rename: a half-written dataset never looks complete.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with stop_signals_exit() if stoppable else contextlib.nullcontext():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            _write(tmp, num_images, image_size, seed)
            _publish(tmp, out)
        except OSError as e:  # a read-only or special folder, a file in the way, a full disk
            room = free_space(out.parent) if e.errno in FULL else ""
            raise UserError(f"cannot write the synthetic dataset to {out}: {e.strerror or e}{room}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_room(out: Path, num_images: int, image_size: int) -> None:
    """Refused before the first image when the PNGs cannot fit: they take about 0.7 bytes a pixel's
    channel, so half of that is a floor."""
    need = num_images * image_size * image_size * 3 * 0.5
    folder = next((p for p in [out, *out.parents] if p.is_dir()), None)
    try:
        usage = shutil.disk_usage(folder) if folder is not None else None
    except OSError:  # not ours to know: the write says it if it fails
        usage = None
    if usage is not None and usage.total > 0 and need > usage.free:  # /proc and the like: no blocks to count
        raise UserError(f"the synthetic dataset of {num_images:,} images of {image_size} px needs at least "
                        f"{need / 2**30:.1f} GiB; {folder} has {usage.free / 2**30:.1f} GiB free")


@contextlib.contextmanager
def stop_signals_exit():
    """SIGTERM and SIGHUP as SystemExit(128 + signal) for the block, so that `finally` removes the
    hidden half-written folder (their default kills the process where it stands, leaving gigabytes).
    A second signal kills at once, as the default would. Main thread only (the `data synth` command)."""
    def stop(signum, frame):
        for sig in previous:
            signal.signal(sig, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous = {sig: old for sig, old in previous.items() if old != signal.SIG_IGN}  # nohup: outlive the terminal
    for sig in previous:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _publish(tmp: Path, out: Path) -> None:
    try:
        os.rename(tmp, out)  # atomic; replaces an empty folder
    except OSError:
        if not (out / ANNOTATIONS).is_file():  # another process writing the same dataset won: fine
            raise


def _write(root: Path, num_images: int, image_size: int, seed: int) -> None:
    (root / IMAGES).mkdir()
    images, annotations = [], []
    for i in range(num_images):
        rng = np.random.default_rng([seed, i])
        width, height = _image_size(i, image_size)
        pixels, shapes = _draw_image(rng, width, height)
        name = f"{i:06d}.png"
        Image.fromarray(pixels).save(root / IMAGES / name, format="PNG", compress_level=1)
        image_id = i + 1
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
        for category, polygon, keypoints in shapes:
            annotations.append(_annotation(len(annotations) + 1, image_id, category, polygon, keypoints,
                                           width, height))
    categories = [{"id": k + 1, "name": name, "supercategory": "shape", "keypoints": KEYPOINTS,
                   "skeleton": SKELETON} for k, name in enumerate(SHAPES)]
    data = {"info": {"description": f"synthetic shapes, seed {seed}"}, "images": images,
            "annotations": annotations, "categories": categories}
    (root / ANNOTATIONS).write_text(json.dumps(data))


def _image_size(i: int, size: int) -> tuple[int, int]:
    if i % 4 == 3:  # portrait (w < h), a second aspect group
        return round(size * 7 / 8), round(size * 5 / 4)
    return size, size


def _draw_image(rng, width: int, height: int):
    base = rng.integers(30, 100)
    noise = rng.normal(0, 8, size=(height, width, 3))
    pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    boxes, shapes = [], []
    max_size = max(12, min(60, min(width, height) // 2))
    for _ in range(int(rng.integers(1, 5))):
        placed = _place(rng, boxes, width, height, max_size)
        if placed is None:
            continue
        category = int(rng.integers(0, len(SHAPES)))
        polygon, keypoints = _GEOMETRY[SHAPES[category]](*placed)
        color = tuple(int(c) for c in rng.integers(110, 256, size=3))
        draw.polygon([tuple(p) for p in polygon], fill=color)
        shapes.append((category + 1, polygon, keypoints))
    return np.asarray(image), shapes


def _place(rng, boxes: list, width: int, height: int, max_size: int):
    """A centre and half-size whose box keeps clear of the shapes already drawn (occlusion-free masks)."""
    for _ in range(20):
        half = int(rng.integers(6, max_size // 2 + 1))
        cx = int(rng.integers(half + 1, width - half - 1))
        cy = int(rng.integers(half + 1, height - half - 1))
        box = (cx - half - 2, cy - half - 2, cx + half + 2, cy + half + 2)
        if all(box[2] < b[0] or b[2] < box[0] or box[3] < b[1] or b[3] < box[1] for b in boxes):
            boxes.append(box)
            return cx, cy, half
    return None


def _extremes(cx: int, cy: int, h: int) -> list:
    """The top/right/bottom/left keypoints of a shape that touches its box's sides at their middles."""
    return [(cx, cy - h), (cx + h, cy), (cx, cy + h), (cx - h, cy)]


def _square(cx: int, cy: int, h: int):
    return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)], _extremes(cx, cy, h)


def _circle(cx: int, cy: int, h: int):
    angles = [2 * math.pi * k / 24 for k in range(24)]
    return [(round(cx + h * math.cos(a), 2), round(cy + h * math.sin(a), 2)) for a in angles], _extremes(cx, cy, h)


def _triangle(cx: int, cy: int, h: int):
    return [(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)], [(cx, cy - h), (cx + h, cy + h), (cx, cy + h), (cx - h, cy + h)]


# Each shape's polygon and top/right/bottom/left keypoints, from its centre and half-size. The order
# gives the category ids (1, 2, ...) and every image's random draws: a new shape changes them all.
_GEOMETRY = {"square": _square, "circle": _circle, "triangle": _triangle}
SHAPES = tuple(_GEOMETRY)


def _annotation(ann_id, image_id, category, polygon, keypoints, width, height) -> dict:
    flat = [float(v) for p in polygon for v in p]
    xs, ys = flat[0::2], flat[1::2]
    rle = mask_utils.merge(mask_utils.frPyObjects([flat], height, width))
    return {
        "id": ann_id, "image_id": image_id, "category_id": category,
        "bbox": [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)],
        "area": float(mask_utils.area(rle)), "iscrowd": 0, "segmentation": [flat],
        "keypoints": [float(v) for x, y in keypoints for v in (x, y, 2)],
        "num_keypoints": len(keypoints),
    }
