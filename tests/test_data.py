"""Datasets, the synthetic generator, the batch sampler, loaders and the prefetcher."""
import contextlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from pycocotools import mask as mask_utils

from trainer.data import coco
from trainer.config import defaults
from trainer.data import CocoDetection, build_test_loader, build_train_loader, resolve_dataset
from trainer.data.images import as_float, decode, read_file
from trainer.data.prefetch import Prefetcher
from trainer.data.sampler import InfiniteGroupedBatchSampler
from trainer.errors import UserError
from trainer.data.synth import SHAPES, write_synthetic_dataset

pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),  # pycocotools
              pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")]  # torchvision 0.29


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "tiny", num_images=12, image_size=64, seed=0)


def _cfg(tmp_path, tiny=None, **train):
    cfg = defaults()
    cfg["DATA_DIR"] = str(tmp_path)
    if tiny is not None:
        cfg["DATASET_CATALOG"] = {"tiny": {"IM_DIR": str(tiny / "images"), "ANN_FN": str(tiny / "annotations.json")}}
        cfg.TRAIN["DATASETS"] = ["tiny"]
    cfg.TRAIN.update(train)
    cfg.DATA_LOADER["NUM_THREADS"] = 0
    return cfg


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- synthetic data ---------------------------------------------------------------------------

def test_synth_is_deterministic_and_atomic(tmp_path, tiny):
    a = write_synthetic_dataset(tmp_path / "a", num_images=12, image_size=64, seed=0)
    b = write_synthetic_dataset(tmp_path / "b", num_images=12, image_size=64, seed=1)
    assert _files(a) == _files(tiny)
    assert (a / "annotations.json").read_bytes() != (b / "annotations.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary folder left
    stamp = (a / "annotations.json").stat().st_mtime_ns
    write_synthetic_dataset(a, num_images=99, seed=5)  # a complete dataset is left alone
    assert (a / "annotations.json").stat().st_mtime_ns == stamp
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(UserError, match="no annotations.json"):
        write_synthetic_dataset(tmp_path / "junk")
    # a link to an empty folder: every image was drawn, then "Not a directory" (helper-55)
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to("empty")
    write_synthetic_dataset(tmp_path / "link", num_images=12, image_size=64, seed=0)
    assert _files(tmp_path / "link") == _files(tiny) and (tmp_path / "link").is_symlink()


def test_synth_content(tiny):
    d = json.loads((tiny / "annotations.json").read_text())
    assert [(c["id"], c["name"]) for c in d["categories"]] == list(enumerate(SHAPES, 1))
    assert all(c["keypoints"] == ["top", "right", "bottom", "left"] and c["skeleton"] for c in d["categories"])
    sizes = {(im["width"], im["height"]) for im in d["images"]}
    assert any(w < h for w, h in sizes) and any(w >= h for w, h in sizes)
    per_image = np.bincount([a["image_id"] for a in d["annotations"]])[1:]
    assert per_image.min() >= 1 and per_image.max() <= 4
    for a in d["annotations"]:
        assert a["iscrowd"] == 0 and a["num_keypoints"] == 4 and len(a["keypoints"]) == 12
        assert 12 <= a["bbox"][2] <= 60 and a["area"] > 0 and len(a["segmentation"][0]) >= 6


def test_synth_generated_on_first_use(tmp_path):
    image_dir, ann = resolve_dataset(_cfg(tmp_path), "synth_shapes_val")
    assert ann == tmp_path / "synth_shapes/val/annotations.json" and len(list(image_dir.iterdir())) == 16


# --- CocoDetection ----------------------------------------------------------------------------

def test_masks_match_boxes_and_areas(tiny):
    ds = CocoDetection(tiny / "images", tiny / "annotations.json", masks=True)
    assert ds.num_classes == len(SHAPES) + 1 and len(ds) == 12 and ds.label_to_cat_id == {k: k for k in range(1, len(SHAPES) + 1)}
    coco = ds.coco
    for i in range(len(ds)):
        image, t = ds[i]
        assert image.dtype == torch.uint8  # as stored: a quarter of float's bytes through /dev/shm; float on the device
        assert image.shape[1:] == t["masks"].shape[1:] and t["masks"].dtype == torch.uint8
        assert t["boxes"].dtype == torch.float32 and t["labels"].dtype == torch.int64
        assert len(t["masks"]) == len(t["boxes"]) == len(coco.imgToAnns[t["image_id"]])
        for mask, box, area in zip(t["masks"], t["boxes"], t["area"]):
            ys, xs = torch.nonzero(mask, as_tuple=True)
            assert xs.min() >= box[0] - 1 and xs.max() <= box[2] + 1
            assert ys.min() >= box[1] - 1 and ys.max() <= box[3] + 1
            assert abs(int(mask.sum()) - float(area)) <= 0.02 * float(area) + 1


def test_keypoints_and_flip(tiny):
    ds = CocoDetection(tiny / "images", tiny / "annotations.json", masks=True, keypoints=True)
    for i in (0, 3):  # a square and a portrait image
        image, t = ds[i]
        flipped, f = ds[(i, True)]
        width = image.shape[-1]
        assert t["keypoints"].shape == (len(t["boxes"]), 4, 3) and t["keypoints"].dtype == torch.float32
        assert torch.equal(flipped, image.flip(-1)) and torch.equal(f["masks"], t["masks"].flip(-1))
        assert torch.allclose(f["boxes"][:, [0, 2]], width - t["boxes"][:, [2, 0]])
        assert torch.equal(f["boxes"][:, [1, 3]], t["boxes"][:, [1, 3]])
        # left and right swap names: the flipped "left" point is the mirrored "right" one
        swapped = f["keypoints"][:, [0, 3, 2, 1]]
        assert torch.allclose(swapped[..., 0], width - t["keypoints"][..., 0])
        assert torch.equal(swapped[..., 1:], t["keypoints"][..., 1:])
        assert (f["keypoints"][:, 3, 0] <= f["keypoints"][:, 1, 0]).all()  # left stays left of right
        assert torch.equal(ds[(i, False)][0], image)


def _write_coco(root, images, annotations, categories=None):
    (root / "images").mkdir(parents=True, exist_ok=True)
    for im in images:
        Image.new("RGB", (im["width"], im["height"]), (200, 10, 10)).save(root / "images" / im["file_name"])
    categories = categories or [{"id": 7, "name": "thing"}, {"id": 9, "name": "other"}]
    (root / "annotations.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": categories}))
    return root / "images", root / "annotations.json"


def _ann(i, image_id, bbox, **kw):
    return {"id": i, "image_id": image_id, "category_id": kw.pop("category_id", 7), "bbox": bbox,
            "area": kw.pop("area", bbox[2] * bbox[3]), "iscrowd": kw.pop("iscrowd", 0), **kw}


def _edge_case_dataset(tmp_path):
    images = [{"id": k, "file_name": f"{k}.png", "width": 20, "height": 10} for k in (1, 2, 3, 4)]
    rle = mask_utils.encode(np.asfortranarray(np.pad(np.ones((4, 5), np.uint8), ((2, 4), (3, 12)))))
    rle["counts"] = rle["counts"].decode()
    crowd = mask_utils.encode(np.asfortranarray(np.ones((10, 20), np.uint8)))
    crowd_rle = {"size": [10, 20], "counts": [0, 200]}  # uncompressed RLE, as COCO writes crowds
    assert mask_utils.decode(mask_utils.frPyObjects(crowd_rle, 10, 20)).sum() == mask_utils.decode(crowd).sum()
    anns = [
        _ann(1, 1, [3, 2, 5, 4], segmentation=rle, category_id=9),  # compressed RLE mask
        _ann(2, 1, [0, 0, 20, 10], segmentation=crowd_rle, iscrowd=1),  # crowd: dropped in training
        _ann(3, 1, [5, 5, 0, 3]),  # zero width
        _ann(4, 1, [5, 5, -2, 3]),  # negative width
        _ann(5, 1, [-5, 8, 10, 10], segmentation=[[-5, 8, 5, 8, 5, 18, -5, 18]]),  # clipped to [0, 8, 5, 10]
        _ann(6, 2, [30, 0, 5, 5]),  # wholly outside: the image has no usable box left
        _ann(7, 3, [1, 1, 4, 4], segmentation=[[1, 1, 5, 1, 5, 5, 1, 5]]),
    ]  # image 4 has no annotation at all
    return _write_coco(tmp_path, images, anns)


