"""Backbones on torchvision's own classes: every ResNet and ResNeXt Detectron trained (ResNet-50/101/152,
ResNeXt-101 32x8d and 64x4d, ResNeXt-152 32x8d), with Detectron's options (the stride in the 1x1 conv as
in MSRA's ResNets, GroupNorm), under an FPN or as Detectron's C4 trunk (res2-res4 for the RPN, res5 as
the box head on 14x14 RoIs)."""
from __future__ import annotations

from collections import OrderedDict
from functools import partial

import torchvision
from torch import nn
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool, LastLevelP6P7

# name -> (block, blocks per stage, groups, width per group); the names of torchvision's builders
RESNETS = {
    "resnet18": (BasicBlock, [2, 2, 2, 2], 1, 64),
    "resnet34": (BasicBlock, [3, 4, 6, 3], 1, 64),
    "resnet50": (Bottleneck, [3, 4, 6, 3], 1, 64),
    "resnet101": (Bottleneck, [3, 4, 23, 3], 1, 64),
    "resnet152": (Bottleneck, [3, 8, 36, 3], 1, 64),
    "resnext101_32x8d": (Bottleneck, [3, 4, 23, 3], 32, 8),
    "resnext101_64x4d": (Bottleneck, [3, 4, 23, 3], 64, 4),
    "resnext152_32x8d": (Bottleneck, [3, 8, 36, 3], 32, 8),  # Detectron's X-152; torchvision has no builder
}
BACKBONES = (*RESNETS, "mobilenet_v3_large")


def norm_layer(kind: str):
    """None (the module's own BatchNorm2d) or GroupNorm with 32 groups, as Detectron's GN models."""
    return partial(nn.GroupNorm, 32) if kind == "GN" else None


def resnet(name: str, norm: str = "", stride_in_1x1: bool = False) -> ResNet:
    block, layers, groups, width = RESNETS[name]
    layer = norm_layer(norm)
    net = ResNet(block, layers, groups=groups, width_per_group=width, **({"norm_layer": layer} if layer else {}))
    if stride_in_1x1:  # MSRA's ResNets (Detectron's R-50.pkl...) downsample in a block's 1x1 conv; torchvision's in its 3x3
        for unit in net.modules():
            if isinstance(unit, Bottleneck) and unit.conv2.stride != (1, 1):
                unit.conv1.stride, unit.conv2.stride = unit.conv2.stride, (1, 1)
    return net


def fpn_backbone(m, single_stage: bool) -> BackboneWithFPN:
    """An FPN of m.FPN_CHANNELS over m.BACKBONE: P2-P6 (max pool) for R-CNN, P3-P7 for single-stage
    types, their P6 from C5 with m.P6_FROM_C5 (Detectron's RetinaNet) or else from P5."""
    ch = m.FPN_CHANNELS
    if m.BACKBONE == "mobilenet_v3_large":
        # torchvision's BN momentum 0.01 suits fine-tuning; from scratch the weights move fast and
        # running statistics that slow lag far behind the batch ones (eval scores collapse).
        norm = partial(nn.BatchNorm2d, eps=0.001, momentum=0.1)
        features = torchvision.models.mobilenet_v3_large(weights=None, width_mult=m.BACKBONE_WIDTH,
                                                         norm_layer=norm).features
        stages = [i for i, b in enumerate(features) if getattr(b, "_is_cn", False)] + [len(features) - 1]
        used = stages[-2:]  # like torchvision's _mobilenet_extractor
        extra = LastLevelP6P7(ch, ch) if single_stage else LastLevelMaxPool()
        return BackboneWithFPN(features, {str(i): str(k) for k, i in enumerate(used)},
                               [features[i].out_channels for i in used], ch, extra_blocks=extra)
    net = resnet(m.BACKBONE, m.BACKBONE_NORM, m.STRIDE_IN_1X1)
    layers = [2, 3, 4] if single_stage else [1, 2, 3, 4]
    in_channels = [net.inplanes // 8 * 2 ** (i - 1) for i in layers]
    if single_stage:
        extra = LastLevelP6P7(in_channels[-1] if m.P6_FROM_C5 else ch, ch)
    else:
        extra = LastLevelMaxPool()
    return BackboneWithFPN(net, {f"layer{i}": str(k) for k, i in enumerate(layers)}, in_channels, ch,
                           extra_blocks=extra, norm_layer=norm_layer(m.FPN_NORM))


class C4Backbone(nn.Module):
    """res2-res4 of a ResNet: one stride-16 feature map, Detectron's conv4 body."""

    def __init__(self, net: ResNet):
        super().__init__()
        self.body = IntermediateLayerGetter(net, {"layer3": "0"})
        self.out_channels = net.inplanes // 2  # res4's width: res5 (net.inplanes) doubles it

    def forward(self, x) -> OrderedDict:
        return self.body(x)


class Res5BoxHead(nn.Module):
    """res5 on each RoI (14x14 in, stride 2), average-pooled: Detectron's roi_conv5 head."""

    def __init__(self, res5: nn.Module):
        super().__init__()
        self.res5 = res5

    def forward(self, x):
        return self.res5(x).mean(dim=(2, 3))


def c4_parts(m) -> tuple[C4Backbone, nn.Module, int]:
    """(the conv4 backbone, the res5 trunk, res5's output width) of m.BACKBONE."""
    net = resnet(m.BACKBONE, m.BACKBONE_NORM, m.STRIDE_IN_1X1)
    return C4Backbone(net), net.layer4, net.inplanes
