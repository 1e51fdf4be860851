"""`tracktron config`: the resolved config, how a Detectron file was translated, and the network it
builds (random init, on CPU, no data read, nothing downloaded or written)."""
from __future__ import annotations

import yaml
from torch import nn

from trainer.config import Config, redacted
from trainer.config_detectron import Translation
from trainer.models import build_model
from trainer.redaction import printable

COCO_CLASSES, COCO_KEYPOINTS = 81, 17  # what is built when the dataset would decide (80 + background)


def explain(cfg: Config, translation: Translation | None, path: str) -> str:
    parts = [f"# {printable(str(path))}: {'a Detectron config, translated' if translation else 'a tracktron config'}"]
    if translation is not None:
        parts += ["", "## Detectron key -> tracktron key", *translation.lines()]
        if translation.ignored:
            parts += ["", f"## ignored ({len(translation.ignored)}: no meaning here)", ", ".join(translation.ignored)]
        if translation.renamed:
            parts += ["", "## renamed by Detectron, read under the new name", ", ".join(translation.renamed)]
    parts += ["", "## resolved config", yaml.safe_dump(redacted(cfg), sort_keys=False).rstrip()]
    parts += ["", "## architecture", *architecture(cfg)]
    return "\n".join(parts)


def architecture(cfg: Config) -> list[str]:
    m = cfg.MODEL
    classes = m.NUM_CLASSES if m.NUM_CLASSES > 0 else COCO_CLASSES
    model = build_model(cfg, classes, COCO_KEYPOINTS)
    total, trainable = _count(model), _count(model, trainable=True)
    where = f"MODEL.NUM_CLASSES {m.NUM_CLASSES}" if m.NUM_CLASSES > 0 else "COCO's; -1 takes the dataset's"
    lines = [f"{type(model).__name__}: {_backbone(cfg)}",
             f"classes: {classes} ({where})" + (f", keypoints: {COCO_KEYPOINTS} (the dataset's decide)"
                                                 if m.TYPE.startswith("keypointrcnn") else ""),
             f"parameters: {total:,} ({trainable:,} trainable)"]
    owner: dict = {}  # a parameter's first part: C4's mask head is the box head's res5 itself
    for name, child in _parts(model):
        first = {owner.setdefault(id(p), name) for p in child.parameters()} - {name}
        lines.append(f"  {name}: {_count(child):,}" + (f" (shared with {first.pop()})" if first else ""))
    return lines


def _backbone(cfg: Config) -> str:
    m = cfg.MODEL
    if not m.BACKBONE:
        return f"torchvision's {m.TYPE}"
    norm = {"": "BatchNorm" + (" (frozen)" if cfg.TRAIN.WEIGHTS else ""), "GN": "GroupNorm"}[m.BACKBONE_NORM]
    extras = [norm] + ([("stride in 1x1" if m.STRIDE_IN_1X1 else "stride in 3x3")] if m.BACKBONE != "mobilenet_v3_large"
                       else [])
    if m.FEATURES == "fpn":
        extras.append(f"FPN {m.FPN_CHANNELS}{' GN' if m.FPN_NORM else ''}")
    else:
        extras.append("C4: res5 box head")
    if m.TYPE.split("_")[0].endswith("rcnn") and m.FEATURES == "fpn":
        extras.append(f"box head {m.BOX_HEAD}{' GN' if m.HEAD_NORM else ''}")
    return f"{m.BACKBONE} ({', '.join(extras)})"


def _parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in model.named_children():
        if name == "transform":
            continue
        grandchildren = [(f"{name}.{n}", c) for n, c in child.named_children() if _count(c)]
        out += grandchildren if name in ("backbone", "roi_heads") else [(name, child)]
    return out


def _count(module: nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)
