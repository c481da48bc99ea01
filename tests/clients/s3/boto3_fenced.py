"""The S3 door's seed scenario through boto3, with the token added by the fencegate
package's hook instead of object metadata.

    PYTHONPATH=clients/python/src python3 boto3_fenced.py ENDPOINT ACCESS_KEY SECRET BUCKET KEY TERM

Two writers, each a boto3 client on which ``fencegate.fence_s3_client`` sends its
term's token as the ``Fencing-Token`` header. Term TERM writes KEY, term TERM+1 writes
it, then term TERM's late PUT and its DeleteObject must both be refused with 409
StaleFencingToken and ``Fencing-Highest: TERM+1``, and the object must still hold term
TERM+1's bytes. Every write request must carry the header among its SigV4 signed
headers, and no metadata token. Exits non-zero, saying why, when anything differs.
"""

import sys
from collections.abc import Callable
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from fencegate import fence_s3_client


def client(endpoint: str, access_key: str, secret: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def main() -> None:
    endpoint, access_key, secret, bucket, key, first = sys.argv[1:7]
    term = int(first)
    sent: list[tuple[str, dict[str, str]]] = []

    def record(request: Any, **_: Any) -> None:
        # The prepared request, as sent: signed, its values encoded to bytes.
        headers = {
            name.lower(): value.decode() if isinstance(value, bytes) else value
            for name, value in request.headers.items()
        }
        sent.append((request.method, headers))

    def writer(token: int) -> Any:
        s3 = client(endpoint, access_key, secret)
        fence_s3_client(s3, token)
        s3.meta.events.register("before-send.s3", record)
        return s3

    old, new = writer(term), writer(term + 1)

    def put(s3: Any, body: str) -> None:
        s3.put_object(Bucket=bucket, Key=key, Body=body.encode())

    def refused(what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except ClientError as error:
            status = error.response["ResponseMetadata"]["HTTPStatusCode"]
            code = error.response["Error"]["Code"]
            highest = error.response["ResponseMetadata"]["HTTPHeaders"].get("fencing-highest")
            if (status, code, highest) != (409, "StaleFencingToken", str(term + 1)):
                sys.exit(f"the {what} was refused with {status} {code}, Fencing-Highest {highest}")
            print(f"{what} refused: {code} ({error.response['Error'].get('Message')})")
        else:
            sys.exit(f"the {what} of an older term was accepted")

    put(old, f"term {term}")
    put(new, f"term {term + 1}")
    refused("late PUT", lambda: put(old, f"term {term}, late"))
    refused("late DELETE", lambda: old.delete_object(Bucket=bucket, Key=key))

    held = new.get_object(Bucket=bucket, Key=key)
    body = held["Body"].read().decode()
    if body != f"term {term + 1}":
        sys.exit(f"the object holds {body!r}, not term {term + 1}'s bytes")
    print(f"the object holds {body!r}")

    writes = [(method, headers) for method, headers in sent if method in ("PUT", "DELETE")]
    tokens = [headers.get("fencing-token") for _, headers in writes]
    expected = [str(term), str(term + 1), str(term), str(term)]
    if tokens != expected:
        sys.exit(f"the writes carried tokens {tokens}, not {expected}")
    for method, headers in writes:
        signed = headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
        if "fencing-token" not in signed:
            sys.exit(f"a {method} did not sign its Fencing-Token header: {headers['authorization']}")
        if "x-amz-meta-fencing-token" in headers:
            sys.exit(f"a {method} carried a metadata token too")
    reads = [headers.get("fencing-token") for method, headers in sent if method == "GET"]
    if reads != [None]:
        sys.exit(f"the GET carried a token: {reads}")
    print(f"{len(writes)} writes carried their term's token as a signed header")


if __name__ == "__main__":
    main()
