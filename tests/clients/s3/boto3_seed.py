"""The S3 door's seed scenario, driven by boto3 with nothing changed but the endpoint.

    python3 boto3_seed.py ENDPOINT ACCESS_KEY SECRET BUCKET KEY TERM

Term TERM writes KEY, term TERM+1 writes it, then term TERM's late PUT must be refused
with 409 StaleFencingToken, and the object must still hold term TERM+1's bytes. The
token travels as object metadata (x-amz-meta-fencing-token), which every SDK sends
without middleware. Then boto3's transfer manager uploads an object of 6 MiB in
parts (a multipart upload, with the token in its metadata) under term TERM+1, and
lists both keys with ListObjectsV2. Exits non-zero, saying why, when anything differs.
"""

import io
import sys

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError


def main() -> None:
    endpoint, access_key, secret, bucket, key, first = sys.argv[1:7]
    term = int(first)
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )

    def put(token: int, body: str) -> None:
        s3.put_object(
            Bucket=bucket,
            Key=key,
            Body=body.encode(),
            Metadata={"fencing-token": str(token)},
        )

    put(term, f"term {term}")
    put(term + 1, f"term {term + 1}")
    try:
        put(term, f"term {term}, late")
    except ClientError as error:
        status = error.response["ResponseMetadata"]["HTTPStatusCode"]
        code = error.response["Error"]["Code"]
        if status != 409 or code != "StaleFencingToken":
            sys.exit(f"the late PUT was refused with {status} {code}, not 409 StaleFencingToken")
        print(f"late PUT refused: {code} ({error.response['Error'].get('Message')})")
    else:
        sys.exit("the late PUT of an older term was accepted")
    held = s3.get_object(Bucket=bucket, Key=key)
    body = held["Body"].read().decode()
    if body != f"term {term + 1}":
        sys.exit(f"the object holds {body!r}, not term {term + 1}'s bytes")
    token = held["Metadata"].get("fencing-token")
    if token != str(term + 1):
        sys.exit(f"the object's metadata names token {token}, not {term + 1}")
    print(f"the object holds {body!r}")

    big_key = f"{key}.big"
    big = b"0123456789abcdef" * (6 * 1024 * 1024 // 16)
    parts = TransferConfig(multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024)
    s3.upload_fileobj(
        io.BytesIO(big),
        bucket,
        big_key,
        ExtraArgs={"Metadata": {"fencing-token": str(term + 1)}},
        Config=parts,
    )
    head = s3.head_object(Bucket=bucket, Key=big_key)
    if head["ContentLength"] != len(big) or not head["ETag"].endswith('-2"'):
        sys.exit(f"the multipart upload reads back as {head['ContentLength']} bytes, ETag {head['ETag']}")
    if s3.get_object(Bucket=bucket, Key=big_key)["Body"].read() != big:
        sys.exit("the multipart upload's bytes differ")
    print(f"multipart upload of {len(big)} bytes in 2 parts: ETag {head['ETag']}")

    prefix = key.rsplit("/", 1)[0] + "/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    listed = [entry["Key"] for page in pages for entry in page.get("Contents", [])]
    if key not in listed or big_key not in listed:
        sys.exit(f"ListObjectsV2 of {prefix} lists {listed}, without {key} or {big_key}")
    if any(name.startswith(".fencegate/") for name in listed):
        sys.exit(f"ListObjectsV2 lists the door's physical keys: {listed}")
    print(f"listed {len(listed)} keys under {prefix}")


if __name__ == "__main__":
    main()
