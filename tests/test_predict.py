"""`tracktron predict` as a user runs it, and the drawing it writes (trainer/visualize.py).

Real files throughout: a randomly initialised demo model saved as a model folder (cheap, and its
scores spread around 0.25, so thresholds matter), and the model_final.pth of a 3-iteration
training. Bad input runs in this process (`trainer.cli.main`, as tests/test_bad_input.py does: it
is found before any prediction, at a fraction of a subprocess's cost); a few of the same cases run
as real processes to pin what the shell sees.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from tests.conftest import DEMO, demo_overrides, run_trainer
from trainer import cli
from trainer.config import load_config
from trainer.data import CocoDetection, resolve_dataset
from trainer.inference import decode, save
from trainer.models import build_model
from trainer.predict import output_names, split_args
from trainer.visualize import GROUND_TRUTH, draw, to_png

pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),  # pycocotools
              pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")]  # torchvision.io, 0.29

KEYS = {"boxes", "scores", "category_ids", "category_names", "image", "width", "height"}


def predict_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", "predict", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


@pytest.fixture(scope="module")
def categories(data_dir) -> list[dict]:
    cfg = load_config(DEMO, ["DATA_DIR", str(data_dir)])
    return CocoDetection(*resolve_dataset(cfg, "synth_shapes_val"), train=False).categories


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, data_dir, categories) -> Path:
    cfg = load_config(DEMO, ["DATA_DIR", str(data_dir)])
    torch.manual_seed(0)
    model = build_model(cfg, len(categories) + 1)
    return save(tmp_path_factory.mktemp("model") / "detector", cfg, model.state_dict(), categories, [])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_dir) -> Path:
    tmp = tmp_path_factory.mktemp("train")
    keys = {"SOLVER.MAX_ITER": 3, "TRACKING.ENABLED": False, "TEST.DATASETS": "()"}
    result = run_trainer(demo_overrides(tmp, data_dir, **keys), cwd=tmp)
    assert result.returncode == 0, result.stderr
    return tmp / "output" / "model_final.pth"


@pytest.fixture(scope="module")
def images(tmp_path_factory, data_dir) -> dict[str, Path]:
    """A validation PNG, a landscape JPEG of another size, and a PNG of the same stem in another folder."""
    cfg = load_config(DEMO, ["DATA_DIR", str(data_dir)])
    first, second = sorted(resolve_dataset(cfg, "synth_shapes_val")[0].glob("*.png"))[:2]
    root = tmp_path_factory.mktemp("images")
    (root / "other").mkdir()
    with Image.open(second) as im:
        im.convert("RGB").resize((90, 60)).save(root / "photo.jpg", quality=90)
    return {"png": Path(shutil.copy(first, root)), "jpg": root / "photo.jpg",
            "same_stem": Path(shutil.copy(second, root / "other" / first.name))}


def image_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        return im.size


# ------------------------------------------------------------------------------------- the command

def check_outputs(out: Path, name: str, source: Path, categories: list[dict]) -> dict:
    """What a user checks: the drawing opens at the image's size; the json is whole and in the image."""
    w, h = image_size(source)
    with Image.open(out / f"{name}.png") as drawn:
        assert (drawn.size, drawn.mode) == ((w, h), "RGB")
    found = json.loads((out / f"{name}.json").read_text())
    assert KEYS <= set(found) and found["image"] == str(source) and (found["width"], found["height"]) == (w, h)
    n = len(found["scores"])
    assert n > 0 and len(found["boxes"]) == len(found["category_ids"]) == len(found["category_names"]) == n
    assert all(0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h for x1, y1, x2, y2 in found["boxes"])
    assert set(found["category_names"]) <= {c["name"] for c in categories}
    return found