def test_training_filters_crowd_and_bad_boxes(tmp_path, caplog):
    image_dir, ann = _edge_case_dataset(tmp_path)
    with caplog.at_level("INFO", logger="trainer.data"):
        ds = CocoDetection(image_dir, ann, masks=True)
    assert "dropped 1 crowd and 3 empty boxes; 2 of 4 images" in caplog.text
    assert ds.image_ids == [1, 3] and ds.aspect_ratios == [2.0, 2.0] and ds.num_classes == 3
    _, t = ds[0]
    assert t["labels"].tolist() == [2, 1] and t["iscrowd"].tolist() == [0, 0]  # category 9 -> label 2
    assert t["boxes"].tolist() == [[3, 2, 8, 6], [0, 8, 5, 10]]
    assert t["masks"][0].sum() == 20 and t["masks"][0][2:6, 3:8].all()  # the RLE mask
    assert t["masks"][1][8:, :5].all() and t["masks"][1].sum() == 10
    _, f = ds[(0, True)]
    assert f["boxes"].tolist() == [[12, 2, 17, 6], [15, 8, 20, 10]] and f["masks"][0][2:6, 12:17].all()


def test_a_training_set_with_no_annotation_at_all_says_so_not_crowd(tmp_path):
    """An export of the images alone (no box drawn yet): the crowd advice of a set whose boxes were
    all dropped would send the user looking for iscrowd flags that are not there."""
    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "a.png", "width": 10, "height": 8}], [])
    with pytest.raises(UserError, match=r"has no usable annotation: its annotations list is empty$"):
        CocoDetection(image_dir, ann)
    assert len(CocoDetection(image_dir, ann, train=False)) == 1  # a test set may hold images without boxes


def test_a_training_set_holds_its_masks_compactly_and_not_its_parsed_file(tmp_path):
    """helper-69's COCO-sized set (864k annotations, 575 MB): every rank kept the parsed file (3.6 GiB)
    for the whole job, and each loader worker copied the pages of the polygons' floats it read (~33
    kB per image: ~1 GB a worker in a Mask R-CNN 1x). The records now hold one array per polygon, an
    RLE as bytes, the same masks; a training set drops the parsed file (only a test set's is read
    again). Measured here as what the dataset keeps allocated: 5x the file before, 1.4x now."""
    import gc
    import tracemalloc

    rng = np.random.default_rng(0)
    images = [{"id": k, "file_name": f"{k}.png", "width": 64, "height": 48} for k in range(1, 41)]
    anns = [_ann(len(images) * j + k, k, [5, 5, 30, 30], segmentation=[np.round(rng.uniform(5, 40, 60), 2).tolist()])
            for k in range(1, 41) for j in range(50)]
    anns[0]["segmentation"] = {"size": [48, 64], "counts": [300, 20, 28, 20, 2704]}  # uncompressed RLE, not a crowd
    image_dir, ann = _write_coco(tmp_path, images, anns)
    gc.collect()
    tracemalloc.start()
    try:
        ds = CocoDetection(image_dir, ann, masks=True)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 2 * ann.stat().st_size, f"{held:,} bytes held for a {ann.stat().st_size:,}-byte file"
    coco = ds.coco  # the file read again, as a test set's evaluation reads it
    for i in (0, 1, 39):
        _, t = ds[i]
        expected = [coco.annToMask(a) for a in coco.imgToAnns[t["image_id"]]]
        assert len(expected) == 50 and all(np.array_equal(m.numpy(), e) for m, e in zip(t["masks"], expected))


def test_eval_keeps_everything(tmp_path):
    ds = CocoDetection(*_edge_case_dataset(tmp_path), train=False)
    assert ds.image_ids == [1, 2, 3, 4] and len(ds[0][1]["boxes"]) == 5 and ds[0][1]["iscrowd"].tolist()[1] == 1
    assert ds[3][1]["boxes"].shape == (0, 4)
    loaders = [build_test_loader(_test_cfg(tmp_path), str(tmp_path), rank=r, world_size=2)[0] for r in (0, 1)]
    ids = [[t["image_id"] for _, targets in loader for t in targets] for loader in loaders]
    assert ids == [[1, 3], [2, 4]]


def _test_cfg(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.TEST["IMS_PER_BATCH"] = 1
    return cfg


def test_user_errors(tmp_path, tiny):
    image = [{"id": 1, "file_name": "1.png", "width": 8, "height": 8}]
    cases = {
        "no_boxes": ([_ann(1, 1, [0, 0, 0, 0])], "no usable annotation"),
        "unknown_cat": ([_ann(1, 1, [0, 0, 4, 4], category_id=5)], "category_id 5, not among"),
        "no_anns": ([], "no usable annotation"),
    }
    for name, (anns, message) in cases.items():
        with pytest.raises(UserError, match=message):
            CocoDetection(*_write_coco(tmp_path / name, image, anns))
    image_dir, ann = _write_coco(tmp_path / "bad", image, [_ann(1, 1, [0, 0, 4, 4])])
    ann.write_text(ann.read_text()[:-5])
    with pytest.raises(UserError, match=f"malformed annotation file {ann}"):
        CocoDetection(image_dir, ann)
    images = [{"id": k, "file_name": f"{k}.png", "width": 8, "height": 8} for k in (1, 2, 3)]
    image_dir, ann = _write_coco(tmp_path / "missing", images, [_ann(1, 1, [0, 0, 4, 4])])
    (image_dir / "2.png").unlink()
    (image_dir / "3.png").unlink()
    with pytest.raises(UserError, match="2 of 3 images .* missing .* e.g. 2.png"):
        CocoDetection(image_dir, ann)


def test_bad_image_file(tmp_path):
    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "1.png", "width": 9, "height": 8}],
                                 [_ann(1, 1, [0, 0, 4, 4])])
    Image.new("RGB", (8, 8)).save(image_dir / "1.png")
    with pytest.raises(UserError, match="is 8x8 but .* says 9x8"):
        CocoDetection(image_dir, ann)[0]
    (image_dir / "1.png").write_bytes(b"not a png")
    with pytest.raises(UserError, match="cannot decode image"):
        CocoDetection(image_dir, ann)[0]
    # a newline in the name split the line: through a loader worker, whose last line is passed on,
    # the error lost the file's name (helper-55)
    data = json.loads(ann.read_text())
    data["images"][0]["file_name"] = "bad\nname.png"
    ann.write_text(json.dumps(data))
    (image_dir / "bad\nname.png").write_bytes(b"not a png")
    with pytest.raises(UserError) as e:
        CocoDetection(image_dir, ann)[0]
    assert str(e.value).startswith(f"cannot decode image {image_dir}/bad\\nname.png: ") and "\n" not in str(e.value)


