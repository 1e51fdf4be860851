"""Detectron's own YAML configs, unchanged: its keys mapped onto tracktron's (docs/DETECTRON.md).

A file is Detectron's when it has a section tracktron does not (RESNETS, FPN, FAST_RCNN, ...) or
MODEL.CONV_BODY. Its values are read over Detectron's defaults (core/config.py), so a key the file
leaves out means what it meant to Detectron. Each key is mapped, ignored (no meaning on PyTorch: listed
once in a warning), or, when it would change the result in a way torchvision cannot follow, an error
naming it.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field

from trainer.config_checks import dataset_dirname
from trainer.detectron_keys import DEFAULTS, KNOWN, RENAMED, flat_list, flatten, renamed_value, short, typed
from trainer.errors import ConfigError

_OWN_SECTIONS = ("RESNETS", "FPN", "RPN", "FAST_RCNN", "MRCNN", "KRCNN", "RETINANET", "GROUP_NORM")
_BODIES = {  # MODEL.CONV_BODY -> (depth, features)
    "FPN.add_fpn_ResNet50_conv5_body": (50, "fpn"), "FPN.add_fpn_ResNet101_conv5_body": (101, "fpn"),
    "FPN.add_fpn_ResNet152_conv5_body": (152, "fpn"), "ResNet.add_ResNet50_conv4_body": (50, "c4"),
    "ResNet.add_ResNet101_conv4_body": (101, "c4"), "ResNet.add_ResNet152_conv4_body": (152, "c4"),
}
_RESNEXTS = {(50, 32, 4): "resnext50_32x4d", (101, 32, 8): "resnext101_32x8d", (101, 64, 4): "resnext101_64x4d",
             (152, 32, 8): "resnext152_32x8d"}
_BOX_HEADS = {"fast_rcnn_heads.add_roi_2mlp_head": ("2fc", ""), "head_builder.add_roi_2mlp_head": ("2fc", ""),
              "fast_rcnn_heads.add_roi_Xconv1fc_head": ("4conv1fc", ""),
              "fast_rcnn_heads.add_roi_Xconv1fc_gn_head": ("4conv1fc", "GN"),
              "ResNet.add_ResNet_roi_conv5_head": ("res5", "")}
_MASK_HEADS = {"mask_rcnn_heads.mask_rcnn_fcn_head_v1up4convs": ("fpn", ""),
               "mask_rcnn_heads.mask_rcnn_fcn_head_v1up4convs_gn": ("fpn", "GN"),
               "mask_rcnn_heads.mask_rcnn_fcn_head_v0upshare": ("c4", "")}
_GN = {"RESNETS.TRANS_FUNC": ("bottleneck_transformation", "bottleneck_gn_transformation"),
       "RESNETS.STEM_FUNC": ("basic_bn_stem", "basic_gn_stem"),
       "RESNETS.SHORTCUT_FUNC": ("basic_bn_shortcut", "basic_gn_shortcut")}


def is_detectron(data: dict) -> bool:
    model = data.get("MODEL")
    return any(s in data for s in _OWN_SECTIONS) or (isinstance(model, dict) and "CONV_BODY" in model)


@dataclass
class Translation:
    values: dict = field(default_factory=dict)  # tracktron key -> value
    sources: dict = field(default_factory=dict)  # tracktron key -> the Detectron keys it comes from
    ignored: list = field(default_factory=list)  # keys of the file with no meaning here
    renamed: list = field(default_factory=list)  # keys Detectron renamed, read under their new name
    given: dict = field(default_factory=dict)  # the file's own keys, flattened
    output_root: tuple = ("", "")  # Detectron's OUTPUT_DIR and MODEL.TYPE

    def set(self, key: str, value, *sources: str) -> None:
        self.values[key] = value
        self.sources[key] = sources

    def output_dir(self, datasets: list) -> str:
        """Where Detectron writes: OUTPUT_DIR/train/<datasets>/<model type>, of the job's final TRAIN.DATASETS."""
        root, model_type = self.output_root
        return os.path.join(root, "train", ":".join(map(dataset_dirname, datasets)) or "none", model_type)

    def lines(self) -> list[str]:
        """`DETECTRON.KEY value -> TRACKTRON.KEY value`, for the keys the file sets (or their defaults)."""
        out, given = [], self.given
        for key, value in self.values.items():
            srcs = [f"{s} {_show(given[s])}" for s in self.sources[key] if s in given]
            named = [s for s in self.sources[key] if s[:1] != "("]  # "(...)": a rule of Detectron's code
            where = ", ".join(srcs) if srcs else f"{'/'.join(named)} (Detectron's default)" if named \
                else self.sources[key][0]
            out.append(f"{where} -> {key} {_show(value)}")
        return out


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def translate(data: dict) -> Translation:
    """ConfigError for an unknown key or one that would change the result and cannot be honoured."""
    given = flatten(data)
    t = Translation(given=given)
    for old, new in RENAMED.items():
        if old in given:
            value = typed(new, renamed_value(given.pop(old), new))  # TEST.SCALES (800,) -> TEST.SCALE 800
            if new in given and typed(new, given[new]) != value:
                raise ConfigError(f"{old} (Detectron's old name of {new}) and {new} disagree: "
                                  f"{short(value)} and {short(given[new])}")
            given.setdefault(new, value)
            t.renamed.append(f"{old} (now {new})")
    for key in given:
        if key not in KNOWN and key != "DATASET_CATALOG":
            close = difflib.get_close_matches(key, KNOWN, n=1, cutoff=0.7)
            raise ConfigError(f"unknown Detectron config key {key}{f' (did you mean {close[0]}?)' if close else ''}")
    given.update({key: typed(key, value) for key, value in given.items()})
    d = _Reads({**DEFAULTS, **given})
    family = _family(d)
    _backbone(d, t, family)
    _heads(d, t, family)
    _anchors(d, t, family)
    _sampling_and_test(d, t, family)
    _solver_and_job(d, t)
    t.ignored = sorted(k for k in given if k not in d.read)
    return t


