"""The S3 door's seed scenario, driven by boto3 with nothing changed but the endpoint.

    python3 boto3_seed.py ENDPOINT ACCESS_KEY SECRET BUCKET KEY TERM

Term TERM writes KEY, term TERM+1 writes it, then term TERM's late PUT must be refused
with 409 StaleFencingToken, and the object must still hold term TERM+1's bytes. The
token travels as object metadata (x-amz-meta-fencing-token), which every SDK sends
without middleware. Exits non-zero, saying why, when anything differs.
"""

import sys

import boto3
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


if __name__ == "__main__":
    main()
