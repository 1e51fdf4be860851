"""Datasets and loaders: Detectron's catalog, COCO-format datasets, a resumable batch sampler.

Images are NOT resized here: the torchvision model's GeneralizedRCNNTransform resizes (and
normalises) each image to TRAIN.SCALES / MAX_SIZE, so targets stay in original pixel coordinates.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import difflib
import functools
import io
import json
import logging
import math
import os
import random
import signal
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_image

from trainer.errors import UserError
from trainer.sampler import InfiniteGroupedBatchSampler
from trainer.synth import ANNOTATIONS, IMAGES, write_synthetic_dataset

log = logging.getLogger(__name__)
# torchvision 0.29 deprecates its decoders for TorchCodec, which this project does not use.
warnings.filterwarnings("ignore", "The image decoding and encoding", DeprecationWarning, "torchvision")


def _coco_catalog() -> dict:
    catalog = {}
    for year, splits in {"2014": ("train", "val", "minival", "valminusminival"), "2017": ("train", "val")}.items():
        for split in splits:
            im_dir = f"coco/{'train' if split == 'train' else 'val'}{year}"
            catalog[f"coco_{year}_{split}"] = (im_dir, f"coco/annotations/instances_{split}{year}.json")
            catalog[f"keypoints_coco_{year}_{split}"] = (
                im_dir, f"coco/annotations/person_keypoints_{split}{year}.json")
    return catalog


_SYNTH = {"synth_shapes_train": ("train", 64, 0), "synth_shapes_val": ("val", 16, 1)}  # split, images, seed
CATALOG = {**_coco_catalog(), **{name: (f"synth_shapes/{split}/{IMAGES}", f"synth_shapes/{split}/{ANNOTATIONS}")
                                 for name, (split, _, _) in _SYNTH.items()}}


def resolve_dataset(cfg, name: str) -> tuple[Path, Path]:
    """(image dir, annotation file) of a catalog name, a DATASET_CATALOG entry or a dataset folder."""
    data_dir = Path(cfg.DATA_DIR).expanduser()
    user = cfg.DATASET_CATALOG.get(name)
    if user is not None:
        if not isinstance(user, dict) or not {"IM_DIR", "ANN_FN"} <= set(user):
            raise UserError(f"DATASET_CATALOG.{name} needs IM_DIR and ANN_FN, got {user!r}")
        im_dir, ann = data_dir / str(user["IM_DIR"]), data_dir / str(user["ANN_FN"])
    elif name in CATALOG:
        im_dir, ann = (data_dir / p for p in CATALOG[name])
        if name in _SYNTH and not ann.is_file():  # generated on first use
            split, count, seed = _SYNTH[name]
            log.info("generating %s (%d images) in %s", name, count, ann.parent)
            write_synthetic_dataset(ann.parent, num_images=count, image_size=128, seed=seed)
    elif "/" in name or os.sep in name or name.startswith((".", "~")) or Path(name).is_dir():
        root = Path(name).expanduser()
        if not root.is_dir() and (data_dir / root).is_dir():  # relative to DATA_DIR
            root = data_dir / root
        if not root.is_dir():
            raise UserError(f"dataset folder not found: {root}")
        im_dir, ann = root / IMAGES, root / ANNOTATIONS
    else:
        known = sorted({*CATALOG, *cfg.DATASET_CATALOG})
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "add it to DATASET_CATALOG or give a folder path"
        raise UserError(f"unknown dataset {name!r} ({hint})")
    if not ann.is_file():
        raise UserError(f"dataset {name}: annotation file not found: {ann} (check DATA_DIR={cfg.DATA_DIR})")
    if not im_dir.is_dir():
        raise UserError(f"dataset {name}: image folder not found: {im_dir} (check DATA_DIR={cfg.DATA_DIR})")
    return im_dir, ann


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"malformed annotation file {path}: {e}") from None
    except RecursionError:
        raise UserError(f"malformed annotation file {path}: nested too deeply") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read annotation file {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) \
            or not isinstance(data.get("categories"), list):
        raise UserError(f"malformed annotation file {path}: needs 'images' and 'categories' lists (COCO format)")
    data.setdefault("annotations", [])  # test-set files (image_info_*) have none
    return data


def _check(path: Path, data: dict, image_dir: Path, masks: bool = False, keypoints: bool = False) -> None:
    """Fail up front, naming the file, rather than at iteration 50000 in a worker.

    Structure and types are checked here (every value the loader will compute with); box
    geometry is not: empty boxes are dropped and boxes reaching outside their image are clipped
    when the dataset is built, with a logged count. Segmentations and keypoints are checked only
    when the model uses them.
    """
    for im in data["images"]:
        if not isinstance(im, dict) or not {"id", "file_name", "width", "height"} <= set(im):
            raise UserError(f"{path}: image entry {str(im)[:80]} needs id, file_name, width and height")
        if not _is_id(im["id"]):
            raise UserError(f"{path}: image id {_short(im['id'])} is not a number or a string")
        if not isinstance(im["file_name"], str) or not im["file_name"]:
            raise UserError(f"{path}: image {im['id']!r} has file_name {_short(im['file_name'])}, not a file name")
        if not (_is_int(im["width"]) and _is_int(im["height"]) and im["width"] > 0 and im["height"] > 0):
            raise UserError(f"{path}: image {im['id']!r} has width {_short(im['width'])} and height "
                            f"{_short(im['height'])}; both must be positive integers")
    for c in data["categories"]:
        if not isinstance(c, dict) or "id" not in c:
            raise UserError(f"{path}: every category needs an id")
        if not _is_id(c["id"]):
            raise UserError(f"{path}: category id {_short(c['id'])} is not a number or a string")
        names = c.get("keypoints")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise UserError(f"{path}: category {c['id']!r} has keypoints {_short(names)}, not a list of names")
    cat_ids = {c["id"] for c in data["categories"]}
    if len(cat_ids) != len(data["categories"]):
        raise UserError(f"{path}: a category id appears twice")
    image_ids = {}
    for im in data["images"]:
        if im["id"] in image_ids:
            raise UserError(f"{path}: image id {im['id']!r} appears twice")
        image_ids[im["id"]] = im
    for what, ids in (("category", cat_ids), ("image", image_ids)):
        try:
            sorted(ids)  # labels follow category order, images are read in id order
        except TypeError:
            raise UserError(f"{path}: {what} ids mix numbers and strings") from None
    ann_ids: set = set()
    for ann in data["annotations"]:
        if not isinstance(ann, dict):
            raise UserError(f"{path}: annotation entry {_short(ann)} is not an object")
        what = f"{path}: annotation {_short(ann.get('id'))}"
        if not _is_id(ann.get("id")):
            raise UserError(f"{what} needs an id (a number or a string)")
        if ann["id"] in ann_ids:
            raise UserError(f"{what}: annotation id {ann['id']!r} appears twice")
        ann_ids.add(ann["id"])
        category = ann.get("category_id")
        if not _is_id(category) or category not in cat_ids:
            raise UserError(f"{what} has category_id {_short(category)}, not among the categories {sorted(cat_ids, key=str)}")
        image = ann.get("image_id")
        if not _is_id(image) or image not in image_ids:
            raise UserError(f"{what} refers to unknown image_id {_short(image)}")
        bbox = ann.get("bbox")
        if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
            raise UserError(f"{what} has no [x, y, w, h] bbox")
        if not all(_is_number(v) for v in bbox):
            raise UserError(f"{what} has bbox {_short(bbox)}: x, y, w, h must be finite numbers")
        if "area" in ann and not _is_number(ann["area"]):
            raise UserError(f"{what} has area {_short(ann['area'])}, not a number")
        if ann.get("iscrowd", 0) not in (0, 1):  # True and False are 1 and 0
            raise UserError(f"{what} has iscrowd {_short(ann.get('iscrowd'))}; it must be 0 or 1")
        if masks:
            _check_segmentation(what, ann.get("segmentation"), image_ids[image])
        if keypoints and ann.get("keypoints") is not None:
            kp = ann["keypoints"]
            if not isinstance(kp, list) or len(kp) % 3 or not all(_is_number(v) for v in kp):
                raise UserError(f"{what} has keypoints {_short(kp)}: a flat list of x, y, visibility numbers")
    if not data["images"]:
        raise UserError(f"{path} lists no images")
    if not image_dir.is_dir():
        raise UserError(f"image folder not found: {image_dir} (for {path})")
    on_disk = set(os.listdir(image_dir))  # one listing, not one stat per image
    missing = [im["file_name"] for im in data["images"]
               if im["file_name"] not in on_disk and not (image_dir / im["file_name"]).is_file()]
    if missing:
        example = missing[0] if missing[0].isprintable() else repr(missing[0])
        raise UserError(f"{len(missing)} of {len(data['images'])} images listed in {path} are missing "
                        f"from {image_dir}, e.g. {example}")


def _check_segmentation(what: str, segm, image: dict) -> None:
    """Polygons (lists of numbers) or RLE ({'counts': ..., 'size': [height, width]})."""
    if segm is None:
        return
    if isinstance(segm, list):
        if all(isinstance(p, list) and all(_is_number(v) for v in p) for p in segm):
            return
    elif isinstance(segm, dict):
        counts, size = segm.get("counts"), segm.get("size")
        counts_ok = isinstance(counts, str) or (isinstance(counts, list) and all(_is_int(v) and v >= 0 for v in counts))
        if counts_ok and size == [image["height"], image["width"]]:
            return
        if counts_ok and isinstance(size, list):
            raise UserError(f"{what} has an RLE mask of size {_short(size)} on an image of "
                            f"{image['height']}x{image['width']} (height x width)")
    raise UserError(f"{what} has segmentation {_short(segm)}: polygons (lists of numbers) or RLE "
                    "({'counts', 'size'}) expected")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_id(v) -> bool:
    return (isinstance(v, (int, str)) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _flip_perm(names: list) -> list:
    """Keypoint order after a horizontal flip: left_* <-> right_* (COCO), left <-> right (shapes)."""
    index = {n: i for i, n in enumerate(names)}
    mirror = lambda n: n.replace("left", "\0").replace("right", "left").replace("\0", "right")  # noqa: E731
    return [index.get(mirror(n), i) for i, n in enumerate(names)]


class CocoDetection(Dataset):
    """A COCO-format dataset; items are (float CHW image in [0, 1], target dict) in pixel coordinates."""

    def __init__(self, image_dir, ann_file, train: bool = True, masks: bool = False, keypoints: bool = False):
        self.image_dir, self.ann_file = Path(image_dir), Path(ann_file)
        self.train, self.masks, self.keypoints = train, masks, keypoints
        data = _read_json(self.ann_file)
        _check(self.ann_file, data, self.image_dir, masks=masks, keypoints=keypoints)
        self._coco = _index(data)
        self.categories = sorted(data["categories"], key=lambda c: c["id"])  # label i = categories[i - 1]
        self.label_to_cat_id = {i + 1: c["id"] for i, c in enumerate(self.categories)}
        self.cat_id_to_label = {c: label for label, c in self.label_to_cat_id.items()}
        self.class_names = ["__background__"] + [c.get("name", str(c["id"])) for c in self.categories]
        self.keypoint_names = next((list(c["keypoints"]) for c in self.categories if c.get("keypoints")), [])
        if keypoints and not self.keypoint_names:
            raise UserError(f"{self.ann_file}: a keypoint model needs categories with 'keypoints' names")
        self._flip = _flip_perm(self.keypoint_names)
        self._records = self._build_records()
        self.aspect_ratios = [r["width"] / r["height"] for r in self._records]

    @property
    def num_classes(self) -> int:
        return len(self.categories) + 1

    @property
    def num_keypoints(self) -> int:
        return len(self.keypoint_names)

    @property
    def coco(self) -> COCO:
        if self._coco is None:  # dropped when pickled to a worker
            self._coco = _index(_read_json(self.ann_file))
        return self._coco

    @property
    def image_ids(self) -> list:
        return [r["id"] for r in self._records]

    def __getstate__(self):
        return {**self.__dict__, "_coco": None}

    def __len__(self) -> int:
        return len(self._records)

    def _build_records(self) -> list:
        coco, records, dropped = self._coco, [], {"crowd": 0, "degenerate": 0, "images": 0}
        for image_id in sorted(coco.imgs):
            im = coco.imgs[image_id]
            w, h = im["width"], im["height"]
            anns = list(coco.imgToAnns.get(image_id, []))
            boxes = [_clip_xyxy(a["bbox"], w, h) for a in anns]
            if self.train:  # as torchvision's references: no crowd, no empty box, no image without a box
                dropped["crowd"] += sum(bool(a.get("iscrowd", 0)) for a in anns)
                keep = [i for i, a in enumerate(anns) if not a.get("iscrowd", 0)]
                good = [i for i in keep if boxes[i][2] > boxes[i][0] and boxes[i][3] > boxes[i][1]]
                dropped["degenerate"] += len(keep) - len(good)
                anns, boxes = [anns[i] for i in good], [boxes[i] for i in good]
                if not anns:
                    dropped["images"] += 1
                    continue
            records.append(self._record(im, anns, boxes))
        if self.train:
            log.info("%s: dropped %d crowd and %d empty boxes; %d of %d images have no usable box and are "
                     "skipped", self.ann_file, dropped["crowd"], dropped["degenerate"], dropped["images"],
                     len(coco.imgs))
            if not records:
                raise UserError(f"{self.ann_file} has no usable annotation (every box is crowd, empty or "
                                f"outside its image)")
        return records

    def _record(self, im: dict, anns: list, boxes: list) -> dict:
        k = len(self.keypoint_names)
        record = {
            "id": im["id"], "file_name": im["file_name"], "width": im["width"], "height": im["height"],
            "boxes": np.asarray(boxes, np.float32).reshape(-1, 4),
            "labels": np.asarray([self.cat_id_to_label[a["category_id"]] for a in anns], np.int64),
            "area": np.asarray([a.get("area", 0.0) for a in anns], np.float32),
            "iscrowd": np.asarray([a.get("iscrowd", 0) for a in anns], np.int64),
        }
        if self.masks:
            record["segms"] = [a.get("segmentation") for a in anns]
        if self.keypoints:
            record["keypoints"] = np.stack([_keypoints(a, k) for a in anns]) if anns else np.zeros((0, k, 3), np.float32)
        return record

    def __getitem__(self, key):
        index, flip = key if isinstance(key, tuple) else (key, False)
        record = self._records[index]
        image = self._load_image(record)
        target = {"boxes": torch.tensor(record["boxes"]), "labels": torch.tensor(record["labels"]),
                  "image_id": record["id"], "area": torch.tensor(record["area"]),
                  "iscrowd": torch.tensor(record["iscrowd"])}
        if self.masks:
            h, w = record["height"], record["width"]
            masks = [_segm_to_mask(s, h, w) for s in record["segms"]]
            target["masks"] = torch.from_numpy(np.stack(masks) if masks else np.zeros((0, h, w), np.uint8))
        if self.keypoints:
            target["keypoints"] = torch.tensor(record["keypoints"])
        return _hflip(image, target, self._flip) if flip else (image, target)

    def _load_image(self, record: dict) -> torch.Tensor:
        path = self.image_dir / record["file_name"]
        try:
            image = decode_image(str(path), mode=ImageReadMode.RGB)
        except (RuntimeError, OSError, ValueError) as e:
            raise UserError(f"cannot decode image {path}: {e}") from None
        if tuple(image.shape[1:]) != (record["height"], record["width"]):  # boxes would be misplaced
            raise UserError(f"{path} is {image.shape[2]}x{image.shape[1]} but {self.ann_file} says "
                            f"{record['width']}x{record['height']}")
        return image.float().div_(255)


def _index(data: dict) -> COCO:
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        coco.createIndex()
    return coco


def _clip_xyxy(bbox, w: int, h: int) -> list:
    x, y, bw, bh = (float(v) for v in bbox)
    return [min(max(x, 0.0), w), min(max(y, 0.0), h), min(max(x + bw, 0.0), w), min(max(y + bh, 0.0), h)]


def _keypoints(ann: dict, k: int) -> np.ndarray:
    values = np.asarray(ann.get("keypoints") or [], np.float32)
    return values.reshape(k, 3) if values.size == 3 * k else np.zeros((k, 3), np.float32)


def _segm_to_mask(segm, h: int, w: int) -> np.ndarray:
    if isinstance(segm, list):  # polygons; one of 4 numbers would be read as a box, fewer is no area
        polygons = [p for p in segm if len(p) >= 6]
        if not polygons:
            return np.zeros((h, w), np.uint8)
        rle = mask_utils.merge(mask_utils.frPyObjects(polygons, h, w))
    elif isinstance(segm, dict) and isinstance(segm.get("counts"), list):  # uncompressed RLE
        rle = mask_utils.frPyObjects(segm, h, w)
    elif isinstance(segm, dict):
        rle = segm
    else:
        return np.zeros((h, w), np.uint8)
    return mask_utils.decode(rle)


def _hflip(image: torch.Tensor, target: dict, keypoint_perm: list):
    width = image.shape[-1]
    b = target["boxes"]
    target["boxes"] = torch.stack([width - b[:, 2], b[:, 1], width - b[:, 0], b[:, 3]], dim=1)
    if "masks" in target:
        target["masks"] = target["masks"].flip(-1)
    if "keypoints" in target:
        kp = target["keypoints"][:, keypoint_perm].clone()  # the left point becomes the right one
        kp[..., 0] = torch.where(kp[..., 2] > 0, width - kp[..., 0], torch.zeros_like(kp[..., 0]))
        target["keypoints"] = kp
    return image.flip(-1), target


class ConcatDetection(ConcatDataset):
    """Several datasets with the same categories, so labels mean the same thing in all of them."""

    def __init__(self, datasets: list):
        super().__init__(datasets)
        first = datasets[0]
        for other in datasets[1:]:
            if _category_key(other) != _category_key(first):
                raise UserError(f"training datasets {first.ann_file} and {other.ann_file} have different categories")
        for attr in ("categories", "label_to_cat_id", "cat_id_to_label", "class_names", "keypoint_names",
                     "num_keypoints"):
            setattr(self, attr, getattr(first, attr))
        self.aspect_ratios = [a for d in datasets for a in d.aspect_ratios]

    @property
    def num_classes(self) -> int:
        return len(self.categories) + 1

    def __getitem__(self, key):
        index, flip = key if isinstance(key, tuple) else (key, False)
        d = bisect.bisect_right(self.cumulative_sizes, index)
        return self.datasets[d][(index - (self.cumulative_sizes[d - 1] if d else 0), flip)]


def _category_key(dataset) -> list:
    return [(c["id"], c.get("name")) for c in dataset.categories]


def collate(batch):
    images, targets = zip(*batch)
    return list(images), list(targets)


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32  # torch gives each worker base_seed + worker_id
    np.random.seed(seed)
    random.seed(seed)


def _init_worker(parent_pid: int, worker_id: int) -> None:
    """Each loader worker: seeded, tied to the trainer's life, deaf to the job's stop signals."""
    _bind_to_parent(parent_pid)
    _seed_worker(worker_id)


def _bind_to_parent(parent_pid: int) -> None:
    """Workers never outlive the trainer, and a stop signal is the trainer's to handle.

    - SIGINT/SIGTERM are ignored: Ctrl-C, `kill -- -PGID`, systemd, slurm or `tini -g` signal
      the whole process group, and a worker that dies of it would turn the trainer's orderly
      stop (finish the iteration, checkpoint, KILLED) into a crash. The trainer shuts its
      workers down itself.
    - Linux: SIGKILL when the trainer's main thread (which forks the workers) dies, so a trainer
      killed with SIGKILL or exiting at once on a second signal leaves no worker behind (torch's
      own watchdog notices only after up to 5 s).
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: torch's watchdog still ends the worker
            return
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def _loader(dataset, workers: int, seed: int, persistent: bool, **kwargs) -> DataLoader:
    return DataLoader(dataset, num_workers=workers, collate_fn=collate, pin_memory=torch.cuda.is_available(),
                      worker_init_fn=functools.partial(_init_worker, os.getpid()) if workers else None,
                      generator=torch.Generator().manual_seed(seed), persistent_workers=persistent and workers > 0,
                      prefetch_factor=2 if workers else None, **kwargs)


