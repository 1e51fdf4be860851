"""trainer.inference: what the served model and `tracktron predict` accept, and what they refuse."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ROOT
from trainer.errors import UserError
from trainer.inference import Detector, decode, detections_of, save


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), 128).save(buffer, "PNG")
    return buffer.getvalue()


def test_bytes_and_arrays_decode_alike():
    array = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    from_bytes, from_array = decode(buffer.getvalue()), decode(array)
    assert from_bytes.shape == (3, 20, 30) and torch.equal(from_bytes, from_array)
    assert decode(_png(5, 4, "L")).shape == (3, 4, 5)  # grey becomes RGB, as the loader reads it


@pytest.mark.parametrize("image, message", [
    (b"", "empty"),
    (b"hello, not an image", "no image format"),
    (_png(20_001, 1), "each side must be 1 to 20000"),
    (_png(9_000, 5_000, "1"), "at most 40,000,000 pixels"),  # 1-bit: a small file, 45 M pixels decoded
    (_png(40, 30)[:60], "cannot decode"),  # truncated
    (np.zeros((4, 4), np.uint8), "HxWx3 uint8"),
    (np.zeros((4, 4, 3), np.float32), "HxWx3 uint8"),
    ("a path, not bytes", "encoded bytes"),
])
def test_what_is_not_an_image_is_one_clear_value_error(image, message):
    with pytest.raises(ValueError, match=message):
        decode(image)


def test_a_label_past_the_categories_keeps_its_number():
    output = {"boxes": torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 2), "scores": torch.tensor([0.9, 0.8]),
              "labels": torch.tensor([1, 5])}
    found = detections_of(output, [{"id": 7, "name": "cat"}])
    assert found["category_ids"] == [7, 5] and found["category_names"] == ["cat", "5"]


def test_masks_leave_the_device_thresholded_and_encode_as_their_probabilities_over_a_half():
    from pycocotools import mask as mask_utils

    from trainer.inference import on_host

    probs = torch.tensor([[0.4, 0.5, 0.6], [0.9, 0.1, 0.51]]).reshape(1, 1, 2, 3)
    output = {"boxes": torch.tensor([[0.0, 0.0, 3.0, 2.0]]), "scores": torch.tensor([0.9]), "labels": torch.tensor([1]),
              "masks": probs}
    assert on_host(output)["masks"].dtype == torch.bool  # a quarter of the floats a GPU would copy out
    (rle,) = detections_of(output, [{"id": 7, "name": "cat"}])["masks"]
    assert mask_utils.decode({**rle, "counts": rle["counts"].encode()}).tolist() == [[0, 0, 1], [1, 0, 1]]


def test_a_damaged_model_folder_is_a_user_error(tmp_path):
    from trainer.config import load_config
    from trainer.models import build_model

    cfg = load_config(ROOT / "configs" / "demo.yaml")
    model = build_model(cfg, 3)
    folder = save(tmp_path / "detector", cfg, model.state_dict(), [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}], [])
    assert Detector.load(folder).categories[1]["name"] == "b"
    (folder / "categories.json").write_text(json.dumps({"categories": [{"id": 1}]}))  # one class too few
    with pytest.raises(UserError, match="do not fit"):
        Detector.load(folder)
    (folder / "categories.json").write_text(json.dumps({"categories": "two"}))
    with pytest.raises(UserError, match="categories.json lists no categories"):
        Detector.load(folder)
    (folder / "weights.pt").write_bytes(b"\x80\x04garbage")
    with pytest.raises(UserError, match="not a usable tracktron model"):
        Detector.load(folder)


@pytest.mark.parametrize("model_type, extra", [("maskrcnn_resnet50_fpn", {"masks"}),
                                               ("keypointrcnn_resnet50_fpn", {"keypoints"})])
def test_the_logged_models_signature_names_what_its_predictions_hold(tmp_path, monkeypatch, model_type, extra):
    """The output signature listed boxes, scores and categories only: a Mask R-CNN's masks and a
    Keypoint R-CNN's keypoints, which every prediction of theirs holds, were missing from it."""
    import mlflow
    import pandas as pd

    from trainer.config import load_config
    from trainer.models import build_model
    from trainer.tracking.logged_model import log_detector

    cfg = load_config(ROOT / "configs" / "demo.yaml", ["MODEL.TYPE", model_type])
    keypoints = ["left", "right"] if extra == {"keypoints"} else []
    model = build_model(cfg, 3, len(keypoints))
    folder = save(tmp_path / "detector", cfg, model.state_dict(), [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}],
                  keypoints)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)  # the store's artifacts go to ./mlruns
    run = mlflow.MlflowClient(tracking_uri=uri).create_run("0")
    info = log_detector(uri, run.info.run_id, folder)
    columns = set(info.signature.outputs.input_names())
    assert columns == {"boxes", "scores", "category_ids", "category_names"} | extra
    (found,) = mlflow.pyfunc.load_model(info.model_uri).predict(pd.DataFrame({"image": [_png(64, 48)]}))
    assert set(found) == columns


def test_a_model_folder_that_does_not_fit_is_one_line_naming_the_file_and_keeps_the_older_one(tmp_path):
    """The disk full (here a 1 MiB file size limit, EFBIG; Python ignores SIGXFSZ) while the final
    model is written: `OSError: [Errno 28] No space left on device` named no file. Now it names the
    file and the free space, as a checkpoint's write error does, and the folder's older files stay.
    Found by the red team of 2026-12-03 (second)."""
    import resource

    from trainer.atomic_write import WriteError
    from trainer.config import load_config
    from trainer.inference import CATEGORIES, CONFIG, WEIGHTS

    cfg = load_config(ROOT / "configs" / "demo.yaml")
    categories = [{"id": 1, "name": "a"}]
    folder = save(tmp_path / "detector", cfg, {"w": torch.zeros(4)}, categories, [])
    before = (folder / WEIGHTS).read_bytes()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))
    try:
        with pytest.raises(WriteError) as err:
            save(folder, cfg, {"w": torch.zeros(1 << 20)}, categories, [])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert str(err.value).startswith(f"cannot write file {folder / WEIGHTS}: File too large (")
    assert "MiB free in" in str(err.value) and "\n" not in str(err.value)
    assert (folder / WEIGHTS).read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == sorted([WEIGHTS, CONFIG, CATEGORIES])
