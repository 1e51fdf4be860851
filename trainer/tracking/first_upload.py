"""The run's first upload, sent before training: an artifact store that refuses it (no credentials,
a bucket that does not exist, a folder that may not be written) would refuse every checkpoint, so
the job stops in one line now rather than failing each upload for hours. Anything that may mend
(an outage, a timeout, a proxy's 404 while it restarts) is left to the uploader's retries."""
from __future__ import annotations

import errno
import logging
import re
import time
from concurrent.futures import Future, wait
from typing import Callable

from trainer.daemon_call import daemon_call
from trainer.errors import UserError, first_line
from trainer.redaction import redact_text

log = logging.getLogger(__name__)
RETRY_AFTER_S = 3.0  # a refusal is taken as the store's answer once a second try gets it too

# botocore: credentials or configuration that no retry finds; S3 codes that say who or where is wrong
_CONFIGURATION = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound",
                  "UnknownCredentialError", "InvalidConfigError", "NoRegionError"}
_S3_REFUSALS = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket", "AllAccessDisabled",
                "InvalidBucketName", "AccountProblem", "ExpiredToken", "InvalidToken"}
_S3_CODE = re.compile(r"An error occurred \((\w+)\)")  # boto3's S3UploadFailedError keeps only the message


def send_first(send: Callable[[], None], where: Callable[[], str], timeout_s: float = 30.0) -> Callable[[], None] | None:
    """`send()` now, waited for (timeout_s at most): None once sent; UserError, naming the store
    (`where()`), when it is refused twice; else the uploader's job, which waits for a try still
    going and sends again only if that failed (never two uploads of one file at once)."""
    deadline = time.monotonic() + timeout_s
    for attempt in (1, 2):
        done = daemon_call(send, "first upload")
        if not wait([done], max(0.0, deadline - time.monotonic())).done:
            # Said now: a try still going is MLflow's client retrying (an MLflow server whose own store
            # fails answers a bare 500) or a server that hangs; its own warning would come minutes later.
            log.warning("tracking: the run's first upload to %s has had no answer in %.0f s (see the tracking "
                        "server's log); training goes on, uploads are retried in the background",
                        redact_text(_named(where)), timeout_s)
            break
        if (e := done.exception()) is None:
            return None
        if not refused(e):
            break
        if attempt == 2:
            raise UserError(f"the run's artifact store {redact_text(_named(where))} refuses uploads ({first_line(e)}): "
                            "no checkpoint or model of the job would reach it; fix its credentials or location")
        time.sleep(min(RETRY_AFTER_S, max(0.0, deadline - time.monotonic())))
    return lambda: _after(done, send)


def _after(first: Future, send: Callable[[], None]) -> None:
    try:
        first.result()  # still going: its end is waited for
    except Exception:
        send()


def _named(where: Callable[[], str]) -> str:
    try:
        return where()
    except Exception:  # the run's artifact location was not read: the line says the rest
        return "(its location unknown)"


def refused(e: BaseException | None) -> bool:
    """An upload error that says who or where is wrong: no credentials, a profile or endpoint that
    does not exist, S3's AccessDenied or NoSuchBucket, MLflow's PERMISSION_DENIED or UNAUTHENTICATED,
    an HTTP 401 or 403, a folder that may not be written. A 404 or any 5xx may be a proxy restarting."""
    seen = set()
    while e is not None and id(e) not in seen:  # boto3 wraps S3's ClientError in S3UploadFailedError
        seen.add(id(e))
        name = type(e).__name__
        if name in _CONFIGURATION or (name == "ValueError" and "endpoint" in str(e).lower()):
            return True
        if isinstance(e, OSError) and e.filename is not None and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return True  # a file system's answer (a socket's EPERM has no file name)
        response = getattr(e, "response", None)  # botocore's dict, requests' Response
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in _S3_REFUSALS:
            return True
        if (code := _S3_CODE.search(str(e))) and code.group(1) in _S3_REFUSALS:
            return True
        if getattr(e, "error_code", None) in ("PERMISSION_DENIED", "UNAUTHENTICATED"):  # MlflowException
            return True
        if getattr(response, "status_code", None) in (401, 403):  # requests' HTTPError
            return True
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return False
