"""Detectron's .pkl weights (issue 18): ImageNet backbones land tensor by tensor where they should, a
converted end-to-end model detects what the model it came from detects, a pickle never runs code, and
a weights URL is fetched once into the cache.

The pickles are made here from known tensors under this file's own table of Detectron's blob names and
layouts (written from Detectron's modeling code: ResNet.py, FPN.py, rpn_heads.py, fast_rcnn_heads.py,
mask_rcnn_heads.py, keypoint_rcnn_heads.py, retinanet_heads.py), never from the converter's, so a wrong
name or layout there fails here. The configs are written in Detectron's format (its keys and values),
kept small at run time: R-50 at 128 px, few proposals and detections, CPU, eval mode.
"""
from __future__ import annotations

import contextlib
import http.server
import io
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torchvision.ops.misc import FrozenBatchNorm2d

from tests.conftest import DEMO, ROOT, locked_by_another_process
from tests.servers import FileServer, serve_handler
from trainer.config import load_config
from trainer.models import build_model, load_weights

# ------------------------------------------------------------------------------ Detectron configs

_SCHEDULE = """
NUM_GPUS: 8
SOLVER:
  WEIGHT_DECAY: 0.0001
  LR_POLICY: steps_with_decay
  BASE_LR: 0.02
  GAMMA: 0.1
  MAX_ITER: 90000
  STEPS: [0, 60000, 80000]
TRAIN:
  WEIGHTS: https://dl.fbaipublicfiles.com/detectron/ImageNetPretrained/{weights}
  DATASETS: ('coco_2014_train', 'coco_2014_valminusminival')
  SCALES: (128,)
  MAX_SIZE: 160
  BATCH_SIZE_PER_IM: 512
TEST:
  DATASETS: ('coco_2014_minival',)
  SCALE: 128
  MAX_SIZE: 160
  NMS: 0.5
  RPN_PRE_NMS_TOP_N: 200
  RPN_POST_NMS_TOP_N: 50
  SCORE_THRESH: {score_thresh}
  DETECTIONS_PER_IM: 10
OUTPUT_DIR: .
"""
_R50_FPN = """
MODEL:
  TYPE: generalized_rcnn
  CONV_BODY: FPN.add_fpn_ResNet50_conv5_body
  NUM_CLASSES: {classes}
  FASTER_RCNN: True
  MASK_ON: {mask}
  KEYPOINTS_ON: {keypoints}
FPN:
  FPN_ON: True
  MULTILEVEL_ROIS: True
  MULTILEVEL_RPN: True
  USE_GN: {gn}
"""
_2MLP = """
FAST_RCNN:
  ROI_BOX_HEAD: fast_rcnn_heads.add_roi_2mlp_head
  ROI_XFORM_METHOD: RoIAlign
  ROI_XFORM_RESOLUTION: 7
  ROI_XFORM_SAMPLING_RATIO: 2
"""
_MASK_HEAD = """
MRCNN:
  ROI_MASK_HEAD: mask_rcnn_heads.mask_rcnn_fcn_head_v1up4convs{gn}
  RESOLUTION: 28
  ROI_XFORM_METHOD: RoIAlign
  ROI_XFORM_RESOLUTION: 14
  ROI_XFORM_SAMPLING_RATIO: 2
  DILATION: 1
  CONV_INIT: MSRAFill
"""
_GN = """
RESNETS:
  STRIDE_1X1: False
  TRANS_FUNC: bottleneck_gn_transformation
  STEM_FUNC: basic_gn_stem
  SHORTCUT_FUNC: basic_gn_shortcut
FAST_RCNN:
  ROI_BOX_HEAD: fast_rcnn_heads.add_roi_Xconv1fc_gn_head
  ROI_XFORM_METHOD: RoIAlign
  ROI_XFORM_RESOLUTION: 7
  ROI_XFORM_SAMPLING_RATIO: 2
"""
_KEYPOINT_HEAD = """
KRCNN:
  ROI_KEYPOINTS_HEAD: keypoint_rcnn_heads.add_roi_pose_head_v1convX
  NUM_STACKED_CONVS: 8
  NUM_KEYPOINTS: 17
  USE_DECONV_OUTPUT: True
  CONV_INIT: MSRAFill
  CONV_HEAD_DIM: 512
  UP_SCALE: 2
  HEATMAP_SIZE: 56
  ROI_XFORM_METHOD: RoIAlign
  ROI_XFORM_RESOLUTION: 14
  ROI_XFORM_SAMPLING_RATIO: 2
  KEYPOINT_CONFIDENCE: bbox
"""
_R50_C4_MASK = """
MODEL:
  TYPE: generalized_rcnn
  CONV_BODY: ResNet.add_ResNet50_conv4_body
  NUM_CLASSES: 81
  FASTER_RCNN: True
  MASK_ON: True
RPN:
  SIZES: (32, 64, 128, 256, 512)
FAST_RCNN:
  ROI_BOX_HEAD: ResNet.add_ResNet_roi_conv5_head
  ROI_XFORM_METHOD: RoIAlign
MRCNN:
  ROI_MASK_HEAD: mask_rcnn_heads.mask_rcnn_fcn_head_v0upshare
  RESOLUTION: 14
  ROI_XFORM_METHOD: RoIAlign
  ROI_XFORM_RESOLUTION: 14
  DILATION: 1
  CONV_INIT: MSRAFill
"""
_RETINANET = """
MODEL:
  TYPE: retinanet
  CONV_BODY: FPN.add_fpn_ResNet50_conv5_body
  NUM_CLASSES: 81
FPN:
  FPN_ON: True
  MULTILEVEL_RPN: True
  RPN_MAX_LEVEL: 7
  RPN_MIN_LEVEL: 3
  COARSEST_STRIDE: 128
  EXTRA_CONV_LEVELS: True
RETINANET:
  RETINANET_ON: True
  NUM_CONVS: 4
  ASPECT_RATIOS: (1.0, 2.0, 0.5)
  SCALES_PER_OCTAVE: 3
  ANCHOR_SCALE: 4
  LOSS_GAMMA: 2.0
  LOSS_ALPHA: 0.25
"""
_MSRA, _GN_WEIGHTS = "MSRA/R-50.pkl", "47261647/R-50-GN.pkl"
CONFIGS = {  # name: (model part, ImageNet weights the config names)
    "faster_fpn": (_R50_FPN.format(classes=81, mask=False, keypoints=False, gn=False) + _2MLP, _MSRA),
    "mask_fpn": (_R50_FPN.format(classes=81, mask=True, keypoints=False, gn=False) + _2MLP
                 + _MASK_HEAD.format(gn=""), _MSRA),
    "mask_c4": (_R50_C4_MASK, _MSRA),
    "keypoint_fpn": (_R50_FPN.format(classes=2, mask=False, keypoints=True, gn=False) + _2MLP + _KEYPOINT_HEAD, _MSRA),
    "retinanet": (_RETINANET, _MSRA),
    "mask_gn": (_R50_FPN.format(classes=81, mask=True, keypoints=False, gn=True) + _GN
                + _MASK_HEAD.format(gn="_gn"), _GN_WEIGHTS),
    "faster_fpn_4": (_R50_FPN.format(classes=4, mask=False, keypoints=False, gn=False) + _2MLP, _MSRA),
}


