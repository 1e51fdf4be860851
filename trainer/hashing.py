"""A file's sha256, read in 1 MB pieces: what checkpoint tags, downloads and torchvision's
weight names are checked against."""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
