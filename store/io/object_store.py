"""An object store's failures as one line naming the store, the endpoint or bucket, and the fix.

A store on S3 (or GCS, Azure ...) is reached through fsspec: the file system package may not be
installed (a plain `pip install -e .` has no s3fs), the bucket may not exist, the credentials may be
missing or refused, the endpoint may not answer. Each surfaces deep in s3fs, botocore or aiohttp
as a traceback; `file_system` and `reachable` turn them into a StoreError, and `failures` does the
same for a failure met later. The client libraries' exceptions are told apart by their class
names: they are optional packages, not imported here.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import fsspec

from store.errors import StoreError

S3_EXTRA = "pip install s3fs (in a checkout: pip install -e '.[s3]')"
# botocore's, aiohttp's and asyncio's names for an endpoint that does not answer
UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ConnectionRefusedError",
    "gaierror",
}
NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}


def file_system(location: str, **options):
    """fsspec's (file system, path) of a location; the file system's package not installed: one line."""
    try:
        return fsspec.core.url_to_fs(location, **options)
    except ImportError as e:
        protocol = location.split("://", 1)[0]
        wanted = re.search(r"[Ii]nstall (\S+)", str(e))
        how = S3_EXTRA if protocol in ("s3", "s3a") else f"pip install {wanted[1]}" if wanted else str(e)
        raise StoreError(
            f"{location}: fsspec's {protocol}:// file system needs {wanted[1] if wanted else 'a package'}, "
            f"which is not installed; {how}"
        ) from None


def endpoint(fs) -> str:
    """Where an object store's requests go, as a person would name it."""
    url = getattr(fs, "endpoint_url", None) or getattr(fs, "client_kwargs", {}).get("endpoint_url")
    return url or f"the default {fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]} endpoint"


def bucket_of(root: str) -> str:
    return root.strip("/").split("/", 1)[0]


def reachable(location: str, fs, root: str) -> None:
    """One request: the store's bucket exists and answers with these credentials, or one line naming
    what is wrong (an access the credentials may not have on the bucket itself is left to the reads)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "memory" in protocols:  # fsspec's in-process file system: no buckets, nothing to reach
        return
    bucket = bucket_of(root)
    with failures(location, fs):
        try:
            fs.info(bucket)
        except FileNotFoundError:
            raise StoreError(
                f"{location}: bucket {bucket} does not exist at {endpoint(fs)}; check the bucket in "
                "the store's URL, or create the bucket first"
            ) from None
        except PermissionError:
            pass


@contextlib.contextmanager
def failures(location: str, fs) -> Iterator[None]:
    """An object store that cannot be reached or has no credentials, inside: one line naming it."""
    try:
        yield
    except Exception as e:
        names = {type(c).__name__ for c in _chain(e)}
        if names & NO_CREDENTIALS:
            raise StoreError(
                f"{location}: no credentials for the object store at {endpoint(fs)}; set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, as "
                "for any S3 client"
            ) from None
        if names & UNREACHABLE:
            raise StoreError(
                f"{location}: cannot reach the object store at {endpoint(fs)} ({_first_line(e)}); "
                "check that it runs and the endpoint (FSSPEC_S3_ENDPOINT_URL for an S3-compatible "
                "server), or the network"
            ) from None
        raise


def _chain(e: BaseException | None) -> list[BaseException]:
    out = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
