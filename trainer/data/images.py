"""The one image decoder: training, evaluation, the served model and `tracktron predict` read
images the same way (RGB, float CHW in [0, 1]; 16-bit PNGs divided by 65535, not by 255). A training
or test set's 8-bit images leave the loader's workers as uint8 and become float on the device.

PIL opens encoded bytes first: its header's size refuses a decompression bomb before anything is
allocated, and a PNG's critical chunks are checked (libpng inside torchvision kills the process on a
corrupt one). Then torchvision decodes the pixels, except an animated image's first frame, which PIL
decodes alone.

Training and evaluation read the pixels as stored (annotations are boxes on those), as COCO's tools
do. A photo for `predict` or the served model is turned upright by its EXIF orientation (`upright`),
so that a phone's portrait shot is not detected on its side.
"""
from __future__ import annotations

import io
import os
import re
import stat
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from trainer.data.checks import MAX_IMAGE_SIDE
from trainer.errors import first_line

MAX_PIXELS = 40_000_000  # about 480 MB as float; more is a tiled aerial image, not a detection input
MAX_FILE_BYTES = 512 * 2**20  # an image file of MAX_PIXELS, 16-bit and stored raw, is 240 MB
_PNG = b"\x89PNG\r\n\x1a\n"
_CXX_PLACE = re.compile(r"^(?:\w+, )?\S+[.](?:cpp|h):[0-9]+,? *")  # "decode_image, /__w/.../x.cpp:67, "


def read_file(path: Path) -> bytes:
    """An image file's bytes; ValueError for what is no file (a FIFO would block, /dev/zero never
    end) or is larger than any image this decodes."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # FileNotFoundError for a broken link
        raise ValueError("not an image file (a folder, a FIFO or a device)")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES // 2**20} MB, more than an image of {MAX_PIXELS:,} pixels")
        return f.read(size)  # read(n) reserves n bytes at once: 512 MB per image failed under a memory limit


def decode(image, upright: bool = False, raw: bool = False) -> torch.Tensor:
    """Encoded bytes (PNG, JPEG, GIF, WebP, ...) or an HxWx3 uint8 RGB array -> float CHW in [0, 1];
    ValueError with one line for anything else. upright: the EXIF orientation applied. raw: an 8-bit
    image stays uint8 (`as_float` later): a loader worker passes a quarter of the bytes through
    /dev/shm, pinned memory and the copy to the GPU."""
    pixels = _decode(image, upright)
    return pixels if raw and pixels.dtype == torch.uint8 else as_float(pixels)


def as_float(image: torch.Tensor) -> torch.Tensor:
    """Integer pixels -> float in [0, 1] (8-bit by 255, 16-bit by 65535); float ones as they are."""
    return image if image.is_floating_point() else image.float().div_(torch.iinfo(image.dtype).max)


def _decode(image, upright: bool) -> torch.Tensor:
    """CHW pixels as stored: uint8, or uint16 for a 16-bit PNG."""
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"an image array must be HxWx3 uint8 (RGB), got {image.shape} {image.dtype}")
        check_size(image.shape[1], image.shape[0])
        return torch.from_numpy(np.array(image, copy=True)).permute(2, 0, 1).contiguous()  # arrays may be read-only
    if isinstance(image, (bytearray, memoryview)):
        image = bytes(image)
    if not isinstance(image, bytes):
        raise ValueError(f"an image must be encoded bytes (PNG, JPEG, ...) or an HxWx3 uint8 array, "
                         f"got {type(image).__name__}")
    if not image:
        raise ValueError("an image is empty (0 bytes)")
    if (by_pil := _check_with_pil(image, upright)) is not None:
        return torch.from_numpy(by_pil).permute(2, 0, 1).contiguous()
    from torchvision.io import ImageReadMode, decode_image

    try:
        decoded = decode_image(torch.frombuffer(bytearray(image), dtype=torch.uint8), mode=ImageReadMode.RGB,
                               apply_exif_orientation=upright)
    except (RuntimeError, ValueError) as e:  # without the C++ source path torchvision puts first
        raise ValueError(f"cannot decode the image ({_CXX_PLACE.sub('', first_line(e))})") from None
    return decoded


def _check_with_pil(data: bytes, upright: bool = False) -> np.ndarray | None:
    """Checks the header's size. Decoded by PIL alone, HxWx3: an animated image (GIF, WebP), its first
    frame (torchvision decodes every frame, and forty 4000x4000 frames fit in 500 kB); with upright, an
    image of another format than JPEG and PNG that has an EXIF orientation (torchvision ignores it)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    by_pil = None
    try:
        with Image.open(io.BytesIO(data)) as probe:
            size = probe.size
            if max(size) <= MAX_IMAGE_SIDE and size[0] * size[1] <= MAX_PIXELS:
                turned = upright and probe.format not in ("JPEG", "PNG") and _orientation(probe) != 1
                if getattr(probe, "is_animated", False) or turned:  # decoded here, after the size check: one frame, upright
                    by_pil = np.array((ImageOps.exif_transpose(probe) if upright else probe).convert("RGB"))
                elif data.startswith(_PNG):
                    probe.load()
                    if why := _png_damage(data):
                        raise ValueError(why)
    except UnidentifiedImageError:
        why = _png_damage(data) if data.startswith(_PNG) else None  # PIL calls a bad CRC before IDAT no PNG
        raise ValueError(f"cannot decode the image ({why})" if why else
                         "the bytes are no image format this reads (PNG, JPEG, GIF, WebP, ...)") from None
    except Exception as e:  # PIL parses in Python: a damaged file raises whatever its parser meets (IndexError...)
        raise ValueError(f"cannot decode the image ({first_line(e) or type(e).__name__})") from None
    check_size(*size)
    return by_pil


def _png_damage(data: bytes) -> str | None:
    """Which critical PNG chunk before IEND (IHDR, PLTE, IDAT) has a CRC that does not match: PIL's
    load() skips them, and libpng kills the process on a bad one. An ancillary chunk's CRC, or no
    IEND, libpng lets pass, and so does this (PIL's verify() refuses both)."""
    view, pos = memoryview(data), len(_PNG)
    while pos + 12 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if kind == b"IEND" or end > len(data):  # cut short: load() has said so where pixels are missing
            return None
        if not kind[0] & 0x20 and zlib.crc32(view[pos + 4:end - 4]) != struct.unpack_from(">I", data, end - 4)[0]:
            return f"a damaged PNG: the CRC of its {kind.decode('latin-1')} chunk does not match"
        pos = end
    return None


def _orientation(image) -> int:
    try:
        return int(image.getexif().get(0x0112, 1))
    except Exception:  # an EXIF block that does not parse: the pixels as stored, as torchvision does
        return 1


def check_size(width: int, height: int) -> None:
    if max(width, height) > MAX_IMAGE_SIDE or min(width, height) < 1:
        raise ValueError(f"an image of {width}x{height} pixels: each side must be 1 to {MAX_IMAGE_SIDE}")
    if width * height > MAX_PIXELS:
        raise ValueError(f"an image of {width}x{height} pixels: at most {MAX_PIXELS:,} pixels (tile larger images)")
