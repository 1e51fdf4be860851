"""Datasets and loaders: Detectron's catalog and COCO-format datasets. Images are NOT resized here:
the model's GeneralizedRCNNTransform resizes (and normalises) each to TRAIN.SCALES / MAX_SIZE, so
targets stay in the original pixel coordinates."""
from __future__ import annotations

import bisect
import contextlib
import difflib
import functools
import hashlib
import io
import json
import logging
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from pycocotools.coco import COCO
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from trainer.data.checks import (category_difference, category_key, check, check_image_headers, other_layout,
                                 read_json, size_mismatch)
from trainer.data.images import MAX_PIXELS, decode, read_file
from trainer.data.masks import compact, eval_mask, segm_to_mask
from trainer.data.sampler import InfiniteGroupedBatchSampler
from trainer.data.synth import ANNOTATIONS, IMAGES, write_synthetic_dataset
from trainer.data.workers import check_shared_memory, forking, in_shared_memory, init_worker
from trainer.errors import UserError, user_path
from trainer.redaction import printable

log = logging.getLogger(__name__)
# Pixels: a box narrower is empty. A width of 1e-6 at x=62 is none in float32, where torchvision's
# model asserts x2 > x1 (after any resize): a training failure at iteration 0, not a dropped box.
MIN_BOX_SIDE = 0.01
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
    for year, splits in {"2007": ("train", "val", "trainval", "test"), "2012": ("train", "val", "trainval")}.items():
        for split in splits:  # Detectron's PASCAL VOC, as COCO json
            catalog[f"voc_{year}_{split}"] = (f"VOC{year}/JPEGImages", f"VOC{year}/annotations/voc_{year}_{split}.json")
    return catalog


_SYNTH = {"synth_shapes_train": ("train", 64, 0), "synth_shapes_val": ("val", 16, 1)}  # split, images, seed
CATALOG = {**_coco_catalog(), **{name: (f"synth_shapes/{split}/{IMAGES}", f"synth_shapes/{split}/{ANNOTATIONS}")
                                 for name, (split, _, _) in _SYNTH.items()}}


def resolve_dataset(cfg, name: str) -> tuple[Path, Path]:
    """(image dir, annotation file) of a catalog name, a DATASET_CATALOG entry or a dataset folder."""
    data_dir = user_path(cfg.DATA_DIR, "DATA_DIR")
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
        root = user_path(name, "dataset")
        if not root.is_dir() and (data_dir / root).is_dir():  # relative to DATA_DIR
            root = data_dir / root
        if not root.is_dir():
            raise UserError(f"dataset folder not found: {root}")
        im_dir, ann = root / IMAGES, root / ANNOTATIONS
        if not ann.is_file() and (layout := other_layout(root)):  # Roboflow's, CVAT's, FiftyOne's exports
            found = layout[1].relative_to(root.absolute())
            raise UserError(f"dataset folder {root} has {found}, not {ANNOTATIONS} and {IMAGES}/: for another layout name "
                            f"it in DATASET_CATALOG (e.g. DATASET_CATALOG.mine \"{{IM_DIR: {layout[0]}, ANN_FN: "
                            f"{layout[1]}}}\" TRAIN.DATASETS \"('mine',)\")")
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


def _flip_perm(names: list) -> list:
    """Keypoint order after a horizontal flip: left_* <-> right_* (COCO), left <-> right (shapes)."""
    def mirror(name: str) -> str:
        return name.replace("left", "\0").replace("right", "left").replace("\0", "right")

    index = {n: i for i, n in enumerate(names)}
    return [index.get(mirror(n), i) for i, n in enumerate(names)]


