"""Detection models: torchvision's builders driven by MODEL.* keys, and model.txt.

Two ways to build:
- MODEL.BACKBONE '' (the default): torchvision's own builder for MODEL.TYPE, random init, so its
  architecture is exactly torchvision's. MODEL.FPN_CHANNELS must then stay 256 (the builders hard-code
  it) and MODEL.BACKBONE_WIDTH 1.0; ask for a BACKBONE to change either.
- MODEL.BACKBONE set: the type's model class around that network (architectures.py). Default anchors:
  one size per level, 32*2**i (FCOS: 8*2**i). The _v2 types get the same plain heads as v1 here.

On either: ANCHOR_SIZES (one base size per feature level; ratios 0.5, 1, 2; RetinaNet keeps its three
octave scales per size and FCOS its single square anchor), REPRESENTATION_SIZE (R-CNN box head width;
ignored by single-stage types) and TRAINABLE_BACKBONE_LAYERS. When TRAIN.WEIGHTS is set the network is
prepared the way torchvision prepares a pretrained one: FrozenBatchNorm2d in the backbone (not in the
_v2 types, which keep BatchNorm2d) and only the last 3 stages trainable unless
TRAINABLE_BACKBONE_LAYERS says otherwise. Without weights everything trains.
"""
from __future__ import annotations

import difflib
import re
from functools import partial

import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchvision.models import detection as tvd
from torchvision.models.detection._utils import overwrite_eps
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.retinanet import RetinaNetHead
from torchvision.models.detection.rpn import RPNHead
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool, LastLevelP6P7
from torchvision.ops.misc import FrozenBatchNorm2d

from trainer.errors import UserError
from trainer.models.architectures import anchor_generator, build_c4, build_fpn, check_architecture
from trainer.models.backbones import BACKBONES

WEIGHT_NAME = re.compile(r"\w+_Weights\.\w+")  # a torchvision weight name, such as ResNet50_Weights.IMAGENET1K_V1

MODEL_TYPES = (
    "fasterrcnn_resnet50_fpn", "fasterrcnn_resnet50_fpn_v2", "fasterrcnn_mobilenet_v3_large_fpn",
    "fasterrcnn_mobilenet_v3_large_320_fpn", "maskrcnn_resnet50_fpn", "maskrcnn_resnet50_fpn_v2",
    "keypointrcnn_resnet50_fpn", "retinanet_resnet50_fpn", "retinanet_resnet50_fpn_v2", "fcos_resnet50_fpn",
    "ssdlite320_mobilenet_v3_large",
)


def _family(model_type: str) -> str:
    return model_type.split("_")[0]  # fasterrcnn, maskrcnn, keypointrcnn, retinanet, fcos, ssdlite320