def test_a_16_bit_png_is_read_on_the_same_0_to_1_scale_as_an_8_bit_one(tmp_path):
    """A 16-bit PNG decodes to values up to 65535: divided by 255 they went up to 257."""
    images = [{"id": 1, "file_name": "8bit.png", "width": 16, "height": 8},
              {"id": 2, "file_name": "16bit.png", "width": 16, "height": 8}]
    image_dir, ann = _write_coco(tmp_path, images, [_ann(1, 1, [0, 0, 4, 4]), _ann(2, 2, [0, 0, 4, 4])])
    gray = (np.arange(16 * 8).reshape(8, 16) * 2).astype(np.uint8)
    Image.fromarray(gray).save(image_dir / "8bit.png")
    Image.fromarray(gray.astype(np.uint16) * 257).save(image_dir / "16bit.png")  # the same picture, 16 bits
    ds = CocoDetection(image_dir, ann, train=False)
    eight, sixteen = ds[0][0], ds[1][0]
    assert eight.dtype == torch.uint8 and sixteen.dtype == torch.float32  # uint8 leaves the worker; 16 bits cannot
    assert float(sixteen.max()) <= 1.0
    assert torch.allclose(as_float(eight), sixteen, atol=1e-6)


def test_resolve_dataset(tmp_path, tiny):
    cfg = _cfg(tmp_path, tiny)
    assert resolve_dataset(cfg, "tiny") == (tiny / "images", tiny / "annotations.json")
    assert resolve_dataset(cfg, str(tiny)) == (tiny / "images", tiny / "annotations.json")
    with pytest.raises(UserError, match="unknown dataset 'coco_2017_trian' \\(did you mean coco_2017_train\\?\\)"):
        resolve_dataset(cfg, "coco_2017_trian")
    with pytest.raises(UserError, match="annotation file not found: .*instances_val2017.json"):
        resolve_dataset(cfg, "coco_2017_val")
    with pytest.raises(UserError, match="dataset folder not found"):
        resolve_dataset(cfg, str(tmp_path / "nope"))
    cfg["DATASET_CATALOG"]["coco_2017_val"] = {"IM_DIR": "x"}
    with pytest.raises(UserError, match="needs IM_DIR and ANN_FN"):
        resolve_dataset(cfg, "coco_2017_val")
    assert coco.CATALOG["keypoints_coco_2014_minival"] == (
        "coco/val2014", "coco/annotations/person_keypoints_minival2014.json")
    with pytest.raises(UserError, match="TRAIN.DATASETS is empty"):
        build_train_loader(_cfg(tmp_path))


def test_several_training_datasets(tmp_path, tiny):
    other = write_synthetic_dataset(tmp_path / "other", num_images=4, image_size=64, seed=3)
    cfg = _cfg(tmp_path, tiny)
    cfg.TRAIN["DATASETS"] = ["tiny", str(other)]
    _, ds = build_train_loader(cfg)
    assert len(ds) == 16 and ds.num_classes == len(SHAPES) + 1 and ds.num_keypoints == 4 and len(ds.aspect_ratios) == 16
    image, target = ds[(13, True)]
    assert torch.equal(image, CocoDetection(other / "images", other / "annotations.json")[(1, True)][0])
    _write_coco(tmp_path / "odd", [{"id": 1, "file_name": "1.png", "width": 8, "height": 8}], [_ann(1, 1, [0, 0, 4, 4])])
    cfg.TRAIN["DATASETS"] = ["tiny", str(tmp_path / "odd")]
    with pytest.raises(UserError, match="different categories"):
        build_train_loader(cfg)


# --- the sampler ------------------------------------------------------------------------------

RATIOS = [1.0] * 13 + [0.7] * 7  # two aspect groups


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_sampler_is_a_pure_function_of_seed_and_iteration():
    a = _take(InfiniteGroupedBatchSampler(RATIOS, 3, seed=5), 30)
    assert a == _take(InfiniteGroupedBatchSampler(RATIOS, 3, seed=5), 30)
    assert a != _take(InfiniteGroupedBatchSampler(RATIOS, 3, seed=6), 30)
    fresh = InfiniteGroupedBatchSampler(RATIOS, 3, seed=5)
    assert [fresh.batch_at(i) for i in (17, 3, 29, 0)] == [a[17], a[3], a[29], a[0]]
    assert _take(InfiniteGroupedBatchSampler(RATIOS, 3, seed=5, start_iter=11), 19) == a[11:]
    flips = [f for batch in a for _, f in batch]
    assert any(flips) and not all(flips)
    assert not any(f for b in _take(InfiniteGroupedBatchSampler(RATIOS, 3, 5, flip=False), 10) for _, f in b)


def test_sampler_epochs_groups_and_ranks():
    s = InfiniteGroupedBatchSampler(RATIOS, 3, seed=1)
    assert s.batches_per_epoch == 4 + 2  # 13 // 3 + 7 // 3: each group's remainder is dropped
    for epoch in range(3):
        batches = [s.batch_at(epoch * 6 + k) for k in range(6)]
        items = [i for b in batches for i, _ in b]
        assert len(set(items)) == 18
        assert all(len({RATIOS[i] < 1 for i, _ in b}) == 1 for b in batches)  # one aspect group per batch
    ranks = [InfiniteGroupedBatchSampler(RATIOS, 3, seed=1, rank=r, world_size=3) for r in range(3)]
    for it in (0, 1):  # iterations 0 and 1 use the epoch's six batches
        seen = [i for r in ranks for i, _ in r.batch_at(it)]
        assert len(seen) == len(set(seen)) == 9
    assert [ranks[r].batch_at(1) for r in range(3)] == [s.batch_at(3 + r) for r in range(3)]


def test_sampler_fallbacks():
    s = InfiniteGroupedBatchSampler([1.0] * 10 + [0.5], 4, seed=0)  # the portrait group cannot fill a batch
    assert s.batches_per_epoch == 2
    assert any(i == 10 for e in range(5) for k in range(2) for i, _ in s.batch_at(e * 2 + k))
    small = InfiniteGroupedBatchSampler([1.0, 0.5], 4, seed=0)  # smaller than one batch
    assert all(len(small.batch_at(i)) == 4 and {j for j, _ in small.batch_at(i)} == {0, 1} for i in range(3))
    ungrouped = InfiniteGroupedBatchSampler(RATIOS, 3, seed=1, group=False)
    assert ungrouped.batches_per_epoch == 6


# --- loaders and the prefetcher ---------------------------------------------------------------

def test_a_worker_hands_on_uint8_pixels_and_the_prefetcher_makes_them_float(tmp_path, tiny):
    """A quarter of float's bytes through /dev/shm, pinned memory and the copy to the GPU (docker's
    64 MB /dev/shm, row 314); the model gets the same floats as a decode to float gives."""
    cfg = _cfg(tmp_path, tiny, IMS_PER_BATCH=2)
    cfg.DATA_LOADER["NUM_THREADS"] = 1
    loader, dataset = build_train_loader(cfg)
    images, targets = next(iter(loader))
    assert [im.dtype for im in images] == [torch.uint8, torch.uint8]
    with Prefetcher([(images, targets)], torch.device("cpu")) as batches:
        floats, _ = batches.next()
    for pixels, got, t in zip(images, floats, targets):
        index = dataset.image_ids.index(t["image_id"])
        stored = decode(read_file(tiny / "images" / dataset.file_name(index)))  # what predict and serving read
        assert torch.equal(got, stored) or torch.equal(got, stored.flip(-1))  # the sampler may flip it


@pytest.mark.parametrize("error, said", [
    ("unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device (28)",
     "the data loader's workers are out of shared memory: /dev/shm holds"),
    ("unable to open shared memory object </torch_1_2_0> in read-write mode: Too many open files (24)",
     "the data loader's workers cannot put a batch in shared memory (/dev/shm): Too many open files (24); "
     "set DATA_LOADER.NUM_THREADS 0"),
    ("unable to open shared memory object </torch_1_2_0> in read-write mode: Permission denied (13)",
     "the data loader's workers cannot put a batch in shared memory (/dev/shm): Permission denied (13);")])