class CocoDetection(Dataset):
    """A COCO-format dataset; items are (float CHW image in [0, 1], target dict) in pixel coordinates."""

    def __init__(self, image_dir, ann_file, train: bool = True, masks: bool = False, keypoints: bool = False,
                 sizes: tuple | None = None):
        self.image_dir, self.ann_file = Path(image_dir), Path(ann_file)
        self.train, self.masks, self.keypoints = train, masks, keypoints
        data = read_json(self.ann_file)
        check(self.ann_file, data, self.image_dir, masks=masks, keypoints=keypoints, sizes=sizes, max_pixels=MAX_PIXELS)
        if masks and data["annotations"] and not any(a.get("segmentation") for a in data["annotations"]):
            if train:  # its mask head would learn empty masks, and be registered so (a keypoint model is refused too)
                raise UserError(f"{self.ann_file}: a mask model needs segmentations, and none of its "
                                f"{len(data['annotations']):,} annotations has one")
            log.warning("%s has no segmentation: a mask model's segm scores on it are of empty masks", self.ann_file)
        self.categories = sorted(data["categories"], key=lambda c: c["id"])  # label i = categories[i - 1]
        self.label_to_cat_id = {i + 1: c["id"] for i, c in enumerate(self.categories)}
        self.cat_id_to_label = {c: label for label, c in self.label_to_cat_id.items()}
        self.class_names = ["__background__"] + [c.get("name", str(c["id"])) for c in self.categories]
        self.keypoint_names = next((list(c["keypoints"]) for c in self.categories if c.get("keypoints")), [])
        if keypoints and not self.keypoint_names:
            raise UserError(f"{self.ann_file}: a keypoint model needs categories with 'keypoints' names")
        self._flip = _flip_perm(self.keypoint_names)
        self._coco = _index(data, self.masks, self.num_keypoints)
        self._records = self._build_records()
        self.aspect_ratios = [r["width"] / r["height"] for r in self._records]
        if train:  # only a test set's is read again (COCOeval): COCO's parsed file is GBs in every rank
            self._coco = None

    @property
    def num_classes(self) -> int:
        return len(self.categories) + 1

    @property
    def num_keypoints(self) -> int:
        return len(self.keypoint_names)

    @property
    def coco(self) -> COCO:
        if self._coco is None:  # dropped when pickled to a worker
            self._coco = _index(read_json(self.ann_file), self.masks, self.num_keypoints)
        return self._coco

    @property
    def image_ids(self) -> list:
        return [r["id"] for r in self._records]

    def file_name(self, index: int) -> str:
        return self._records[index]["file_name"]

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
                good = [i for i in keep if min(boxes[i][2] - boxes[i][0], boxes[i][3] - boxes[i][1]) >= MIN_BOX_SIDE]
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
            if not coco.anns:  # an export of the images alone: crowd and empty boxes are no matter
                raise UserError(f"{self.ann_file} has no usable annotation: its annotations list is empty")
            if not records:  # CVAT exports brush masks as crowd: say so, Detectron never trains on crowd
                raise UserError(f"{self.ann_file} has no usable annotation: of its {len(coco.anns)} boxes, "
                                f"{dropped['crowd']} are crowd (iscrowd 1, never trained: set 0 for single objects) "
                                f"and {dropped['degenerate']} empty or outside their image")
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
            record["segms"] = [compact(a["segmentation"], im["height"], im["width"]) for a in anns]
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
            masks = [segm_to_mask(s, h, w) for s in record["segms"]]
            target["masks"] = torch.from_numpy(np.stack(masks) if masks else np.zeros((0, h, w), np.uint8))
        if self.keypoints:
            target["keypoints"] = torch.tensor(record["keypoints"])
        return _hflip(image, target, self._flip) if flip else (image, target)

    def _load_image(self, record: dict) -> torch.Tensor:
        path = self.image_dir / record["file_name"]
        shown = printable(str(path))  # a newline in a name split the error, whose last line a loader worker passes on
        try:
            image = decode(read_file(path), raw=True)  # uint8 (a 16-bit PNG: float), as_float on the device
        except (OSError, ValueError) as e:
            raise UserError(f"cannot decode image {shown}: {getattr(e, 'strerror', None) or e}") from None
        if tuple(image.shape[1:]) != (record["height"], record["width"]):  # boxes would be misplaced
            raise size_mismatch(path, (image.shape[2], image.shape[1]), self.ann_file, record, shown) from None
        return image