def write_config(folder: Path, name: str) -> Path:
    model, weights = CONFIGS[name]
    path = folder / f"{name}.yaml"
    path.write_text(model + _SCHEDULE.format(weights=weights, score_thresh=0.0))
    return path


def build(config: Path, num_classes: int = 81, num_keypoints: int = 0) -> nn.Module:
    torch.manual_seed(0)
    return build_model(load_config(config), num_classes, num_keypoints).eval()


# ------------------------------------------------------------------- Detectron's blob names (the table)
# A row: (blob name without _w/_b/_s, our module, kind, shape or None). Kinds: conv, conv1 (BGR input),
# fc, deconv (Caffe2's ConvTranspose weight: in, out, kH, kW, as torch's), bn (AffineChannel: _s, _b),
# gn (SpatialGN: _s, _b), retina_cls / retina_box (RetinaNet outputs, Detectron's channel layout).

R50_BLOCKS = {2: 3, 3: 4, 4: 6, 5: 3}  # res2..res5 of R-50 (ResNet.py)


def resnet_stage(stage: int, path: str, norm: str) -> list[tuple]:
    """res{stage}_{i}_branch2{a,b,c} and res{stage}_0_branch1, as Detectron's add_stage names them."""
    inner = 64 * 2 ** (stage - 2)
    out, dim_in = 4 * inner, 64 if stage == 2 else 2 * inner  # dim_in: the previous stage's output
    rows = []
    for i in range(R50_BLOCKS[stage]):
        cin = dim_in if i == 0 else out
        for branch, k, shape in (("2a", 1, (inner, cin, 1, 1)), ("2b", 2, (inner, inner, 3, 3)),
                                 ("2c", 3, (out, inner, 1, 1))):
            rows += [(f"res{stage}_{i}_branch{branch}", f"{path}.{i}.conv{k}", "conv", shape),
                     (f"res{stage}_{i}_branch{branch}_{norm}", f"{path}.{i}.bn{k}", norm, (shape[0],))]
    return rows + [(f"res{stage}_0_branch1", f"{path}.0.downsample.0", "conv", (out, dim_in, 1, 1)),
                   (f"res{stage}_0_branch1_{norm}", f"{path}.0.downsample.1", norm, (out,))]


def resnet_body(norm: str = "bn", stages=(2, 3, 4, 5)) -> list[tuple]:
    """basic_bn_stem (conv1, res_conv1_bn) or basic_gn_stem (conv1, conv1_gn), then the stages."""
    stem = "res_conv1_bn" if norm == "bn" else "conv1_gn"
    rows = [("conv1", "backbone.body.conv1", "conv1", (64, 3, 7, 7)), (stem, "backbone.body.bn1", norm, (64,))]
    for stage in stages:
        rows += resnet_stage(stage, f"backbone.body.layer{stage - 1}", norm)
    return rows


