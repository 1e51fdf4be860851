"""Checks of a COCO annotation file before training: malformed json, missing images, unknown category
ids, broken segmentations and keypoints end in one UserError line naming the file and what is wrong."""
from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path

from trainer.config_checks import MAX_CLASSES
from trainer.errors import UserError, first_line

# PIL warns of an image past its own threshold, which is above our MAX_PIXELS: the size is refused
# anyway, in one line that its two-line warning would come before.
warnings.filterwarnings("ignore", r"Image size \(\d+ pixels\) exceeds limit")
MAX_IMAGE_SIDE = 20_000  # pixels
MAX_NUMBER = 3.4e38  # float32's largest: a box, area or keypoint past it is no number the model can hold
MAX_COORDINATE = 1e6  # pixels: a polygon's point, however far outside its image (clipped later)
# pixels: an annotation's polygons' outline (each edge's longer side). pycocotools rasterises 5 points
# a pixel into an int count, which far longer outlines overflow (a segfault) or fill memory with.
MAX_OUTLINE = 1e7
DECODED_FORMATS = ("JPEG", "MPO", "PNG", "GIF", "WEBP")  # PIL's names of what images.decode reads (MPO: a camera's JPEG)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))  # a BOM, as Windows tools write, is no error
    except json.JSONDecodeError as e:
        raise UserError(f"malformed annotation file {path}: {e}") from None
    except RecursionError:
        raise UserError(f"malformed annotation file {path}: nested too deeply") from None
    except MemoryError:  # under a memory limit (ulimit -v, a container's): a 2 GB file of nothing
        raise UserError(f"annotation file {path} ({os.path.getsize(path):,} bytes) does not fit in this "
                        "process's memory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read annotation file {path}: {e}") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise UserError(f"malformed annotation file {path}: {first_line(e)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) \
            or not isinstance(data.get("categories"), list):
        raise UserError(f"malformed annotation file {path}: needs 'images' and 'categories' lists (COCO format)")
    if data.get("annotations") is None:  # test-set files (image_info_*) have none
        data["annotations"] = []
    if not isinstance(data["annotations"], list):
        raise UserError(f"malformed annotation file {path}: 'annotations' must be a list (COCO format)")
    return data


def check(path: Path, data: dict, image_dir: Path, masks: bool = False, keypoints: bool = False,
          sizes: tuple | None = None, max_pixels: int | None = None) -> None:
    """Fail up front, naming the file, rather than at iteration 50000 in a worker.

    Structure and types are checked here (every value the loader will compute with); box
    geometry is not: empty boxes are dropped and boxes reaching outside their image are clipped
    when the dataset is built, with a logged count. Segmentations and keypoints are checked only
    when the model uses them; image sizes against the model's input `sizes` (coco.input_sizes) and
    the decoder's `max_pixels` (images.MAX_PIXELS; images.py imports this module) when given.
    """
    _check_images(path, data["images"], sizes, max_pixels)
    num_keypoints = _check_categories(path, data["categories"], keypoints)
    cat_ids, image_ids = _unique_ids(path, data)
    ann_ids: set = set()
    for ann in data["annotations"]:
        _check_annotation(path, ann, ann_ids, cat_ids, image_ids, masks, keypoints, num_keypoints)
    _check_image_files(path, data["images"], image_dir)


def _check_images(path: Path, images: list, sizes: tuple | None, max_pixels: int | None) -> None:
    for im in images:
        if not isinstance(im, dict) or not {"id", "file_name", "width", "height"} <= set(im):
            raise UserError(f"{path}: image entry {str(im)[:80]} needs id, file_name, width and height")
        if not _is_id(im["id"]):
            raise UserError(f"{path}: image id {_short(im['id'])} is not a number or a string")
        if not isinstance(im["file_name"], str) or not im["file_name"]:
            raise UserError(f"{path}: image {im['id']!r} has file_name {_short(im['file_name'])}, not a file name")
        if not (_is_int(im["width"]) and _is_int(im["height"]) and im["width"] > 0 and im["height"] > 0):
            raise UserError(f"{path}: image {im['id']!r} has width {_short(im['width'])} and height "
                            f"{_short(im['height'])}; both must be positive integers")
        if max(im["width"], im["height"]) > MAX_IMAGE_SIDE:  # decoding it would take gigabytes
            raise UserError(f"{path}: image {im['id']!r} is {im['width']}x{im['height']}; at most "
                            f"{MAX_IMAGE_SIDE} pixels a side (tile larger images)")
        if max_pixels and im["width"] * im["height"] > max_pixels:  # else refused when decoded, mid-training
            raise UserError(f"{path}: image {im['id']!r} is {im['width']}x{im['height']}; at most "
                            f"{max_pixels:,} pixels (tile larger images)")
        if sizes:
            _check_resized(path, im, *sizes)


def _check_categories(path: Path, categories: list, keypoints: bool) -> int:
    """The number of keypoints the categories name (0: none)."""
    if len(categories) >= MAX_CLASSES:  # with the background, the model's classes
        raise UserError(f"{path} lists {len(categories):,} categories; a model takes at most {MAX_CLASSES - 1:,}")
    for c in categories:
        if not isinstance(c, dict) or "id" not in c:
            raise UserError(f"{path}: every category needs an id")
        # COCO's category ids are integers, and its names strings: the model's categories.json keeps them so
        if not _is_int(c["id"]):
            raise UserError(f"{path}: category id {_short(c['id'])} is not an integer")
        if "name" in c and not isinstance(c["name"], str):
            raise UserError(f"{path}: category {c['id']} has name {_short(c['name'])}, not a name")
        names = c.get("keypoints")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise UserError(f"{path}: category {c['id']!r} has keypoints {_short(names)}, not a list of names")
        if keypoints and names and len(set(names)) < len(names):  # the flip map pairs points by name
            twice = next(n for n in names if names.count(n) > 1)
            raise UserError(f"{path}: category {c['id']!r} names keypoint {twice!r} twice; each needs its own name")
    counts = sorted({len(c.get("keypoints") or []) for c in categories if c.get("keypoints")})
    if keypoints and len(counts) > 1:  # one keypoint head: one skeleton
        raise UserError(f"{path}: categories name {' and '.join(map(str, counts))} keypoints; a keypoint model "
                        "needs one number for all")
    return counts[0] if counts else 0


def _unique_ids(path: Path, data: dict) -> tuple[set, dict]:
    """The category ids, and the images by id."""
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
    return cat_ids, image_ids


def _check_annotation(path: Path, ann, ann_ids: set, cat_ids: set, image_ids: dict, masks: bool, keypoints: bool,
                      num_keypoints: int) -> None:
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
    if not _all_numbers(bbox):
        raise UserError(f"{what} has bbox {_short(bbox)}: x, y, w, h must be finite numbers (float32)")
    if "area" in ann and not _is_number(ann["area"]):
        raise UserError(f"{what} has area {_short(ann['area'])}, not a number")
    if ann.get("iscrowd", 0) not in (0, 1):  # True and False are 1 and 0
        raise UserError(f"{what} has iscrowd {_short(ann.get('iscrowd'))}; it must be 0 or 1")
    if masks:
        _check_segmentation(what, ann.get("segmentation"), image_ids[image])
    if keypoints and ann.get("keypoints") not in (None, []):  # none or [] is none labelled, as in _keypoints
        kp = ann["keypoints"]
        if not isinstance(kp, list) or len(kp) % 3 or not _all_numbers(kp):
            raise UserError(f"{what} has keypoints {_short(kp)}: a flat list of x, y, visibility numbers")
        if len(kp) != 3 * num_keypoints:  # COCOeval and the keypoint head both assume the count
            raise UserError(f"{what} has {len(kp) // 3} keypoints; its categories name {num_keypoints}")
        # torchvision, COCOeval and the flip read any v > 0 as labelled: a score (0.3) or a -1 went unseen
        if odd := [v for v in kp[2::3] if v not in (0, 1, 2)]:
            raise UserError(f"{what} has keypoint visibility {odd[0]!r}; COCO's are 0 (not labelled), 1 (labelled, "
                            "hidden) or 2 (visible)")


def _check_image_files(path: Path, images: list, image_dir: Path) -> None:
    if not images:
        raise UserError(f"{path} lists no images")
    if not image_dir.is_dir():
        raise UserError(f"image folder not found: {image_dir} (for {path})")
    # One listing, whose entries know a plain file without a stat each (a link or a subfolder's file is stat-ed).
    on_disk = {e.name: e for e in os.scandir(image_dir)}
    listed = [(im["file_name"], on_disk.get(im["file_name"]) or image_dir / im["file_name"]) for im in images]

    def refuse(names: list, are: str) -> UserError:
        example = names[0] if names[0].isprintable() else repr(names[0])
        locale = ("; names that are not ASCII cannot be found in this locale (file names as "
                  f"{sys.getfilesystemencoding()}): use LC_ALL=C.UTF-8 or PYTHONUTF8=1"
                  if not all(n.isascii() for n in names) and sys.getfilesystemencoding().lower() != "utf-8" else "")
        where = (" (a file_name that is an absolute path, as Label Studio's /data/upload/..., is read there, not in the image "
                 "folder: make the file names relative to it)") if os.path.isabs(names[0]) else ""
        if "\\" in names[0] and os.sep == "/":  # labelme2coco and others run on Windows
            where = " (a file_name of backslashes, as written on Windows: folders are separated by '/' here)"
        return UserError(f"{len(names)} of {len(listed)} images listed in {path} {are} {image_dir}, e.g. {example}"
                         f"{where}{locale}")

    if missing := [name for name, p in listed if name not in on_disk and not _exists(p)]:
        raise refuse(missing, "are missing from")
    if not_files := [name for name, p in listed if not p.is_file()]:  # reading a FIFO would block forever
        raise refuse(not_files, "are no image files (a folder, a FIFO, a device, a broken link) in")


def other_layout(root: Path) -> tuple | None:
    """(image folder, annotation file) of a folder exported in another layout than tracktron's: Roboflow's
    (_annotations.coco.json beside the images), CVAT's (annotations/instances_default.json, images/),
    FiftyOne's (labels.json, data/); None if it holds no json file."""
    root = root.absolute()
    found = sorted(root.glob("*.json")) or sorted(root.glob("annotations/*.json"))
    if not found:
        return None
    return next((root / d for d in ("images", "data") if (root / d).is_dir()), root), found[0]


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name longer than the file system takes (ENAMETOOLONG) cannot be there
        return False


def _check_resized(path: Path, im: dict, min_size: int, max_size: int, keys: str) -> None:
    """GeneralizedRCNNTransform scales an image by min(min_size / short side, max_size / long side)
    and floors the sides: a side of 0 pixels (a thin strip) is a RuntimeError traceback mid-training.
    The smallest min_size gives the smallest image."""
    short, long = sorted((im["width"], im["height"]))
    scale = min(min_size / short, max_size / long)
    if math.floor(short * scale) < 1:
        w, h = (math.floor(side * scale) for side in (im["width"], im["height"]))
        raise UserError(f"{path}: image {im['id']!r} is {im['width']}x{im['height']}, which {keys} resize to "
                        f"{w}x{h} pixels: crop or drop images this thin")


def check_image_headers(path: Path, image_dir: Path, images: list) -> None:
    """Every image's header (PIL reads no pixels): a format images.decode reads, the size `path` says."""
    from PIL import Image, UnidentifiedImageError

    for im in images:
        file = image_dir / im["file_name"]
        try:
            with Image.open(file) as probe:
                found, size = probe.format, probe.size
        except UnidentifiedImageError:
            found, size = None, None
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise UserError(f"cannot read image {file}: {first_line(e)}") from None
        if found not in DECODED_FORMATS:
            raise UserError(f"{file} is {found or 'no image'}, not a format the trainer reads (JPEG, PNG, GIF or WebP)")
        if size != (im["width"], im["height"]):  # boxes would be misplaced
            raise size_mismatch(file, size, path, im)


def size_mismatch(file: Path, size: tuple, path: Path, im: dict, shown: str | None = None) -> UserError:
    """An image of another size than its annotation file says; a phone photo's EXIF orientation,
    which the tool that annotated it applied (a browser, detectron2's read_image), named."""
    from PIL import Image

    error = f"{shown or file} is {size[0]}x{size[1]} but {path} says {im['width']}x{im['height']}"
    try:
        with Image.open(file) as probe:
            orientation = int(probe.getexif().get(0x0112, 1))
    except Exception:  # no EXIF to read: the sizes alone
        orientation = 1
    if orientation in (5, 6, 7, 8) and tuple(size) == (im["height"], im["width"]):
        error += (f": its EXIF orientation ({orientation}) turns it, as the annotation tool showed it, and tracktron reads "
                  "the pixels as stored; store the images upright (`mogrify -auto-orient`, PIL's ImageOps.exif_transpose)")
    return UserError(error)


def category_key(categories: list, keypoints: bool = True) -> list:
    """What labels mean: each category's id and name, and for a keypoint model its keypoints' names
    in their order (a box model never reads them)."""
    return [(c["id"], c.get("name"), tuple(c.get("keypoints") or ()) if keypoints else ()) for c in categories]


def same_categories(ours: list, theirs: list) -> bool:
    """Whether two category_key lists name the same categories, whatever their keypoints."""
    return [k[:2] for k in ours] == [k[:2] for k in theirs]


def category_difference(ours: list, theirs: list) -> str:
    """The first difference of two category_key lists, for a message."""
    pairs = [(a, b) for a, b in zip(ours, theirs) if a != b]
    if not pairs:
        return f"{len(ours)} categories against {len(theirs)}"
    a, b = pairs[0]
    if a[:2] != b[:2]:
        return f"category {a[0]!r} {a[1]!r} against {b[0]!r} {b[1]!r}"
    j = next((j for j, (x, y) in enumerate(zip(a[2], b[2])) if x != y), None)
    if j is None:
        return f"category {a[0]!r} {a[1]!r} has {len(a[2])} keypoints against {len(b[2])}"
    return f"category {a[0]!r} {a[1]!r}'s keypoint {j + 1} is {a[2][j]!r} against {b[2][j]!r}"


def _check_segmentation(what: str, segm, image: dict) -> None:
    """Polygons (lists of numbers) or RLE ({'counts': ..., 'size': [height, width]})."""
    if segm is None:
        return
    if isinstance(segm, list):
        if all(isinstance(p, list) and _all_numbers(p) for p in segm):
            reach = max((max(-min(p), max(p)) for p in segm if p), default=0)
            if reach > MAX_COORDINATE:  # pycocotools' rasteriser crashes the process far beyond the image
                raise UserError(f"{what} has a polygon reaching {reach:g} pixels from the origin, on an image of "
                                f"{image['height']}x{image['width']}")
            # no edge is longer than 2 * reach: the exact outline only for polygons that could pass the cap
            if sum(map(len, segm)) * reach > MAX_OUTLINE and (length := sum(map(_outline, segm))) > MAX_OUTLINE:
                raise UserError(f"{what} has polygons {length:,.0f} pixels long, on an image of "
                                f"{image['height']}x{image['width']} (at most {MAX_OUTLINE:,.0f})")
            return
    elif isinstance(segm, dict):
        counts, size = segm.get("counts"), segm.get("size")
        counts_ok = isinstance(counts, str) or (isinstance(counts, list) and all(_is_int(v) and v >= 0 for v in counts))
        if counts_ok and size == [image["height"], image["width"]]:
            covered = _rle_pixels(counts)
            if covered == image["height"] * image["width"]:
                return
            raise UserError(f"{what} has an RLE mask whose counts cover {covered if covered >= 0 else 'no valid run of'} "
                            f"pixels, not the {image['height']}x{image['width']} of its image")
        if counts_ok and isinstance(size, list):
            raise UserError(f"{what} has an RLE mask of size {_short(size)} on an image of "
                            f"{image['height']}x{image['width']} (height x width)")
    raise UserError(f"{what} has segmentation {_short(segm)}: polygons (lists of numbers) or RLE "
                    "({'counts', 'size'}) expected")


def _outline(polygon: list) -> float:
    """A closed polygon's length as pycocotools walks it: each edge's longer side (0 for one of
    fewer than 3 points, which the loader drops)."""
    if len(polygon) < 6:
        return 0
    xs, ys = polygon[0:len(polygon) - 1:2], polygon[1::2]  # an odd last number is no point
    return sum(max(abs(x1 - x0), abs(y1 - y0)) for x0, x1, y0, y1 in zip(xs, xs[1:] + xs[:1], ys, ys[1:] + ys[:1]))


def _rle_pixels(counts) -> int:
    """How many pixels an RLE's runs cover (-1: a malformed compressed string). pycocotools decodes
    what it is given without this check, writing past the mask's end when the runs are too long."""
    if isinstance(counts, list):
        return sum(counts)
    if not all("0" <= ch <= "o" for ch in counts):  # 6 bits a character from '0'; pycocotools reads UTF-8 bytes
        return -1
    runs: list[int] = []
    i = 0
    while i < len(counts):  # COCO's compressed counts: 5 bits a character, a continuation bit, deltas
        x, k, more = 0, 0, True
        while more:
            if i >= len(counts):
                return -1
            c = ord(counts[i]) - 48
            x |= (c & 0x1F) << (5 * k)
            more, i, k = bool(c & 0x20), i + 1, k + 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(runs) > 2:
            x += runs[-2]
        if x < 0:
            return -1
        runs.append(x)
    return sum(runs)


def _is_number(v) -> bool:
    """Finite, and within float32 (what the tensors hold; a JSON integer may have 400 digits)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -MAX_NUMBER <= v <= MAX_NUMBER


def _all_numbers(values: list) -> bool:
    """all(map(_is_number, values)) in C's loops: COCO's polygons hold tens of millions of numbers,
    checked at every start. A NaN or an infinity makes the sum no finite number; past that, min and
    max are exact."""
    if not set(map(type, values)) <= {int, float}:  # bool is a type of its own
        return False
    try:
        finite = math.isfinite(sum(values))
    except OverflowError:  # a 400-digit integer, which no float holds
        return False
    return finite and (not values or (-MAX_NUMBER <= min(values) and max(values) <= MAX_NUMBER))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_id(v) -> bool:
    return (isinstance(v, (int, str)) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
