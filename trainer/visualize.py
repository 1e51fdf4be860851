"""Detections drawn on their image, for a person to look at: `tracktron predict` writes them as PNGs,
and an HxWx3 uint8 array is what mlflow.log_image takes.

    draw(image, detections, ground_truth=None, score_threshold=0.5)  -> HxWx3 uint8 array
    to_png(array)                                                     -> PNG bytes

Ground truth is drawn in green, labelled with its category; predictions at or above the threshold
in one colour per category, labelled "name 0.87". Masks go under the boxes, keypoints over them.
Everything is drawn with torchvision.utils. drawings() gives each evaluation's first TEST.VIS_IMAGES
test images (the same every time, so that the UI's step slider shows the detector improving).
"""
from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np
import torch
from pycocotools import mask as mask_utils
from torchvision.io import encode_png
from torchvision.utils import draw_bounding_boxes, draw_keypoints, draw_segmentation_masks

GROUND_TRUTH = (0, 200, 0)
# Predictions, by category id: none of them green, so they never pass for ground truth.
PALETTE = [(230, 25, 75), (245, 130, 48), (255, 225, 25), (240, 50, 230), (0, 130, 200), (145, 30, 180),
           (70, 240, 240), (128, 0, 0), (250, 190, 212), (255, 255, 255)]
MASK_ALPHA = 0.4
SCORE_THRESHOLD = 0.5  # of the detections drawn at each evaluation


def draw(image: torch.Tensor, detections: dict, ground_truth: dict | None = None,
         score_threshold: float = 0.5) -> np.ndarray:
    """`image` CHW float in [0, 1] (trainer.inference.decode) or uint8; `detections` as detections_of gives them."""
    canvas = _to_uint8(image)
    if ground_truth:
        every = list(range(len(ground_truth.get("boxes", []))))
        canvas = _layer(canvas, ground_truth, every, [GROUND_TRUTH] * len(every),
                        [_name(ground_truth, i) for i in every])
    scores = detections.get("scores", [])
    keep = [i for i, s in enumerate(scores) if s >= score_threshold]
    ids = detections.get("category_ids", [])
    colors = [_color(ids[i] if i < len(ids) else 0) for i in keep]
    canvas = _layer(canvas, detections, keep, colors, [f"{_name(detections, i)} {scores[i]:.2f}" for i in keep])
    return canvas.permute(1, 2, 0).contiguous().numpy()


def to_png(array: np.ndarray) -> bytes:
    """An HxWx3 uint8 array (what draw returns) as PNG bytes."""
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"expected an HxWx3 uint8 array, got {array.shape} {array.dtype}")
    return bytes(encode_png(torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1).contiguous()).numpy())


def drawings(dataset, results: list[dict], count: int) -> list[tuple[str, np.ndarray]]:
    """(image key, HxWx3 uint8 drawing) for the first `count` images of `dataset` (a test-mode CocoDetection)."""
    names = {c["id"]: c.get("name", str(c["id"])) for c in dataset.categories}
    by_image: dict = {}
    for r in results:
        by_image.setdefault(r["image_id"], []).append(r)
    out = []
    for index in range(min(count, len(dataset))):
        image, target = dataset[index]
        found = _as_detections(by_image.get(target["image_id"], []), names)
        truth = {"boxes": target["boxes"].tolist(),
                 "category_names": [dataset.class_names[label] for label in target["labels"].tolist()]}
        key = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(dataset.file_name(index)).stem) or str(target["image_id"])
        out.append((key, draw(image, found, truth, SCORE_THRESHOLD)))
    return out


def _as_detections(entries: list[dict], names: dict) -> dict:
    """COCO results entries of one image -> the dict draw() takes (boxes back to x1, y1, x2, y2)."""
    found = {"boxes": [[x, y, x + w, y + h] for x, y, w, h in (e["bbox"] for e in entries)],
             "scores": [e["score"] for e in entries], "category_ids": [e["category_id"] for e in entries],
             "category_names": [names.get(e["category_id"], str(e["category_id"])) for e in entries]}
    if entries and "segmentation" in entries[0]:
        found["masks"] = [e["segmentation"] for e in entries]
    if entries and "keypoints" in entries[0]:
        found["keypoints"] = [np.reshape(e["keypoints"], (-1, 3)).tolist() for e in entries]
    return found


