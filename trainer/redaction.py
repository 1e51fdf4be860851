"""Nothing secret leaves the process: one redaction point for every way text goes out.

What is secret: the `user:password@` of any URL, and the values of config keys and environment
variables named like secrets (SECRET_WORDS), remembered as they are read. `redact_text` replaces them
with `***`; `install()` puts it in front of every log record and uncaught traceback.
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
# A URL: a scheme (`:/` too: Path() collapses `//`), then what may follow in one, up to white space or
# a quote (a URL in JSON or HTML ends there). Not MLflow's models:/name@alias, whose `@` names an alias.
# Each is found once, left to right: the scan is linear however long a line is.
_URL = re.compile(r"(?<![A-Za-z0-9+.-])(?!models:)([A-Za-z][A-Za-z0-9+.-]*:/+)([^\s\"'<>]*)")
# A URL as the user typed it: its userinfo runs to the word's last `@`, unescaped `/ ? #` and all.
_TYPED_USERINFO = re.compile(r"(\b(?!models:)[A-Za-z][A-Za-z0-9+.-]*:/+)(\S*?:\S*)@(?!\S*@)")
_QUERY_VALUE = re.compile(r"(^|[&;])([^&;=]*=)?[^&;]*")
_PUBLIC_KEYS = {"workspace="}  # MLflow's UI link names the run's workspace: a name, never a secret
_MIN_LEN = 4  # shorter values (a port, "true") would blank out ordinary text
_values: set[str] = set()


def is_secret_key(key: str) -> bool:
    return any(w in key.upper() for w in SECRET_WORDS)


def remember(value) -> None:
    """A secret's value: redacted from now on wherever it appears."""
    if isinstance(value, str) and len(value) >= _MIN_LEN and value != REDACTED:
        _values.add(value)


def remember_url_credentials(text: str) -> None:
    """The `user:password` of each URL in a value the user gave, as typed: a password with an unescaped
    `/`, `#` or `?` is no URL's userinfo to redact_urls, yet a library's error echoes it whole."""
    for _, userinfo in _TYPED_USERINFO.findall(text) if "@" in text else ():
        remember(userinfo)
        remember(userinfo.partition(":")[2])


def forget_url_credentials(url: str) -> None:
    """A URL fetched from the host a URL parser reads in it had no password typed with a `/`: its
    `host:port/path@…` was a path with an `@` (parent@v1.pth), to be shown whole from now on."""
    for _, userinfo in _TYPED_USERINFO.findall(url) if "@" in url else ():
        _values.discard(userinfo)
        _values.discard(userinfo.partition(":")[2])


def redact_typed_url(value: str) -> str:
    """One value the user gave, its URL's credentials as typed -> `***` (what config.yaml keeps)."""
    return _TYPED_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", value) if "@" in value else value


def remember_environment() -> None:
    for name, value in os.environ.items():
        if is_secret_key(name):
            remember(value)
        elif "://" in value:  # MLFLOW_TRACKING_URI and the like
            remember_url_credentials(value)
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
    the same text always gives the same result, whatever this process remembered). The userinfo
    ends at the authority's LAST `@` (a password may hold an unescaped `@`); a query's values go
    too (presigned URLs carry their signature there, APIs their token)."""
    return _URL.sub(_redact_url, text) if ":/" in text else text


def _redact_url(m: re.Match) -> str:
    rest = m.group(2)
    authority = min([i for i in map(rest.find, "/?#") if i >= 0], default=len(rest))
    if (at := rest.rfind("@", 0, authority)) >= 0:
        rest = REDACTED + rest[at:]
    if (q := rest.find("?")) >= 0:
        end = rest.find("#", q) % (len(rest) + 1)  # -1 (no fragment): the end
        rest = rest[:q + 1] + _QUERY_VALUE.sub(_hide_value, rest[q + 1:end]) + rest[end:]
    return m.group(1) + rest


def _hide_value(m: re.Match) -> str:
    if m.group(0) in ("", "&", ";") or m.group(2) in _PUBLIC_KEYS:
        return m.group(0)
    return f"{m.group(1)}{m.group(2) or ''}{REDACTED}"


def redact_text(text: str) -> str:
    """Every remembered secret and URL credentials -> `***` (the secrets first: a typed userinfo
    with an `@` inside would be cut at its first `@` by redact_urls)."""
    for value in sorted(_values, key=len, reverse=True):  # a longer secret before one inside it
        text = text.replace(value, REDACTED)
    return redact_urls(text)


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
