"""The one exception type that means "the user's input is wrong", and how errors are shown.

The CLI turns a UserError into a single line on stderr and exit status 2; everything else is a bug
or a fault and keeps its traceback. Beside them, two reads of a path the user gave that would
otherwise end in someone else's error: a ~ with no home, a link that leads back to itself.
"""
import errno
import os
from pathlib import Path

from trainer.redaction import redact_text


class UserError(Exception):
    """Bad input: a config key, a value, a file, a dataset, a run id."""


class SharedError(UserError):
    """Bad input that every rank of a job found alike (they agreed on it): they leave together."""


class NoRoom(UserError):
    """A local folder too small for what the job writes there: retrying makes no room."""


class ConfigError(UserError):
    """A config file, key or value that cannot work."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception in one short line (MLflow's and botocore's messages run to pages), its secrets
    hidden before it is cut: a token cut in half no longer matches the one to hide."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return redact_text(text.splitlines()[0][:limit + 2000])[:limit]  # redacting pages of text takes seconds


def user_path(text: str, what: str) -> Path:
    """`text` as a path with its ~ expanded: a ~user with no home is the input's fault, not a traceback."""
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory."
        raise UserError(f"{what} {text}: no home folder is known for {text.split('/')[0]}") from None


def leads_back(link: Path) -> bool:
    """A link that leads back to itself (ELOOP), which exists() calls missing, as if a file could be made there."""
    try:
        os.stat(link)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False