def _name(found: dict, i: int) -> str:
    names = found.get("category_names") or []
    return str(names[i]) if i < len(names) else ""


def _color(category_id) -> tuple:
    """The same colour for a category in every image (COCO ids are ints; a str id goes by its bytes)."""
    key = category_id if isinstance(category_id, int) else zlib.crc32(str(category_id).encode())
    return PALETTE[key % len(PALETTE)]


def _to_uint8(image: torch.Tensor) -> torch.Tensor:
    image = image.detach().cpu()
    if image.ndim == 2:
        image = image[None]
    if image.shape[0] == 1:  # grayscale: the colours of the boxes need three channels
        image = image.expand(3, -1, -1)
    if image.dtype == torch.uint8:  # a dataset's pixels as read
        return image
    return image.float().nan_to_num(0.0).clamp(0, 1).mul(255).round().to(torch.uint8)


def _layer(canvas: torch.Tensor, found: dict, index: list[int], colors: list, labels: list[str]) -> torch.Tensor:
    """The masks, boxes and keypoints of `found` at `index`, each in its colour."""
    if not index:
        return canvas
    if found.get("masks"):
        canvas = _masks(canvas, [found["masks"][i] for i in index], colors)
    canvas = _boxes(canvas, [found["boxes"][i] for i in index], colors, labels)
    if found.get("keypoints"):
        canvas = _keypoints(canvas, [found["keypoints"][i] for i in index], colors)
    return canvas


def _boxes(canvas: torch.Tensor, boxes: list, colors: list, labels: list[str]) -> torch.Tensor:
    """Boxes clipped to the image (one partly outside shows its inside part; one wholly outside, nothing)."""
    h, w = canvas.shape[1:]
    xyxy = torch.tensor(boxes, dtype=torch.float64).reshape(-1, 4)
    x1, x2 = torch.minimum(xyxy[:, 0], xyxy[:, 2]), torch.maximum(xyxy[:, 0], xyxy[:, 2])
    y1, y2 = torch.minimum(xyxy[:, 1], xyxy[:, 3]), torch.maximum(xyxy[:, 1], xyxy[:, 3])
    inside = xyxy.isfinite().all(1) & (x2 >= 0) & (y2 >= 0) & (x1 <= w - 1) & (y1 <= h - 1)
    if not inside.any():
        return canvas
    clipped = torch.stack([x1.clamp(0, w - 1), y1.clamp(0, h - 1), x2.clamp(0, w - 1), y2.clamp(0, h - 1)], 1)
    keep = inside.nonzero().flatten().tolist()
    width = 1 if min(h, w) < 64 else 2
    return draw_bounding_boxes(canvas, clipped[keep].round(), labels=[labels[i] for i in keep],
                               colors=[colors[i] for i in keep], width=width)


def _masks(canvas: torch.Tensor, rles: list[dict], colors: list) -> torch.Tensor:
    """COCO RLEs (counts as str, as in json) of this image's size; one of another size is skipped."""
    h, w = canvas.shape[1:]
    masks, mask_colors = [], []
    for rle, color in zip(rles, colors):
        if rle is None or list(rle.get("size", [])) != [h, w]:
            continue
        counts = rle["counts"].encode("ascii") if isinstance(rle["counts"], str) else rle["counts"]
        masks.append(torch.from_numpy(mask_utils.decode({"size": [h, w], "counts": counts})).bool())
        mask_colors.append(color)
    if not masks:
        return canvas
    return draw_segmentation_masks(canvas, torch.stack(masks), alpha=MASK_ALPHA, colors=mask_colors)


def _keypoints(canvas: torch.Tensor, keypoints: list, colors: list) -> torch.Tensor:
    """[N][K][x, y, v]: the visible ones (v > 0), each instance in its colour (no skeleton: it is per dataset)."""
    for points, color in zip(keypoints, colors):
        kp = torch.tensor(points, dtype=torch.float32).reshape(-1, 3)
        shown = kp[(kp[:, 2] > 0) & kp[:, :2].isfinite().all(1), :2]
        if len(shown):
            canvas = draw_keypoints(canvas, shown[None], colors=color, radius=2)
    return canvas