_LAST_SUM = {2: "res2_2_sum", 3: "res3_3_sum", 4: "res4_5_sum", 5: "res5_2_sum"}  # R-50's FPN inputs


def fpn(first: int, gn: bool = False) -> list[tuple]:
    """Laterals fpn_inner_<C5> and fpn_inner_<C_n>_lateral, outputs fpn_<C_n> (FPN.py), finest level first."""
    rows = []
    for j, n in enumerate(range(first, 6)):
        inner = f"fpn_inner_{_LAST_SUM[n]}" + ("" if n == 5 else "_lateral")
        for name, path in ((inner, f"backbone.fpn.inner_blocks.{j}"), (f"fpn_{_LAST_SUM[n]}", f"backbone.fpn.layer_blocks.{j}")):
            rows.append((name, f"{path}.0", "conv", None))
            if gn:
                rows.append((name + "_gn", f"{path}.1", "gn", None))
    return rows


def rpn(level: str) -> list[tuple]:
    """FPN: one head, named at P2 (_fpn2) and shared by P2-P6; C4: no suffix."""
    return [(f"conv_rpn{level}", "rpn.head.conv.0.0", "conv", None),
            (f"rpn_cls_logits{level}", "rpn.head.cls_logits", "conv", None),
            (f"rpn_bbox_pred{level}", "rpn.head.bbox_pred", "conv", None)]


def box_2mlp() -> list[tuple]:
    return [("fc6", "roi_heads.box_head.fc6", "fc", None), ("fc7", "roi_heads.box_head.fc7", "fc", None)]


def box_4conv1fc_gn() -> list[tuple]:
    """add_roi_Xconv1fc_gn_head: head_conv1..4 (ConvGN, no bias) then one fc6 (after the flatten)."""
    rows = [row for i in range(4) for row in ((f"head_conv{i + 1}", f"roi_heads.box_head.{i}.0", "conv", None),
                                              (f"head_conv{i + 1}_gn", f"roi_heads.box_head.{i}.1", "gn", None))]
    return rows + [("fc6", "roi_heads.box_head.5", "fc", None)]


def box_outputs() -> list[tuple]:
    return [("cls_score", "roi_heads.box_predictor.cls_score", "fc", None),
            ("bbox_pred", "roi_heads.box_predictor.bbox_pred", "fc", None)]


def mask_fpn(gn: bool) -> list[tuple]:
    """v1up4convs: _[mask]_fcn1..4 (with bias); the GN head: _mask_fcn1..4 + _gn (no bias)."""
    rows = []
    for i in range(1, 5):
        if gn:
            rows += [(f"_mask_fcn{i}", f"roi_heads.mask_head.{i - 1}.0", "conv", None),
                     (f"_mask_fcn{i}_gn", f"roi_heads.mask_head.{i - 1}.1", "gn", None)]
        else:
            rows.append((f"_[mask]_fcn{i}", f"roi_heads.mask_head.{i - 1}.0", "conv", None))
    return rows + mask_outputs()


def mask_outputs() -> list[tuple]:
    return [("conv5_mask", "roi_heads.mask_predictor.conv5_mask", "deconv", None),
            ("mask_fcn_logits", "roi_heads.mask_predictor.mask_fcn_logits", "conv", None)]


def keypoint_head() -> list[tuple]:
    rows = [(f"conv_fcn{i + 1}", f"roi_heads.keypoint_head.{2 * i}", "conv", None) for i in range(8)]
    return rows + [("kps_score_lowres", "roi_heads.keypoint_predictor.kps_score_lowres", "deconv", None)]


def retinanet_head() -> list[tuple]:
    """Towers named at P3 (_fpn3) and shared by P3-P7; fpn_6 on C5, fpn_7 on relu(P6)."""
    rows = [("fpn_6", "backbone.fpn.extra_blocks.p6", "conv", None), ("fpn_7", "backbone.fpn.extra_blocks.p7", "conv", None)]
    for tower, head in (("cls", "classification_head"), ("bbox", "regression_head")):
        rows += [(f"retnet_{tower}_conv_n{k}_fpn3", f"head.{head}.conv.{k}.0", "conv", None) for k in range(4)]
    return rows + [("retnet_cls_pred_fpn3", "head.classification_head.cls_logits", "retina_cls", None),
                   ("retnet_bbox_pred_fpn3", "head.regression_head.bbox_reg", "retina_box", None)]


