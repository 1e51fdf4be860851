"""Which job a config is: the keys that change what is trained, and their hash. The hash tags the
job's MLflow run (how a later start finds it to resume); the keys are compared with a checkpoint's
config (never resume another job's) and across torchrun ranks.
"""
from __future__ import annotations

import hashlib
import json

from trainer.config import defaults, flatten, redacted

# Where the job runs, how it is logged, tracked and evaluated, and when it is checkpointed: a
# resume is bit-identical wherever its checkpoints fall, so SNAPSHOT_ITERS may change between starts.
_NOT_IN_JOB = ("NAME", "CUDNN_BENCHMARK", "OUTPUT_DIR", "DATA_DIR", "DATASET_CATALOG", "LOG_PERIOD", "TRACKING", "TEST",
               "DATA_LOADER", "TRAIN.AUTO_RESUME", "TRAIN.CHECKPOINTS_KEEP", "TRAIN.PREEMPT_GRACE_S",
               "TRAIN.SNAPSHOT_ITERS")
# Keys added after jobs were first hashed: at their default they stay out of the hash, so a job
# started before they existed is still found (and resumed) by a newer tracktron.
_LATER_KEYS = ("MODEL.FEATURES", "MODEL.STRIDE_IN_1X1", "MODEL.BACKBONE_NORM", "MODEL.FPN_NORM", "MODEL.HEAD_NORM",
               "MODEL.BOX_HEAD", "MODEL.P6_FROM_C5", "MODEL.BOX_POOL_SIZE", "MODEL.MASK_POOL_SIZE",
               "MODEL.KEYPOINT_POOL_SIZE", "MODEL.POOL_SAMPLING_RATIO", "MODEL.ANCHOR_RATIOS", "MODEL.PIXEL_MEAN",
               "MODEL.PIXEL_STD", "MODEL.RPN_NMS_THRESH", "MODEL.RPN_FG_IOU", "MODEL.RPN_BG_IOU",
               "MODEL.RPN_POSITIVE_FRACTION", "MODEL.FG_IOU", "MODEL.BG_IOU", "MODEL.POSITIVE_FRACTION",
               "MODEL.NMS_THRESH", "MODEL.SCORE_THRESH", "MODEL.TOPK_CANDIDATES", "MODEL.CLS_AGNOSTIC_MASK",
               "SOLVER.BIAS_LR_FACTOR")
# Hashed until 2026-12-03: a run tagged with the hash that includes it is still this job's (it is
# found by that hash too, with the config's value, and retagged when it continues).
_EARLIER_KEYS = ("TRAIN.SNAPSHOT_ITERS",)
_FLAT_DEFAULTS = flatten(defaults())


def job_keys(cfg: dict) -> dict:
    """The flattened keys that change what is trained (a rotated secret is still the same job)."""
    return {k: v for k, v in flatten(redacted(cfg)).items()
            if not any(k == p or k.startswith(p + ".") for p in _NOT_IN_JOB)
            and not (k in _LATER_KEYS and v == _FLAT_DEFAULTS[k])}


def job_hash(cfg: dict) -> str:
    """A short hash of the keys that change what is trained: two runs with it equal are one job."""
    return _hash(job_keys(cfg))


def job_hashes(cfg: dict) -> tuple[str, str]:
    """job_hash, then the hash an earlier tracktron gave the job (with _EARLIER_KEYS' values)."""
    earlier = flatten(redacted(cfg))
    return job_hash(cfg), _hash(job_keys(cfg) | {k: earlier[k] for k in _EARLIER_KEYS})


def _hash(keys: dict) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]