def _model_needs(cfg) -> dict:
    return {"masks": cfg.MODEL.TYPE.startswith("maskrcnn"), "keypoints": cfg.MODEL.TYPE.startswith("keypointrcnn")}


def build_train_dataset(cfg):
    if not cfg.TRAIN.DATASETS:
        raise UserError("TRAIN.DATASETS is empty: name at least one dataset (e.g. synth_shapes_train)")
    datasets = [CocoDetection(*resolve_dataset(cfg, name), train=True, **_model_needs(cfg))
                for name in cfg.TRAIN.DATASETS]
    return datasets[0] if len(datasets) == 1 else ConcatDetection(datasets)


def build_train_loader(cfg, start_iter: int = 0, rank: int = 0, world_size: int = 1):
    """An endless loader of (images, targets) batches for this rank, starting at start_iter."""
    dataset = build_train_dataset(cfg)
    sampler = InfiniteGroupedBatchSampler(
        dataset.aspect_ratios, cfg.TRAIN.IMS_PER_BATCH, cfg.RNG_SEED, start_iter, rank, world_size,
        flip=cfg.TRAIN.USE_FLIPPED, group=cfg.TRAIN.ASPECT_GROUPING)
    loader = _loader(dataset, cfg.DATA_LOADER.NUM_THREADS, cfg.RNG_SEED + rank, True, batch_sampler=sampler)
    return loader, dataset


def build_test_loader(cfg, dataset_name: str, rank: int = 0, world_size: int = 1):
    """Sequential evaluation batches of this rank's shard (indices rank::world_size), unflipped."""
    dataset = CocoDetection(*resolve_dataset(cfg, dataset_name), train=False)
    shard = list(range(rank, len(dataset), world_size))
    loader = _loader(dataset, cfg.DATA_LOADER.NUM_THREADS, cfg.RNG_SEED, False, sampler=shard,
                     batch_size=cfg.TEST.IMS_PER_BATCH)
    return loader, dataset
