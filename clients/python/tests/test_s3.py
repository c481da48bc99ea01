"""fence_s3_client on a real boto3 client, against a local HTTP server that records what
it is sent and answers each request as told. The S3 door itself is driven through
boto3 by the Rust suite (``tests/tests/it/s3_clients.rs``), which needs radosgw."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import boto3
import pytest
from botocore.config import Config

import fencegate
from fencegate import S3_WRITE_OPERATIONS, fence_s3_client

# boto3 warns on Python 3.9, the oldest this package supports, that it will stop
# supporting it; that is boto3's policy, not something these tests can act on.
pytestmark = pytest.mark.filterwarnings("ignore:Boto3 will no longer support Python 3.9")

B = {"Bucket": "data", "Key": "orders/2026-12.json"}
UPLOAD = {**B, "UploadId": "u-1"}


@dataclass
class Sent:
    method: str
    path: str
    headers: dict[str, str]

    @property
    def token(self) -> str | None:
        return self.headers.get("fencing-token")

    @property
    def signed(self) -> list[str]:
        """The names in the Authorization header's SignedHeaders."""
        authorization = self.headers["authorization"]
        signed = authorization.split("SignedHeaders=")[1].split(",")[0]
        return signed.split(";")


@dataclass
class Recorder:
    """Requests received, in order; ``statuses`` are answered first, then 200s."""

    sent: list[Sent] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)


@pytest.fixture
def recorder() -> Iterator[tuple[Recorder, str]]:
    recorder = Recorder()

    class Handler(http.server.BaseHTTPRequestHandler):
        # HTTP/1.1, so that botocore's "Expect: 100-continue" is answered at once.
        protocol_version = "HTTP/1.1"

        def answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {name.lower(): value for name, value in self.headers.items()}
            recorder.sent.append(Sent(self.command, self.path, headers))
            status = recorder.statuses.pop(0) if recorder.statuses else 200
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield recorder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def s3_client(endpoint: str, attempts: int = 1) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="FGWRITER",
        aws_secret_access_key="writer-secret",
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": attempts}),
    )


# Every write, as boto3 calls it.
WRITES: dict[str, Callable[[Any], object]] = {
    "PutObject": lambda s3: s3.put_object(**B, Body=b"term 7"),
    "CopyObject": lambda s3: s3.copy_object(**B, CopySource="data/orders/2026-11.json"),
    "DeleteObject": lambda s3: s3.delete_object(**B),
    "DeleteObjects": lambda s3: s3.delete_objects(Bucket="data", Delete={"Objects": [{"Key": B["Key"]}]}),
    "CreateMultipartUpload": lambda s3: s3.create_multipart_upload(**B),
    "UploadPart": lambda s3: s3.upload_part(**UPLOAD, PartNumber=1, Body=b"part"),
    "UploadPartCopy": lambda s3: s3.upload_part_copy(**UPLOAD, PartNumber=1, CopySource="data/o"),
    "CompleteMultipartUpload": lambda s3: s3.complete_multipart_upload(
        **UPLOAD, MultipartUpload={"Parts": [{"ETag": '"e"', "PartNumber": 1}]}
    ),
    "AbortMultipartUpload": lambda s3: s3.abort_multipart_upload(**UPLOAD),
}


def test_every_write_carries_the_token_as_a_signed_header(recorder: tuple[Recorder, str]) -> None:
    assert set(WRITES) == S3_WRITE_OPERATIONS
    got, endpoint = recorder
    s3 = s3_client(endpoint)
    fence_s3_client(s3, 7)
    for write in WRITES.values():
        write(s3)
    assert len(got.sent) == len(WRITES)
    for operation, sent in zip(WRITES, got.sent):
        assert sent.token == "7", (operation, sent.headers)
        assert "fencing-token" in sent.signed, (operation, sent.headers["authorization"])


def test_reads_carry_no_token(recorder: tuple[Recorder, str]) -> None:
    got, endpoint = recorder
    s3 = s3_client(endpoint)
    fence_s3_client(s3, 7)
    s3.get_object(**B)
    s3.head_object(**B)
    s3.list_objects_v2(Bucket="data")
    assert [sent.method for sent in got.sent] == ["GET", "HEAD", "GET"]
    assert [sent.token for sent in got.sent] == [None, None, None]


def test_a_callable_is_read_once_per_call_and_resends_keep_its_token(recorder: tuple[Recorder, str]) -> None:
    got, endpoint = recorder
    s3 = s3_client(endpoint, attempts=2)
    tokens = iter([41, 42])
    read: list[int] = []

    def current() -> int:
        read.append(next(tokens))
        return read[-1]

    fence_s3_client(s3, current)
    got.statuses = [503]  # the first attempt fails; botocore resends the call
    s3.put_object(**B, Body=b"term 41")
    s3.delete_object(**B)
    assert read == [41, 42]
    assert [(sent.method, sent.token) for sent in got.sent] == [("PUT", "41"), ("PUT", "41"), ("DELETE", "42")]


def test_a_token_source_that_raises_stops_the_call_before_it_is_sent(recorder: tuple[Recorder, str]) -> None:
    got, endpoint = recorder
    s3 = s3_client(endpoint)

    def lost() -> int:
        raise fencegate.LeaseLost("the term is over")

    fence_s3_client(s3, lost)
    with pytest.raises(fencegate.LeaseLost):
        s3.put_object(**B, Body=b"after the term")
    assert got.sent == []


@pytest.mark.parametrize(
    ("token", "error"), [(0, ValueError), (2**63, ValueError), (True, TypeError), ("7", TypeError)]
)
def test_a_bad_token_is_refused_at_once(recorder: tuple[Recorder, str], token: Any, error: type[Exception]) -> None:
    _, endpoint = recorder
    with pytest.raises(error):
        fence_s3_client(s3_client(endpoint), token)


def test_a_callable_returning_a_bad_token_fails_its_call(recorder: tuple[Recorder, str]) -> None:
    got, endpoint = recorder
    s3 = s3_client(endpoint)
    fence_s3_client(s3, lambda: 0)
    with pytest.raises(ValueError, match="a fencing token is 1 to"):
        s3.put_object(**B, Body=b"x")
    assert got.sent == []


def test_remove_takes_the_header_off_again(recorder: tuple[Recorder, str]) -> None:
    got, endpoint = recorder
    s3 = s3_client(endpoint)
    remove = fence_s3_client(s3, 7)
    s3.put_object(**B, Body=b"fenced")
    remove()
    remove()
    s3.put_object(**B, Body=b"plain")
    assert [sent.token for sent in got.sent] == ["7", None]
