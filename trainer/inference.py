"""From images to detections outside training: what the served model, `tracktron predict` and evaluation
share. A model folder (`save` / `Detector.load`) holds weights.pt (a state dict: tensors only, loaded
with weights_only=True, never a pickle of code), config.yaml and categories.json.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from pycocotools import mask as mask_utils

from trainer import torch_load
from trainer.atomic_write import write_atomic
from trainer.config import Config, config_from_dict, load_config, write_config
from trainer.data.checks import category_key
from trainer.data.images import decode
from trainer.errors import UserError, first_line
from trainer.models import build_model, load_error, set_test_size

WEIGHTS, CONFIG, CATEGORIES = "weights.pt", "config.yaml", "categories.json"


def check_weights_given(weights: str) -> None:
    """`--weights "$WEIGHTS"` with the variable unset ("" would be the working folder, a model folder)."""
    if not weights.strip():
        raise UserError("--weights is empty: give a checkpoint path, a model folder, runs:/<id>/... or models:/name/version")


def on_host(output: dict) -> dict:
    """One output on the CPU, its masks thresholded first: as [N, 1, H, W] floats they are four times as large."""
    return {k: (v > 0.5 if k == "masks" else v).detach().cpu() for k, v in output.items()}


def encode_masks(masks: torch.Tensor) -> list[dict]:
    """[N, 1, H, W] probabilities (or on_host's booleans) -> COCO RLEs of mask > 0.5, counts as str
    so they serialise to json."""
    binary = (masks[:, 0] > 0.5).cpu().numpy().astype(np.uint8)
    rles = mask_utils.encode(np.asfortranarray(binary.transpose(1, 2, 0)))
    for rle in rles:
        rle["counts"] = rle["counts"].decode("ascii")
    return rles


def detections_of(output: dict, categories: list[dict]) -> dict:
    """One torchvision output (labels 1..K = categories[0..K-1]) as plain lists, ready for json."""
    out = on_host(output)
    # A label past the categories (MODEL.NUM_CLASSES set larger than the dataset's) keeps its number.
    cats = [categories[i - 1] if 0 < i <= len(categories) else {"id": i} for i in out["labels"].tolist()]
    found = {"boxes": out["boxes"].tolist(), "scores": out["scores"].tolist(),
             "category_ids": [c["id"] for c in cats], "category_names": [c.get("name", str(c["id"])) for c in cats]}
    if "masks" in out:
        found["masks"] = encode_masks(out["masks"])
    if "keypoints" in out:
        found["keypoints"] = out["keypoints"].tolist()  # [N][K][x, y, visibility]
    return found


def detections_to_coco(outputs: list[dict], image_ids: list, label_to_cat_id: dict) -> list[dict]:
    """torchvision detections (boxes already in original image pixels) -> COCO results entries."""
    results = []
    for out, image_id in zip(outputs, image_ids):
        out = on_host(out)
        boxes = out["boxes"].clone()
        boxes[:, 2:] -= boxes[:, :2]  # xyxy -> xywh
        # A label past the dataset's categories (MODEL.NUM_CLASSES set above them) is no category
        # COCOeval scores: dropped, as it would ignore it.
        cats = [label_to_cat_id.get(int(label)) for label in out["labels"].tolist()]
        entries = [{"image_id": image_id, "category_id": c, "bbox": b, "score": s}
                   for c, b, s in zip(cats, boxes.tolist(), out["scores"].tolist())]
        if "masks" in out:
            for entry, rle in zip(entries, encode_masks(out["masks"])):
                entry["segmentation"] = rle
        if "keypoints" in out:
            for entry, kp in zip(entries, out["keypoints"].flatten(1).tolist()):
                entry["keypoints"] = kp
        results.extend(e for e in entries if e["category_id"] is not None)
    return results


def categories_of(dataset) -> dict:
    """What a dataset's labels mean, kept with every checkpoint and model so that detections can be
    named without the dataset: {"categories": [{"id", "name"}], "keypoint_names": [...]}."""
    cats = [{"id": c["id"], "name": c.get("name", str(c["id"]))} for c in dataset.categories]
    return {"categories": cats, "keypoint_names": list(getattr(dataset, "keypoint_names", []))}


def category_key_of(categories: dict, keypoints: bool) -> list:
    """data.checks.category_key of a categories_of dict, whose keypoint names are the model's."""
    names = categories.get("keypoint_names") or []
    return category_key([{**c, "keypoints": names} for c in categories.get("categories", [])], keypoints)


def save(folder: Path, cfg: Config, state_dict: dict, categories: list[dict], keypoint_names: list) -> Path:
    """The model folder a Detector loads: weights, resolved (redacted) config, categories."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, buffer)
    write_atomic(folder / WEIGHTS, buffer.getvalue())
    write_config(cfg, folder / CONFIG)
    cats = [{"id": c["id"], "name": c.get("name", str(c["id"]))} for c in categories]
    write_atomic(folder / CATEGORIES, json.dumps({"categories": cats, "keypoint_names": list(keypoint_names)}))
    return folder


def checked_categories(meta, source) -> tuple[list[dict], list[str]]:
    """The categories and keypoint names a checkpoint or model folder carries, as save() writes them;
    another shape is a UserError naming `source`."""
    cats = meta.get("categories") if isinstance(meta, dict) else None
    if not isinstance(cats, list) or not cats or not all(
            isinstance(c, dict) and type(c.get("id")) is int and isinstance(c.get("name", ""), str) for c in cats):
        raise UserError(f"{source} lists no categories as tracktron writes them "
                        '({"categories": [{"id": <int>, "name": <str>}, ...]})')
    names = meta.get("keypoint_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{source}: its keypoint_names are not a list of names")
    return cats, names


class Detector:
    """A trained detector for images one at a time, as the test loader feeds evaluation."""

    def __init__(self, cfg: Config, state_dict: dict, categories: list[dict], keypoint_names=(),
                 device: str | torch.device = "cpu"):
        self.cfg, self.categories, self.device = cfg, list(categories), torch.device(device)
        self.keypoint_names = list(keypoint_names)
        self.model = build_model(cfg, len(self.categories) + 1, len(keypoint_names))
        if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            raise UserError("the weights are not a state dict (tensors by name)")
        try:
            result = self.model.load_state_dict(state_dict, strict=False)
        except RuntimeError as e:  # a tensor of another shape: weights for other categories or another model
            detail = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), first_line(e))
            raise UserError(f"the weights do not fit {cfg.MODEL.TYPE} with {len(self.categories)} categories: the "
                            f"config or categories disagree with them ({detail[:300]})") from None
        if result.missing_keys or result.unexpected_keys:
            bad = (result.missing_keys + result.unexpected_keys)[:3]
            raise UserError(f"the weights do not fit {cfg.MODEL.TYPE} with {len(self.categories)} categories "
                            f"({len(result.missing_keys)} missing, {len(result.unexpected_keys)} unexpected, "
                            f"e.g. {', '.join(bad)})")
        set_test_size(self.model, cfg)
        self.model.eval().to(self.device)

    @classmethod
    def load(cls, folder: Path, device: str | torch.device = "cpu", shown=None) -> Detector:
        """`shown`: what messages call the model (the URI a temporary download of it came from)."""
        folder = Path(folder)
        shown = shown or folder
        try:
            cfg = load_config(folder / CONFIG)
            meta = json.loads((folder / CATEGORIES).read_text())
            state = torch_load.load(folder / WEIGHTS)
        except UserError:  # a config.yaml of unknown keys or values of the wrong type says which
            raise
        except Exception as e:  # missing files, bad json, a tampered or truncated weights file
            raise UserError(f"{shown} is not a usable tracktron model ({type(e).__name__}: {first_line(e)})") from None
        return cls(cfg, state, *checked_categories(meta, f"{shown}: its {CATEGORIES}" if shown != folder
                                                   else folder / CATEGORIES), device)

    @classmethod
    def from_checkpoint(cls, path: Path, device: str | torch.device = "cpu", shown=None) -> Detector:
        """A training checkpoint (model_iter*.pth, model_final.pth): it carries its config and categories.
        `shown`: what messages call it (the URI a temporary download of it came from)."""
        name = shown or path
        try:
            state = torch_load.load(path)
        except Exception as e:  # not a zip, a tampered pickle, a truncated file
            raise UserError(f"{name} {load_error(e)}") from None
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "config" not in state:
            raise UserError(f"{name} is not a tracktron checkpoint (no model and config in it)")
        if "categories" not in state:
            raise UserError(f"{name} names no categories (written by an older tracktron): evaluate it with "
                            "`tracktron eval --config FILE --weights PATH`, whose dataset names them")
        if not isinstance(state["config"], dict):
            raise UserError(f"{name}: its config is not a mapping of config keys")
        return cls(config_from_dict(state["config"]), state["model"], *checked_categories(state["categories"], name),
                   device)

    @torch.inference_mode()
    def predict(self, images) -> list[dict]:
        """Detections for each image (bytes or HxWx3 uint8 arrays), in the image's pixels as a viewer
        shows them (a photo turned upright by its EXIF orientation first); ValueError for one that is
        no image or that the network cannot take."""
        results = []
        for image in images:
            output = self.model([self.pixels(image).to(self.device)])[0]
            results.append(detections_of(output, self.categories))
        return results

    def pixels(self, image) -> torch.Tensor:
        """The decoded image, once it is known to survive the network's resize (a 400x1 strip scales to no pixel)."""
        pixels = decode(image, upright=True)
        t = self.model.transform
        if getattr(t, "fixed_size", None) is None:
            h, w = pixels.shape[-2:]
            scale = min(t.min_size[-1] / min(h, w), t.max_size / max(h, w))
            if int(h * scale) < 1 or int(w * scale) < 1:
                raise ValueError(f"{w}x{h} pixels is too narrow a strip to detect in (the network scales it to "
                                 f"{int(w * scale)}x{int(h * scale)}); crop or pad it")
        return pixels