def _choice_error(what: str, value: str, valid) -> UserError:
    close = difflib.get_close_matches(value, valid, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return UserError(f"unknown {what} {value!r}{hint}; valid: {', '.join(valid)}")


# ---------------------------------------------------------------------------------------- building

def build_model(cfg, num_classes: int, num_keypoints: int = 0) -> nn.Module:
    """The MODEL.TYPE detector, randomly initialised; `num_classes` includes the background."""
    m = cfg.MODEL
    if m.TYPE not in MODEL_TYPES:
        raise _choice_error("MODEL.TYPE", m.TYPE, MODEL_TYPES)
    family = _family(m.TYPE)
    n = m.NUM_CLASSES if m.NUM_CLASSES > 0 else num_classes
    if 0 < m.NUM_CLASSES < num_classes:  # a label past the classifier's outputs: an IndexError mid-training
        raise UserError(f"MODEL.NUM_CLASSES {m.NUM_CLASSES} is fewer than the dataset's {num_classes} "
                        f"(its {num_classes - 1} categories + background); leave it -1 to take the dataset's")
    if n < 2:
        raise UserError(f"the model needs >= 2 classes (background + objects), got {n}")
    if family == "keypointrcnn" and num_keypoints <= 0:
        raise UserError(f"{m.TYPE} needs the dataset's number of keypoints, got {num_keypoints}")
    _check_keys(cfg, family)
    kw = _size_kwargs(cfg, family)
    if m.BACKBONE and m.FEATURES == "c4":
        model = build_c4(m, family, n, kw)
    elif m.BACKBONE:
        model = build_fpn(m, family, n, num_keypoints, kw)
    else:
        builder = getattr(tvd, m.TYPE)
        extra = {"num_keypoints": num_keypoints} if family == "keypointrcnn" else {}
        model = builder(weights=None, weights_backbone=None, num_classes=n, **kw, **extra)
    if family != "ssdlite320" and m.FEATURES == "fpn":
        _set_anchors(model, cfg, family)
    if family != "ssdlite320":
        _prepare_backbone(model, cfg)
    # Decided by the config, not by loading the weights: a resumed job, every rank and the served
    # model_final then run with the eps the weights were trained with.
    if zero_eps_weights(cfg.TRAIN.WEIGHTS):
        overwrite_eps(model, 0.0)
    if family.endswith("rcnn") and m.REPRESENTATION_SIZE != 1024 and not m.BACKBONE:
        _set_box_head(model, m.REPRESENTATION_SIZE, n)
    if m.PIXEL_MEAN:  # 0-255 in the config (Detectron's convention), 0-1 in torchvision's transform
        model.transform.image_mean = [v / 255 for v in m.PIXEL_MEAN]
    if m.PIXEL_STD:
        model.transform.image_std = [v / 255 for v in m.PIXEL_STD]
    return model


_NEEDS_BACKBONE = {"FEATURES": "fpn", "STRIDE_IN_1X1": False, "BACKBONE_NORM": "", "FPN_NORM": "", "HEAD_NORM": "",
                   "BOX_HEAD": "2fc", "P6_FROM_C5": False, "BOX_POOL_SIZE": 7, "MASK_POOL_SIZE": 14,
                   "KEYPOINT_POOL_SIZE": 14, "POOL_SAMPLING_RATIO": 2}


def _check_keys(cfg, family: str) -> None:
    m = cfg.MODEL
    if m.BACKBONE and m.BACKBONE not in BACKBONES:
        raise _choice_error("MODEL.BACKBONE", m.BACKBONE, BACKBONES)
    if family == "ssdlite320" and (m.BACKBONE or m.ANCHOR_SIZES or m.ANCHOR_RATIOS or m.TRAINABLE_BACKBONE_LAYERS != -1):
        raise UserError("MODEL.BACKBONE, ANCHOR_SIZES, ANCHOR_RATIOS and TRAINABLE_BACKBONE_LAYERS do not apply to "
                        "ssdlite")
    if not m.BACKBONE and m.FPN_CHANNELS != 256:
        raise UserError(f"MODEL.FPN_CHANNELS {m.FPN_CHANNELS} needs MODEL.BACKBONE set (torchvision's own "
                        "builders use 256)")
    changed = [k for k, v in _NEEDS_BACKBONE.items() if m[k] != v]
    if changed and not m.BACKBONE:
        raise UserError(f"MODEL.{changed[0]} needs MODEL.BACKBONE set (torchvision's own builders fix it)")
    if m.BACKBONE_WIDTH != 1.0 and m.BACKBONE != "mobilenet_v3_large":
        raise UserError("MODEL.BACKBONE_WIDTH applies to MODEL.BACKBONE mobilenet_v3_large only")
    if m.FPN_CHANNELS <= 0 or m.REPRESENTATION_SIZE <= 0 or any(s <= 0 for s in m.ANCHOR_SIZES):
        raise UserError("MODEL.FPN_CHANNELS, REPRESENTATION_SIZE and ANCHOR_SIZES must be positive")
    # GroupNorm(32 groups) refuses a group of one value: at 32 channels, a lone image's 1x1 top map (predict)
    if family == "fcos" and (m.FPN_CHANNELS % 32 or m.FPN_CHANNELS < 64):
        raise UserError(f"fcos needs MODEL.FPN_CHANNELS a multiple of 32 and at least 64 (its head's GroupNorm has "
                        f"32 groups), got {m.FPN_CHANNELS}")
    check_architecture(m, family)


def _size_kwargs(cfg, family: str) -> dict:
    m = cfg.MODEL
    chosen = {"nms_thresh": m.NMS_THRESH, "score_thresh": m.SCORE_THRESH, "topk_candidates": m.TOPK_CANDIDATES}
    if family == "ssdlite320":  # fixed 320x320 input: the scales do not apply
        return {"detections_per_img": m.DETECTIONS_PER_IMAGE, **_given(chosen)}
    # A tuple of scales: GeneralizedRCNNTransform picks one at random per training batch, on the device.
    kw = {"min_size": tuple(cfg.TRAIN.SCALES), "max_size": cfg.TRAIN.MAX_SIZE}
    if family == "fcos":
        return {**kw, "detections_per_img": m.DETECTIONS_PER_IMAGE, **_given(chosen)}
    if family == "retinanet":
        return {**kw, "detections_per_img": m.DETECTIONS_PER_IMAGE,
                **_given({**chosen, "fg_iou_thresh": m.FG_IOU, "bg_iou_thresh": m.BG_IOU})}
    return {**kw, **{arg: m[key] for arg, key in _RCNN_ARGS.items()}, "box_detections_per_img": m.DETECTIONS_PER_IMAGE,
            **_given({"box_fg_iou_thresh": m.FG_IOU, "box_bg_iou_thresh": m.BG_IOU, "box_nms_thresh": m.NMS_THRESH,
                      "box_score_thresh": m.SCORE_THRESH})}


# The R-CNN types' arguments and the MODEL key of each: keys no other family reads.
_RCNN_ARGS = {"rpn_pre_nms_top_n_train": "RPN_PRE_NMS_TOP_N_TRAIN", "rpn_post_nms_top_n_train": "RPN_POST_NMS_TOP_N_TRAIN",
              "rpn_pre_nms_top_n_test": "RPN_PRE_NMS_TOP_N_TEST", "rpn_post_nms_top_n_test": "RPN_POST_NMS_TOP_N_TEST",
              "rpn_batch_size_per_image": "RPN_BATCH_SIZE_PER_IMAGE", "rpn_nms_thresh": "RPN_NMS_THRESH",
              "rpn_fg_iou_thresh": "RPN_FG_IOU", "rpn_bg_iou_thresh": "RPN_BG_IOU",
              "rpn_positive_fraction": "RPN_POSITIVE_FRACTION", "box_batch_size_per_image": "ROI_BATCH_SIZE_PER_IMAGE",
              "box_positive_fraction": "POSITIVE_FRACTION"}
_RCNN_ONLY = {"REPRESENTATION_SIZE", *_RCNN_ARGS.values()}


def unread_keys(cfg) -> list[str]:
    """MODEL keys set away from their defaults that MODEL.TYPE's family never reads (_size_kwargs and
    the heads say which it does): a demo's RPN keys under retinanet, a mask pool size on Faster R-CNN,
    the FPN and box-head widths on C4."""
    from trainer.config import defaults

    family, default = _family(cfg.MODEL.TYPE), defaults().MODEL
    unread = set() if family.endswith("rcnn") else set(_RCNN_ONLY)
    unread |= {"MASK_POOL_SIZE"} if family != "maskrcnn" else set()
    unread |= {"KEYPOINT_POOL_SIZE"} if family != "keypointrcnn" else set()
    unread |= {"TOPK_CANDIDATES"} if family.endswith("rcnn") else set()
    unread |= {"FG_IOU", "BG_IOU"} if family in ("fcos", "ssdlite320") else set()
    unread |= {"REPRESENTATION_SIZE", "FPN_CHANNELS", "FPN_NORM"} if cfg.MODEL.FEATURES == "c4" else set()  # res5 heads, no FPN
    return sorted(f"MODEL.{k}" for k in unread if cfg.MODEL[k] != default[k])


def _given(values: dict) -> dict:
    """The ones set (-1 leaves torchvision's default for the type)."""
    return {k: v for k, v in values.items() if v != -1}


def _num_levels(backbone: BackboneWithFPN) -> int:
    extra = {LastLevelMaxPool: 1, LastLevelP6P7: 2}.get(type(backbone.fpn.extra_blocks), 0)
    return len(backbone.body.return_layers) + extra


def _set_anchors(model: nn.Module, cfg, family: str) -> None:
    sizes, ratios, levels = list(cfg.MODEL.ANCHOR_SIZES), tuple(cfg.MODEL.ANCHOR_RATIOS), _num_levels(model.backbone)
    if not sizes and not ratios and not cfg.MODEL.BACKBONE:
        return  # torchvision's own anchors already fit its own backbone
    if sizes and len(sizes) != levels:
        raise UserError(f"MODEL.ANCHOR_SIZES needs one size per feature map: {cfg.MODEL.TYPE} with "
                        f"{cfg.MODEL.BACKBONE or 'its backbone'} has {levels}, got {len(sizes)}")
    sizes = sizes or [(8 if family == "fcos" else 32) * 2 ** i for i in range(levels)]  # torchvision's too
    generator = anchor_generator(sizes, ratios, family)
    if not family.endswith("rcnn"):
        model.anchor_generator = generator
        count = generator.num_anchors_per_location()[0]
        if family == "retinanet" and model.head.classification_head.num_anchors != count:
            model.head = RetinaNetHead(model.backbone.out_channels, count, model.head.classification_head.num_classes,
                                       norm_layer=_retinanet_norm(model))
        elif family == "fcos" and ratios not in ((), (1.0,)):  # anchor_generator gives fcos one square anchor whatever they say
            raise UserError("fcos takes one square anchor per location: MODEL.ANCHOR_RATIOS does not apply")
        return
    rpn = model.rpn
    rpn.anchor_generator = generator
    count = generator.num_anchors_per_location()[0]
    if rpn.head.cls_logits.out_channels != count:  # e.g. the mobilenet types' 15 anchors per location
        rpn.head = RPNHead(model.backbone.out_channels, count, conv_depth=len(rpn.head.conv))


def _retinanet_norm(model: nn.Module):
    """The _v2 head's GroupNorm, kept when the head is rebuilt for another anchor count."""
    norms = [mod for mod in model.head.classification_head.conv.modules() if isinstance(mod, nn.GroupNorm)]
    return partial(nn.GroupNorm, 32) if norms else None


def _set_box_head(model: nn.Module, width: int, n: int) -> None:
    heads = model.roi_heads
    if isinstance(heads.box_head, TwoMLPHead):
        heads.box_head = TwoMLPHead(heads.box_head.fc6.in_features, width)
    else:  # the _v2 conv head: keep its convs, resize its one fully-connected layer
        i, fc = [(i, mod) for i, mod in enumerate(heads.box_head) if isinstance(mod, nn.Linear)][-1]
        heads.box_head[i] = nn.Linear(fc.in_features, width)
    heads.box_predictor = FastRCNNPredictor(width, n)


def _prepare_backbone(model: nn.Module, cfg) -> None:
    """Frozen BN and frozen early stages for pretrained weights, as torchvision's builders do."""
    body, pretrained = model.backbone.body, bool(cfg.TRAIN.WEIGHTS)
    if pretrained and not (cfg.MODEL.TYPE.endswith("_v2") and not cfg.MODEL.BACKBONE):
        _freeze_batchnorm(model)  # the backbone's, and C4's res5 head's
    stages = _stages(body)
    wanted = cfg.MODEL.TRAINABLE_BACKBONE_LAYERS
    if wanted > len(stages):
        raise UserError(f"MODEL.TRAINABLE_BACKBONE_LAYERS must be -1 or 0..{len(stages)} for this backbone, "
                        f"got {wanted}")
    trainable = wanted if wanted >= 0 else (3 if pretrained else len(stages))
    frozen = [name for stage in stages[:len(stages) - trainable] for name in stage]
    for name, p in body.named_parameters():
        if name.split(".")[0] in frozen:
            p.requires_grad_(False)


def torchvision_weight(spec: str):
    """The torchvision weight `spec` names (such as ResNet50_Weights.IMAGENET1K_V1), or None."""
    if not WEIGHT_NAME.fullmatch(spec):
        return None
    try:
        return torchvision.models.get_weight(spec)
    except (ValueError, KeyError, AttributeError):
        return None


def zero_eps_weights(spec: str) -> bool:
    """Whether `spec` names one of torchvision's first COCO detectors, trained with FrozenBatchNorm2d's
    eps 0 (torchvision's builders set it for them; eps is an attribute, in no state_dict)."""
    return torchvision_weight(spec) in {tvd.FasterRCNN_ResNet50_FPN_Weights.COCO_V1, tvd.MaskRCNN_ResNet50_FPN_Weights.COCO_V1,
                                        tvd.KeypointRCNN_ResNet50_FPN_Weights.COCO_V1, tvd.RetinaNet_ResNet50_FPN_Weights.COCO_V1}


def _stages(body: nn.Module) -> list[list[str]]:
    """The body's top-level children grouped into stages, earliest first (torchvision's numbering)."""
    if hasattr(body, "layer1"):  # resnet: stem (conv1 + bn1), layer1..layer4 (C4: layer4 is the box head)
        return [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]]
    names = [name for name, _ in body.named_children()]
    starts = [0] + [i for i, b in enumerate(body.children()) if getattr(b, "_is_cn", False)] + [len(names) - 1]
    return [names[a:b] for a, b in zip(starts, starts[1:] + [len(names)]) if a < b]