def test_a_worker_blames_the_size_of_dev_shm_only_when_it_is_full(monkeypatch, error, said):
    """A /dev/shm with room but another failure (the fd limit, no permission) is not sent to --shm-size."""
    from types import SimpleNamespace

    from trainer.data import workers

    if not os.path.isdir(workers.SHM):
        pytest.skip("no /dev/shm here")

    def fails(self):
        raise RuntimeError(error)

    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(num_workers=2))
    monkeypatch.setattr(torch.Tensor, "share_memory_", fails)
    with pytest.raises(UserError) as e:
        workers.in_shared_memory(([torch.zeros(3, 4, 4, dtype=torch.uint8)], [{"boxes": torch.zeros(0, 4)}]))
    assert str(e.value).startswith(said), str(e.value)
    assert ("--shm-size" in str(e.value)) == ("No space left" in error)


def test_loader_workers_give_the_same_batches(tmp_path, tiny):
    def first_batches(workers, start_iter=0):
        cfg = _cfg(tmp_path, tiny, IMS_PER_BATCH=2)
        cfg.DATA_LOADER["NUM_THREADS"] = workers
        cfg.MODEL["TYPE"] = "maskrcnn_resnet50_fpn"
        loader, dataset = build_train_loader(cfg, start_iter=start_iter)
        with Prefetcher(loader, torch.device("cpu")) as batches:
            got = [batches.next() for _ in range(5)]
            procs = list(getattr(batches._it, "_workers", []))
        assert len(procs) == workers and not any(w.is_alive() for w in procs)  # none outlives close()
        return got, dataset

    single, dataset = first_batches(0)
    multi, _ = first_batches(2)
    assert dataset.num_classes == len(SHAPES) + 1
    for (images0, targets0), (images1, targets1) in zip(single, multi):
        assert len(images0) == 2 and all(torch.equal(a, b) for a, b in zip(images0, images1))
        assert all(im.dtype == torch.float32 and 0 <= im.min() and im.max() <= 1 for im in images0 + images1)
        assert [t["image_id"] for t in targets0] == [t["image_id"] for t in targets1]
        assert all(torch.equal(a["masks"], b["masks"]) for a, b in zip(targets0, targets1))
    resumed, _ = first_batches(0, start_iter=3)
    assert all(torch.equal(a, b) for a, b in zip(resumed[0][0], single[3][0]))


def test_prefetcher_reraises_loader_errors(tmp_path):
    def failing():
        yield [torch.zeros(1)], [{}]
        raise ValueError("boom")

    p = Prefetcher(failing(), depth=2)
    assert p.next()[0][0].shape == (1,)
    for _ in range(2):
        with pytest.raises(ValueError, match="boom"):
            p.next()
    p.close()
    # A UserError raised in a worker process comes back as one clean line.
    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "1.png", "width": 8, "height": 8}],
                                 [_ann(1, 1, [0, 0, 4, 4])])
    cfg = _cfg(tmp_path, tmp_path)
    cfg.DATA_LOADER["NUM_THREADS"] = 1
    cfg.TRAIN["IMS_PER_BATCH"] = 1  # the one image
    (image_dir / "1.png").write_bytes(b"broken")
    loader, _ = build_train_loader(cfg)
    with Prefetcher(loader) as p, pytest.raises(UserError) as info:
        p.next()
    assert str(info.value).startswith("cannot decode image") and "\n" not in str(info.value)