class _Reads(dict):
    """Detectron's effective config, remembering which keys the translation read."""

    def __init__(self, data: dict):
        super().__init__(data)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _family(d: dict) -> str:
    retina = d["RETINANET.RETINANET_ON"] or d["MODEL.TYPE"] == "retinanet"
    _need(d["MODEL.TYPE"] in ("generalized_rcnn", "retinanet"),
          f"Detectron MODEL.TYPE {d['MODEL.TYPE']!r} is not supported (generalized_rcnn or retinanet)")
    _need(not (d["MODEL.RPN_ONLY"] or (d["RPN.RPN_ON"] and not d["MODEL.FASTER_RCNN"] and not retina)),
          "Detectron's RPN-only models (MODEL.RPN_ONLY) are not supported: torchvision's detectors have no "
          "proposal-only mode; train the e2e_ config of the same backbone")
    _need(retina or d["MODEL.FASTER_RCNN"],
          "Fast R-CNN on precomputed proposals (TRAIN.PROPOSAL_FILES, no MODEL.FASTER_RCNN) is not supported: "
          "torchvision's R-CNN computes its own proposals; train the e2e_ config of the same model")
    _need(not (d["MODEL.MASK_ON"] and d["MODEL.KEYPOINTS_ON"]),
          "MODEL.MASK_ON and MODEL.KEYPOINTS_ON together: torchvision has no model with both heads")
    if retina:
        return "retinanet"
    return "maskrcnn" if d["MODEL.MASK_ON"] else "keypointrcnn" if d["MODEL.KEYPOINTS_ON"] else "fasterrcnn"


