"""Detectron's config keys and their defaults (its core/config.py), as facts for config_detectron.py
(a key a Detectron file leaves out means its default there too), and a file's values read as the
types of those defaults, the way Detectron reads them."""
from __future__ import annotations

import math

from trainer.config_yaml import Bool, literal, plain
from trainer.errors import ConfigError

DEFAULTS: dict = {'TRAIN.WEIGHTS': '',
 'TRAIN.DATASETS': [],
 'TRAIN.SCALES': [600],
 'TRAIN.MAX_SIZE': 1000,
 'TRAIN.IMS_PER_BATCH': 2,
 'TRAIN.BATCH_SIZE_PER_IM': 64,
 'TRAIN.FG_FRACTION': 0.25,
 'TRAIN.FG_THRESH': 0.5,
 'TRAIN.BG_THRESH_HI': 0.5,
 'TRAIN.BG_THRESH_LO': 0.0,
 'TRAIN.USE_FLIPPED': True,
 'TRAIN.BBOX_THRESH': 0.5,
 'TRAIN.SNAPSHOT_ITERS': 20000,
 'TRAIN.PROPOSAL_FILES': [],
 'TRAIN.ASPECT_GROUPING': True,
 'TRAIN.GENERATE_PROPOSALS_ON_GPU': False,
 'TRAIN.RPN_POSITIVE_OVERLAP': 0.7,
 'TRAIN.RPN_NEGATIVE_OVERLAP': 0.3,
 'TRAIN.RPN_FG_FRACTION': 0.5,
 'TRAIN.RPN_BATCH_SIZE_PER_IM': 256,
 'TRAIN.RPN_NMS_THRESH': 0.7,
 'TRAIN.RPN_PRE_NMS_TOP_N': 12000,
 'TRAIN.RPN_POST_NMS_TOP_N': 2000,
 'TRAIN.RPN_STRADDLE_THRESH': 0,
 'TRAIN.RPN_MIN_SIZE': 0,
 'TRAIN.CROWD_FILTER_THRESH': 0.7,
 'TRAIN.GT_MIN_AREA': -1,
 'TRAIN.FREEZE_CONV_BODY': False,
 'TRAIN.AUTO_RESUME': True,
 'TRAIN.COPY_WEIGHTS': False,
 'TRAIN.FREEZE_AT': 2,
 'DATA_LOADER.NUM_THREADS': 4,
 'DATA_LOADER.MINIBATCH_QUEUE_SIZE': 64,
 'DATA_LOADER.BLOBS_QUEUE_CAPACITY': 8,
 'TEST.WEIGHTS': '',
 'TEST.DATASETS': [],
 'TEST.SCALE': 600,
 'TEST.MAX_SIZE': 1000,
 'TEST.NMS': 0.3,
 'TEST.BBOX_REG': True,
 'TEST.PROPOSAL_FILES': [],
 'TEST.GENERATE_PROPOSALS_ON_GPU': False,
 'TEST.PROPOSAL_LIMIT': 2000,
 'TEST.RPN_NMS_THRESH': 0.7,
 'TEST.RPN_PRE_NMS_TOP_N': 12000,
 'TEST.RPN_POST_NMS_TOP_N': 2000,
 'TEST.RPN_MIN_SIZE': 0,
 'TEST.DETECTIONS_PER_IM': 100,
 'TEST.SCORE_THRESH': 0.05,
 'TEST.COMPETITION_MODE': True,
 'TEST.FORCE_JSON_DATASET_EVAL': False,
 'TEST.PRECOMPUTED_PROPOSALS': True,
 'TEST.BBOX_AUG.ENABLED': False,
 'TEST.BBOX_AUG.SCORE_HEUR': 'UNION',
 'TEST.BBOX_AUG.COORD_HEUR': 'UNION',
 'TEST.BBOX_AUG.H_FLIP': False,
 'TEST.BBOX_AUG.SCALES': [],
 'TEST.BBOX_AUG.MAX_SIZE': 4000,
 'TEST.BBOX_AUG.SCALE_H_FLIP': False,
 'TEST.BBOX_AUG.SCALE_SIZE_DEP': False,
 'TEST.BBOX_AUG.AREA_TH_LO': 2500,
 'TEST.BBOX_AUG.AREA_TH_HI': 32400,
 'TEST.BBOX_AUG.ASPECT_RATIOS': [],
 'TEST.BBOX_AUG.ASPECT_RATIO_H_FLIP': False,
 'TEST.MASK_AUG.ENABLED': False,
 'TEST.MASK_AUG.HEUR': 'SOFT_AVG',
 'TEST.MASK_AUG.H_FLIP': False,
 'TEST.MASK_AUG.SCALES': [],
 'TEST.MASK_AUG.MAX_SIZE': 4000,
 'TEST.MASK_AUG.SCALE_H_FLIP': False,
 'TEST.MASK_AUG.SCALE_SIZE_DEP': False,
 'TEST.MASK_AUG.AREA_TH': 32400,
 'TEST.MASK_AUG.ASPECT_RATIOS': [],
 'TEST.MASK_AUG.ASPECT_RATIO_H_FLIP': False,
 'TEST.KPS_AUG.ENABLED': False,
 'TEST.KPS_AUG.HEUR': 'HM_AVG',
 'TEST.KPS_AUG.H_FLIP': False,
 'TEST.KPS_AUG.SCALES': [],
 'TEST.KPS_AUG.MAX_SIZE': 4000,
 'TEST.KPS_AUG.SCALE_H_FLIP': False,
 'TEST.KPS_AUG.SCALE_SIZE_DEP': False,
 'TEST.KPS_AUG.AREA_TH': 32400,
 'TEST.KPS_AUG.ASPECT_RATIOS': [],
 'TEST.KPS_AUG.ASPECT_RATIO_H_FLIP': False,
 'TEST.SOFT_NMS.ENABLED': False,
 'TEST.SOFT_NMS.METHOD': 'linear',
 'TEST.SOFT_NMS.SIGMA': 0.5,
 'TEST.BBOX_VOTE.ENABLED': False,
 'TEST.BBOX_VOTE.VOTE_TH': 0.8,
 'TEST.BBOX_VOTE.SCORING_METHOD': 'ID',
 'TEST.BBOX_VOTE.SCORING_METHOD_BETA': 1.0,
 'MODEL.TYPE': '',
 'MODEL.CONV_BODY': '',
 'MODEL.NUM_CLASSES': -1,
 'MODEL.CLS_AGNOSTIC_BBOX_REG': False,
 'MODEL.BBOX_REG_WEIGHTS': [10.0, 10.0, 5.0, 5.0],
 'MODEL.FASTER_RCNN': False,
 'MODEL.MASK_ON': False,
 'MODEL.KEYPOINTS_ON': False,
 'MODEL.RPN_ONLY': False,
 'MODEL.EXECUTION_TYPE': 'dag',
 'RETINANET.RETINANET_ON': False,
 'RETINANET.ASPECT_RATIOS': [0.5, 1.0, 2.0],
 'RETINANET.SCALES_PER_OCTAVE': 3,
 'RETINANET.ANCHOR_SCALE': 4,
 'RETINANET.NUM_CONVS': 4,
 'RETINANET.BBOX_REG_WEIGHT': 1.0,
 'RETINANET.BBOX_REG_BETA': 0.11,
 'RETINANET.PRE_NMS_TOP_N': 1000,
 'RETINANET.POSITIVE_OVERLAP': 0.5,
 'RETINANET.NEGATIVE_OVERLAP': 0.4,
 'RETINANET.LOSS_ALPHA': 0.25,
 'RETINANET.LOSS_GAMMA': 2.0,
 'RETINANET.PRIOR_PROB': 0.01,
 'RETINANET.SHARE_CLS_BBOX_TOWER': False,
 'RETINANET.CLASS_SPECIFIC_BBOX': False,
 'RETINANET.SOFTMAX': False,
 'RETINANET.INFERENCE_TH': 0.05,
 'SOLVER.BASE_LR': 0.001,
 'SOLVER.LR_POLICY': 'step',
 'SOLVER.GAMMA': 0.1,
 'SOLVER.STEP_SIZE': 30000,
 'SOLVER.STEPS': [],
 'SOLVER.LRS': [],
 'SOLVER.MAX_ITER': 40000,
 'SOLVER.MOMENTUM': 0.9,
 'SOLVER.WEIGHT_DECAY': 0.0005,
 'SOLVER.WEIGHT_DECAY_GN': 0.0,
 'SOLVER.WARM_UP_ITERS': 500,
 'SOLVER.WARM_UP_FACTOR': 0.3333333333333333,
 'SOLVER.WARM_UP_METHOD': 'linear',
 'SOLVER.SCALE_MOMENTUM': True,
 'SOLVER.SCALE_MOMENTUM_THRESHOLD': 1.1,
 'SOLVER.LOG_LR_CHANGE_THRESHOLD': 1.1,
 'FAST_RCNN.ROI_BOX_HEAD': '',
 'FAST_RCNN.MLP_HEAD_DIM': 1024,
 'FAST_RCNN.CONV_HEAD_DIM': 256,
 'FAST_RCNN.NUM_STACKED_CONVS': 4,
 'FAST_RCNN.ROI_XFORM_METHOD': 'RoIPoolF',
 'FAST_RCNN.ROI_XFORM_SAMPLING_RATIO': 0,
 'FAST_RCNN.ROI_XFORM_RESOLUTION': 14,
 'RPN.RPN_ON': False,
 'RPN.SIZES': [64, 128, 256, 512],
 'RPN.STRIDE': 16,
 'RPN.ASPECT_RATIOS': [0.5, 1, 2],
 'FPN.FPN_ON': False,
 'FPN.DIM': 256,
 'FPN.ZERO_INIT_LATERAL': False,
 'FPN.COARSEST_STRIDE': 32,
 'FPN.MULTILEVEL_ROIS': False,
 'FPN.ROI_CANONICAL_SCALE': 224,
 'FPN.ROI_CANONICAL_LEVEL': 4,
 'FPN.ROI_MAX_LEVEL': 5,
 'FPN.ROI_MIN_LEVEL': 2,
 'FPN.MULTILEVEL_RPN': False,
 'FPN.RPN_MAX_LEVEL': 6,
 'FPN.RPN_MIN_LEVEL': 2,
 'FPN.RPN_ASPECT_RATIOS': [0.5, 1, 2],
 'FPN.RPN_ANCHOR_START_SIZE': 32,
 'FPN.EXTRA_CONV_LEVELS': False,
 'FPN.USE_GN': False,
 'MRCNN.ROI_MASK_HEAD': '',
 'MRCNN.RESOLUTION': 14,
 'MRCNN.ROI_XFORM_METHOD': 'RoIAlign',
 'MRCNN.ROI_XFORM_RESOLUTION': 7,
 'MRCNN.ROI_XFORM_SAMPLING_RATIO': 0,
 'MRCNN.DIM_REDUCED': 256,
 'MRCNN.DILATION': 2,
 'MRCNN.UPSAMPLE_RATIO': 1,
 'MRCNN.USE_FC_OUTPUT': False,
 'MRCNN.CONV_INIT': 'GaussianFill',
 'MRCNN.CLS_SPECIFIC_MASK': True,
 'MRCNN.WEIGHT_LOSS_MASK': 1.0,
 'MRCNN.THRESH_BINARIZE': 0.5,
 'KRCNN.ROI_KEYPOINTS_HEAD': '',
 'KRCNN.HEATMAP_SIZE': -1,
 'KRCNN.UP_SCALE': -1,
 'KRCNN.USE_DECONV': False,
 'KRCNN.DECONV_DIM': 256,
 'KRCNN.USE_DECONV_OUTPUT': False,
 'KRCNN.DILATION': 1,
 'KRCNN.DECONV_KERNEL': 4,
 'KRCNN.NUM_KEYPOINTS': -1,
 'KRCNN.NUM_STACKED_CONVS': 8,
 'KRCNN.CONV_HEAD_DIM': 256,
 'KRCNN.CONV_HEAD_KERNEL': 3,
 'KRCNN.CONV_INIT': 'GaussianFill',
 'KRCNN.NMS_OKS': False,
 'KRCNN.KEYPOINT_CONFIDENCE': 'bbox',
 'KRCNN.ROI_XFORM_METHOD': 'RoIAlign',
 'KRCNN.ROI_XFORM_RESOLUTION': 7,
 'KRCNN.ROI_XFORM_SAMPLING_RATIO': 0,
 'KRCNN.MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH': 20,
 'KRCNN.INFERENCE_MIN_SIZE': 0,
 'KRCNN.LOSS_WEIGHT': 1.0,
 'KRCNN.NORMALIZE_BY_VISIBLE_KEYPOINTS': True,
 'RFCN.PS_GRID_SIZE': 3,
 'RESNETS.NUM_GROUPS': 1,
 'RESNETS.WIDTH_PER_GROUP': 64,
 'RESNETS.STRIDE_1X1': True,
 'RESNETS.TRANS_FUNC': 'bottleneck_transformation',
 'RESNETS.STEM_FUNC': 'basic_bn_stem',
 'RESNETS.SHORTCUT_FUNC': 'basic_bn_shortcut',
 'RESNETS.RES5_DILATION': 1,
 'GROUP_NORM.DIM_PER_GP': -1,
 'GROUP_NORM.NUM_GROUPS': 32,
 'GROUP_NORM.EPSILON': 1e-05,
 'NUM_GPUS': 1,
 'USE_NCCL': False,
 'DEDUP_BOXES': 0.0625,
 'BBOX_XFORM_CLIP': 4.135166556742356,
 'PIXEL_MEANS': [102.9801, 115.9465, 122.7717],
 'RNG_SEED': 3,
 'EPS': 1e-14,
 'ROOT_DIR': '',
 'OUTPUT_DIR': '/tmp',
 'MATLAB': 'matlab',
 'MEMONGER': True,
 'MEMONGER_SHARE_ACTIVATIONS': False,
 'VIS': False,
 'VIS_TH': 0.9,
 'EXPECTED_RESULTS': [],
 'EXPECTED_RESULTS_RTOL': 0.1,
 'EXPECTED_RESULTS_ATOL': 0.005,
 'EXPECTED_RESULTS_SIGMA_TOL': 4,
 'EXPECTED_RESULTS_EMAIL': '',
 'DOWNLOAD_CACHE': '/tmp/detectron-download-cache',
 'CLUSTER.ON_CLUSTER': False}

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
