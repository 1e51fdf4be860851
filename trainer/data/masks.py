"""A segmentation three ways: as COCOeval reads it (polygons of 3+ points, else an RLE), as a
training record keeps it (few Python objects), and as the mask a model is trained on."""
from __future__ import annotations

import numpy as np
from pycocotools import mask as mask_utils


def eval_mask(segm, image: dict):
    """An RLE as checks vetted it, the polygons of 3+ points (4 numbers read as a box), else empty."""
    if isinstance(segm, dict):
        return segm
    polygons = [p for p in segm if len(p) >= 6] if isinstance(segm, list) else []
    return polygons or mask_utils.encode(np.zeros((image["height"], image["width"]), np.uint8, order="F"))


def compact(segm, h: int, w: int):
    """eval_mask's segmentation as few Python objects (one array per polygon, an RLE's counts as
    bytes), the same mask: a loader worker reading a list of floats writes to each one's refcount,
    so the pages of the trainer's records it shares would be copied."""
    if isinstance(segm, list):
        return [np.asarray(p, np.float64) for p in segm]
    if isinstance(segm.get("counts"), list):  # uncompressed RLE
        return mask_utils.frPyObjects(segm, h, w)
    return segm


def segm_to_mask(segm, h: int, w: int) -> np.ndarray:
    """The HxW uint8 mask of a compact segmentation: its polygons (3+ points each), or its RLE."""
    return mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects(segm, h, w)) if isinstance(segm, list) else segm)