class _Crash(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        os._exit(3)  # a worker killed mid-batch (out of memory, a segfault in a decoder)


def test_prefetcher_reports_a_dead_worker():
    loader = torch.utils.data.DataLoader(_Crash(), batch_size=2, num_workers=1)
    with Prefetcher(loader) as p, pytest.raises(RuntimeError, match="worker"):
        p.next()


def test_prefetcher_close_is_prompt():
    p = Prefetcher(itertools.repeat(([torch.ones(2)], [{"boxes": torch.zeros(0, 4)}])), depth=2)
    deadline = time.monotonic() + 5
    while p.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.qsize() == 2  # the thread now waits on a full queue
    start = time.monotonic()
    p.close()
    assert time.monotonic() - start < 0.5 and not p._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        p.next()

    release = threading.Event()

    def stuck():  # a source that never produces (a hung worker)
        release.wait(30)
        yield None

    p = Prefetcher(stuck())
    start = time.monotonic()
    p.close()
    assert time.monotonic() - start < 3
    release.set()


@pytest.mark.parametrize("counts, what", [([5, 3], "list runs short of the image"), ([150, 100], "list runs past it"),
                                          ("0i0", "compressed runs past it"), ("0", "compressed runs short"),
                                          # helper-55: read by character here, by UTF-8 byte in pycocotools (a traceback)
                                          ("\u00e90?hn3", "a character outside COCO's alphabet")])
def test_an_rle_mask_that_does_not_fit_its_image_is_refused_up_front(tmp_path, counts, what):
    """The RLE's size matches its image, its runs do not: pycocotools would decode it anyway (past
    the mask's end when the runs are too long), so the check counts them."""
    from trainer.data.checks import check

    images = [{"id": 1, "file_name": "1.png", "width": 20, "height": 10}]
    image_dir, ann = _write_coco(tmp_path, images, [_ann(1, 1, [0, 0, 4, 4],
                                                         segmentation={"size": [10, 20], "counts": counts})])
    data = json.loads(ann.read_text())
    with pytest.raises(UserError, match="has an RLE mask whose counts cover .* not the 10x20 of its image"):
        check(ann, data, image_dir, masks=True)
    good = mask_utils.encode(np.asfortranarray(np.ones((10, 20), np.uint8)))
    data["annotations"][0]["segmentation"] = {"size": [10, 20], "counts": good["counts"].decode()}
    check(ann, data, image_dir, masks=True)  # a fitting one passes
    # helper-55: a character 128 above COCO's has the same low bits, so its runs counted right here;
    # pycocotools reads the string's UTF-8 bytes, and its decoder ended in a traceback mid-training
    counts = good["counts"].decode()
    data["annotations"][0]["segmentation"]["counts"] = chr(ord(counts[0]) + 128) + counts[1:]
    with pytest.raises(UserError, match="has an RLE mask whose counts cover no valid run of pixels"):
        check(ann, data, image_dir, masks=True)


def test_annotations_without_area_or_iscrowd_are_evaluated(tmp_path):
    """Both are optional in many COCO-format datasets; COCOeval needs them (a KeyError after training)."""
    from trainer.evaluation import coco_evaluate

    images = [{"id": 1, "file_name": "1.png", "width": 20, "height": 10}]
    anns = [{"id": 1, "image_id": 1, "category_id": 7, "bbox": [2, 2, 6, 4]}]
    image_dir, ann = _write_coco(tmp_path, images, anns)
    ds = CocoDetection(image_dir, ann, train=False)
    hit = [{"image_id": 1, "category_id": 7, "bbox": [2, 2, 6, 4], "score": 0.9}]
    assert coco_evaluate(ds.coco, hit, ["bbox"])["bbox/AP"] == pytest.approx(1.0)


def test_keypoint_counts_must_agree_for_a_keypoint_model(tmp_path):
    from trainer.data.checks import check

    images = [{"id": 1, "file_name": "1.png", "width": 20, "height": 10}]
    cats = [{"id": 7, "name": "a", "keypoints": ["l", "r"]}, {"id": 9, "name": "b", "keypoints": ["l", "r", "m"]}]
    image_dir, ann = _write_coco(tmp_path, images, [_ann(1, 1, [0, 0, 4, 4], keypoints=[1, 1, 2, 3, 3, 2])], cats)
    data = json.loads(ann.read_text())
    with pytest.raises(UserError, match="categories name 2 and 3 keypoints"):
        check(ann, data, image_dir, keypoints=True)
    data["categories"][1]["keypoints"] = ["l", "r"]
    check(ann, data, image_dir, keypoints=True)  # agreeing: fine
    data["annotations"][0]["keypoints"] = [1, 1, 2]
    with pytest.raises(UserError, match="annotation 1 has 1 keypoints; its categories name 2"):
        check(ann, data, image_dir, keypoints=True)
    # a name twice: the flip map paired "l" with itself, and flipped samples lost one point and doubled
    # another (the red team of 2026-12-03); a box model never reads the names
    data["annotations"][0]["keypoints"] = [1, 1, 2, 3, 3, 2]
    for c in data["categories"]:
        c["keypoints"] = ["l", "l"]
    with pytest.raises(UserError, match="category 7 names keypoint 'l' twice; each needs its own name"):
        check(ann, data, image_dir, keypoints=True)
    check(ann, data, image_dir, keypoints=False)


def test_keypoints_missing_or_empty_are_none_labelled(tmp_path):
    """An object with no keypoints field and one with [] (exporters write either) mean the same: no point
    labelled. [] was refused as "0 keypoints" while a missing field was read as none (helper-94)."""
    images = [{"id": 1, "file_name": "1.png", "width": 20, "height": 10}]
    cats = [{"id": 7, "name": "a", "keypoints": ["l", "r"]}]
    anns = [_ann(1, 1, [0, 0, 4, 4], keypoints=[1, 1, 2, 3, 3, 2]), _ann(2, 1, [5, 5, 4, 4], keypoints=[]),
            _ann(3, 1, [9, 5, 4, 4])]
    image_dir, ann = _write_coco(tmp_path, images, anns, cats)
    ds = CocoDetection(image_dir, ann, train=False, keypoints=True)
    points = ds[0][1]["keypoints"]
    assert points.shape == (3, 2, 3)
    assert points[0, :, 2].tolist() == [2, 2] and points[1:].abs().sum() == 0
    assert [ds.coco.anns[i]["num_keypoints"] for i in (1, 2, 3)] == [2, 0, 0]


def test_an_animated_image_is_read_as_its_first_frame(tmp_path):
    images = [{"id": 1, "file_name": "1.gif", "width": 16, "height": 8}]
    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "1.png", "width": 16, "height": 8}],
                                 [_ann(1, 1, [0, 0, 4, 4])])
    frames = [Image.new("RGB", (16, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(image_dir / "1.gif", save_all=True, append_images=frames[1:])
    data = json.loads(ann.read_text())
    data["images"] = images
    ann.write_text(json.dumps(data))
    image = as_float(CocoDetection(image_dir, ann, train=False)[0][0])
    assert image.shape == (3, 8, 16) and float(image[0].mean()) > 0.9  # the red first frame


def test_an_animated_image_decodes_its_first_frame_alone(tmp_path):
    """Forty 4000x4000 frames fit in 500 kB of GIF. torchvision decoded them all to keep the first
    (3 GB and 14 s per image: a few such requests took the served model's worker). Found by the red
    team of 2026-12-02."""
    frames = [Image.new("P", (4000, 4000), i) for i in range(40)]
    frames[0].save(tmp_path / "many.gif", save_all=True, append_images=frames[1:])
    assert (tmp_path / "many.gif").stat().st_size < 2**20
    code = ("import resource, sys; from trainer.data.images import decode; data = open(sys.argv[1], 'rb').read(); "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; image = decode(data); "
            "print(tuple(image.shape), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "many.gif")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    shape, grown_mb = done.stdout.rsplit(" ", 1)
    assert shape == "(3, 4000, 4000)" and int(grown_mb) < 600  # the first frame as float is 192 MB


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_a_photo_is_turned_upright_for_inference_and_read_as_stored_for_training(fmt):
    """Each EXIF orientation (1-8), against PIL's ImageOps.exif_transpose: upright for predict and
    the served model, as viewers show it; as stored for training and evaluation, whose annotations
    are boxes on the stored pixels. torchvision turns JPEG and PNG, PIL the other formats."""
    import io

    from PIL import ImageOps

    from trainer.data.images import decode

    stored = np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8)
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        buf = io.BytesIO()
        Image.fromarray(stored).save(buf, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))
        data = buf.getvalue()
        with Image.open(io.BytesIO(data)) as im:
            as_stored, upright = np.array(im.convert("RGB")), np.array(ImageOps.exif_transpose(im).convert("RGB"))
        for turn, expected in ((True, upright), (False, as_stored)):
            got = (decode(data, upright=turn) * 255).round().byte().permute(1, 2, 0).numpy()
            assert got.shape == expected.shape, (fmt, orientation, turn)
            assert np.abs(got.astype(int) - expected).mean() < 3, (fmt, orientation, turn)  # lossy codecs differ a little


@pytest.mark.parametrize("polygons", [
    [[True, 0, 4, 0, 4, 4]], [[math.nan, 0, 4, 0, 4, 4]], [[math.inf, 0, 4, 0, 4, 4]], [["1", 0, 4, 0, 4, 4]],
    [[10 ** 400, 0, 4, 0, 4, 4]], [[1e39, 0, 4, 0, 4, 4]], [[[1, 2], 0, 4, 0, 4, 4]], [1, 0, 4, 0, 4, 4], [None],
    [[0, 0, 4, 0, 4, 4], [math.inf, 0, -math.inf, 0, 4, 4]], [[-1e39, 0.5, 4, 0, 4, 4]], [[10 ** 400, 0.5, 4, 0, 4, 4]],
    [[1e308, 1e308, 4, 0, 4, 4]], [[-math.inf, 0, 4, 0, 4, 4]],
], ids=["a-boolean", "nan", "infinity", "a-string", "a-400-digit-int", "past-float32", "nested", "flat", "none",
        "both-infinities-in-a-second-polygon", "below-float32", "a-400-digit-int-beside-a-float", "summing-past-float64",
        "minus-infinity"])
def test_a_polygon_of_anything_but_numbers_is_refused_up_front(tmp_path, polygons):
    """What JSON can hold in a polygon and no rasteriser takes (helper-69's COCO-sized set had 57 M
    numbers in its polygons, each checked at every start: a faster check must refuse these still)."""
    from trainer.data.checks import check

    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "1.png", "width": 20, "height": 10}],
                                 [_ann(1, 1, [0, 0, 4, 4], segmentation=polygons)])
    data = json.loads(ann.read_text())
    with pytest.raises(UserError, match=r"has segmentation .*: polygons \(lists of numbers\) or RLE"):
        check(ann, data, image_dir, masks=True)
    data["annotations"][0]["segmentation"] = [[0, 0.5, 4, 0, 4, 4.25], []]  # ints and floats, an empty one
    check(ann, data, image_dir, masks=True)