def test_predict_writes_a_drawing_and_the_detections_of_each_image(tmp_path, model_dir, images, categories):
    inputs = [images["png"], images["jpg"], images["same_stem"]]
    result = predict_cli("--weights", model_dir, "--out", tmp_path / "out", *inputs, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out, names = tmp_path / "out", ["000000", "photo", "000000-2"]  # the same stem twice: nothing overwritten
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.{e}" for n in names for e in ("png", "json"))
    lines = result.stdout.splitlines()
    assert len(lines) == len(inputs)
    for source, name, line in zip(inputs, names, lines):
        found = check_outputs(out, name, source, categories)
        above = sum(s >= 0.5 for s in found["scores"])
        assert line == f"{source}: {len(found['scores'])} detections ({above} above 0.5) -> {out / name}.png"


def test_images_whose_names_fill_the_systems_limit_get_their_results(tmp_path, model_dir, images, categories):
    """A 242-byte stem: the temporary file beside `<stem>.json`, `.<stem>.json.tmp.<host>.<pid>`, was
    too long, and predict ended in a traceback. A 255-byte file name (the most there is): so was
    `<stem>.json` itself. Results go under the stem, cut where a `-<n>` and `.json` still fit."""
    long, longest = "é" * 121, "b" * 251  # é is two bytes: a cut to fit the temporary name lands inside one
    sources = [Path(shutil.copy(images["png"], tmp_path / f"{stem}.png")) for stem in (long, longest)]
    result = predict_cli("--weights", model_dir, "--out", tmp_path / "out", *sources, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    names = [long, "b" * 243]
    for source, name in zip(sources, names):
        check_outputs(tmp_path / "out", name, source, categories)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{n}.{e}" for n in names for e in ("json", "png"))


def test_the_threshold_changes_the_drawing_only(tmp_path, model_dir, images):
    source = images["png"]
    runs = {t: predict_cli("--weights", model_dir, "--score-threshold", t, "--out", tmp_path / t, source, cwd=tmp_path)
            for t in ("1", "0")}
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr for r in runs.values()]
    assert (tmp_path / "1" / "000000.json").read_bytes() == (tmp_path / "0" / "000000.json").read_bytes()
    found = json.loads((tmp_path / "0" / "000000.json").read_text())
    assert max(found["scores"]) < 1.0
    original = np.asarray(Image.open(source).convert("RGB"))
    assert np.array_equal(np.asarray(Image.open(tmp_path / "1" / "000000.png")), original)  # nothing drawn
    assert not np.array_equal(np.asarray(Image.open(tmp_path / "0" / "000000.png")), original)

    # A lower threshold never draws fewer boxes: more pixels differ from the image, never fewer.
    pixels = decode(source.read_bytes())
    thresholds = [1.0, *np.quantile(found["scores"], [0.9, 0.5, 0.1]).tolist(), 0.0]
    changed = [int((draw(pixels, found, score_threshold=t) != original).any(2).sum()) for t in thresholds]
    assert changed == sorted(changed) and changed[0] == 0 < changed[-1], changed


def test_predict_from_a_training_checkpoint(tmp_path, checkpoint, images, categories):
    result = predict_cli("--weights", checkpoint, "--out", tmp_path / "out", images["jpg"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    check_outputs(tmp_path / "out", "photo", images["jpg"], categories)
    assert result.stdout.startswith(f"{images['jpg']}: ")


def test_a_phone_photo_with_an_exif_orientation_is_detected_upright(tmp_path, model_dir, images):
    """A portrait shot stored sideways with EXIF orientation 6 (as phones save them) gets the
    detections, drawing size and width/height of the same picture stored upright without a tag."""
    stored = np.array(Image.open(images["png"]).convert("RGB"))[:, :96]  # not square: the sides swap
    exif = Image.Exif()
    exif[0x0112] = 6  # turn 90 degrees clockwise to view
    Image.fromarray(stored).save(tmp_path / "sideways.png", exif=exif.tobytes())
    Image.fromarray(np.rot90(stored, k=-1)).save(tmp_path / "upright.png")
    result = predict_cli("--weights", model_dir, "--out", tmp_path / "out", "sideways.png", "upright.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    sideways, upright = (json.loads((tmp_path / "out" / f"{n}.json").read_text()) for n in ("sideways", "upright"))
    assert (sideways["width"], sideways["height"]) == (upright["width"], upright["height"]) == \
        (stored.shape[0], stored.shape[1])
    assert sideways["boxes"] == upright["boxes"] and sideways["scores"] == upright["scores"]
    assert image_size(tmp_path / "out" / "sideways.png") == image_size(tmp_path / "out" / "upright.png")


# ---------------------------------------------------------------------------------------- bad input

@pytest.fixture
def bad(tmp_path, images, model_dir):
    """Files to get wrong, in tmp_path (the working directory), and the argv builder."""
    good = Path(shutil.copy(images["png"], tmp_path / "good.png"))
    (tmp_path / "notes.txt").write_text("not an image\n")
    (tmp_path / "empty.png").write_bytes(b"")
    data = good.read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "shots").mkdir()
    (tmp_path / "taken").write_text("a file where OUT should go\n")
    Image.new("RGB", (400, 1)).save(tmp_path / "strip.png")  # scaled to no pixel on its short side
    Image.new("RGB", (32, 32)).save(tmp_path / "pic.bmp")  # PIL reads it, torchvision does not
    os.mkfifo(tmp_path / "fifo.png")  # reading it waited for a writer forever
    (tmp_path / "zero.png").symlink_to("/dev/zero")  # read until the OOM killer
    (tmp_path / "bomb.png").write_bytes(png_header(13000, 13000))  # PIL warns past 89M pixels, before our line
    (tmp_path / "plain.pth").write_bytes(pickle.dumps({"model": {"w": 1}}, protocol=4))  # torch warns of protocol 4
    return lambda *args, out="out", weights=str(model_dir): ["predict", "--weights", weights, "--out", out, *args]


BAD = [  # id, argv (from the `bad` fixture's builder), what the one line says
    ("missing image", lambda a: a("good.png", "missing.png"), "IMAGE missing.png: no such file"),
    ("folder as image", lambda a: a("shots"), "IMAGE shots is a folder"),
    ("not an image", lambda a: a("good.png", "notes.txt"), "IMAGE notes.txt: the bytes are no image format"),
    ("empty file", lambda a: a("empty.png"), "IMAGE empty.png: the file is empty"),
    ("truncated image", lambda a: a("truncated.png"), "IMAGE truncated.png: cannot decode the image"),
    ("no image", lambda a: a(), "no IMAGE given"),
    ("a 400x1 strip", lambda a: a("good.png", "strip.png"), "IMAGE strip.png: 400x1 pixels is too narrow a strip"),
    ("a BMP", lambda a: a("pic.bmp"), "IMAGE pic.bmp: cannot decode the image (Unsupported image file"),  # no C++ path
    ("a FIFO", lambda a: a("good.png", "fifo.png"), "IMAGE fifo.png: cannot read it (not an image file (a folder, a FIFO"),
    ("a link to /dev/zero", lambda a: a("zero.png"), "IMAGE zero.png: cannot read it (not an image file"),
    ("only overrides", lambda a: a("TEST.SCALE", "64"), "no IMAGE given"),
    ("out is a file", lambda a: a("good.png", out="taken"), "--out taken is a file"),
    ("out empty", lambda a: a("good.png", out=""), "--out must name a folder, got an empty value"),  # wrote into cwd
    ("out under a file", lambda a: a("good.png", out="taken/preds"), "cannot be made: taken is a file"),
    # os.access says yes to root under /proc: the traceback came after the inference (the red team's)
    ("out where nothing can be made", lambda a: a("good.png", out="/proc/tracktron-out"),
     "--out /proc/tracktron-out"),
    ("threshold above 1", lambda a: a("good.png", "--score-threshold", "1.5"), "--score-threshold 1.5: must be between 0"),
    ("threshold below 0", lambda a: a("good.png", "--score-threshold", "-0.1"), "must be between 0 and 1"),
    ("threshold nan", lambda a: a("good.png", "--score-threshold", "nan"), "must be between 0 and 1"),
    ("threshold not a number", lambda a: a("good.png", "--score-threshold", "high"), "'high' is not a valid float"),
    ("misspelt override", lambda a: a("good.png", "TEST.SCAL", "64"), "TEST.SCAL: no such file, nor a config key"),
    ("override without value", lambda a: a("good.png", "TEST.SCALE"), "KEY VALUE pairs"),
    ("missing config", lambda a: a("good.png", "--config", "nope.yaml"), "nope.yaml"),
    ("missing weights", lambda a: a("good.png", weights="nope.pth"), "--weights nope.pth: no such file"),
    ("weights not a checkpoint", lambda a: a("good.png", weights="notes.txt"), "notes.txt is not a valid torch checkpoint"),
    ("weights an empty file", lambda a: a("good.png", weights="empty.png"), "empty.png is not a valid torch checkpoint "
                                                                              "(the file is empty or cut short)"),
    ("weights folder not a model", lambda a: a("good.png", weights="shots"), "neither a checkpoint nor a tracktron model"),
    ("a 13000x13000 image", lambda a: a("bomb.png"), "IMAGE bomb.png: an image of 13000x13000 pixels: at most 40,000,000"),
    ("weights a plain pickle", lambda a: a("good.png", weights="plain.pth"), "plain.pth is not a valid torch checkpoint"),
]
# also as real processes (the library warnings of the last two reached stderr before the line: helper-46)
SHELL = ["missing image", "not an image", "out is a file", "a 13000x13000 image", "weights a plain pickle"]


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature, IHDR and IEND, no pixels: what PIL reads to tell the size."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_mtime_ns) for p in root.rglob("*")}


def run_in_process(argv: list[str]) -> tuple[int | None, str]:
    """`tracktron <argv>` here: its exit status and stderr; anything but SystemExit fails the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.main(argv)
    except SystemExit as e:
        return e.code, err.getvalue()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return None, err.getvalue()


def assert_one_error_line(code, stderr: str, expected: str) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("argv, expected", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_one_line_exit_2_and_nothing_written(bad, tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    assert_one_error_line(*run_in_process(argv(bad)), expected)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("argv, expected", [c[1:] for c in BAD if c[0] in SHELL], ids=SHELL)
def test_bad_input_as_the_shell_sees_it(bad, tmp_path, argv, expected):
    before = tree(tmp_path)
    result = predict_cli(*argv(bad)[1:], cwd=tmp_path)
    assert_one_error_line(result.returncode, result.stderr, expected)
    assert result.stdout == "" and tree(tmp_path) == before


def test_arguments_split_at_the_first_config_key_and_stems_stay_unique():
    assert split_args(["a.jpg", "IMG_0001.JPG", "TEST.SCALE", "64", "MODEL.TYPE", "x"]) == (
        ["a.jpg", "IMG_0001.JPG"], ["TEST.SCALE", "64", "MODEL.TYPE", "x"])
    assert split_args(["a.jpg", "DATASET_CATALOG.mine.IM_DIR", "d"]) == (["a.jpg"], ["DATASET_CATALOG.mine.IM_DIR", "d"])
    assert output_names(["a/x.png", "b/x.jpg", "X.png", "x-2.png"], Path("out")) == ["x", "x-2", "X-3", "x-2-2"]


def test_names_reach_the_terminal_escaped_and_a_link_loop_in_out_is_a_name_taken(tmp_path, model_dir, images):
    """A file name is anyone's to choose: its escape sequences and newlines are shown escaped on
    stdout. A symlink loop where a result would go is no traceback, and is left as it is (the user's)."""
    name = "evil\x1b[31mRED\x1b]0;pwned\x07\nline2"
    shutil.copy(images["png"], tmp_path / f"{name}.png")
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.png").symlink_to("y.png")
    (out / "y.png").symlink_to("x.png")
    shutil.copy(images["png"], tmp_path / "x.png")
    result = predict_cli("--weights", model_dir, "--out", out, f"{name}.png", "x.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not set("\x1b\x07\r") & set(result.stdout) and len(result.stdout.splitlines()) == 2
    assert "evil\\x1b[31mRED\\x1b]0;pwned\\x07\\nline2.png: " in result.stdout
    with Image.open(out / "x-2.png") as drawn:
        assert drawn.size == image_size(images["png"])
    assert os.readlink(out / "x.png") == "y.png" and os.readlink(out / "y.png") == "x.png"


def test_out_as_the_images_folder_never_overwrites_an_image(tmp_path, model_dir, images, categories):
    shots = tmp_path / "shots"
    shots.mkdir()
    png, jpg = Path(shutil.copy(images["png"], shots)), Path(shutil.copy(images["jpg"], shots))
    before = {p: p.read_bytes() for p in (png, jpg)}
    result = predict_cli("--weights", model_dir, "--out", shots, png, jpg, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(p.read_bytes() == data for p, data in before.items())  # the user's images as they were
    check_outputs(shots, f"{png.stem}-2", png, categories)  # its drawing beside it, under another name
    check_outputs(shots, "photo", jpg, categories)


def test_out_as_the_images_folder_never_replaces_a_users_file_but_replaces_its_own(tmp_path, model_dir, images,
                                                                                   categories):
    """cat.jpg with the user's cat.png and a LabelMe cat.json beside it, predicted into its own
    folder: both were replaced by the drawing and the detections, exit 0. They are left as they
    are; a rerun replaces its own earlier results. Found by the red team of 2026-12-03."""
    photos = tmp_path / "photos"
    photos.mkdir()
    cat = Path(shutil.copy(images["jpg"], photos / "cat.jpg"))
    shutil.copy(images["png"], photos / "cat.png")
    (photos / "cat.json").write_text('{"version": "5.0.1", "shapes": [], "imagePath": "cat.jpg"}')
    before = {p.name: p.read_bytes() for p in photos.iterdir()}
    for _ in range(2):
        result = predict_cli("--weights", model_dir, "--out", photos, cat, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert all((photos / name).read_bytes() == data for name, data in before.items())
        check_outputs(photos, "cat-2", cat, categories)
    assert sorted(p.name for p in photos.iterdir()) == ["cat-2.json", "cat-2.png", "cat.jpg", "cat.json", "cat.png"]


def test_a_later_run_never_replaces_another_images_results_of_the_same_name(tmp_path, model_dir, images, categories):
    """a/x.png, then b/x.png predicted into the same OUT by a second run: b's results replaced a's
    (x.json named b/x.png afterwards), though the first run knew to give one of them x-2. An earlier
    result of another image now stays; one of the same image is still replaced. Found by the red
    team of 2026-12-03 (second)."""
    a, b = tmp_path / "a" / "x.png", tmp_path / "b" / "x.png"
    for path in (a, b):
        path.parent.mkdir()
        shutil.copy(images["png"], path)
    out = tmp_path / "out"
    for image in (a, b, a, b):
        result = predict_cli("--weights", model_dir, "--out", out, image, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    check_outputs(out, "x", a, categories)
    check_outputs(out, "x-2", b, categories)
    assert sorted(p.name for p in out.iterdir()) == ["x-2.json", "x-2.png", "x.json", "x.png"]


def test_the_same_image_from_another_folder_replaces_its_own_results(tmp_path, model_dir, images, categories):
    """`predict photos/cat.jpg` from one folder, then `predict cat.jpg` from photos/: the json named
    the image as typed (relative), so the second run took it for another image's and wrote cat-2.
    The json now names the image's absolute path: the rerun replaces its own results. Found by the
    review of 2026-12-03 (fourth)."""
    photos, out = tmp_path / "photos", tmp_path / "out"
    photos.mkdir()
    cat = Path(shutil.copy(images["jpg"], photos / "cat.jpg"))
    for image, cwd in (("photos/cat.jpg", tmp_path), ("cat.jpg", photos), (str(cat), out.parent)):
        result = predict_cli("--weights", model_dir, "--out", out, image, cwd=cwd)
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in out.iterdir()) == ["cat.json", "cat.png"]
        check_outputs(out, "cat", cat, categories)


def test_a_folder_where_a_drawing_was_takes_the_next_name_and_a_reader_gone_stops_nothing(tmp_path, model_dir, images,
                                                                                           categories):
    """helper-46's red team: a prediction's .png replaced by a folder (its json still this image's)
    was a traceback at the rename, after the drawing was made; and `predict ... | head -1` exited 1
    with nothing said, the images after the second left unpredicted (the pipe's EPIPE)."""
    out = tmp_path / "out"
    first = predict_cli("--weights", model_dir, "--out", out, images["png"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    name = images["png"].stem
    (out / f"{name}.png").unlink()
    (out / f"{name}.png").mkdir()
    again = predict_cli("--weights", model_dir, "--out", out, images["png"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    check_outputs(out, f"{name}-2", images["png"], categories)
    assert (out / f"{name}.png").is_dir()

    many = []
    for n in range(4):
        many.append(tmp_path / "many" / f"img{n}.png")
        many[-1].parent.mkdir(exist_ok=True)
        shutil.copy(images["png"], many[-1])
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: `| head -0`
    try:
        gone = subprocess.run([sys.executable, "-m", "trainer", "predict", "--weights", str(model_dir), "--out",
                               str(tmp_path / "piped"), *map(str, many)], cwd=tmp_path, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert gone.returncode == 0, gone.stderr
    assert "the console's stdout is gone" in gone.stderr
    for image in many:
        check_outputs(tmp_path / "piped", image.stem, image, categories)


# ------------------------------------------------------------------------------------------ drawing

def canvas(h: int = 100, w: int = 120) -> tuple[torch.Tensor, np.ndarray]:
    """A float image as decode gives it, and its exact uint8 pixels (HxWx3)."""
    pixels = torch.randint(0, 256, (3, h, w), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return pixels.float() / 255, pixels.permute(1, 2, 0).numpy()


def detections(boxes, scores=None, **extra) -> dict:
    n = len(boxes)
    return {"boxes": boxes, "scores": scores or [0.9] * n, "category_ids": [1] * n,
            "category_names": ["square"] * n, **extra}


def rles(masks: np.ndarray) -> list[dict]:
    """N HxW masks as json keeps them: COCO RLE with str counts."""
    out = mask_utils.encode(np.asfortranarray(masks.transpose(1, 2, 0).astype(np.uint8)))
    return [{**r, "counts": r["counts"].decode("ascii")} for r in out]


def test_draw_zero_detections_returns_the_image_unchanged_without_warnings():
    image, pixels = canvas()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torchvision warns when handed no boxes
        drawn = draw(image, detections([]), ground_truth={"boxes": [], "category_names": []})
    assert drawn.dtype == np.uint8 and drawn.shape == (100, 120, 3) and np.array_equal(drawn, pixels)
    assert np.array_equal(draw(image, detections([[10, 10, 50, 50]], [0.4])), pixels)  # below the threshold


def test_draw_boxes_outside_the_image_and_a_one_pixel_image():
    image, pixels = canvas()
    outside = [[-50, -50, -10, -10], [200, 10, 300, 40], [float("nan"), 0, 5, 5]]
    assert np.array_equal(draw(image, detections(outside)), pixels)
    changed = (draw(image, detections([[60, 30, 500, 500]])) != pixels).any(2)
    assert changed[30:, 118:].any() and changed[99, 60:].any()  # clipped to the right and bottom edges
    assert not changed[:29].any() and not changed[:, :59].any()
    tiny = draw(canvas(1, 1)[0], detections([[-5, -5, 5, 5]]), ground_truth={"boxes": [[0, 0, 3, 3]],
                                                                              "category_names": ["x"]})
    assert tiny.shape == (1, 1, 3)


def test_draw_masks_keypoints_and_ground_truth():
    image, pixels = canvas()
    masks = np.zeros((2, 100, 120), bool)
    masks[0, 40:60, 40:80] = True
    found = detections([[40, 40, 80, 60], [0, 0, 5, 5]], masks=rles(masks),
                       keypoints=[[[100, 90, 1], [10, 90, 0]], [[0, 0, 0], [0, 0, 0]]])
    changed = (draw(image, found) != pixels).any(2)
    assert changed[45:55, 50:70].all()  # the mask, inside its box
    assert changed[90, 100] and not changed[90, 10]  # a visible keypoint drawn, an invisible one not
    assert not changed[70:85, 20:90].any()  # clear of every box, mask and keypoint

    wrong_size = detections([[40, 40, 80, 60]], masks=rles(np.ones((1, 10, 10), bool)))
    assert draw(image, wrong_size).shape == (100, 120, 3)  # a mask of another size is skipped

    truth = draw(image, detections([]), ground_truth={"boxes": [[20, 20, 80, 80]], "category_names": ["circle"],
                                                      "masks": rles(masks[:1])})
    assert tuple(truth[50, 20]) == GROUND_TRUTH  # the box's left edge
    assert not np.array_equal(truth[45:55, 50:70], pixels[45:55, 50:70])


def test_to_png_round_trips():
    _, pixels = canvas(7, 5)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(to_png(pixels)))), pixels)
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        to_png(pixels[..., 0])


# A checkpoint's or model folder's categories and config of the wrong types: (id, the change made to
# the good ones, what the line says)
def _first_category(**change):
    return lambda meta: {**meta, "categories": [{**meta["categories"][0], **change}, *meta["categories"][1:]]}


WRONG_METADATA = [
    ("categories a string", lambda meta: "circle", "categories"),
    ("category list a string", lambda meta: {**meta, "categories": "circle"}, "categories"),
    ("a category id a string", _first_category(id="1"), "categories"),
    ("a category name a number", _first_category(name=5), "categories"),
    ("keypoint names a number", lambda meta: {**meta, "keypoint_names": 5}, "keypoint_names"),
    ("config a string", "MODEL", "config"),
    ("config section a number", {"MODEL": 5}, "MODEL"),
]


@pytest.mark.parametrize("change, expected", [c[1:] for c in WRONG_METADATA], ids=[c[0] for c in WRONG_METADATA])
def test_wrong_types_in_a_checkpoint_or_model_folder_are_one_line(tmp_path, monkeypatch, checkpoint, model_dir, images,
                                                                   data_dir, change, expected):
    """predict of a checkpoint and of a model folder, and eval of the checkpoint (whose config is
    --config's, not the file's): one line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    state = torch.load(checkpoint, weights_only=True)
    folder = Path(shutil.copytree(model_dir, tmp_path / "odd"))
    commands = [["predict", "--weights", "odd.pth", "--out", "out", str(images["png"])],
                ["predict", "--weights", "odd", "--out", "out", str(images["png"])]]
    if callable(change):  # the categories
        torch.save({**state, "categories": change(state["categories"])}, tmp_path / "odd.pth")
        (folder / "categories.json").write_text(json.dumps(change(json.loads((folder / "categories.json").read_text()))))
        commands.append(["eval", "--config", str(DEMO), "--weights", "odd.pth", "DATA_DIR", str(data_dir),
                         "OUTPUT_DIR", "o"])
    else:
        torch.save({**state, "config": change}, tmp_path / "odd.pth")
        (folder / "config.yaml").write_text(json.dumps(change))
    for argv in commands:
        code, stderr = run_in_process(argv)
        assert_one_error_line(code, stderr, expected)
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
