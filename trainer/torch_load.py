"""torch.load of a file a user handed over: tensors only (weights_only, nothing unpickled that could
run code), onto the CPU, and no zip entry that inflates past MAX_EXPANSION times its size. torch.save
stores its entries uncompressed, but torch.load inflates deflated ones: a 1 MB file could hold a
1 GiB tensor of zeros, taken into memory before anything is checked."""
from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

MAX_EXPANSION = 100
# torch's note on a plain pickle (protocol past 2) that it may not read: what it cannot read is one
# line of ours; the note would come before it, in two.
warnings.filterwarnings("ignore", r"Detected pickle protocol \d+ in the checkpoint")


def load(path, mmap: bool = False):
    """What torch.load(weights_only=True) gives; ValueError for a zip bomb, torch's own errors else."""
    import torch

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if entry.compress_type != zipfile.ZIP_STORED and \
                        entry.file_size > MAX_EXPANSION * max(entry.compress_size, 1):
                    raise ValueError(f"its entry {Path(entry.filename).name} inflates {entry.compress_size:,} bytes "
                                     f"to {entry.file_size:,}: torch.save writes no compressed entries")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