def _freeze_batchnorm(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features)  # torchvision's eps, as in its builders
            for key in ("weight", "bias", "running_mean", "running_var"):
                getattr(frozen, key).copy_(getattr(child, key).detach())
            setattr(module, name, frozen)
        else:
            _freeze_batchnorm(child)


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself, out of its DistributedDataParallel wrapper if it has one."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def set_test_size(model: nn.Module, cfg) -> None:
    """Evaluate at TEST.SCALE / TEST.MAX_SIZE."""
    _set_size(model, (cfg.TEST.SCALE,), cfg.TEST.MAX_SIZE)


def set_train_size(model: nn.Module, cfg) -> None:
    """Back to TRAIN.SCALES / TRAIN.MAX_SIZE after an evaluation during training."""
    _set_size(model, tuple(cfg.TRAIN.SCALES), cfg.TRAIN.MAX_SIZE)


def _set_size(model: nn.Module, min_size: tuple, max_size: int) -> None:
    t = unwrap(model).transform
    if t.fixed_size is None:  # ssdlite's fixed 320 stays
        t.min_size, t.max_size = min_size, max_size


# ---------------------------------------------------------------------------------------- model.txt

def describe_model(model: nn.Module) -> str:
    """The module tree and parameter counts: the heir of Detectron's net.pbtxt."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{model}\n\nparameters: {total:,} total, {trainable:,} trainable\n"
