"""The detectors built on MODEL.BACKBONE: torchvision's model classes around our backbones and heads.

- FPN (MODEL.FEATURES fpn): every type but ssdlite. R-CNN heads follow MODEL.BOX_HEAD (2fc: two
  REPRESENTATION_SIZE layers; 4conv1fc: four FPN_CHANNELS-wide convs and one layer, Detectron's GN
  head with HEAD_NORM GN), FPN_CHANNELS-wide mask convs and 2*FPN_CHANNELS-wide keypoint convs (at 256
  those are torchvision's and Detectron's heads).
- C4 (MODEL.FEATURES c4): Faster and Mask R-CNN as Detectron's R-50-C4: the RPN on res4 with every
  anchor size on that one map, res5 as the box head, and for masks the same res5 (shared weights,
  Detectron's mask_rcnn_fcn_head_v0upshare) then a 2x deconvolution to 14x14 masks.
"""
from __future__ import annotations

from torch import nn
from torchvision.models import detection as tvd
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNConvFCHead, FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.keypoint_rcnn import KeypointRCNNHeads, KeypointRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.rpn import RPNHead
from torchvision.ops import MultiScaleRoIAlign

from trainer.errors import UserError
from trainer.models.backbones import RESNETS, Res5BoxHead, c4_parts, fpn_backbone, norm_layer

CLASSES = {"fasterrcnn": tvd.FasterRCNN, "maskrcnn": tvd.MaskRCNN, "keypointrcnn": tvd.KeypointRCNN,
           "retinanet": tvd.RetinaNet, "fcos": tvd.FCOS}
_DEFAULT_RATIOS = (0.5, 1.0, 2.0)


def check_architecture(m, family: str) -> None:
    """What the MODEL.* architecture keys ask for exists for this type and backbone."""
    bottleneck = m.BACKBONE in RESNETS and RESNETS[m.BACKBONE][0].expansion == 4
    if m.FEATURES == "c4" and family not in ("fasterrcnn", "maskrcnn"):
        raise UserError(f"MODEL.FEATURES c4 builds Faster and Mask R-CNN only, not {m.TYPE}")
    if m.FEATURES == "c4" and not bottleneck:
        raise UserError(f"MODEL.FEATURES c4 needs a ResNet-50 or deeper MODEL.BACKBONE, got {m.BACKBONE!r}")
    if m.STRIDE_IN_1X1 and not bottleneck:
        raise UserError(f"MODEL.STRIDE_IN_1X1 applies to ResNet-50 and deeper backbones, not {m.BACKBONE!r}")
    if m.BACKBONE_NORM and m.BACKBONE not in RESNETS:
        raise UserError(f"MODEL.BACKBONE_NORM {m.BACKBONE_NORM} applies to the ResNet backbones, not {m.BACKBONE!r}")
    if m.P6_FROM_C5 and family not in ("retinanet", "fcos"):
        raise UserError("MODEL.P6_FROM_C5 applies to the single-stage types (retinanet, fcos)")
    if m.BOX_HEAD != "2fc" and (not family.endswith("rcnn") or m.FEATURES == "c4"):
        raise UserError(f"MODEL.BOX_HEAD {m.BOX_HEAD} applies to R-CNN types on an FPN")
    if m.CLS_AGNOSTIC_MASK and (family != "maskrcnn" or not m.BACKBONE):
        raise UserError("MODEL.CLS_AGNOSTIC_MASK applies to maskrcnn types with MODEL.BACKBONE set")
    if m.HEAD_NORM and m.FEATURES == "c4":
        raise UserError("MODEL.HEAD_NORM applies to the FPN heads (C4's res5 head has the backbone's norm)")
    if family in ("fcos", "ssdlite320") and -1 not in (m.FG_IOU, m.BG_IOU):
        raise UserError(f"MODEL.FG_IOU and BG_IOU do not apply to {m.TYPE}")


def anchor_generator(sizes, ratios, family: str) -> AnchorGenerator:
    """One base size per level; RetinaNet three octave scales per size (torchvision's and Detectron's)."""
    ratios = tuple(ratios) or _DEFAULT_RATIOS
    if family == "fcos":  # FCOS takes exactly one square anchor per location
        return AnchorGenerator(tuple((s,) for s in sizes), ((1.0,),) * len(sizes))
    if family == "retinanet":
        per_level = tuple((s, int(s * 2 ** (1 / 3)), int(s * 2 ** (2 / 3))) for s in sizes)
    else:
        per_level = tuple((s,) for s in sizes)
    return AnchorGenerator(per_level, (ratios,) * len(sizes))