def _backbone(d: dict, t: Translation, family: str) -> None:
    body = d["MODEL.CONV_BODY"]
    _need(body in _BODIES, f"Detectron MODEL.CONV_BODY {body!r} is not supported; supported: {', '.join(_BODIES)}")
    depth, features = _BODIES[body]
    groups, width = d["RESNETS.NUM_GROUPS"], d["RESNETS.WIDTH_PER_GROUP"]
    name = f"resnet{depth}" if (groups, width) == (1, 64) else _RESNEXTS.get((depth, groups, width))
    _need(name is not None, f"RESNETS.NUM_GROUPS {groups} x WIDTH_PER_GROUP {width} at depth {depth} is no "
                            f"ResNeXt torchvision's ResNet class is built as here ({', '.join(_RESNEXTS.values())})")
    t.set("MODEL.TYPE", f"{family}_resnet50_fpn", "MODEL.TYPE", "MODEL.FASTER_RCNN", "MODEL.MASK_ON",
          "MODEL.KEYPOINTS_ON", "RETINANET.RETINANET_ON")
    t.set("MODEL.BACKBONE", name, "MODEL.CONV_BODY", "RESNETS.NUM_GROUPS", "RESNETS.WIDTH_PER_GROUP")
    t.set("MODEL.FEATURES", features, "MODEL.CONV_BODY")
    t.set("MODEL.STRIDE_IN_1X1", bool(d["RESNETS.STRIDE_1X1"]), "RESNETS.STRIDE_1X1")
    gn = {k: _choice(d, k, pair) for k, pair in _GN.items()}
    _need(len(set(gn.values())) == 1, "RESNETS.TRANS_FUNC, STEM_FUNC and SHORTCUT_FUNC must all be GN or all BN "
                                      f"here, got {', '.join(f'{k} {d[k]}' for k in gn)}")
    t.set("MODEL.BACKBONE_NORM", "GN" if gn["RESNETS.TRANS_FUNC"] else "", *_GN)
    _need(d["RESNETS.RES5_DILATION"] == 1, f"RESNETS.RES5_DILATION {d['RESNETS.RES5_DILATION']} is not supported (1)")
    # Detectron's FREEZE_CONV_BODY stops the gradient at the conv body's output, which for an FPN body
    # is the FPN's: torchvision's trainable layers would freeze the ResNet and leave the FPN training.
    _need(not (d["TRAIN.FREEZE_CONV_BODY"] and features == "fpn"), "TRAIN.FREEZE_CONV_BODY True is not supported "
          "with an FPN body (Detectron froze the FPN with the ResNet; here only the ResNet would be)")
    frozen = 5 if d["TRAIN.FREEZE_CONV_BODY"] else d["TRAIN.FREEZE_AT"]
    _need(0 <= frozen <= 5, f"TRAIN.FREEZE_AT must be 0 to 5, got {frozen}")
    t.set("MODEL.TRAINABLE_BACKBONE_LAYERS", 5 - frozen, "TRAIN.FREEZE_AT", "TRAIN.FREEZE_CONV_BODY")
    if features == "fpn":
        t.set("MODEL.FPN_CHANNELS", d["FPN.DIM"], "FPN.DIM")
        t.set("MODEL.FPN_NORM", "GN" if d["FPN.USE_GN"] else "", "FPN.USE_GN")
    _need((d["GROUP_NORM.NUM_GROUPS"], d["GROUP_NORM.DIM_PER_GP"], d["GROUP_NORM.EPSILON"]) == (32, -1, 1e-5),
          "GROUP_NORM other than 32 groups, eps 1e-5 is not supported")


def _choice(d: dict, key: str, pair: tuple) -> bool:
    _need(d[key] in pair, f"{key} {d[key]!r} is not supported ({' or '.join(pair)})")
    return d[key] == pair[1]