def test_huge_declared_images_and_far_polygons_are_refused_up_front(tmp_path):
    """50000x50000 would be decoded into gigabytes; a polygon point at 1e9 crashes pycocotools'
    rasteriser (a segfault, not an exception)."""
    from trainer.data.checks import check

    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "1.png", "width": 20, "height": 10}],
                                 [_ann(1, 1, [0, 0, 4, 4], segmentation=[[0, 0, 1e9, 0, 1e9, 1e9]])])
    data = json.loads(ann.read_text())
    with pytest.raises(UserError, match="has a polygon reaching 1e\\+09 pixels from the origin"):
        check(ann, data, image_dir, masks=True)
    data["images"][0].update(width=50_000, height=50_000)
    with pytest.raises(UserError, match="is 50000x50000; at most 20000 pixels a side"):
        check(ann, data, image_dir)
    # helper-55: each point within reach, the outline 860 edges of 1e6: pycocotools' count of the
    # points it rasterises overflowed (a segfault of the process, or of a loader worker); 1,000 took 21 GB
    data["images"][0].update(width=20, height=10)
    data["annotations"][0]["segmentation"] = [[0, 0, 1e6, 1e6, 0, 1e6, 1e6, 0] * 215]
    with pytest.raises(UserError, match="has polygons 860,000,000 pixels long, on an image of 10x20 "
                                        "\\(at most 10,000,000\\)"):
        check(ann, data, image_dir, masks=True)
    data["annotations"][0]["segmentation"] = [[0, 0, 19, 0, 19, 9, 0, 9], [2, 2, 5, 2, 5, 5]]
    check(ann, data, image_dir, masks=True)  # polygons an image holds pass
    # helper-57: a canopy on a 20000x20000 image, its wavy outline and 4,000 holes (1.3e6 pixels):
    # pycocotools rasterises it in a second, and the first cap (1e6) refused it
    data["images"][0].update(width=20_000, height=20_000)
    wavy = [v for i in range(0, 19_000, 2) for v in (500 + i, 500 + i % 4)] + [19_500, 19_500, 500, 19_500]
    hole = [0, 0, 60, 0, 120, 60, 60, 120, 0, 60]  # 360 pixels of outline
    holes = [[v + 200 * (k // 90 if j % 2 else k % 90) for j, v in enumerate(hole)] for k in range(4000)]
    data["annotations"][0]["segmentation"] = [wavy, *holes]
    check(ann, data, image_dir, masks=True)


@pytest.mark.parametrize("edit, says", [
    # trained and exited 0; eval, predict and the served model then refused the model's categories.json
    (lambda d: [c.update(id=f"c{c['id']}") for c in d["categories"]], "category id 'c7' is not an integer"),
    (lambda d: d["categories"][0].update(name={"a": [1, 2]}), "category 7 has name {'a': [1, 2]}, not a name"),
    (lambda d: d["categories"][0].update(name=5), "category 7 has name 5, not a name"),
    # MODEL.NUM_CLASSES 100,001 was refused, the same number of categories from the data built it (5 GB)
    (lambda d: d["categories"].extend({"id": 1000 + i, "name": f"k{i}"} for i in range(100_000)),
     "lists 100,002 categories; a model takes at most 99,999"),
], ids=["string-ids", "dict-name", "number-name", "too-many"])
def test_categories_no_model_can_keep_are_refused_up_front(tmp_path, edit, says):
    """helper-55's red team: what the model's categories.json cannot hold is refused with the data."""
    from trainer.data.checks import check

    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "1.png", "width": 20, "height": 10}],
                                 [_ann(1, 1, [0, 0, 4, 4])])
    data = json.loads(ann.read_text())
    check(ann, data, image_dir)
    edit(data)
    for a in data["annotations"]:
        a["category_id"] = data["categories"][0]["id"]
    with pytest.raises(UserError, match=re.escape(says)):
        check(ann, data, image_dir)


def test_reading_an_image_reserves_no_more_memory_than_the_file_holds(tmp_path):
    """Every image read reserved 512 MB of address space (read(MAX + 1) allocates it up front): a
    loader worker under `ulimit -v` or strict overcommit failed with MemoryError on a 1 kB PNG."""
    png = tmp_path / "small.png"
    Image.new("RGB", (16, 16)).save(png)
    script = (
        "import resource, sys\n"
        "from trainer.data.images import read_file\n"
        "size = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024\n"
        "limit = size + 256 * 2**20\n"
        "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
        f"assert read_file({str(png)!r}) == open({str(png)!r}, 'rb').read()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _train_with_open_files(tmp_path, data_dir, ulimit: str, *flags: str) -> subprocess.CompletedProcess:
    """The demo with 2 loader workers, started from a shell whose `ulimit -n` is `ulimit`."""
    from tests.conftest import demo_overrides, trainer_cmd

    cmd = trainer_cmd(*flags, *demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 4, "TRAIN.SNAPSHOT_ITERS": 2,
                                                                    "DATA_LOADER.NUM_THREADS": 2}))
    return subprocess.run(["bash", "-c", f'ulimit {ulimit} && exec "$@"', "bash", *cmd], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags", [(), ("--dry-run",)])
def test_too_few_open_files_for_the_loader_workers_is_one_line_before_anything_is_written(tmp_path, data_dir, flags):
    """`ulimit -n 32`: a worker's feeder thread died of EMFILE and the trainer waited for its batch
    without end (48 or 64: a traceback mid-job)."""
    done = _train_with_open_files(tmp_path, data_dir, "-n 40", *flags)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "DATA_LOADER.NUM_THREADS 2 needs about" in lines[0] and "limit is 40" in lines[0]
    assert sorted(os.listdir(tmp_path)) == []  # no OUTPUT_DIR, no mlflow.db


def test_a_low_soft_open_files_limit_is_raised_and_the_job_trains(tmp_path, data_dir):
    """Only the soft limit low (the hard one as the system set it): raised as `ulimit -n` would."""
    done = _train_with_open_files(tmp_path, data_dir, "-Sn 40")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "open files limit raised from 40 to" in done.stderr
    assert (tmp_path / "output" / "model_final.pth").is_file()


def test_an_unlimited_hard_open_files_limit_above_the_kernels_ceiling_is_one_error(monkeypatch):
    """`ulimit -Hn unlimited` still stops at fs.nr_open: raising the soft limit past it is refused
    by the kernel, which must read as the same one-line error, not a traceback."""
    import resource

    from trainer.errors import UserError
    from trainer.open_files import check_open_files

    nr_open = int(open("/proc/sys/fs/nr_open").read())
    workers = nr_open // 16  # needs more than the kernel allows any process
    monkeypatch.setattr(resource, "getrlimit", lambda which: (40, resource.RLIM_INFINITY))
    with pytest.raises(UserError, match=f"DATA_LOADER.NUM_THREADS {workers} needs about .* the limit is 40"):
        check_open_files(workers, 1)


@pytest.mark.parametrize("signum", ["TERM", "HUP"])
def test_a_signal_during_data_synth_leaves_no_hidden_folder(tmp_path, signum):
    """SIGTERM killed `data synth` where it stood: its hidden .s.tmp-<pid>-<hex>/ stayed, gigabytes of it."""
    import signal

    job = subprocess.Popen(["env", f"--default-signal={signum}", sys.executable, "-m", "trainer", "data", "synth",
                            "--out", str(tmp_path / "s"), "--num-images", "100000", "--size", "64"],
                           cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # env: pytest under nohup
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".s.tmp-*/images/*.png")):  # writing images
            assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()
            time.sleep(0.05)
        job.send_signal(getattr(signal, f"SIG{signum}"))
        assert job.wait(timeout=60) == 128 + getattr(signal, f"SIG{signum}")
    finally:
        job.kill()
    assert "Traceback" not in job.stderr.read().decode()
    assert os.listdir(tmp_path) == []  # neither the dataset nor its hidden folder



# --- what failed only after training, or with a traceback (red team of the data checks) ---------

def _edited_copy(source, dest, edit):
    """A copy of the dataset folder `source` whose annotation json `edit` changed in place."""
    import shutil

    shutil.copytree(source, dest)
    data = json.loads((dest / "annotations.json").read_text())
    edit(data)
    (dest / "annotations.json").write_text(json.dumps(data))
    return dest


def _swap_names(d):
    d["categories"][0]["name"], d["categories"][1]["name"] = d["categories"][1]["name"], d["categories"][0]["name"]


def _renumber(d):  # category 3 becomes 4, its annotations with it
    d["categories"][2]["id"] = 4
    for a in d["annotations"]:
        a["category_id"] = 4 if a["category_id"] == 3 else a["category_id"]


def _fewer(d):  # category 3 dropped, its annotations with it
    d["categories"].pop()
    d["annotations"] = [a for a in d["annotations"] if a["category_id"] != 3]


def _no_annotations_swapped(d):  # a test set of images only (image_info_*): its categories still count
    del d["annotations"]
    _swap_names(d)


