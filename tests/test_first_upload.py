"""Which errors of the run's first upload stop a job before it trains (first_upload.refused), and
how the upload is waited for and handed to the uploader (first_upload.send_first). Unit tests of
two functions: the end-to-end refusal (moto's S3, no bucket, no credentials) is in test_faults_storage.py."""
from __future__ import annotations

import errno
import threading
import time

import pytest
import requests
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import ClientError, NoCredentialsError, ProfileNotFound
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import ENDPOINT_NOT_FOUND, PERMISSION_DENIED

from trainer.errors import UserError
from trainer.tracking import first_upload
from trainer.tracking.first_upload import refused, send_first


def _s3(code: str, status: int, wrapped: bool = True) -> Exception:
    error = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    if not wrapped:
        return error
    try:
        try:
            raise error
        except ClientError as e:  # as boto3's upload_file raises it
            raise S3UploadFailedError(f"Failed to upload config.yaml to b/k: {e}") from None
    except S3UploadFailedError as e:
        return e


def _http(status: int) -> requests.HTTPError:
    response = requests.Response()
    response.status_code = status
    return requests.HTTPError(f"{status} Client Error", response=response)


def _context(outer: Exception, inner: Exception, suppressed: bool) -> Exception:
    outer.__context__, outer.__suppress_context__ = inner, suppressed
    return outer


@pytest.mark.parametrize("error, stops", [
    (NoCredentialsError(), True),
    (ProfileNotFound(profile="prod-typo"), True),
    (ValueError("Invalid endpoint: minio:9000"), True),
    (_s3("NoSuchBucket", 404), True),
    (_s3("AccessDenied", 403), True),
    (_s3("InvalidAccessKeyId", 403, wrapped=False), True),
    (_http(403), True),
    (MlflowException("denied", error_code=PERMISSION_DENIED), True),
    (PermissionError(errno.EACCES, "Permission denied", "/artifacts/run"), True),
    (OSError(errno.EROFS, "Read-only file system", "/artifacts/run"), True),
    # what may mend: retried in the background, the job trains
    (_s3("SlowDown", 503), False),
    (_s3("RequestTimeout", 400), False),
    (_s3("Throttling", 400, wrapped=False), False),
    (_http(404), False),  # an ingress's page while the server restarts
    (_http(409), False),
    (MlflowException("not found", error_code=ENDPOINT_NOT_FOUND), False),
    (OSError(errno.EPERM, "Operation not permitted"), False),  # a socket's (a firewall reloading), no file
    (requests.ConnectionError("Connection refused"), False),
    (TimeoutError("timed out"), False),
    (_context(requests.ConnectionError("reset"), _http(403), suppressed=True), False),
    (_context(requests.ConnectionError("reset"), _http(403), suppressed=False), True),
])
def test_a_refusal_is_an_answer_about_who_or_where_never_an_outage(error, stops):
    assert refused(error) is stops


def test_an_exception_that_is_its_own_cause_ends_the_walk():
    error = ValueError("x")
    error.__cause__ = error
    assert refused(error) is False


def test_a_refusal_stops_only_when_a_second_try_gets_it_too(monkeypatch):
    monkeypatch.setattr(first_upload, "RETRY_AFTER_S", 0.05)
    answers = [_s3("AccessDenied", 403), None]

    def once_denied():
        if error := answers.pop(0):
            raise error

    assert send_first(once_denied, lambda: "s3://b/run/artifacts") is None  # sent on the second try
    with pytest.raises(UserError, match=r"^the run's artifact store s3://b/run/artifacts refuses uploads \("):
        send_first(lambda: (_ for _ in ()).throw(NoCredentialsError()), lambda: "s3://b/run/artifacts")
    with pytest.raises(UserError, match=r"store \(its location unknown\) refuses"):
        send_first(lambda: (_ for _ in ()).throw(NoCredentialsError()), lambda: None.artifact_uri)


def test_an_upload_still_going_is_waited_for_by_the_uploader_not_sent_twice_at_once(caplog):
    release, running, sends = threading.Event(), [], []

    def slow():
        running.append(1)
        try:
            assert len(running) == 1, "two uploads of one file at once"
            sends.append(1)
            release.wait(5)
        finally:
            running.pop()

    started = time.monotonic()
    later = send_first(slow, lambda: "s3://b", timeout_s=0.2)
    assert later is not None and time.monotonic() - started < 2
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == ["tracking: the run's first upload to s3://b has had no answer in 0 s (see the tracking server's log); "
                    "training goes on, uploads are retried in the background"]  # said now, not when the try ends
    threading.Timer(0.3, release.set).start()
    later()  # the uploader's job: waits for the first try, which succeeded
    assert sends == [1]

    outage = send_first(lambda: sends.append(2) or (_ for _ in ()).throw(requests.ConnectionError()), lambda: "s3://b")
    assert outage is not None  # an outage: the uploader tries again
    with pytest.raises(requests.ConnectionError):
        outage()
    assert sends == [1, 2, 2]
