"""Weights named by URL (Detectron's configs name their ImageNet weights so): fetched once into
TRACKTRON_CACHE (default ~/.cache/tracktron) and read from there afterwards. No torch here: the CLI
fetches them before a run is made for the job."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from trainer.errors import UserError, first_line
from trainer.redaction import redact_urls

log = logging.getLogger(__name__)
URL_SCHEMES = ("http://", "https://")


def download(url: str, option: str) -> Path:
    """The cached copy of `url`, downloaded now if there is none."""
    cache = Path(os.environ.get("TRACKTRON_CACHE") or Path.home() / ".cache" / "tracktron") / "weights"
    name = os.path.basename(urllib.parse.urlsplit(url).path) or "weights"
    target = cache / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}"
    if target.is_file():
        return target
    shown = redact_urls(url)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, prefix=".part-", delete=False) as part:
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    shutil.copyfileobj(response, part, length=1 << 20)
                os.replace(part.name, target)
            finally:
                Path(part.name).unlink(missing_ok=True)
    except (OSError, ValueError) as e:  # no network, a proxy, an HTTP error, a full disk: all the same here
        raise UserError(f"{option} {shown}: download failed ({type(e).__name__}: {first_line(e)}); fetch it where "
                        f"the network allows and set {option} to the local file's path") from None
    log.info("downloaded %s to %s", shown, target)
    return target