@pytest.mark.parametrize("edit, differs", [
    (_swap_names, "category 1 'circle' against 1 'square'"),
    (_renumber, "category 4 'triangle' against 3 'triangle'"),
    (lambda d: d["categories"][0]["keypoints"].reverse(), "category 1 'square''s keypoint 1 is 'left' against 'top'"),
    (_fewer, "2 categories against 3"),
    (_no_annotations_swapped, "category 1 'circle' against 1 'square'"),
])
def test_a_test_set_with_other_categories_is_refused_before_training(tmp_path, tiny, edit, differs):
    """Accepted, the final evaluation crashed (a KeyError) or scored detections under swapped names."""
    test = _edited_copy(tiny, tmp_path / "test", edit)
    cfg = _cfg(tmp_path, tiny)
    cfg.MODEL["TYPE"] = "keypointrcnn_resnet50_fpn"  # keypoint names count for a keypoint model only
    cfg.TEST["DATASETS"] = [str(test)]
    with pytest.raises(UserError) as refused:
        coco.check_test_datasets(cfg, coco.build_train_dataset(cfg))
    assert str(refused.value) == (f"test set {test / 'annotations.json'} has other categories than the training set "
                                  f"{tiny / 'annotations.json'} ({differs})")
    fine = _edited_copy(tiny, tmp_path / "fine", lambda d: d.pop("annotations"))  # images only, same categories
    cfg.TEST["DATASETS"] = [str(fine)]
    coco.check_test_datasets(cfg, coco.build_train_dataset(cfg))


def test_training_sets_whose_keypoints_differ_are_refused(tmp_path, tiny):
    """The same categories with their keypoints in another order were concatenated: the keypoint
    head learnt "top" from one set and "left" from the other at the same index."""
    other = _edited_copy(tiny, tmp_path / "other", lambda d: [c["keypoints"].reverse() for c in d["categories"]])
    cfg = _cfg(tmp_path, tiny)
    cfg.TRAIN["DATASETS"] = ["tiny", str(other)]
    build_train_loader(cfg)  # a box model never reads keypoint names
    cfg.MODEL["TYPE"] = "keypointrcnn_resnet50_fpn"
    with pytest.raises(UserError) as refused:
        build_train_loader(cfg)
    assert str(refused.value) == (f"training datasets {tiny / 'annotations.json'} and {other / 'annotations.json'} "
                                  "have different categories (category 1 'square''s keypoint 1 is 'top' against 'left')")


def test_images_the_model_cannot_take_are_refused_from_the_json(tmp_path):
    """A 400x1 strip is resized to 192x0 by TRAIN.SCALES 128 / MAX_SIZE 192 (torchvision's
    RuntimeError mid-training); 7000x7000 is past the decoder's 40,000,000 pixels (refused when
    decoded, after the run was made). Training images are not opened: the json's sizes decide."""
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    from trainer.data.checks import check

    images = [{"id": 1, "file_name": "1.png", "width": 20, "height": 10},
              {"id": 2, "file_name": "2.png", "width": 400, "height": 1}]
    image_dir, ann = _write_coco(tmp_path / "d", images, [_ann(1, 1, [0, 0, 4, 4]), _ann(2, 2, [0, 0, 40, 1])])
    cfg = _cfg(tmp_path, tmp_path / "d", SCALES=[600], MAX_SIZE=1000)
    build_train_loader(cfg)  # 400x1 is 1000x2 there
    cfg.TRAIN.update(SCALES=[256, 128], MAX_SIZE=192)
    with pytest.raises(UserError) as refused:
        build_train_loader(cfg)
    assert str(refused.value) == (f"{ann}: image 2 is 400x1, which TRAIN.SCALES 128 and TRAIN.MAX_SIZE 192 resize to "
                                  "192x0 pixels: crop or drop images this thin")
    cfg.TEST.update(DATASETS=[str(tmp_path / "d")], SCALE=128, MAX_SIZE=192)
    with pytest.raises(UserError, match="image 2 is 400x1, which TEST.SCALE 128 and TEST.MAX_SIZE 192 resize to 192x0"):
        coco.check_test_datasets(cfg, CocoDetection(image_dir, ann))
    resize = GeneralizedRCNNTransform(128, 192, [0.0] * 3, [1.0] * 3).eval()
    for height in (1, 2, 3):  # the check says what torchvision does
        images[1]["height"] = height
        try:
            resize([torch.zeros(3, height, 400)])
            refused = None
        except RuntimeError:
            refused = True
        with pytest.raises(UserError) if refused else contextlib.nullcontext():
            check(ann, {"images": images, "annotations": [], "categories": []}, image_dir,
                       sizes=coco.input_sizes(cfg, train=False))
    data = json.loads(ann.read_text())
    data["images"][0].update(width=7000, height=7000)
    ann.write_text(json.dumps(data))
    cfg.TRAIN.update(SCALES=[600], MAX_SIZE=1000)
    with pytest.raises(UserError) as refused:
        build_train_loader(cfg)
    assert str(refused.value) == f"{ann}: image 1 is 7000x7000; at most 40,000,000 pixels (tile larger images)"


def test_a_test_sets_image_files_are_opened_before_training(tmp_path, tiny):
    """A test image the decoder cannot read, or of another size than its json says, was found only
    by the final evaluation, after the whole training: a rerun then had nothing to do."""
    test = _edited_copy(tiny, tmp_path / "test", lambda d: None)
    name = json.loads((tiny / "annotations.json").read_text())["images"][0]["file_name"]
    cfg = _cfg(tmp_path, tiny)
    cfg.TEST["DATASETS"] = [str(test)]
    train = coco.build_train_dataset(cfg)
    coco.check_test_datasets(cfg, train)  # as generated: fine
    image = Image.open(tiny / "images" / name)
    for save, message in [
        (lambda path: image.save(path, "BMP"), f"{test / 'images' / name} is BMP, not a format the trainer reads "
                                               "(JPEG, PNG, GIF or WebP)"),
        (lambda path: path.write_bytes(b"not an image"), f"{test / 'images' / name} is no image, not a format"),
        (lambda path: image.resize((8, 8)).save(path), f"{test / 'images' / name} is 8x8 but "
                                                       f"{test / 'annotations.json'} says {image.width}x{image.height}"),
        (lambda path: path.write_bytes((tiny / "images" / name).read_bytes()[:20]), "cannot read image"),
    ]:
        save(test / "images" / name)
        with pytest.raises(UserError) as refused:
            coco.check_test_datasets(cfg, train)
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_a_file_name_too_long_for_the_file_system_is_a_missing_image(tmp_path):
    """ENAMETOOLONG from the existence check was a 52-line traceback."""
    long = "x" * 300 + ".png"
    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "1.png", "width": 8, "height": 8}],
                                 [_ann(1, 1, [0, 0, 4, 4])])
    data = json.loads(ann.read_text())
    data["images"].append({"id": 2, "file_name": long, "width": 8, "height": 8})
    ann.write_text(json.dumps(data))
    with pytest.raises(UserError) as refused:
        CocoDetection(image_dir, ann)
    assert str(refused.value) == f"1 of 2 images listed in {ann} are missing from {image_dir}, e.g. {long}"


def test_an_annotation_file_with_a_utf8_bom_is_read(tmp_path):
    """Windows tools write one; it was refused (Unexpected UTF-8 BOM)."""
    image_dir, ann = _write_coco(tmp_path, [{"id": 1, "file_name": "1.png", "width": 8, "height": 8}],
                                 [_ann(1, 1, [0, 0, 4, 4])], [{"id": 7, "name": "dé"}])
    ann.write_bytes("\ufeff".encode() + ann.read_text().encode())
    ds = CocoDetection(image_dir, ann, train=False)
    assert len(ds) == 1 and ds.class_names == ["__background__", "dé"] and len(ds.coco.anns) == 1