def _heads(d: dict, t: Translation, family: str) -> None:
    features = t.values["MODEL.FEATURES"]
    _need((d["MODEL.CLS_AGNOSTIC_BBOX_REG"], list(d["MODEL.BBOX_REG_WEIGHTS"])) == (False, [10.0, 10.0, 5.0, 5.0]),
          "MODEL.CLS_AGNOSTIC_BBOX_REG and BBOX_REG_WEIGHTS must keep Detectron's defaults (torchvision's)")
    if family == "retinanet":
        return _retinanet(d, t)
    head, norm = _BOX_HEADS.get(d["FAST_RCNN.ROI_BOX_HEAD"], (None, ""))
    _need(head is not None, f"FAST_RCNN.ROI_BOX_HEAD {d['FAST_RCNN.ROI_BOX_HEAD']!r} is not supported; "
                            f"supported: {', '.join(_BOX_HEADS)}")
    _need((head == "res5") == (features == "c4"), "ResNet.add_ResNet_roi_conv5_head goes with a conv4 body "
                                                  "(ResNet.add_ResNet50_conv4_body), and only there")
    _roi(d, t, "FAST_RCNN", "MODEL.BOX_POOL_SIZE")
    if head != "res5":
        t.set("MODEL.BOX_HEAD", head, "FAST_RCNN.ROI_BOX_HEAD")
        t.set("MODEL.REPRESENTATION_SIZE", d["FAST_RCNN.MLP_HEAD_DIM"], "FAST_RCNN.MLP_HEAD_DIM")
        if head == "4conv1fc":
            _need(d["FAST_RCNN.CONV_HEAD_DIM"] == d["FPN.DIM"] and d["FAST_RCNN.NUM_STACKED_CONVS"] == 4,
                  "FAST_RCNN.CONV_HEAD_DIM must equal FPN.DIM and NUM_STACKED_CONVS be 4")
    if family == "maskrcnn":
        mask, mask_norm = _MASK_HEADS.get(d["MRCNN.ROI_MASK_HEAD"], (None, ""))
        _need(mask == features, f"MRCNN.ROI_MASK_HEAD {d['MRCNN.ROI_MASK_HEAD']!r} is not supported with "
                                f"{d['MODEL.CONV_BODY']}; supported: {', '.join(_MASK_HEADS)}")
        _need(head != "4conv1fc" or norm == mask_norm, "the box and mask heads must both use GN, or neither")
        norm = norm or mask_norm
        _roi(d, t, "MRCNN", "MODEL.MASK_POOL_SIZE")
        up = 2 if features == "fpn" else 1  # FPN: one 2x deconvolution; C4: res5 halves, the deconvolution doubles
        _need(d["MRCNN.RESOLUTION"] == up * d["MRCNN.ROI_XFORM_RESOLUTION"],
              f"MRCNN.RESOLUTION must be {up} x MRCNN.ROI_XFORM_RESOLUTION with this head")
        _need(d["MRCNN.DIM_REDUCED"] == (d["FPN.DIM"] if features == "fpn" else 256),
              "MRCNN.DIM_REDUCED must equal FPN.DIM (C4: 256)")
        _need(features == "c4" or d["MRCNN.DILATION"] == 1, "MRCNN.DILATION must be 1 for the FPN mask head")
        _need(d["MRCNN.UPSAMPLE_RATIO"] == 1 and not d["MRCNN.USE_FC_OUTPUT"],
              "MRCNN.UPSAMPLE_RATIO other than 1 and MRCNN.USE_FC_OUTPUT are not supported")
        t.set("MODEL.CLS_AGNOSTIC_MASK", not d["MRCNN.CLS_SPECIFIC_MASK"], "MRCNN.CLS_SPECIFIC_MASK")
    if family == "keypointrcnn":
        head_name = "keypoint_rcnn_heads.add_roi_pose_head_v1convX"
        _need(d["KRCNN.ROI_KEYPOINTS_HEAD"] == head_name, f"KRCNN.ROI_KEYPOINTS_HEAD {d['KRCNN.ROI_KEYPOINTS_HEAD']!r} "
                                                          f"is not supported ({head_name})")
        d["KRCNN.NUM_KEYPOINTS"]  # read, not mapped: the dataset's keypoints decide, as they must agree
        _roi(d, t, "KRCNN", "MODEL.KEYPOINT_POOL_SIZE")
        _fixed(d, "KRCNN", "torchvision's keypoint head is fixed", {
            "CONV_HEAD_DIM": 2 * d["FPN.DIM"], "NUM_STACKED_CONVS": 8, "UP_SCALE": 2, "USE_DECONV": False,
            "USE_DECONV_OUTPUT": True, "HEATMAP_SIZE": 4 * d["KRCNN.ROI_XFORM_RESOLUTION"], "NMS_OKS": False})
    t.set("MODEL.HEAD_NORM", norm, "FAST_RCNN.ROI_BOX_HEAD", "MRCNN.ROI_MASK_HEAD")


