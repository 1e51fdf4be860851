"""What the detector sees, at each evaluation: the first TEST.VIS_IMAGES images of a test set
(the same ones every time, so that the UI's step slider shows the detector improving) with their
ground truth in green and the detections scoring at least 0.5 in colour, and the per-category AP
as a table. Both go to the run (mlflow.log_image with the iteration as step; log_table).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from pycocotools.cocoeval import COCOeval

from trainer.visualize import draw

SCORE_THRESHOLD = 0.5


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


def per_category_rows(ev: COCOeval) -> dict:
    """Columns for mlflow's log_table: category, AP, AP50 (area all, 100 detections), instances."""
    precision, gt = ev.eval["precision"], ev.cocoGt  # [iou thresholds, recall, category, area, max dets]
    table: dict = {"category": [], "AP": [], "AP50": [], "instances": []}
    for k, cat_id in enumerate(ev.params.catIds):
        p = precision[:, :, k, 0, -1]
        table["category"].append(gt.cats[cat_id].get("name", str(cat_id)))
        table["AP"].append(_mean_defined(p))
        table["AP50"].append(_mean_defined(p[0]))
        table["instances"].append(len(gt.getAnnIds(catIds=[cat_id], iscrowd=False)))
    return table


def _mean_defined(p: np.ndarray) -> float | None:
    return float(p[p > -1].mean()) if (p > -1).any() else None  # -1: no such ground truth
