"""Checkpoint-sized files to and from the run's artifact store, in bounded memory and with timeouts
that suit the size.

Uploads. MLflow's artifact repository for the run's artifact URI does the work: boto3's
`upload_file` when the run writes to S3 itself (`MLFLOW_S3_ENDPOINT_URL`; multipart in 8 MB parts,
each request with botocore's own timeouts), the local disk, and so on. Through the tracking server's proxy
(`mlflow-artifacts:`) MLflow's client has one timeout for every request, or none at all, so that
path is driven here, with the repository's own multipart protocol:
- When the server offers multipart uploads (its operator set MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD, or
  the client did: MLflow's choice), its store takes them (S3) and the file is past
  MLFLOW_MULTIPART_UPLOAD_MINIMUM_FILE_SIZE, the server starts one and signs a URL per part of
  MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE; the parts go straight to the store, PART_WORKERS at a time,
  each read from the open file when its turn comes; the server then completes the upload.
- Otherwise one streamed PUT, which the server answers only once it has stored the whole file.

Timeouts are idle timeouts (no byte moved for that long), so a slow transfer that moves never times
out. They must allow for the far side's silence while it works: none for a part (the store answers
once it has it), the server's onward upload of the whole file for a single PUT. So each request's
timeout is MLFLOW_HTTP_REQUEST_TIMEOUT plus that work at STORE_FLOOR_BPS.

Downloads. Through the proxy a file comes in one streamed GET, read 1 MB at a time (a folder, such as
a registered model's, file by file). The server sends
the first byte only once it has the whole file from its store, so that GET's idle timeout is sized
like a single PUT's, and the file is hashed as it arrives. MLflow's own download is the same GET with
a flat timeout, which a server fetching a large checkpoint outlasts. Only where MLflow would fetch
from the store itself, through signed URLs, does it get the file: always on a server that moves no
artifact bytes (MLFLOW_ARTIFACTS_PRESIGNED_ONLY); past MLFLOW_MULTIPART_DOWNLOAD_MINIMUM_FILE_SIZE
(500 MB) where ranged downloads are on (the server's MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD, or the
client's). Below that size ours is still used: MLflow's ranged download reads requests' 10 kB pieces,
ten times the client's CPU, GIL time a resuming job takes from torch's import. Every other store goes
through MLflow's own download, then is hashed.
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import posixpath
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trainer.hashing import sha256_of

STORE_FLOOR_BPS = 8 * 1024**2  # a server storing a file onward slower than this is taken for hung
CONNECT_S = 10.0
PART_WORKERS = min(8, 2 * (os.cpu_count() or 1))  # parts in flight, so PART_WORKERS chunks in memory


def repository(artifact_uri: str, tracking_uri: str):
    """MLflow's artifact repository for a run's artifact URI (what `client.log_artifact` would use)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    return get_artifact_repository(artifact_uri, tracking_uri=tracking_uri)


def run_repository(client, tracking_uri: str, run_id: str):
    return repository(client.get_run(run_id).info.artifact_uri, tracking_uri)


def idle_timeout(silent_bytes: int) -> float:
    """Seconds a request may go without a byte moving, when the far side works on `silent_bytes` first."""
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_TIMEOUT

    return MLFLOW_HTTP_REQUEST_TIMEOUT.get() + silent_bytes / STORE_FLOOR_BPS


def file_identity(path: Path) -> tuple | None:
    """What a file that is still the one written shows (device, inode, size, mtime): taken as it is
    handed to the uploader; None when there is no file. Through a descriptor, as the upload's check
    (some file systems, overlayfs among them, have given stat and fstat different devices)."""
    try:
        with open(path, "rb") as f:
            return _identity(os.fstat(f.fileno()))
    except OSError:
        return None


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def upload(repo, path: Path, artifact_path: str, written: tuple | None = None) -> None:
    """`path` into the run's `artifact_path` folder. With `written` (file_identity as the file was
    handed over), the descriptor the upload reads must still be that file: one replaced, rewritten or
    cut short since is never sent for a checkpoint that its sha256 tag would then call complete.
    A stat, not a second read of the whole file."""
    from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository

    if not isinstance(repo, HttpArtifactRepository):
        with open(path, "rb") as f:
            _check(written, f, path)
        repo.log_artifact(str(path), artifact_path)
        return
    should = getattr(repo, "_should_multipart_upload", None)  # MLflow's own choice: server support, size
    if should is not None and should(str(path)):
        with contextlib.suppress(_Unsupported):
            _put_parts(repo, path, artifact_path, written)
            return
    _put_whole(repo, path, artifact_path, written)


