"""`tracktron predict`: a trained detector on image files, without a dataset or a tracking run.

For each IMAGE it writes OUT/<stem>.png (the detections at or above the score threshold, drawn) and
OUT/<stem>.json (every detection, with the image's path and size); output_names keeps them from
replacing anything but an earlier prediction of the same image. Every input is checked before
anything is predicted or written: a bad one ends as a UserError, and OUT is left as it was.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from PIL import Image

from trainer.atomic_write import write_atomic
from trainer.config import defaults, flatten, load_config
from trainer.data.images import read_file
from trainer.errors import UserError, first_line, user_path
from trainer.redaction import printable
from trainer.inference import check_weights_given, decode
from trainer.logs import write_or_drop
from trainer.output_dir import make_writable, named_folder
from trainer.tracking.logged_model import load_detector
from trainer.visualize import draw, to_png


def split_args(args) -> tuple[list[str], list[str]]:
    """IMAGE... [KEY VALUE ...]: the overrides start at the first argument that names a config key
    (an image file is not called TEST.SCALE; DSC_0001.JPG names no key)."""
    keys = set(flatten(defaults()))
    for i, arg in enumerate(args):
        if arg in keys or arg.startswith("DATASET_CATALOG."):
            return list(args[:i]), list(args[i:])
    return list(args), []


def predict_command(weights: str, images: list[str], out_dir: str, config_file: str | None,
                    score_threshold: float, opts: tuple) -> None:
    """Check every input, load the detector, then predict, draw and write each image in turn."""
    if not 0.0 <= score_threshold <= 1.0:  # NaN fails this too
        raise UserError(f"--score-threshold {score_threshold}: must be between 0 and 1")
    check_weights_given(weights)
    if not images:
        raise UserError("no IMAGE given: tracktron predict --weights PATH --out DIR IMAGE... [KEY VALUE ...]")
    out = check_out_dir(out_dir)
    cfg = load_config(config_file, list(opts))  # only runs:/ and models:/ weights use it: the tracking URI
    for image in images:
        check_image(image)
    names = output_names(images, out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    detector = load_detector(cfg, weights, option="--weights", device=device)
    for image in images:  # what the network cannot take (a 400x1 strip) is said before anything is written
        try:
            detector.pixels(read_image(image))
        except ValueError as e:
            raise UserError(f"IMAGE {image}: {first_line(e)}") from None
    make_writable(out, f"--out {out_dir}")
    for image, name in zip(images, names):
        predict_one(detector, image, out, name, score_threshold)


def predict_one(detector, image: str, out: Path, name: str, score_threshold: float) -> None:
    """OUT/<name>.png and OUT/<name>.json for one image, and its line on stdout."""
    data = read_image(image)
    found = detector.predict([data])[0]
    pixels = decode(data, upright=True)
    drawing = out / f"{name}.png"
    write_atomic(drawing, to_png(draw(pixels, found, score_threshold=score_threshold)))
    where = os.path.abspath(user_path(image, "IMAGE"))  # the json names its image from any folder
    record = {"image": where, "width": pixels.shape[2], "height": pixels.shape[1], **found}
    write_atomic(out / f"{name}.json", json.dumps(record))
    shown = sum(s >= score_threshold for s in found["scores"])
    line = printable(f"{image}: {len(found['scores'])} detections ({shown} above {score_threshold:g}) -> {drawing}")
    write_or_drop(sys.stdout, line + "\n")  # a view: a reader gone (`| head`) stops no prediction


def check_out_dir(out_dir: str) -> Path:
    """OUT is a folder, or can be made as one, and can be written: checked without writing anything."""
    out = named_folder(out_dir, "--out")
    try:
        existing = next(p for p in (out, *out.parents) if p.exists())
    except (OSError, ValueError) as e:  # a NUL in the name, a name too long
        raise UserError(f"--out {out_dir}: {first_line(e)}") from None
    if not existing.is_dir():
        where = "is a file" if existing == out else f"cannot be made: {existing} is a file"
        raise UserError(f"--out {out_dir} {where}; name a folder (it is made if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--out {out_dir}: permission denied on {existing}")
    return out


def check_image(image: str) -> None:
    """The file exists, is readable and decodes as an image (the whole of it, not only its header)."""
    data = read_image(image)
    if not data:
        raise UserError(f"IMAGE {image}: the file is empty")
    try:
        decode(data, upright=True)
    # Not an image, a truncated one, one too large (PIL's bomb check, over ~179M pixels, is no ValueError).
    except (ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"IMAGE {image}: {first_line(e)}") from None


def read_image(image: str) -> bytes:
    path = user_path(image, "IMAGE")
    try:
        if path.is_dir():
            raise UserError(f"IMAGE {image} is a folder; name image files (e.g. {image.rstrip('/')}/*.jpg)")
        return read_file(path)
    except FileNotFoundError:
        raise UserError(f"IMAGE {image}: no such file{_key_hint(image)}") from None
    except (OSError, ValueError) as e:  # permission denied, a NUL in the name
        raise UserError(f"IMAGE {image}: cannot read it ({getattr(e, 'strerror', None) or first_line(e)})") from None


def _key_hint(arg: str) -> str:
    """A misspelt override (TEST.SCAL 256) reads as two more images: say why."""
    top = {k.split(".")[0] for k in flatten(defaults())}
    if arg.split(".")[0] in top:
        return ", nor a config key (KEY VALUE overrides follow the images)"
    return ""


def _real(path: Path) -> Path:
    try:
        return path.resolve()
    except (RuntimeError, OSError):  # a symlink loop: the name itself (writing replaces the link)
        return path.absolute()


_LONGEST_STEM = 255 - len(".json") - len("-999999")  # bytes: <stem>-<n>.json fits a file name


def output_names(images: list[str], out: Path) -> list[str]:
    """One name per image, its stem, made unique with -2, -3, ... in the order given (compared without
    case, as macOS and Windows folders do), and never a file of the user's: an input, or anything in OUT
    but an earlier prediction of the same image (OUT may be the images' folder)."""
    inputs = {_real(Path(i).expanduser()) for i in images}
    taken, names = set(), []
    for image in images:
        stem = Path(image).stem or "image"
        while len(os.fsencode(stem)) > _LONGEST_STEM:  # a name of 255 bytes has no room for `.json`
            stem = stem[:-1]
        name, n = stem, 2
        while name.casefold() in taken or not _free(out, name, inputs, image):
            name, n = f"{stem}-{n}", n + 1
        taken.add(name.casefold())
        names.append(name)
    return names


def _free(out: Path, name: str, inputs: set, image: str) -> bool:
    """OUT/<name>.png and .json may be written: neither is an input or a folder (no rename replaces
    one), and what is there already is an earlier prediction of `image` (a rerun replaces it), or nothing."""
    files = [out / f"{name}.{e}" for e in ("png", "json")]
    if any(_real(f) in inputs or (f.is_dir() and not f.is_symlink()) for f in files):
        return False
    return not any(f.exists() or f.is_symlink() for f in files) or _is_prediction(files[1], image)


def _is_prediction(path: Path, image: str) -> bool:
    """A json that predict_one wrote for `image` (its path, size and detections)."""
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):  # not there, a folder, not json (UnicodeDecodeError is a ValueError)
        return False
    if not (isinstance(record, dict) and {"image", "width", "height", "boxes", "scores"} <= record.keys()):
        return False
    try:
        return _real(Path(record["image"]).expanduser()) == _real(Path(image).expanduser())
    except (TypeError, ValueError, RuntimeError):  # not a path (a number, a NUL, ~nobody): not this image's
        return False