def build_fpn(m, family: str, n: int, num_keypoints: int, kw: dict) -> nn.Module:
    backbone = fpn_backbone(m, single_stage=not family.endswith("rcnn"))
    if not family.endswith("rcnn"):
        return CLASSES[family](backbone, num_classes=n, **kw)
    # R-CNN: we give the predictors, so the classes travel with them (num_classes=None, as torchvision asks).
    ch, width, size = m.FPN_CHANNELS, m.REPRESENTATION_SIZE, m.BOX_POOL_SIZE
    levels = list(backbone.body.return_layers.values())  # P2-P5 (mobilenet: its two maps), as Detectron's ROI levels

    def pool(resolution: int) -> MultiScaleRoIAlign:
        return MultiScaleRoIAlign(levels, resolution, m.POOL_SAMPLING_RATIO)

    if m.BOX_HEAD == "4conv1fc":
        box_head = FastRCNNConvFCHead((ch, size, size), [ch] * 4, [width], norm_layer=norm_layer(m.HEAD_NORM))
    else:
        box_head = TwoMLPHead(ch * size * size, width)
    heads = {"box_roi_pool": pool(size), "box_head": box_head, "box_predictor": FastRCNNPredictor(width, n)}
    if family == "maskrcnn":
        heads |= {"mask_roi_pool": pool(m.MASK_POOL_SIZE),
                  "mask_head": MaskRCNNHeads(ch, (ch,) * 4, 1, norm_layer=norm_layer(m.HEAD_NORM)),
                  "mask_predictor": mask_predictor(m, ch, ch, n)}
    elif family == "keypointrcnn":
        heads |= {"keypoint_roi_pool": pool(m.KEYPOINT_POOL_SIZE),
                  "keypoint_head": KeypointRCNNHeads(ch, (2 * ch,) * 8),
                  "keypoint_predictor": KeypointRCNNPredictor(2 * ch, num_keypoints)}
    return CLASSES[family](backbone, num_classes=None, **kw, **heads)


def build_c4(m, family: str, n: int, kw: dict) -> nn.Module:
    backbone, res5, width = c4_parts(m)
    sizes, ratios = tuple(m.ANCHOR_SIZES or (32, 64, 128, 256, 512)), tuple(m.ANCHOR_RATIOS) or _DEFAULT_RATIOS
    pool = MultiScaleRoIAlign(["0"], m.BOX_POOL_SIZE, m.POOL_SAMPLING_RATIO)
    heads = {"rpn_anchor_generator": AnchorGenerator((sizes,), (ratios,)),
             "rpn_head": RPNHead(backbone.out_channels, len(sizes) * len(ratios)),
             "box_roi_pool": pool, "box_head": Res5BoxHead(res5), "box_predictor": FastRCNNPredictor(width, n)}
    if family == "maskrcnn":  # the box head's res5 module itself: one set of weights, as Detectron's
        heads |= {"mask_roi_pool": MultiScaleRoIAlign(["0"], m.MASK_POOL_SIZE, m.POOL_SAMPLING_RATIO),
                  "mask_head": res5, "mask_predictor": mask_predictor(m, width, 256, n)}
    return CLASSES[family](backbone, num_classes=None, **kw, **heads)


class ClassAgnosticMaskPredictor(nn.Module):
    """One mask per box, shown to torchvision's per-class mask loss and inference as every class's mask
    (a broadcast view: no copy, and every class's gradient reaches the one channel)."""

    def __init__(self, in_channels: int, dim: int, num_classes: int):
        super().__init__()
        self.predictor = MaskRCNNPredictor(in_channels, dim, 1)
        self.num_classes = num_classes

    def forward(self, x):
        return self.predictor(x).expand(-1, self.num_classes, -1, -1)


def mask_predictor(m, in_channels: int, dim: int, n: int) -> nn.Module:
    if m.CLS_AGNOSTIC_MASK:
        return ClassAgnosticMaskPredictor(in_channels, dim, n)
    return MaskRCNNPredictor(in_channels, dim, n)
