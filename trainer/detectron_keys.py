"""Detectron's config keys and their defaults (its core/config.py), as facts for config_detectron.py
(a key a Detectron file leaves out means its default there too), and a file's values read as the
types of those defaults, the way Detectron reads them."""
from __future__ import annotations

import math

from trainer.config_yaml import Bool, literal, plain
from trainer.errors import ConfigError

# Detectron's defaults as its core/config.py sets them, section by section.
_SECTIONS = dict(
    TRAIN=dict(WEIGHTS="", DATASETS=[], SCALES=[600], MAX_SIZE=1000, IMS_PER_BATCH=2, BATCH_SIZE_PER_IM=64, FG_FRACTION=0.25,
        FG_THRESH=0.5, BG_THRESH_HI=0.5, BG_THRESH_LO=0.0, USE_FLIPPED=True, BBOX_THRESH=0.5, SNAPSHOT_ITERS=20000,
        PROPOSAL_FILES=[], ASPECT_GROUPING=True, GENERATE_PROPOSALS_ON_GPU=False, RPN_POSITIVE_OVERLAP=0.7,
        RPN_NEGATIVE_OVERLAP=0.3, RPN_FG_FRACTION=0.5, RPN_BATCH_SIZE_PER_IM=256, RPN_NMS_THRESH=0.7, RPN_PRE_NMS_TOP_N=12000,
        RPN_POST_NMS_TOP_N=2000, RPN_STRADDLE_THRESH=0, RPN_MIN_SIZE=0, CROWD_FILTER_THRESH=0.7, GT_MIN_AREA=-1,
        FREEZE_CONV_BODY=False, AUTO_RESUME=True, COPY_WEIGHTS=False, FREEZE_AT=2),
    DATA_LOADER=dict(NUM_THREADS=4, MINIBATCH_QUEUE_SIZE=64, BLOBS_QUEUE_CAPACITY=8),
    TEST=dict(WEIGHTS="", DATASETS=[], SCALE=600, MAX_SIZE=1000, NMS=0.3, BBOX_REG=True, PROPOSAL_FILES=[],
        GENERATE_PROPOSALS_ON_GPU=False, PROPOSAL_LIMIT=2000, RPN_NMS_THRESH=0.7, RPN_PRE_NMS_TOP_N=12000,
        RPN_POST_NMS_TOP_N=2000, RPN_MIN_SIZE=0, DETECTIONS_PER_IM=100, SCORE_THRESH=0.05, COMPETITION_MODE=True,
        FORCE_JSON_DATASET_EVAL=False, PRECOMPUTED_PROPOSALS=True,
        BBOX_AUG=dict(ENABLED=False, SCORE_HEUR="UNION", COORD_HEUR="UNION", H_FLIP=False, SCALES=[], MAX_SIZE=4000,
            SCALE_H_FLIP=False, SCALE_SIZE_DEP=False, AREA_TH_LO=2500, AREA_TH_HI=32400, ASPECT_RATIOS=[],
            ASPECT_RATIO_H_FLIP=False),
        MASK_AUG=dict(ENABLED=False, HEUR="SOFT_AVG", H_FLIP=False, SCALES=[], MAX_SIZE=4000, SCALE_H_FLIP=False,
            SCALE_SIZE_DEP=False, AREA_TH=32400, ASPECT_RATIOS=[], ASPECT_RATIO_H_FLIP=False),
        KPS_AUG=dict(ENABLED=False, HEUR="HM_AVG", H_FLIP=False, SCALES=[], MAX_SIZE=4000, SCALE_H_FLIP=False,
            SCALE_SIZE_DEP=False, AREA_TH=32400, ASPECT_RATIOS=[], ASPECT_RATIO_H_FLIP=False),
        SOFT_NMS=dict(ENABLED=False, METHOD="linear", SIGMA=0.5),
        BBOX_VOTE=dict(ENABLED=False, VOTE_TH=0.8, SCORING_METHOD="ID", SCORING_METHOD_BETA=1.0)),
    MODEL=dict(TYPE="", CONV_BODY="", NUM_CLASSES=-1, CLS_AGNOSTIC_BBOX_REG=False, BBOX_REG_WEIGHTS=[10.0, 10.0, 5.0, 5.0],
        FASTER_RCNN=False, MASK_ON=False, KEYPOINTS_ON=False, RPN_ONLY=False, EXECUTION_TYPE="dag"),
    RETINANET=dict(RETINANET_ON=False, ASPECT_RATIOS=[0.5, 1.0, 2.0], SCALES_PER_OCTAVE=3, ANCHOR_SCALE=4, NUM_CONVS=4,
        BBOX_REG_WEIGHT=1.0, BBOX_REG_BETA=0.11, PRE_NMS_TOP_N=1000, POSITIVE_OVERLAP=0.5, NEGATIVE_OVERLAP=0.4,
        LOSS_ALPHA=0.25, LOSS_GAMMA=2.0, PRIOR_PROB=0.01, SHARE_CLS_BBOX_TOWER=False, CLASS_SPECIFIC_BBOX=False,
        SOFTMAX=False, INFERENCE_TH=0.05),
    SOLVER=dict(BASE_LR=0.001, LR_POLICY="step", GAMMA=0.1, STEP_SIZE=30000, STEPS=[], LRS=[], MAX_ITER=40000, MOMENTUM=0.9,
        WEIGHT_DECAY=0.0005, WEIGHT_DECAY_GN=0.0, WARM_UP_ITERS=500, WARM_UP_FACTOR=1.0 / 3.0, WARM_UP_METHOD="linear",
        SCALE_MOMENTUM=True, SCALE_MOMENTUM_THRESHOLD=1.1, LOG_LR_CHANGE_THRESHOLD=1.1),
    FAST_RCNN=dict(ROI_BOX_HEAD="", MLP_HEAD_DIM=1024, CONV_HEAD_DIM=256, NUM_STACKED_CONVS=4, ROI_XFORM_METHOD="RoIPoolF",
        ROI_XFORM_SAMPLING_RATIO=0, ROI_XFORM_RESOLUTION=14),
    RPN=dict(RPN_ON=False, SIZES=[64, 128, 256, 512], STRIDE=16, ASPECT_RATIOS=[0.5, 1, 2]),
    FPN=dict(FPN_ON=False, DIM=256, ZERO_INIT_LATERAL=False, COARSEST_STRIDE=32, MULTILEVEL_ROIS=False,
        ROI_CANONICAL_SCALE=224, ROI_CANONICAL_LEVEL=4, ROI_MAX_LEVEL=5, ROI_MIN_LEVEL=2, MULTILEVEL_RPN=False,
        RPN_MAX_LEVEL=6, RPN_MIN_LEVEL=2, RPN_ASPECT_RATIOS=[0.5, 1, 2], RPN_ANCHOR_START_SIZE=32, EXTRA_CONV_LEVELS=False,
        USE_GN=False),
    MRCNN=dict(ROI_MASK_HEAD="", RESOLUTION=14, ROI_XFORM_METHOD="RoIAlign", ROI_XFORM_RESOLUTION=7,
        ROI_XFORM_SAMPLING_RATIO=0, DIM_REDUCED=256, DILATION=2, UPSAMPLE_RATIO=1, USE_FC_OUTPUT=False,
        CONV_INIT="GaussianFill", CLS_SPECIFIC_MASK=True, WEIGHT_LOSS_MASK=1.0, THRESH_BINARIZE=0.5),
    KRCNN=dict(ROI_KEYPOINTS_HEAD="", HEATMAP_SIZE=-1, UP_SCALE=-1, USE_DECONV=False, DECONV_DIM=256, USE_DECONV_OUTPUT=False,
        DILATION=1, DECONV_KERNEL=4, NUM_KEYPOINTS=-1, NUM_STACKED_CONVS=8, CONV_HEAD_DIM=256, CONV_HEAD_KERNEL=3,
        CONV_INIT="GaussianFill", NMS_OKS=False, KEYPOINT_CONFIDENCE="bbox", ROI_XFORM_METHOD="RoIAlign",
        ROI_XFORM_RESOLUTION=7, ROI_XFORM_SAMPLING_RATIO=0, MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH=20, INFERENCE_MIN_SIZE=0,
        LOSS_WEIGHT=1.0, NORMALIZE_BY_VISIBLE_KEYPOINTS=True),
    RFCN=dict(PS_GRID_SIZE=3),
    RESNETS=dict(NUM_GROUPS=1, WIDTH_PER_GROUP=64, STRIDE_1X1=True, TRANS_FUNC="bottleneck_transformation",
        STEM_FUNC="basic_bn_stem", SHORTCUT_FUNC="basic_bn_shortcut", RES5_DILATION=1),
    GROUP_NORM=dict(DIM_PER_GP=-1, NUM_GROUPS=32, EPSILON=1e-05),
    CLUSTER=dict(ON_CLUSTER=False),
    NUM_GPUS=1, USE_NCCL=False, DEDUP_BOXES=0.0625, BBOX_XFORM_CLIP=math.log(1000.0 / 16.0),
    PIXEL_MEANS=[102.9801, 115.9465, 122.7717], RNG_SEED=3, EPS=1e-14, ROOT_DIR="", OUTPUT_DIR="/tmp", MATLAB="matlab",
    MEMONGER=True, MEMONGER_SHARE_ACTIVATIONS=False, VIS=False, VIS_TH=0.9, EXPECTED_RESULTS=[], EXPECTED_RESULTS_RTOL=0.1,
    EXPECTED_RESULTS_ATOL=0.005, EXPECTED_RESULTS_SIGMA_TOL=4, EXPECTED_RESULTS_EMAIL="",
    DOWNLOAD_CACHE="/tmp/detectron-download-cache")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