def _index(data: dict, masks: bool = False, num_keypoints: int = 0) -> COCO:
    """The ground truth as COCOeval reads it, with what it needs and many files leave out or leave
    empty filled in as training reads them: no mask is an empty mask, no keypoints none visible."""
    images = {im["id"]: im for im in data["images"]}
    for number, ann in enumerate(data["annotations"], 1):
        # COCOeval keeps a match as the ground truth's id in a float array, 0 for none: an id 0 (Roboflow's,
        # labelme2coco's first) would score a true positive as a false one, a string id fail. 1..N as loadRes.
        ann["id"] = number
        ann.setdefault("iscrowd", 0)
        if "area" not in ann:
            ann["area"] = float(ann["bbox"][2] * ann["bbox"][3])
        if masks:
            ann["segmentation"] = eval_mask(ann.get("segmentation"), images[ann["image_id"]])
        if num_keypoints:
            ann["keypoints"] = _keypoints(ann, num_keypoints).reshape(-1).tolist()
            ann["num_keypoints"] = int(sum(v > 0 for v in ann["keypoints"][2::3]))
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
            if (ours := dataset_category_key(first)) != (theirs := dataset_category_key(other)):
                raise UserError(f"training datasets {first.ann_file} and {other.ann_file} have different categories "
                                f"({category_difference(ours, theirs)})")
        for attr in ("ann_file", "keypoints", "categories", "label_to_cat_id", "cat_id_to_label", "class_names", "keypoint_names",
                     "num_classes", "num_keypoints"):
            setattr(self, attr, getattr(first, attr))
        self.aspect_ratios = [a for d in datasets for a in d.aspect_ratios]

    def __getitem__(self, key):
        index, flip = key if isinstance(key, tuple) else (key, False)
        d = bisect.bisect_right(self.cumulative_sizes, index)
        return self.datasets[d][(index - (self.cumulative_sizes[d - 1] if d else 0), flip)]