class ChangedOnDisk(ValueError):  # a ValueError: final, never retried
    """The file is no longer the one whose sha256 was taken when it was written."""


def _check(written: tuple | None, f, path: Path) -> None:
    if written is not None and _identity(os.fstat(f.fileno())) != written:
        raise ChangedOnDisk(f"{path} changed since it was written (replaced, rewritten or cut short): not "
                            "uploaded, and not marked complete")


class TooLarge(ValueError):  # a ValueError: final, never retried (the same bytes never pass)
    """The server, or a proxy in front of it, refuses a body this large (HTTP 413)."""


class _Unsupported(Exception):
    """The server's store takes no multipart upload."""


def _put_whole(repo, path: Path, artifact_path: str, written: tuple | None) -> None:
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.request_utils import augmented_raise_for_status
    from mlflow.utils.rest_utils import http_request

    endpoint = posixpath.join("/", artifact_path, path.name)
    with open(path, "rb") as f:
        _check(written, f, path)
        size = os.fstat(f.fileno()).st_size
        # The file mapped and handed over as one buffer, sent by one sendall without the GIL; a file
        # object goes out in urllib3's 16 kB reads, a Python loop turn each, taken from training.
        # Checkpoints are complete when they get here and are only ever renamed or unlinked (a
        # mapping outlives both), never truncated.
        with contextlib.ExitStack() as stack:
            body = b""
            if size:
                body = memoryview(stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)))
                stack.callback(body.release)
            resp = http_request(get_default_host_creds(repo.artifact_uri), endpoint, "PUT", data=body,
                                extra_headers={"Content-Type": "application/octet-stream"},
                                timeout=(CONNECT_S, idle_timeout(size)))
    if resp.status_code == 413:  # nginx's client_max_body_size is 1 MB unless raised
        raise TooLarge(f"{path.name} ({size / 2**20:.1f} MiB) is larger than the tracking server, or a proxy in front "
                       "of it, takes (HTTP 413): raise its body limit (nginx: client_max_body_size; ingress-nginx: "
                       "proxy-body-size) and run the same command again")
    augmented_raise_for_status(resp)