def test_a_mask_model_is_refused_a_training_set_without_one_segmentation(tmp_path, caplog):
    """helper-70: Mask R-CNN trained on a box-only set exited 0, its mask head taught empty masks and
    registered with a segm AP of 0; a keypoint model on a set without keypoints is refused likewise.
    A test set without segmentations still scores the boxes, with a warning."""
    images = [{"id": 1, "file_name": "1.png", "width": 20, "height": 10}]
    for segmentation in ({}, {"segmentation": []}):
        image_dir, ann = _write_coco(tmp_path, images, [_ann(1, 1, [0, 0, 8, 8], **segmentation),
                                                        _ann(2, 1, [4, 2, 8, 6], **segmentation)])
        with pytest.raises(UserError, match=r"a mask model needs segmentations, and none of its 2 annotations has one"):
            CocoDetection(image_dir, ann, train=True, masks=True)
        assert len(CocoDetection(image_dir, ann, train=True)) == 1  # a box model trains on it
        with caplog.at_level("WARNING"):
            assert len(CocoDetection(image_dir, ann, train=False, masks=True)) == 1
        assert "has no segmentation: a mask model's segm scores on it are of empty masks" in caplog.text
    image_dir, ann = _write_coco(tmp_path, images, [_ann(1, 1, [0, 0, 8, 8]),
                                                    _ann(2, 1, [4, 2, 8, 6], segmentation=[[4, 2, 12, 2, 12, 8]])])
    assert len(CocoDetection(image_dir, ann, train=True, masks=True)) == 1  # one is enough (row 88: the rest empty)


def _phone_photos(root):
    """A folder dataset as Label Studio or CVAT export phone photos: stored sideways with EXIF
    orientation 6, annotated (width, height and boxes) upright, as the browser showed them."""
    (root / "images").mkdir(parents=True)
    images, anns = [], []
    for i in range(1, 4):
        exif = Image.Exif()
        exif[0x0112] = 6
        Image.new("RGB", (96, 80), (200, 40, 40)).save(root / "images" / f"IMG_{i}.jpg", exif=exif.tobytes())
        images.append({"id": i, "file_name": f"IMG_{i}.jpg", "width": 80, "height": 96})
        anns.append({"id": i, "image_id": i, "category_id": 1, "bbox": [10, 20, 30, 40], "area": 1200, "iscrowd": 0})
    (root / "annotations.json").write_text(json.dumps({"images": images, "annotations": anns,
                                                       "categories": [{"id": 1, "name": "red"}]}))
    return root


@pytest.mark.parametrize("test_sets", ["()", "same"], ids=["training-set", "test-set"])
def test_photos_annotated_upright_by_their_exif_orientation_are_refused_naming_it(tmp_path, test_sets):
    """The size check said only `IMG_1.jpg is 96x80 but annotations.json says 80x96`: nothing of the
    orientation the annotation tool applied, nor of the fix (detectron2's read_image applies it)."""
    from tests.conftest import demo_overrides, run_trainer

    photos = _phone_photos(tmp_path / "photos")
    done = run_trainer(demo_overrides(tmp_path, tmp_path, **{"TRAIN.DATASETS": f"('{photos}',)", "SOLVER.MAX_ITER": 2,
                                                             "TEST.DATASETS": f"('{photos}',)" if test_sets == "same" else "()",
                                                             "TRACKING.URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}), tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: {re.escape(str(photos / 'images'))}/IMG_\d\.jpg is 96x80 but "
                        rf"{re.escape(str(photos / 'annotations.json'))} says 80x96: its EXIF orientation \(6\) turns it, .*"
                        r"store the images upright \(`mogrify -auto-orient`, PIL's ImageOps.exif_transpose\)", line), line
    for path in (photos / "images").iterdir():  # the fix it names trains
        with Image.open(path) as im:
            upright = ImageOps.exif_transpose(im)
        upright.save(path)
    done = run_trainer(demo_overrides(tmp_path, tmp_path, **{"TRAIN.DATASETS": f"('{photos}',)", "SOLVER.MAX_ITER": 2,
                                                             "TEST.DATASETS": "()", "OUTPUT_DIR": str(tmp_path / "fixed"),
                                                             "TRACKING.URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("images, annotations", [("", "_annotations.coco.json"),
                                                 ("images", "annotations/instances_default.json"),
                                                 ("data", "labels.json")], ids=["roboflow", "cvat", "fiftyone"])
def test_an_annotation_tools_export_folder_is_refused_with_the_catalog_entry_that_reads_it(tmp_path, tiny, images,
                                                                                          annotations):
    """Roboflow's COCO export puts `_annotations.coco.json` beside the images (train/, valid/, test/),
    CVAT's `annotations/instances_default.json` beside `images/`, FiftyOne's `labels.json` beside
    `data/`: as a dataset folder each was `annotation file not found: …/annotations.json (check
    DATA_DIR=…)`, the folder found and DATA_DIR no part of the fix. The entry the line gives trains."""
    import shlex

    from tests.conftest import demo_overrides, run_trainer

    export = tmp_path / "export" / "train"
    (export / images).mkdir(parents=True)
    for image in (tiny / "images").iterdir():
        (export / images / image.name).write_bytes(image.read_bytes())
    (export / annotations).parent.mkdir(exist_ok=True)
    (export / annotations).write_bytes((tiny / "annotations.json").read_bytes())
    with pytest.raises(UserError) as refused:
        resolve_dataset(_cfg(tmp_path), "export/train")  # relative to DATA_DIR, as a user names it
    line = str(refused.value)
    assert line.startswith(f"dataset folder {export} has {annotations}, not annotations.json and images/: ")
    suggested = shlex.split(line.split("(e.g. ", 1)[1][:-1])
    done = run_trainer(demo_overrides(tmp_path, tmp_path, **{"SOLVER.MAX_ITER": 2, "TEST.DATASETS": "()",
                                                             "TRACKING.URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
                       + suggested, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


def _one_image_listed_as(tmp_path, file_name: str):
    """A one-image set whose image, x.png in the image folder, the annotation file lists as `file_name`."""
    image_dir, ann = _write_coco(tmp_path, [{"id": 0, "file_name": "x.png", "width": 8, "height": 8}], [_ann(0, 0, [0, 0, 4, 4])])
    data = json.loads(ann.read_text())
    data["images"][0]["file_name"] = file_name
    ann.write_text(json.dumps(data))
    return image_dir, ann


def test_an_absolute_file_name_missing_says_it_is_not_looked_for_in_the_image_folder(tmp_path):
    """Label Studio exports images it did not download as `/data/upload/1/x.jpg`: `missing from
    IMAGE_DIR, e.g. /data/upload/1/x.jpg` said where it was not looked for."""
    image_dir, ann = _one_image_listed_as(tmp_path, "/data/upload/1/x.png")
    with pytest.raises(UserError) as refused:
        CocoDetection(image_dir, ann)
    assert str(refused.value) == (f"1 of 1 images listed in {ann} are missing from {image_dir}, e.g. /data/upload/1/x.png (a "
                                  "file_name that is an absolute path, as Label Studio's /data/upload/..., is read there, "
                                  "not in the image folder: make the file names relative to it)")


def test_a_windows_file_name_missing_says_its_backslashes_are_no_folders(tmp_path):
    """labelme2coco run on Windows writes `JPEGImages\\\\x.png`: `missing from IMAGE_DIR, e.g.
    JPEGImages\\x.png` with the file there, in JPEGImages/, said nothing of why."""
    image_dir, ann = _one_image_listed_as(tmp_path, "JPEGImages\\x.png")
    (image_dir / "JPEGImages").mkdir()
    (image_dir / "x.png").rename(image_dir / "JPEGImages" / "x.png")
    with pytest.raises(UserError) as refused:
        CocoDetection(image_dir, ann)
    assert str(refused.value) == (f"1 of 1 images listed in {ann} are missing from {image_dir}, e.g. JPEGImages\\x.png (a "
                                  "file_name of backslashes, as written on Windows: folders are separated by '/' here)")