def image_list_of(dataset) -> dict:
    """Which images the sampler draws from, in order (their count and a digest of their ids): kept with
    its position, so a resume on another list (a file edited, boxes another tracktron drops) is said."""
    ids = [d.image_ids for d in (dataset.datasets if isinstance(dataset, ConcatDetection) else [dataset])]
    return {"images": len(dataset), "digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}


def dataset_category_key(dataset) -> list:
    """checks.category_key of a dataset (or a ConcatDetection of several)."""
    return category_key(dataset.categories, dataset.keypoints)


def collate(batch):
    images, targets = zip(*batch)
    return in_shared_memory((list(images), list(targets)))


class _Loader(DataLoader):
    def __iter__(self):
        with forking():  # the workers start here
            check_shared_memory(self.num_workers)
            return super().__iter__()


def _loader(dataset, workers: int, seed: int, persistent: bool, **kwargs) -> DataLoader:
    return _Loader(dataset, num_workers=workers, collate_fn=collate, pin_memory=torch.cuda.is_available(),
                   worker_init_fn=functools.partial(init_worker, os.getpid()) if workers else None,
                   generator=torch.Generator().manual_seed(seed), persistent_workers=persistent and workers > 0,
                   prefetch_factor=2 if workers else None, **kwargs)


def model_needs(cfg) -> dict:
    return {"masks": cfg.MODEL.TYPE.startswith("maskrcnn"), "keypoints": cfg.MODEL.TYPE.startswith("keypointrcnn")}


def input_sizes(cfg, train: bool) -> tuple | None:
    """(smallest min_size, max_size, the keys) the model resizes images with; ssdlite's fixed 320x320 fits any."""
    if cfg.MODEL.TYPE.startswith("ssdlite"):
        return None
    scale, max_size = (min(cfg.TRAIN.SCALES), cfg.TRAIN.MAX_SIZE) if train else (cfg.TEST.SCALE, cfg.TEST.MAX_SIZE)
    keys = ("TRAIN.SCALES", "TRAIN.MAX_SIZE") if train else ("TEST.SCALE", "TEST.MAX_SIZE")
    return scale, max_size, f"{keys[0]} {scale} and {keys[1]} {max_size}"


def _dataset(cfg, name: str, train: bool) -> CocoDetection:
    """A catalog name's dataset, with what the model needs (COCOeval uses a test set's masks and keypoints)."""
    return CocoDetection(*resolve_dataset(cfg, name), train=train, sizes=input_sizes(cfg, train), **model_needs(cfg))


def build_train_dataset(cfg):
    if not cfg.TRAIN.DATASETS:
        raise UserError("TRAIN.DATASETS is empty: name at least one dataset (e.g. synth_shapes_train)")
    datasets = [_dataset(cfg, name, True) for name in cfg.TRAIN.DATASETS]
    return datasets[0] if len(datasets) == 1 else ConcatDetection(datasets)


def check_batch_size(cfg, dataset) -> None:
    """A batch no bigger than the training set (1e9 ended in a MemoryError in the sampler)."""
    if cfg.TRAIN.IMS_PER_BATCH > len(dataset.aspect_ratios):
        raise UserError(f"TRAIN.IMS_PER_BATCH {cfg.TRAIN.IMS_PER_BATCH} is more than the training set's "
                        f"{len(dataset.aspect_ratios)} usable images")


def check_test_datasets(cfg, train_dataset) -> dict:
    """Every TEST.DATASETS entry resolves, its annotations are sound, its categories are the training
    set's and its images readable, before training rather than after it. Training sets' images are not
    opened (a COCO-sized set takes tens of seconds; a bad one fails the job in one line, its checkpoints
    kept). Returns each test set's number of images, by name."""
    ours, sizes = dataset_category_key(train_dataset), {}
    for name in cfg.TEST.DATASETS:
        test = _dataset(cfg, name, False)
        if (theirs := dataset_category_key(test)) != ours:  # labels would name other categories
            raise UserError(f"test set {test.ann_file} has other categories than the training set "
                            f"{train_dataset.ann_file} ({category_difference(theirs, ours)})")
        check_image_headers(test.ann_file, test.image_dir, test._records)
        sizes[name] = len(test)
    return sizes


def build_train_loader(cfg, start_iter: int = 0, rank: int = 0, world_size: int = 1, dataset=None):
    """An endless loader of (images, targets) batches for this rank, starting at start_iter."""
    dataset = build_train_dataset(cfg) if dataset is None else dataset
    check_batch_size(cfg, dataset)
    sampler = InfiniteGroupedBatchSampler(
        dataset.aspect_ratios, cfg.TRAIN.IMS_PER_BATCH, cfg.RNG_SEED, start_iter, rank, world_size,
        flip=cfg.TRAIN.USE_FLIPPED, group=cfg.TRAIN.ASPECT_GROUPING)
    loader = _loader(dataset, cfg.DATA_LOADER.NUM_THREADS, cfg.RNG_SEED + rank, True, batch_sampler=sampler)
    return loader, dataset


def build_test_loader(cfg, dataset_name: str, rank: int = 0, world_size: int = 1):
    """Sequential evaluation batches of this rank's shard (indices rank::world_size), unflipped."""
    dataset = _dataset(cfg, dataset_name, False)
    shard = list(range(rank, len(dataset), world_size))
    loader = _loader(dataset, cfg.DATA_LOADER.NUM_THREADS, cfg.RNG_SEED, False, sampler=shard,
                     batch_size=cfg.TEST.IMS_PER_BATCH)
    return loader, dataset