DEFAULTS = _flat(_SECTIONS)

# Keys Detectron itself skips with a warning (config.py's deprecated keys).
DEPRECATED = ("FINAL_MSG", "MODEL.DILATION", "ROOT_GPU_ID", "RPN.ON", "TRAIN.BBOX_NORMALIZE_TARGETS_PRECOMPUTED",
              "TRAIN.DROPOUT", "USE_GPU_NMS", "TEST.NUM_TEST_IMAGES")
# Keys Detectron renamed (it stops on the old name; here the value is read under the new one, with a warning).
RENAMED = {"MODEL.PS_GRID_SIZE": "RFCN.PS_GRID_SIZE", "MODEL.ROI_HEAD": "FAST_RCNN.ROI_BOX_HEAD",
           "MRCNN.MASK_HEAD_NAME": "MRCNN.ROI_MASK_HEAD", "TRAIN.DATASET": "TRAIN.DATASETS",
           "TRAIN.PROPOSAL_FILE": "TRAIN.PROPOSAL_FILES", "TEST.SCALES": "TEST.SCALE", "TEST.DATASET": "TEST.DATASETS",
           "TEST.PROPOSAL_FILE": "TEST.PROPOSAL_FILES"}
KNOWN = sorted({*DEFAULTS, *DEPRECATED})


def flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if key == "DATASET_CATALOG":  # tracktron's own mapping: the user's names, kept whole
            out[key] = plain(v)
        elif isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif any(known.startswith(f"{key}.") for known in KNOWN):  # a section that is not a mapping
            if v is not None:  # an empty section is no section
                raise ConfigError(f"{key} must be a mapping of Detectron keys, got {short(plain(v))}")
        else:
            out[key] = plain(v)
    return out


# Element types of list keys whose default is empty (the others take their default's).
_ITEMS = {"TRAIN.DATASETS": str, "TEST.DATASETS": str, "TRAIN.PROPOSAL_FILES": str, "TEST.PROPOSAL_FILES": str,
          "SOLVER.STEPS": int, "SOLVER.LRS": float}


def typed(key: str, value):
    """A value of the file as the type of Detectron's default, as Detectron reads it (strings go through
    literal_eval; tuples and lists are one type); ConfigError naming the key otherwise."""
    default = DEFAULTS.get(key)
    if isinstance(value, str) and not isinstance(default, str):
        parsed = literal(value.strip())
        value = parsed if not isinstance(parsed, str) or isinstance(default, list) else value
    if isinstance(value, tuple):
        value = list(value)
    if default is None or key == "DATASET_CATALOG":  # a deprecated key: never read
        return value
    if isinstance(default, list):
        if isinstance(value, str) and _ITEMS.get(key) is str:
            value = [value]  # TRAIN.DATASETS: coco_2014_train, as old configs write TRAIN.DATASET
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a tuple such as {_example(key, default)}, got {short(value)}")
        if key == "PIXEL_MEANS":
            value = flat_list(value)
        item = _ITEMS.get(key) or (type(default[0]) if default else str)
        return [_scalar(f"{key}[{i}]", v, item()) for i, v in enumerate(value)]
    return _scalar(key, value, default)


_LARGEST = 2**53  # config.MAX_INT: the largest integer a config takes exactly


def _scalar(key: str, value, default):
    if isinstance(default, bool):
        value = value.truth if isinstance(value, Bool) else value
        ok = isinstance(value, bool)
    elif isinstance(default, (int, float)):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _LARGEST:  # float() overflows
            raise ConfigError(f"{key} is out of range: {short(value)}")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            isinstance(default, float) or float(value).is_integer()) and math.isfinite(value)
        value = type(default)(value) if ok else value
    else:
        ok, value = isinstance(value, (str, int, float)) and not isinstance(value, bool), str(value)
    if not ok:
        raise ConfigError(f"{key} must be {type(default).__name__}, like Detectron's default {short(default)}; "
                          f"got {short(value)}")
    return value


def _example(key: str, default: list) -> str:
    return {str: "('a', 'b')", int: "(1, 2)", float: "(0.5, 1.0)"}[_ITEMS.get(key) or type(default[0])] if (
        default or key in _ITEMS) else "(...)"


def short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def renamed_value(value, new: str):
    """A renamed key's value for its new name: TEST.SCALES (800,) is TEST.SCALE 800."""
    if isinstance(value, str) and value.strip()[:1] == "(":
        value = literal(value.strip())
    if isinstance(value, (list, tuple)) and len(value) == 1 and not isinstance(DEFAULTS[new], list):
        return value[0]
    return value


def flat_list(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in flat_list(v)]
    return [value]