def _roi(d: dict, t: Translation, section: str, key: str) -> None:
    method = d[f"{section}.ROI_XFORM_METHOD"]
    _need(method == "RoIAlign", f"{section}.ROI_XFORM_METHOD {method} is not supported (RoIAlign; "
                                "torchvision's heads pool with RoIAlign)")
    t.set(key, d[f"{section}.ROI_XFORM_RESOLUTION"], f"{section}.ROI_XFORM_RESOLUTION")
    ratio = d[f"{section}.ROI_XFORM_SAMPLING_RATIO"]
    if "MODEL.POOL_SAMPLING_RATIO" in t.values:
        _need(t.values["MODEL.POOL_SAMPLING_RATIO"] == ratio, "the box, mask and keypoint heads must use one "
                                                              "ROI_XFORM_SAMPLING_RATIO here")
    t.set("MODEL.POOL_SAMPLING_RATIO", ratio, "FAST_RCNN.ROI_XFORM_SAMPLING_RATIO",
          "MRCNN.ROI_XFORM_SAMPLING_RATIO", "KRCNN.ROI_XFORM_SAMPLING_RATIO")


def _fixed(d: dict, section: str, what: str, want: dict) -> None:
    """Keys of `section` whose values torchvision's code fixes: each must hold the value in `want`."""
    wrong = [f"{section}.{k} {d[f'{section}.{k}']} (here {v})" for k, v in want.items() if d[f"{section}.{k}"] != v]
    _need(not wrong, f"{what}: {', '.join(wrong)}")


def _retinanet(d: dict, t: Translation) -> None:
    _fixed(d, "RETINANET", "torchvision's RetinaNet head and loss are fixed", {
        "NUM_CONVS": 4, "SCALES_PER_OCTAVE": 3, "LOSS_ALPHA": 0.25, "LOSS_GAMMA": 2.0, "PRIOR_PROB": 0.01,
        "SHARE_CLS_BBOX_TOWER": False, "CLASS_SPECIFIC_BBOX": False, "SOFTMAX": False, "BBOX_REG_WEIGHT": 1.0})
    _need(t.values["MODEL.FEATURES"] == "fpn", "RetinaNet needs an FPN body")
    t.set("MODEL.P6_FROM_C5", bool(d["FPN.EXTRA_CONV_LEVELS"]), "FPN.EXTRA_CONV_LEVELS")
    t.set("MODEL.FG_IOU", d["RETINANET.POSITIVE_OVERLAP"], "RETINANET.POSITIVE_OVERLAP")
    t.set("MODEL.BG_IOU", d["RETINANET.NEGATIVE_OVERLAP"], "RETINANET.NEGATIVE_OVERLAP")
    t.set("MODEL.SCORE_THRESH", d["RETINANET.INFERENCE_TH"], "RETINANET.INFERENCE_TH")
    t.set("MODEL.TOPK_CANDIDATES", d["RETINANET.PRE_NMS_TOP_N"], "RETINANET.PRE_NMS_TOP_N")


def _anchors(d: dict, t: Translation, family: str) -> None:
    if t.values["MODEL.FEATURES"] == "c4":
        _need(d["RPN.STRIDE"] == 16, f"RPN.STRIDE {d['RPN.STRIDE']} is not supported (16, res4's stride)")
        t.set("MODEL.ANCHOR_SIZES", [int(s) for s in d["RPN.SIZES"]], "RPN.SIZES")
        t.set("MODEL.ANCHOR_RATIOS", [float(r) for r in d["RPN.ASPECT_RATIOS"]], "RPN.ASPECT_RATIOS")
        return
    low, high = d["FPN.RPN_MIN_LEVEL"], d["FPN.RPN_MAX_LEVEL"]
    levels = (3, 7) if family == "retinanet" else (2, 6)
    _need((low, high) == levels, f"FPN.RPN_MIN_LEVEL/RPN_MAX_LEVEL {low}/{high} are not supported for this model "
                                 f"({levels[0]}/{levels[1]}, torchvision's pyramid)")
    _need((d["FPN.ROI_MIN_LEVEL"], d["FPN.ROI_MAX_LEVEL"], d["FPN.ROI_CANONICAL_SCALE"], d["FPN.ROI_CANONICAL_LEVEL"])
          == (2, 5, 224, 4), "FPN.ROI_MIN_LEVEL/ROI_MAX_LEVEL/ROI_CANONICAL_SCALE/LEVEL must keep 2/5/224/4")
    if family == "retinanet":
        scale = d["RETINANET.ANCHOR_SCALE"]
        t.set("MODEL.ANCHOR_SIZES", [int(scale * 2 ** lvl) for lvl in range(low, high + 1)], "RETINANET.ANCHOR_SCALE")
        t.set("MODEL.ANCHOR_RATIOS", [float(r) for r in d["RETINANET.ASPECT_RATIOS"]], "RETINANET.ASPECT_RATIOS")
        return
    start = d["FPN.RPN_ANCHOR_START_SIZE"]
    t.set("MODEL.ANCHOR_SIZES", [int(start * 2 ** i) for i in range(high - low + 1)], "FPN.RPN_ANCHOR_START_SIZE")
    t.set("MODEL.ANCHOR_RATIOS", [float(r) for r in d["FPN.RPN_ASPECT_RATIOS"]], "FPN.RPN_ASPECT_RATIOS")