TABLES = {
    "faster_fpn": lambda: resnet_body() + fpn(2) + rpn("_fpn2") + box_2mlp() + box_outputs(),
    "mask_fpn": lambda: resnet_body() + fpn(2) + rpn("_fpn2") + box_2mlp() + box_outputs() + mask_fpn(gn=False),
    # C4: res5 is the box head, and the mask head is that same res5 (Detectron's _[mask]_res5_* load res5_*)
    "mask_c4": lambda: (resnet_body(stages=(2, 3, 4)) + rpn("") + resnet_stage(5, "roi_heads.box_head.res5", "bn")
                        + resnet_stage(5, "roi_heads.mask_head", "bn") + box_outputs() + mask_outputs()),
    "keypoint_fpn": lambda: resnet_body() + fpn(2) + rpn("_fpn2") + box_2mlp() + box_outputs() + keypoint_head(),
    "retinanet": lambda: resnet_body() + fpn(3) + retinanet_head(),
    "mask_gn": lambda: (resnet_body("gn") + fpn(2, gn=True) + rpn("_fpn2") + box_4conv1fc_gn() + box_outputs()
                        + mask_fpn(gn=True)),
}
TABLES["faster_fpn_4"] = TABLES["faster_fpn"]

# ------------------------------------------------------------------------------ writing Detectron pickles


def covered_keys(model: nn.Module, rows: list[tuple]) -> set[str]:
    return {f"{path}.{key}" for _, path, _, _ in rows for key in model.get_submodule(path).state_dict()}


def export(model: nn.Module, rows: list[tuple], retina_anchors: tuple[int, int] = (3, 3)) -> dict[str, np.ndarray]:
    """The model's tensors as Detectron's blobs."""
    blobs = {}
    for name, path, kind, _ in rows:
        m = model.get_submodule(path)  # not named_modules(): C4's shared res5 is there once, under one name
        if kind == "bn":  # frozen BN -> AffineChannel: y = x * s + b
            scale = m.weight.double() / torch.sqrt(m.running_var.double() + m.eps)
            out = {"_s": scale, "_b": m.bias.double() - m.running_mean.double() * scale}
        elif kind == "gn":
            out = {"_s": m.weight, "_b": m.bias}
        else:
            out = {"_w": m.weight.flip(1) if kind == "conv1" else m.weight}  # conv1: Detectron's input is BGR
            if m.bias is not None:
                out["_b"] = m.bias
            if kind.startswith("retina"):
                out = {k: detectron_anchor_order(v, kind == "retina_cls", *retina_anchors) for k, v in out.items()}
        blobs.update({name + k: v.detach().float().numpy().copy() for k, v in out.items()})
    return blobs


def detectron_anchor_order(value: torch.Tensor, classes: bool, ratios: int, octaves: int) -> torch.Tensor:
    """torchvision: channel (anchor, K) with anchor = ratio * octaves + octave, K with background 0;
    Detectron: anchor = octave * ratios + ratio (retinanet_heads._create_cell_anchors), 80 classes."""
    v = value.reshape(ratios, octaves, -1, *value.shape[1:])
    if classes:
        v = v[:, :, 1:]
    return v.transpose(0, 1).reshape(-1, *value.shape[1:])


def write_pickle(path: Path, obj) -> Path:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # Detectron's save_object
    return path


class _Py2Pickler(pickle._Pickler):
    """Writes strings and bytes as Python 2's str (BINSTRING), as Detectron's Python 2 pickles hold them."""
    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj):
        data = obj if isinstance(obj, bytes) else obj.encode("latin1")
        n = len(data)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)) + data)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str
    dispatch[str] = _save_py2_str


