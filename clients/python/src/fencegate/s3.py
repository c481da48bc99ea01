"""Fencing tokens on an S3 SDK's writes: boto3 and botocore through the gateway's S3 door.

The door takes a write's token from the object metadata ``x-amz-meta-fencing-token``
or from the ``Fencing-Token`` header. Metadata exists only on the calls that create an
object; DeleteObject and the multipart calls have none, so :func:`fence_s3_client`
sends the header, on every write call of one client::

    s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:7480", ...)
    remove = fence_s3_client(s3, lease.check)
    s3.put_object(Bucket="data", Key="orders/2026-12.json", Body=body)
    s3.delete_object(Bucket="data", Key="orders/2026-11.json")

Behavior:

- The header is added in botocore's ``before-call`` event, which fires once per API
  call before the request is built and signed: it is one of the request's SigV4
  signed headers, and the SDK's own resends of that call carry the same token.
- The token source is read once per call. A callable such as :meth:`Lease.check`
  raises once the term is over, so the call fails before anything is sent.
- Reads (GetObject, HeadObject, listings) get no header, and presigned URLs are not
  touched: they are made without an API call.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Union

from ._protocol import check_token

__all__ = ["S3_WRITE_OPERATIONS", "S3ClientLike", "TokenSource", "fence_s3_client"]

S3_WRITE_OPERATIONS: frozenset[str] = frozenset(
    {
        "PutObject",
        "CopyObject",
        "DeleteObject",
        "DeleteObjects",
        "CreateMultipartUpload",
        "UploadPart",
        "UploadPartCopy",
        "CompleteMultipartUpload",
        "AbortMultipartUpload",
    }
)
"""The S3 operations that present a token: the door's writes."""

HEADER = "Fencing-Token"

TokenSource = Union[int, Callable[[], int]]
"""A fencing token, or a callable that returns the current one (``lease.check``)."""


class _Events(Protocol):
    def register(self, event_name: str, handler: Callable[..., Any]) -> object: ...

    def unregister(self, event_name: str, handler: Callable[..., Any]) -> object: ...


class _Meta(Protocol):
    @property
    def events(self) -> _Events: ...


class S3ClientLike(Protocol):
    """What :func:`fence_s3_client` needs of a client: botocore's event hooks, which
    every boto3 and botocore client has as ``client.meta.events``. (Typed by shape, so
    that this package needs neither botocore nor its stubs.)"""

    @property
    def meta(self) -> _Meta: ...


def fence_s3_client(client: S3ClientLike, token: TokenSource) -> Callable[[], None]:
    """Adds ``Fencing-Token: <token>`` to every write call ``client`` makes.

    ``token`` is a fencing token, or a callable returning the current one, which is
    called once per write call: ``lease.check`` (raises
    :class:`~fencegate.LeaseLost` when the term is over, so nothing is sent), or
    ``lambda: lease.token``. The writes are :data:`S3_WRITE_OPERATIONS`.

    Returns a function that removes the header again; calling it twice is harmless.

    Raises:
        TypeError, ValueError: ``token`` is not a fencing token (at once for an int; for
            a callable, from the call whose token it returned).

    A stale token is refused by the door with S3's error document, which botocore
    raises as ``ClientError``: ``error.response["Error"]["Code"] ==
    "StaleFencingToken"``, HTTP status 409, and the highest token in the answer's
    ``Fencing-Highest`` header. Stop the term's work then; do not retry the write.
    """
    if callable(token):
        source = token

        def current() -> int:
            return check_token(source())

    else:
        fixed = check_token(token)

        def current() -> int:
            return fixed

    def add_token(params: dict[str, Any], **_: Any) -> None:
        params["headers"][HEADER] = str(current())

    events = client.meta.events
    names = [f"before-call.s3.{operation}" for operation in sorted(S3_WRITE_OPERATIONS)]
    for name in names:
        events.register(name, add_token)
    registered = True

    def remove() -> None:
        nonlocal registered
        if registered:
            for name in names:
                events.unregister(name, add_token)
            registered = False

    return remove