_SAME = {  # tracktron key: Detectron key, read as it is
    "TRAIN.SCALES": "TRAIN.SCALES", "TRAIN.MAX_SIZE": "TRAIN.MAX_SIZE", "TRAIN.IMS_PER_BATCH": "TRAIN.IMS_PER_BATCH",
    "TRAIN.USE_FLIPPED": "TRAIN.USE_FLIPPED", "TRAIN.ASPECT_GROUPING": "TRAIN.ASPECT_GROUPING",
    "TRAIN.SNAPSHOT_ITERS": "TRAIN.SNAPSHOT_ITERS", "TRAIN.AUTO_RESUME": "TRAIN.AUTO_RESUME",
    "TEST.SCALE": "TEST.SCALE", "TEST.MAX_SIZE": "TEST.MAX_SIZE", "MODEL.NUM_CLASSES": "MODEL.NUM_CLASSES",
    "MODEL.DETECTIONS_PER_IMAGE": "TEST.DETECTIONS_PER_IM", "NUM_GPUS": "NUM_GPUS", "RNG_SEED": "RNG_SEED",
}
_RCNN = {
    "MODEL.RPN_PRE_NMS_TOP_N_TRAIN": "TRAIN.RPN_PRE_NMS_TOP_N", "MODEL.RPN_POST_NMS_TOP_N_TRAIN":
    "TRAIN.RPN_POST_NMS_TOP_N", "MODEL.RPN_PRE_NMS_TOP_N_TEST": "TEST.RPN_PRE_NMS_TOP_N",
    "MODEL.RPN_POST_NMS_TOP_N_TEST": "TEST.RPN_POST_NMS_TOP_N", "MODEL.RPN_BATCH_SIZE_PER_IMAGE":
    "TRAIN.RPN_BATCH_SIZE_PER_IM", "MODEL.ROI_BATCH_SIZE_PER_IMAGE": "TRAIN.BATCH_SIZE_PER_IM",
    "MODEL.RPN_NMS_THRESH": "TRAIN.RPN_NMS_THRESH", "MODEL.RPN_FG_IOU": "TRAIN.RPN_POSITIVE_OVERLAP",
    "MODEL.RPN_BG_IOU": "TRAIN.RPN_NEGATIVE_OVERLAP", "MODEL.RPN_POSITIVE_FRACTION": "TRAIN.RPN_FG_FRACTION",
    "MODEL.POSITIVE_FRACTION": "TRAIN.FG_FRACTION", "MODEL.FG_IOU": "TRAIN.FG_THRESH",
    "MODEL.BG_IOU": "TRAIN.BG_THRESH_HI", "MODEL.SCORE_THRESH": "TEST.SCORE_THRESH",
}


def _ious(d: dict, family: str) -> None:
    """torchvision's matchers need background below foreground: said with Detectron's names."""
    pairs = [("RETINANET.NEGATIVE_OVERLAP", "RETINANET.POSITIVE_OVERLAP")] if family == "retinanet" else [
        ("TRAIN.RPN_NEGATIVE_OVERLAP", "TRAIN.RPN_POSITIVE_OVERLAP"), ("TRAIN.BG_THRESH_HI", "TRAIN.FG_THRESH")]
    for low, high in pairs:
        _need(d[low] <= d[high], f"{low} {d[low]} must not exceed {high} {d[high]}")