def _put_parts(repo, path: Path, artifact_path: str, written: tuple | None) -> None:
    from mlflow.environment_variables import MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE

    chunk = MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE.get()
    with open(path, "rb") as f:  # one descriptor, read with pread: a file pruned meanwhile still reads
        _check(written, f, path)
        size = os.fstat(f.fileno()).st_size
        create = _create(repo, path, max(1, -(-size // chunk)), artifact_path)
        pool = ThreadPoolExecutor(PART_WORKERS, thread_name_prefix="upload-part")
        try:
            futures = [pool.submit(_put_part, f.fileno(), c, i * chunk, min(chunk, size - i * chunk))
                       for i, c in enumerate(create.credentials)]
            parts = [future.result() for future in futures]
            repo.complete_multipart_upload(str(path), create.upload_id, parts, artifact_path)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            with contextlib.suppress(Exception):  # the store drops the parts sent (else they linger, billed)
                repo.abort_multipart_upload(str(path), create.upload_id, artifact_path)
            raise
        finally:
            pool.shutdown()


def _create(repo, path: Path, parts: int, artifact_path: str):
    from mlflow.exceptions import _UnsupportedMultipartUploadException
    from requests import HTTPError

    try:
        return repo.create_multipart_upload(str(path), parts, artifact_path)
    except HTTPError as e:
        try:
            message = str(e.response.json().get("message", ""))
        except Exception:  # not MLflow's JSON error: a proxy's page, say
            raise e from None
        if message.startswith(_UnsupportedMultipartUploadException.MESSAGE):
            raise _Unsupported() from None
        raise


def _put_part(fd: int, credential, start: int, length: int):
    from mlflow.entities.multipart_upload import MultipartUploadPart
    from mlflow.environment_variables import MLFLOW_S3_IGNORE_TLS
    from mlflow.utils.request_utils import augmented_raise_for_status, cloud_storage_http_request

    data = os.pread(fd, length, start)
    with cloud_storage_http_request("put", credential.url, data=data, headers=credential.headers,
                                    timeout=(CONNECT_S, idle_timeout(length)),
                                    verify=not MLFLOW_S3_IGNORE_TLS.get()) as resp:
        augmented_raise_for_status(resp)
        return MultipartUploadPart(credential.part_number, resp.headers.get("ETag", ""), credential.url)


def download(repo, artifact_path: str, folder: Path, size: int | None = None) -> tuple[Path, str]:
    """The run's `artifact_path` into `folder`, under its own name: its local path and sha256 (`size`: as
    a listing gave it)."""
    from mlflow.environment_variables import MLFLOW_MULTIPART_DOWNLOAD_MINIMUM_FILE_SIZE
    from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / posixpath.basename(artifact_path)
    # A server that moves no artifact bytes itself (MLFLOW_ARTIFACTS_PRESIGNED_ONLY) signs a URL to the store instead.
    presigned_only = getattr(repo, "_is_artifacts_presigned_only", lambda: False)
    if isinstance(repo, HttpArtifactRepository) and not presigned_only():
        size = _size(repo, artifact_path) if size is None else size
        ranged = size is not None and size >= MLFLOW_MULTIPART_DOWNLOAD_MINIMUM_FILE_SIZE.get() and _ranged(repo)
        if size is not None and not ranged:
            return _get_whole(repo, artifact_path, path, size)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:  # MLflow keeps the artifact's folders
        Path(repo.download_artifacts(artifact_path, tmp)).replace(path)
    return path, sha256_of(path)


def download_tree(repo, path: str, dest: Path) -> tuple[Path, str | None]:
    """`path` of `repo`, a file or a folder ("" for all of it), into `dest`/`path` (as the repository's own
    download_artifacts lays it out), each file as `download` takes it: its local path, and a file's sha256."""
    listed = repo.list_artifacts(path or None)
    if path and not listed:  # a file (MLflow lists one as nothing), or nothing: FileNotFoundError, from any store
        return download(repo, path, dest / posixpath.dirname(path), _size(repo, path))
    for info in listed:
        if info.is_dir:
            download_tree(repo, info.path, dest)
        else:
            download(repo, info.path, dest / posixpath.dirname(info.path), info.file_size)
    (dest / path).mkdir(parents=True, exist_ok=True)  # a model whose files were deleted: an empty folder
    return dest / path, None


def _ranged(repo) -> bool:
    """Whether MLflow's download through this server fetches from the store in ranged parts through
    signed URLs (MLflow's own choice, as for uploads) rather than in one GET through the server."""
    from mlflow.environment_variables import MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD
    from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

    enabled = getattr(repo, "_is_multipart_download_enabled", None)  # MLflow 3.18: the server says, or the client
    if enabled is None:  # before 3.18: the client's variable, for mlflow-artifacts: URIs
        return isinstance(repo, MlflowArtifactsRepository) and MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD.get()
    served = getattr(repo, "_artifact_server_base_uri", lambda: "")() is not None  # MLflow's artifact service
    return served and bool(enabled())


def _size(repo, artifact_path: str) -> int | None:
    """The file's size as the server lists it; FileNotFoundError when it lists no such file."""
    for info in repo.list_artifacts(posixpath.dirname(artifact_path) or None):
        if info.path == artifact_path and not info.is_dir:
            return info.file_size
    raise FileNotFoundError(f"no artifact {artifact_path} in the run")


def _get_whole(repo, artifact_path: str, dest: Path, size: int) -> tuple[Path, str]:
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.request_utils import augmented_raise_for_status
    from mlflow.utils.rest_utils import http_request

    resp = http_request(get_default_host_creds(repo.artifact_uri), posixpath.join("/", artifact_path), "GET",
                        stream=True, timeout=(CONNECT_S, idle_timeout(size)))
    digest, got = hashlib.sha256(), 0
    with resp:
        augmented_raise_for_status(resp)
        with open(dest, "wb") as f:
            for chunk in resp.iter_content(1 << 20):
                got += len(chunk)
                if got > size:  # a broken or hostile server does not fill the disk
                    raise OSError(f"the server sent more than the {size} bytes it lists for {artifact_path}")
                f.write(chunk)
                digest.update(chunk)
    if got < size:  # a connection closed early, or a listing that does not hold: never a file cut short
        raise OSError(f"the server sent {got} of the {size} bytes it lists for {artifact_path}")
    return dest, digest.hexdigest()
