"""Nothing secret leaves the process: one redaction point for every way text goes out.

What is secret: the `user:password@` of any URL, and the values of config keys and environment
variables named like secrets (password, secret, token, API key, access key, private key,
credential), remembered as they are read. `redact_text` replaces them with `***`; `install()`
puts it in front of every log record and uncaught traceback; the CLI's error line and the run's
tags and params pass through it too. Files (config.yaml, checkpoints) get config.redacted: the
secret-named values and URL credentials replaced, the same on every machine.
"""
from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import sys
import threading
import traceback

SECRET_WORDS = ("PASSWORD", "PASSWD", "SECRET", "TOKEN", "API_KEY", "APIKEY", "ACCESS_KEY", "PRIVATE_KEY",
                "CREDENTIAL")
REDACTED = "***"
# `:/` too: Path() collapses `//`. Not MLflow's models:/name@alias, whose `@` names an alias.
# The userinfo ends at the authority's LAST `@`: a password may hold an unescaped `@` itself, and
# `/`, `?` or `#` too (a token often has a `/`): where the authority has no `@`, `user:` followed by
# anything but a port and a path (`host:8080/...`) runs to the last `@` of the word.
_URL_USERINFO = re.compile(r"(\b(?!models:)[A-Za-z][A-Za-z0-9+.-]*:/+)(?:[^/?#\s]*|[^:/?#@\s]*:(?![0-9]*(?:[/?#\s]|$))\S*)@")
# A URL's query: presigned URLs carry their signature and credential there, APIs their token.
_URL_QUERY = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*:/+[^\s?#]*\?)([^\s#]+)")
_QUERY_VALUE = re.compile(r"(^|[&;])([^&;=]*=)?[^&;]*")
_MIN_LEN = 4  # shorter values (a port, "true") would blank out ordinary text
_values: set[str] = set()


def is_secret_key(key: str) -> bool:
    return any(w in key.upper() for w in SECRET_WORDS)


def remember(value) -> None:
    """A secret's value: redacted from now on wherever it appears."""
    if isinstance(value, str) and len(value) >= _MIN_LEN and value != REDACTED:
        _values.add(value)


def remember_environment() -> None:
    for name, value in os.environ.items():
        if is_secret_key(name):
            remember(value)
    remember_basic_auth()


def remember_basic_auth() -> None:
    """The header MLflow sends for MLFLOW_TRACKING_USERNAME/PASSWORD, `Basic base64(user:password)`:
    a server or proxy that echoes the request in its error body would otherwise print it."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user is None or not password:
        return
    for encoding in ("latin-1", "utf-8"):  # requests encodes latin-1 where it can
        with contextlib.suppress(UnicodeEncodeError):
            remember(base64.b64encode(f"{user}:{password}".encode(encoding)).decode())


def redact_urls(text: str) -> str:
    """`http://user:password@host/x?token=t` -> `http://***@host/x?token=***` (and nothing else:
    the same text always gives the same result, whatever this process remembered)."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    return _URL_QUERY.sub(lambda m: m.group(1) + _QUERY_VALUE.sub(_hide_value, m.group(2)), text)


def _hide_value(m: re.Match) -> str:
    return f"{m.group(1)}{m.group(2) or ''}{REDACTED}" if m.group(0) not in ("", "&", ";") else m.group(0)


def redact_text(text: str) -> str:
    """URL credentials and every remembered secret -> `***`."""
    text = redact_urls(text)
    for value in sorted(_values, key=len, reverse=True):  # a longer secret before one inside it
        text = text.replace(value, REDACTED)
    return text


def printable(text: str, keep_newlines: bool = False) -> str:
    """Control characters (an escape sequence, a carriage return, a bidi override) shown escaped:
    a name from a store, a tag or a file name is never drawn with on the user's terminal."""
    if text.isprintable():
        return text
    kept = "\n\t" if keep_newlines else ""
    return "".join(c if c.isprintable() or c in kept else repr(c)[1:-1] for c in text)


def _redact_record(record: logging.LogRecord) -> logging.LogRecord:
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: the handler reports it as logging always did
        return record
    clean = printable(redact_text(message), keep_newlines=True)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and record.exc_info[0] is not None:
        record.exc_text = printable(redact_text("".join(traceback.format_exception(*record.exc_info)).rstrip()),
                                    keep_newlines=True)
        record.exc_info = None
    return record


def install() -> None:
    """Every log record (ours, MLflow's, any library's, whatever handler writes it) and every
    uncaught traceback, in the main thread or another, goes through redact_text."""
    remember_environment()
    make_record = logging.getLogRecordFactory()
    if getattr(make_record, "redacting", False):
        return
    def factory(*args, **kwargs):
        return _redact_record(make_record(*args, **kwargs))

    factory.redacting = True
    logging.setLogRecordFactory(factory)

    def excepthook(kind, value, tb):
        sys.stderr.write(redact_text("".join(traceback.format_exception(kind, value, tb))))

    def thread_excepthook(args):
        if args.exc_type is not SystemExit:
            sys.stderr.write(redact_text("".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                                            args.exc_traceback))))

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