def _sampling_and_test(d: dict, t: Translation, family: str) -> None:
    _ious(d, family)
    for ours, theirs in _SAME.items():
        t.set(ours, d[theirs], theirs)
    t.set("MODEL.NMS_THRESH", d["TEST.NMS"], "TEST.NMS")
    if family != "retinanet":
        for ours, theirs in _RCNN.items():
            t.set(ours, d[theirs], theirs)
        _need(d["TEST.RPN_NMS_THRESH"] == d["TRAIN.RPN_NMS_THRESH"],
              "TEST.RPN_NMS_THRESH must equal TRAIN.RPN_NMS_THRESH (torchvision's RPN has one)")
        _need(d["TRAIN.BG_THRESH_LO"] == 0, "TRAIN.BG_THRESH_LO must be 0 (torchvision samples every background)")
    for key in ("TRAIN.PROPOSAL_FILES", "TEST.PROPOSAL_FILES"):
        _need(not d[key], f"{key}: precomputed proposals are not supported (torchvision's models compute their own)")
    # Test-time augmentation, soft NMS and box voting change evaluation only, not what is trained: their
    # keys are left unread, so the warning lists them as not applied.
    _need(d["TEST.BBOX_REG"], "TEST.BBOX_REG False is not supported (torchvision always applies box regression)")
    t.set("TRAIN.DATASETS", list(d["TRAIN.DATASETS"]), "TRAIN.DATASETS")
    t.set("TEST.DATASETS", list(d["TEST.DATASETS"]), "TEST.DATASETS")


def _solver_and_job(d: dict, t: Translation) -> None:
    for key in ("BASE_LR", "LR_POLICY", "GAMMA", "STEP_SIZE", "STEPS", "LRS", "MAX_ITER", "MOMENTUM", "WEIGHT_DECAY",
                "WARM_UP_ITERS", "WARM_UP_FACTOR", "WARM_UP_METHOD"):
        t.set(f"SOLVER.{key}", d[f"SOLVER.{key}"], f"SOLVER.{key}")
    # Detectron's optimizer: biases at twice the LR and without decay, GroupNorm with WEIGHT_DECAY_GN.
    _need(d["SOLVER.WEIGHT_DECAY_GN"] == 0, f"SOLVER.WEIGHT_DECAY_GN {d['SOLVER.WEIGHT_DECAY_GN']} is not supported "
                                            "(0: norm layers without weight decay)")
    t.set("SOLVER.NO_DECAY_NORM_AND_BIAS", True, "SOLVER.WEIGHT_DECAY_GN")
    t.set("SOLVER.BIAS_LR_FACTOR", 2.0, "(Detectron's optimizer: biases at 2x the LR, without decay)")
    means = [float(v) for v in flat_list(d["PIXEL_MEANS"])]
    _need(len(means) == 3, f"PIXEL_MEANS must hold three values (B, G, R), got {d['PIXEL_MEANS']}")
    t.set("MODEL.PIXEL_MEAN", means[::-1], "PIXEL_MEANS")  # Detectron's BGR, our RGB (conv1 is permuted to match)
    t.set("MODEL.PIXEL_STD", [1.0, 1.0, 1.0], "PIXEL_MEANS")  # Detectron does not divide by a std
    t.set("TRAIN.WEIGHTS", d["TRAIN.WEIGHTS"], "TRAIN.WEIGHTS")
    t.output_root = (d["OUTPUT_DIR"], d["MODEL.TYPE"])  # an OUTPUT_DIR override replaces it all
    t.set("OUTPUT_DIR", t.output_dir(d["TRAIN.DATASETS"]), "OUTPUT_DIR")
    t.set("DATA_LOADER.NUM_THREADS", d["DATA_LOADER.NUM_THREADS"], "DATA_LOADER.NUM_THREADS")
    if "DATASET_CATALOG" in d:
        t.set("DATASET_CATALOG", d["DATASET_CATALOG"], "DATASET_CATALOG")
    _need(math.isfinite(float(d["SOLVER.BASE_LR"])), "SOLVER.BASE_LR must be a finite number")