def write_py2_pickle(path: Path, obj) -> Path:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    path.write_bytes(buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"))  # numpy 1's name
    return path


def imagenet_blobs(norm: str, seed: int = 0) -> dict[str, np.ndarray]:
    """An ImageNet R-50 as Detectron's pickle_caffe_blobs.py wrote it: zero biases added to every conv (MSRA
    BN models), the unused fc1000 classifier; plus NaN momentum blobs, which must never load."""
    rng = np.random.default_rng(seed)
    blobs = {}
    for name, _, kind, shape in resnet_body(norm):
        if kind in ("bn", "gn"):
            blobs[name + "_s"] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            blobs[name + "_b"] = rng.normal(0, 0.1, shape).astype(np.float32)
        else:
            blobs[name + "_w"] = rng.normal(0, 0.05, shape).astype(np.float32)
            if norm == "bn":
                blobs[name + "_b"] = np.zeros(shape[0], np.float32)
    blobs["fc1000_w"] = rng.normal(0, 0.01, (1000, 2048)).astype(np.float32)
    blobs["fc1000_b"] = np.zeros(1000, np.float32)
    return blobs | {f"{k}_momentum": np.full_like(v, np.nan) for k, v in blobs.items()}


def test_a_py3_pickle_and_an_upper_case_name_load_the_same_tensors(tmp_path):
    """The blobs as Detectron's Python 2 wrote them, pickled again by Python 3 (protocol 5: numpy's
    _frombuffer, C and Fortran order), and files named R-50.PKL and R-50: the very same tensors each
    time. Found by the red team of 2026-12-03: all were refused."""
    blobs = imagenet_blobs("bn")
    blobs["res2_0_branch2a_w"] = np.asfortranarray(blobs["res2_0_branch2a_w"])  # pickled in Fortran order
    files = [write_py2_pickle(tmp_path / "R-50.pkl", blobs)]
    with open(tmp_path / "py3.pkl", "wb") as f:
        pickle.dump(blobs, f, protocol=5)
    files.append(tmp_path / "py3.pkl")
    files.append(Path(shutil.copy(files[0], tmp_path / "R-50-upper.PKL")))
    files.append(Path(shutil.copy(files[0], tmp_path / "R-50")))  # no suffix: refused as pickled objects
    assert b"_frombuffer" in files[1].read_bytes()
    states = []
    for path in files:
        model = build(write_config(tmp_path, "faster_fpn"))
        report = load_weights(model, str(path))
        assert len(report.loaded) == 53 + 53 * 4, path
        states.append({k: model.state_dict()[k] for k in report.loaded})
    for state in states[1:]:
        assert state.keys() == states[0].keys() and all(torch.equal(state[k], states[0][k]) for k in state)


# ------------------------------------------------------------------------------ 1. ImageNet backbones


@pytest.mark.parametrize("norm, config", [("bn", "faster_fpn"), ("gn", "mask_gn")])
def test_imagenet_backbone_lands_tensor_by_tensor(tmp_path, norm, config):
    blobs = imagenet_blobs(norm)
    pkl = write_py2_pickle(tmp_path / "R-50.pkl", blobs)  # a plain dict of blobs, as the ImageNet files are
    model = build(write_config(tmp_path, config))
    if norm == "bn":  # MSRA's R-50: the stride in the 1x1 conv (RESNETS.STRIDE_1X1 defaults to True)
        assert model.backbone.body.layer2[0].conv1.stride == (2, 2)
        assert model.backbone.body.layer2[0].conv2.stride == (1, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = load_weights(model, str(pkl))
    state, modules = model.state_dict(), dict(model.named_modules())

    body = {k for k in state if k.startswith("backbone.body.")}
    rows = resnet_body(norm)
    assert covered_keys(model, rows) == body, "the table names every tensor of the body"
    for name, path, kind, _ in rows:
        if kind in ("conv", "conv1"):
            expected = torch.from_numpy(blobs[name + "_w"])
            assert torch.equal(state[path + ".weight"], expected.flip(1) if kind == "conv1" else expected), path
            continue
        m = modules[path]
        assert torch.equal(m.weight, torch.from_numpy(blobs[name + "_s"])), path
        assert torch.equal(m.bias, torch.from_numpy(blobs[name + "_b"])), path
        if kind == "bn":  # affine channel as a frozen BN: mean 0, and weight / sqrt(var + eps) is the scale
            assert isinstance(m, FrozenBatchNorm2d), path
            assert torch.equal(m.running_mean, torch.zeros_like(m.running_mean)), path
            scale = m.weight / torch.sqrt(m.running_var + m.eps)
            torch.testing.assert_close(scale, torch.from_numpy(blobs[name + "_s"]), rtol=1e-6, atol=0, msg=path)
        else:
            assert isinstance(m, nn.GroupNorm) and m.num_groups == 32, path
    changed = [k for k in state if k not in body and not torch.equal(state[k], before[k])]
    assert not changed, f"outside the body: {changed[:5]}"
    assert report.target == "model" and sorted(report.loaded) == sorted(body) and not report.skipped
    assert sorted(report.missing) == sorted(set(state) - body)
    assert len(report.loaded) == {"bn": 53 + 53 * 4, "gn": 53 + 53 * 2}[norm]  # 53 convs, each with its norm


# ------------------------------------------------------------------------------ 2. end-to-end models


def randomise(model: nn.Module, seed: int) -> None:
    """Every tensor random (seeded), none left at an initial 0 or 1 that a misplaced tensor could match."""
    g = torch.Generator().manual_seed(seed)

    def fill(t: torch.Tensor, low: float, high: float):
        t.copy_(torch.rand(t.shape, generator=g) * (high - low) + low)

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (FrozenBatchNorm2d, nn.GroupNorm)):
                fill(m.weight, 0.5, 1.5)
                fill(m.bias, -0.2, 0.2)
                if isinstance(m, FrozenBatchNorm2d):
                    fill(m.running_mean, -0.2, 0.2)
                    fill(m.running_var, 0.5, 2.0)
            elif isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
                fan_in = m.weight[0].numel() if not isinstance(m, nn.ConvTranspose2d) else m.weight.shape[0]
                bound = (3 / fan_in) ** 0.5 / (64 if fan_in == 3 * 7 * 7 else 1)  # conv1 sees 0-255: activations ~1
                fill(m.weight, -bound, bound)
                if m.bias is not None:
                    fill(m.bias, -0.1, 0.1)


def images(seed: int = 0) -> list[torch.Tensor]:
    """Two small RGB images (landscape, portrait): a noisy background with coloured rectangles."""
    g, out = torch.Generator().manual_seed(seed), []
    for h, w in ((112, 144), (144, 112)):
        img = 0.4 + 0.1 * torch.rand(3, h, w, generator=g)
        for _ in range(4):
            y, x = (torch.randint(0, s - 40, (1,), generator=g).item() for s in (h, w))
            img[:, y:y + 40, x:x + 32] = torch.rand(3, 1, 1, generator=g)
        out.append(img)
    return out


def detect(model: nn.Module) -> list[dict]:
    with torch.no_grad():
        return model(images())


def assert_same_detections(got: list[dict], want: list[dict]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        assert torch.equal(g["labels"], w["labels"]), f"image {i}: labels {g['labels']} != {w['labels']}"
        for key in w:
            torch.testing.assert_close(g[key], w[key], rtol=1e-4, atol=1e-4, msg=lambda m: f"image {i} {key}: {m}")


CASES = [("mask_fpn", 81, 0), ("mask_c4", 81, 0), ("keypoint_fpn", 2, 17), ("retinanet", 81, 0), ("mask_gn", 81, 0)]


@pytest.mark.parametrize("config, classes, keypoints", CASES, ids=[c[0] for c in CASES])
def test_converted_model_detects_what_its_source_detects(tmp_path, config, classes, keypoints):
    path = write_config(tmp_path, config)
    source = build(path, classes, keypoints)
    randomise(source, seed=1)
    if config == "retinanet":  # torchvision's background logit, which Detectron does not have: never fires
        _check_torchvision_anchor_order(source)
        logits = source.head.classification_head.cls_logits
        with torch.no_grad():
            logits.weight.view(9, classes, -1)[:, 0] = 0
            logits.bias.view(9, classes)[:, 0] = -30.0
    rows = TABLES[config]()
    assert covered_keys(source, rows) == set(source.state_dict()), "the table names every tensor of the model"
    blobs = export(source, rows)
    if config == "mask_c4":
        assert not any("[mask]" in k for k in blobs), "C4's mask head is the box head's res5: only res5_* are stored"
    momentum = {f"{k}_momentum": np.full_like(v, np.nan) for k, v in blobs.items() if "pred" in k or "score" in k}
    pkl = write_pickle(tmp_path / "model_final.pkl", {"blobs": blobs | momentum, "cfg": path.read_text()})
    want = detect(source)
    del source

    converted = build(path, classes, keypoints)
    report = load_weights(converted, str(pkl))
    assert not report.skipped and not report.missing, (report.skipped[:5], report.missing[:5])
    assert len(report.loaded) == len(converted.state_dict())
    got = detect(converted)
    assert sum(len(d["boxes"]) for d in want) >= 4, "the comparison needs detections"
    assert len({round(s, 4) for d in want for s in d["scores"].tolist()}) > 2
    assert_same_detections(got, want)


def _check_torchvision_anchor_order(model: nn.Module) -> None:
    """The export above assumes torchvision's cell anchors go ratio-major (octaves inside a ratio)."""
    anchors = model.anchor_generator.cell_anchors[0]
    heights, widths = anchors[:, 3] - anchors[:, 1], anchors[:, 2] - anchors[:, 0]
    ratios = (heights / widths).reshape(3, 3)
    torch.testing.assert_close(ratios, torch.tensor([1.0, 2.0, 0.5]).unsqueeze(1).expand(3, 3), rtol=0.05, atol=0)


# ------------------------------------------------------------------------------ CLI: refusals, URLs, eval


def tracktron(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def dry_run_args(config: Path, weights: str, data_dir: Path, out: Path) -> list[str]:
    args = ["train", "--dry-run", "--config", str(config), "TRAIN.WEIGHTS", weights, "DATA_DIR", str(data_dir),
            "OUTPUT_DIR", str(out), "TRACKING.ENABLED", "false", "DATA_LOADER.NUM_THREADS", "0"]
    if config != DEMO:  # a Detectron config, on the synthetic set
        args += ["TRAIN.DATASETS", "('synth_shapes_train',)", "TEST.DATASETS", "()", "MODEL.NUM_CLASSES", "-1",
                 "NUM_GPUS", "1", "TRAIN.IMS_PER_BATCH", "2"]
    return args


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line of an exit-2 refusal (the log may precede it), checked to be one line without a traceback."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip("\n").split("\n")[-1] == errors[0], result.stderr[-3000:]
    return errors[0]


class _Call:
    """Unpickling this calls fn(*args) (then sets `state` on the result): what a malicious pickle does."""

    def __init__(self, fn, *args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def _evil(case: str, marker: Path, folder: Path) -> bytes:
    touch = f"touch {marker}"
    if case == "os.system":
        obj = {"blobs": {"conv1_w": _Call(os.system, touch)}}
    elif case == "builtins.exec":
        obj = {"conv1_w": _Call(exec, f"open({str(marker)!r}, 'w').close()")}
    elif case == "numpy.load":  # a numpy function, not an array's part: loads a pickled .npy, which runs code
        npy = folder / f"{marker.name}.npy"
        np.save(npy, np.array([_Call(os.system, touch)], dtype=object), allow_pickle=True)
        obj = {"blobs": {"conv1_w": _Call(np.load, str(npy), None, True)}}
    elif case == "object-array-calling":
        obj = {"blobs": {"conv1_w": np.array([_Call(os.system, touch), 1.0], dtype=object)}}
    else:
        raise ValueError(case)
    return pickle.dumps(obj, protocol=2)


CODE_CASES = ["os.system", "builtins.exec", "numpy.load", "object-array-calling"]


def test_the_malicious_pickles_do_run_code_when_unpickled_plainly(tmp_path):
    """The control: each pickle below really runs its code under pickle.load, so its refusal means something."""
    for case in CODE_CASES:
        marker = tmp_path / f"ran-{case}"
        pickle.loads(_evil(case, marker, tmp_path))
        assert marker.exists(), case


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, data_dir):
    """Every bad .pkl given to `train --dry-run` at once (2 cores: the processes overlap their imports)."""
    tmp = tmp_path_factory.mktemp("refusals")
    detectron = write_config(tmp, "faster_fpn")
    cases = {}
    for case in CODE_CASES:
        marker = tmp / f"ran-{case}"
        cases[case] = (tmp / f"{case}.pkl", marker, DEMO)
        cases[case][0].write_bytes(_evil(case, marker, tmp))
    cases["os.system-detectron-config"] = (cases["os.system"][0], tmp / "ran-os.system", detectron)
    cases["object-array-only"] = (write_pickle(tmp / "objects.pkl", {"blobs": {"conv1_w": np.array([1, "a"], dtype=object)}}),
                                  None, DEMO)
    good = pickle.dumps({"conv1_w": np.ones((64, 3, 7, 7), np.float32)}, protocol=2)
    truncated = tmp / "truncated.pkl"
    truncated.write_bytes(good[:len(good) // 2])
    cases["truncated"] = (truncated, None, DEMO)
    corrupt = tmp / "one-byte-changed.pkl"  # the data's codec name damaged: latin1 -> latKn1
    corrupt.write_bytes(good.replace(b"latin1", b"latKn1", 1))
    cases["one-byte-changed"] = (corrupt, None, DEMO)
    # Only allowed names (numpy.dtype), but a malformed dtype state, which numpy's __setstate__ trusts
    crafted = write_pickle(tmp / "dtype-state.pkl", {"blobs": {"conv1_w": _Call(np.dtype, "f4", False, True,
                                                                                 state=(3, "<", {}, 4, 0, 8))}})
    cases["dtype-state"] = (crafted, None, DEMO)
    procs = {case: subprocess.Popen([sys.executable, "-m", "trainer",
                                     *dry_run_args(config, str(pkl), data_dir, tmp / f"out-{case}")],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case, (pkl, _, config) in cases.items()}
    results = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[case] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), cases[case][1])
    return results


NOT_WEIGHTS = "is not a Detectron weights file tracktron loads"
REFUSED = {  # case: what the one line says (any of these)
    "os.system": ["posix.system is not a numpy array part"],
    "builtins.exec": ["exec is not a numpy array part"],  # __builtin__.exec: protocol 2 writes Python 2's name
    "numpy.load": ["numpy.load is not a numpy array part"],
    "object-array-calling": ["posix.system is not a numpy array part"],
    "os.system-detectron-config": ["posix.system is not a numpy array part"],
    "object-array-only": ["holds no float arrays", NOT_WEIGHTS],
    "truncated": [NOT_WEIGHTS],
    "one-byte-changed": [NOT_WEIGHTS],
    "dtype-state": [NOT_WEIGHTS, "holds no float arrays"],
}
# "one-byte-changed" and "dtype-state" broke the first unpickler (a LookupError traceback; numpy's dtype
# __setstate__ segfaulting on a crafted state): arrays are now built by np.frombuffer, numpy never sees the file.


@pytest.mark.parametrize("case", REFUSED)
def test_a_pickle_that_is_not_plain_arrays_is_refused_in_one_line(refusals, case):
    result, marker = refusals[case]
    line = error_line(result)
    assert line.startswith("error: TRAIN.WEIGHTS ") and ".pkl" in line, line
    assert any(reason in line for reason in REFUSED[case]), line
    assert marker is None or not marker.exists(), "the pickle's code ran"


# --- weights by URL


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_weights_url_is_downloaded_once_then_read_from_the_cache(tmp_path, data_dir):
    served = tmp_path / "served"
    served.mkdir()
    stem = {k: v for k, v in imagenet_blobs("bn").items() if k.startswith(("conv1_", "res_conv1_bn_", "fc1000"))}
    pkl = write_py2_pickle(served / "R-50.pkl", stem)
    config, cache = write_config(tmp_path, "faster_fpn"), tmp_path / "cache"
    env = {"TRACKTRON_CACHE": str(cache), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    server = FileServer(served)
    try:
        url = f"{server.url}/R-50.pkl"
        first = tracktron(*dry_run_args(config, url, data_dir, tmp_path / "out"), env=env)
    finally:
        server.stop()
    assert first.returncode == 0, first.stderr[-3000:]
    assert server.requests == ["/R-50.pkl"]
    cached = list((cache / "weights").iterdir())
    assert len(cached) == 1 and cached[0].name.endswith("-R-50.pkl") and cached[0].read_bytes() == pkl.read_bytes()
    assert "loaded 5 tensors" in first.stderr  # conv1 and res_conv1_bn's weight, bias, mean, var

    again = tracktron(*dry_run_args(config, url, data_dir, tmp_path / "out"), env=env)  # the server is gone
    assert again.returncode == 0, again.stderr[-3000:]
    assert "loaded 5 tensors" in again.stderr
    cached_only = tracktron(*dry_run_args(config, url, data_dir, tmp_path / "out"),
                            env={**env, "TRACKTRON_DOWNLOAD_STALL_S": "0"})  # a download's setting: no download
    assert cached_only.returncode == 0, cached_only.stderr[-3000:]

    closed = f"http://127.0.0.1:{_closed_port()}/R-50.pkl"
    failed = tracktron(*dry_run_args(config, closed, data_dir, tmp_path / "out"), env=env)
    line = error_line(failed)
    assert closed in line and "download failed" in line and "local file" in line, line
    assert sorted(p.name for p in (cache / "weights").iterdir()) == [cached[0].name], "no partial download is left"


class _DripServer:
    """An HTTP server that announces 10 MB and sends a byte every 0.2 s, for ever."""

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(10_000_000))
                self.end_headers()
                with contextlib.suppress(OSError):
                    while True:
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.2)

            def log_message(self, *args):
                pass

        self.httpd, url = serve_handler(Handler)
        self.url = f"{url}/R-50.pkl"


def test_a_weights_url_that_drips_is_given_up_and_killed_downloads_are_cleaned(tmp_path, data_dir):
    """A byte every 0.2 s never trips the socket's timeout: the start waited for hours. Now a window
    (TRACKTRON_DOWNLOAD_STALL_S, 2 s here) with under 64 kB ends it in one line. A `.part-*` no process
    holds a lock on (a download killed by a signal) is dropped by the next download; a locked one
    (another job's, running) is left alone."""
    cache = tmp_path / "cache"
    (cache / "weights").mkdir(parents=True)
    old, running = cache / "weights" / ".part-killed", cache / "weights" / ".part-running"
    old.write_bytes(b"half")
    running.write_bytes(b"going")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    server = _DripServer()
    env = {"TRACKTRON_CACHE": str(cache), "TRACKTRON_DOWNLOAD_STALL_S": "2", "NO_PROXY": "127.0.0.1",
           "no_proxy": "127.0.0.1"}
    try:
        with locked_by_another_process(running):
            start = time.monotonic()
            result = tracktron(*dry_run_args(write_config(tmp_path, "faster_fpn"), server.url, data_dir,
                                             tmp_path / "out"), env=env)
            took = time.monotonic() - start
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
    line = error_line(result)
    assert "download failed" in line and "too slow to wait for" in line, line
    assert took < 60, took
    assert sorted(p.name for p in (cache / "weights").iterdir()) == [".part-running"]


# --- eval


def test_eval_of_a_converted_detectron_model(tmp_path, data_dir):
    """`tracktron eval --weights model_final.pkl --config <Detectron config>` on the synthetic set (3 categories)."""
    config = write_config(tmp_path, "faster_fpn_4")
    source = build(config, 4)
    randomise(source, seed=2)
    pkl = write_pickle(tmp_path / "model_final.pkl", {"blobs": export(source, TABLES["faster_fpn_4"]()),
                                                      "cfg": config.read_text()})
    out = tmp_path / "out"
    result = tracktron("eval", "--config", str(config), "--weights", str(pkl), "DATA_DIR", str(data_dir),
                       "OUTPUT_DIR", str(out), "TEST.DATASETS", "('synth_shapes_val',)", "TRACKING.ENABLED", "false",
                       "DATA_LOADER.NUM_THREADS", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| bbox |" in result.stdout, result.stdout
    detections = out / "eval" / "synth_shapes_val" / "detections.json"
    assert detections.is_file() and (detections.parent / "per_category_ap.md").is_file()


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_a_stall_window_that_is_no_positive_number_is_one_line(tmp_path, data_dir, value):
    """TRACKTRON_DOWNLOAD_STALL_S=0 failed every download at its first chunk (TLS reads bring 16 kB);
    nan turned the check off; a word failed the download with a ValueError."""
    result = tracktron(*dry_run_args(write_config(tmp_path, "faster_fpn"), "http://127.0.0.1:9/R-50.pkl", data_dir,
                                     tmp_path / "out"),
                       env={"TRACKTRON_CACHE": str(tmp_path / "cache"), "TRACKTRON_DOWNLOAD_STALL_S": value})
    assert error_line(result) == f"error: TRACKTRON_DOWNLOAD_STALL_S={value}: must be a number of seconds above 0"
    assert not (tmp_path / "cache").exists()
