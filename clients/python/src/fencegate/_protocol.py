"""The HTTP API without I/O: requests to send and answers to read.

The sync and asyncio gateways differ only in how they send; everything they send and
everything they make of an answer is here, once.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import httpx

from .errors import (
    FencegateError,
    GatewayUnreachable,
    TransientError,
    error_for_code,
)
from .models import (
    FenceState,
    IfMatch,
    LeaseState,
    SqlColumn,
    SqlOutcome,
    SqlResult,
    Statement,
    StatementLike,
    StoredObject,
    TxnAdvance,
    TxnCheck,
    TxnDelete,
    TxnOp,
    TxnOutcome,
    TxnPut,
    TxnResult,
    WriteResult,
)

MAX_TOKEN = 2**63 - 1
"""The largest fencing token: tokens are 1 to 2^63 - 1."""

MIN_TTL = 0.01
MAX_TTL = 86_400.0


@dataclass(frozen=True)
class Request:
    """A request to send, and what its errors should name."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    context: dict[str, Any] = field(default_factory=dict)
    """Fields the request already knows (``resource``, ``presented``), merged into an
    error answer so that its exception always carries them."""


def check_token(token: int) -> int:
    """``token`` if it is a fencing token; ``ValueError`` or ``TypeError`` otherwise."""
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"a fencing token is an int, not {type(token).__name__}")
    if not 1 <= token <= MAX_TOKEN:
        raise ValueError(f"a fencing token is 1 to {MAX_TOKEN}, not {token}")
    return token


def ttl_ms(ttl: float) -> int:
    """A lease's time to live, in seconds, as the wire's milliseconds."""
    if not MIN_TTL <= ttl <= MAX_TTL:
        raise ValueError(f"a lease's ttl is {MIN_TTL} to {MAX_TTL} seconds, not {ttl}")
    return round(ttl * 1000)


def _resource(resource: str) -> str:
    return quote(resource, safe="")


def _key(key: str) -> str:
    # A key may contain "/", which the gateway keeps; everything else that is not
    # unreserved is percent-encoded, and the gateway decodes it.
    return quote(key, safe="/")


def _write_headers(
    token: int,
    holder: str | None,
    idempotency_key: str,
    if_match: IfMatch = None,
    if_none_match: bool = False,
) -> dict[str, str]:
    headers = {"Fencing-Token": str(check_token(token)), "Idempotency-Key": idempotency_key}
    if holder is not None:
        headers["Fencing-Holder"] = holder
    if if_match is not None:
        headers["If-Match"] = "*" if if_match == "*" else f'"{int(if_match)}"'
    if if_none_match:
        headers["If-None-Match"] = "*"
    return headers


def _value_bytes(value: bytes | str, what: str = "an object's value") -> bytes:
    """The bytes of a value to store: ``str`` as UTF-8, any bytes-like object as is.
    Anything else is refused here, rather than turned into bytes by ``bytes()``, which
    makes ``n`` zero bytes of an int and fails obscurely on a dict."""
    if isinstance(value, str):
        return value.encode()
    try:
        return memoryview(value).tobytes()
    except TypeError:
        raise TypeError(
            f"{what} is bytes or str, not {type(value).__name__}: to store JSON, "
            "pass json.dumps(value) (or json.dumps(value).encode())"
        ) from None


def _json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


JSON = {"Content-Type": "application/json"}


def put(
    resource: str,
    key: str,
    value: bytes | str,
    *,
    token: int,
    holder: str | None,
    if_match: IfMatch,
    if_none_match: bool,
    idempotency_key: str,
) -> Request:
    content = _value_bytes(value)
    headers = _write_headers(token, holder, idempotency_key, if_match, if_none_match)
    headers["Content-Type"] = "application/octet-stream"
    return Request(
        "PUT",
        f"/v1/kv/{_resource(resource)}/{_key(key)}",
        headers,
        content,
        {"resource": resource, "presented": token},
    )


def delete(
    resource: str,
    key: str,
    *,
    token: int,
    holder: str | None,
    if_match: IfMatch,
    idempotency_key: str,
) -> Request:
    headers = _write_headers(token, holder, idempotency_key, if_match)
    return Request(
        "DELETE",
        f"/v1/kv/{_resource(resource)}/{_key(key)}",
        headers,
        None,
        {"resource": resource, "presented": token},
    )


def get(resource: str, key: str) -> Request:
    return Request("GET", f"/v1/kv/{_resource(resource)}/{_key(key)}", context={"resource": resource})


def fence(resource: str) -> Request:
    return Request("GET", f"/v1/fences/{_resource(resource)}", context={"resource": resource})


def advance(resource: str, *, token: int, holder: str | None, idempotency_key: str) -> Request:
    return Request(
        "POST",
        f"/v1/fences/{_resource(resource)}/advance",
        _write_headers(token, holder, idempotency_key),
        None,
        {"resource": resource, "presented": token},
    )


def _statement(item: StatementLike) -> dict[str, Any]:
    if isinstance(item, Statement):
        return {"sql": item.sql, "params": list(item.params)}
    if isinstance(item, str):
        return {"sql": item}
    sql, params = item
    return {"sql": sql, "params": list(params)}


def sql(
    resource: str,
    statements: Sequence[StatementLike],
    *,
    token: int,
    holder: str | None,
    idempotency_key: str,
) -> Request:
    if isinstance(statements, (str, Statement)):
        statements = [statements]
    headers = {**_write_headers(token, holder, idempotency_key), **JSON}
    body = _json({"statements": [_statement(item) for item in statements]})
    return Request(
        "POST",
        f"/v1/sql/{_resource(resource)}",
        headers,
        body,
        {"resource": resource, "presented": token},
    )


def lease_step(
    resource: str,
    step: Literal["acquire", "renew", "release"],
    *,
    holder: str,
    idempotency_key: str,
    token: int | None = None,
    ttl: float | None = None,
) -> Request:
    body: dict[str, Any] = {"holder": holder}
    if token is not None:
        body["token"] = check_token(token)
    if ttl is not None:
        body["ttl_ms"] = ttl_ms(ttl)
    context: dict[str, Any] = {"resource": resource}
    if token is not None:
        context["presented"] = token
    headers = {**JSON, "Idempotency-Key": idempotency_key}
    return Request("POST", f"/v1/leases/{_resource(resource)}/{step}", headers, _json(body), context)


def read_lease(resource: str) -> Request:
    return Request("GET", f"/v1/leases/{_resource(resource)}", context={"resource": resource})


def _if_match(if_match: IfMatch) -> dict[str, Any]:
    if if_match is None:
        return {}
    if if_match == "*":
        return {"if_match": "*"}
    if isinstance(if_match, bool) or not isinstance(if_match, int) or if_match < 0:
        raise ValueError(f'if_match is a version (0 or more) or "*", not {if_match!r}')
    return {"if_match": if_match}


def _operation(op: TxnOp) -> dict[str, Any]:
    if not isinstance(op, (TxnPut, TxnDelete, TxnAdvance, TxnCheck)):
        raise TypeError(f"a transaction's operation is a TxnPut, TxnDelete, TxnAdvance or TxnCheck, not {op!r}")
    token = check_token(op.token)
    if isinstance(op, TxnPut):
        if isinstance(op.value, str):
            value: dict[str, str] = {"value": op.value}
        else:
            raw = _value_bytes(op.value, "a TxnPut's value")
            value = {"value_base64": base64.b64encode(raw).decode("ascii")}
        return {"op": "put", "resource": op.resource, "key": op.key, "token": token, **value, **_if_match(op.if_match)}
    if isinstance(op, TxnDelete):
        return {"op": "delete", "resource": op.resource, "key": op.key, "token": token, **_if_match(op.if_match)}
    if isinstance(op, TxnAdvance):
        return {"op": "advance", "resource": op.resource, "token": token}
    if (op.key is None) != (op.version is None):
        raise ValueError("a check of an object takes both key and version")
    found = {} if op.key is None else {"key": op.key, "version": op.version}
    return {"op": "check", "resource": op.resource, "token": token, **found}


def txn(operations: Sequence[TxnOp], *, idempotency_key: str) -> Request:
    body = _json({"operations": [_operation(op) for op in operations]})
    return Request("POST", "/v1/txn", {**JSON, "Idempotency-Key": idempotency_key}, body)


# ---------------------------------------------------------------- answers


def _body(response: httpx.Response) -> dict[str, Any]:
    value = response.json()
    if not isinstance(value, dict):
        raise FencegateError(f"an answer that is not a JSON object: {value!r}", status=response.status_code)
    return value


def _replayed(response: httpx.Response) -> bool:
    return str(response.headers.get("idempotency-replayed", "")).lower() == "true"


def _etag_version(response: httpx.Response) -> int:
    return int(response.headers.get("etag", '"0"').strip('"') or 0)


def write_result(response: httpx.Response, request: Request) -> WriteResult:
    check(response, request)
    body = _body(response)
    return WriteResult(
        resource=str(body["resource"]),
        key=str(body["key"]),
        token=int(body["token"]),
        version=int(body["version"]),
        created=response.status_code == 201,
        replayed=_replayed(response),
    )


def stored_object(response: httpx.Response, request: Request) -> StoredObject | None:
    if response.status_code == 404:
        return None
    check(response, request)
    return StoredObject(
        value=response.content,
        version=_etag_version(response),
        token=int(response.headers.get("fencing-token", "0")),
    )


def fence_state(response: httpx.Response, request: Request) -> FenceState:
    check(response, request)
    body = _body(response)
    highest = body.get("highest")
    return FenceState(
        resource=str(body["resource"]),
        highest=None if highest is None else int(highest),
        replayed=_replayed(response),
    )


def lease_state(response: httpx.Response, request: Request) -> LeaseState:
    check(response, request)
    body = _body(response)
    token = body.get("token")
    return LeaseState(
        resource=str(body["resource"]),
        held=bool(body["held"]),
        holder=body.get("holder"),
        identity=body.get("identity"),
        token=None if token is None else int(token),
        expires_in_ms=int(body.get("expires_in_ms", 0)),
        replayed=_replayed(response),
    )


def sql_outcome(response: httpx.Response, request: Request) -> SqlOutcome:
    check(response, request)
    body = _body(response)
    results = tuple(
        SqlResult(
            rows_affected=int(result["rows_affected"]),
            columns=tuple(SqlColumn(str(c["name"]), str(c["type"])) for c in result.get("columns", ())),
            rows=tuple(tuple(row) for row in result.get("rows", ())),
            truncated=bool(result.get("truncated", False)),
        )
        for result in body["results"]
    )
    return SqlOutcome(
        resource=str(body["resource"]), token=int(body["token"]), results=results, replayed=_replayed(response)
    )


_TXN_OPS = ("put", "delete", "advance", "check")


def _txn_result(result: Mapping[str, Any]) -> TxnResult:
    op = result["op"]
    if op not in _TXN_OPS:
        raise FencegateError(f"a transaction result of an unknown operation: {op!r}")
    key = result.get("key")
    version = result.get("version")
    return TxnResult(
        op=op,
        resource=str(result["resource"]),
        token=int(result["token"]),
        key=None if key is None else str(key),
        version=None if version is None else int(version),
        created=bool(result.get("created", False)),
    )


def txn_outcome(response: httpx.Response, request: Request) -> TxnOutcome:
    check(response, request)
    body = _body(response)
    return TxnOutcome(results=tuple(_txn_result(r) for r in body["results"]), replayed=_replayed(response))


def ready(response: httpx.Response, request: Request) -> bool:
    return response.status_code == 200


def check(response: httpx.Response, request: Request) -> None:
    """Raises the error of an answer that is not a success."""
    if response.status_code >= 300:
        raise error_from_answer(response, request)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fencegate never sends one


def error_from_answer(response: httpx.Response, request: Request) -> FencegateError:
    """The exception of an error answer: the class of its ``error`` code."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("error"), str):
        if status in (502, 503, 504):
            # Not the gateway's answer: a proxy in front of it could not reach it, and
            # may or may not have passed the request on.
            return GatewayUnreachable(
                f"HTTP {status} from something in front of the gateway",
                status=status,
                write_applied=None,
                retry_after=_retry_after(response),
            )
        return FencegateError(f"an answer that is not fencegate's: HTTP {status}", status=status)
    merged = {**request.context, **body}
    highest = response.headers.get("fencing-highest")
    if "highest" not in merged and highest is not None and highest.isdigit():
        merged["highest"] = int(highest)
    cls = error_for_code(body["error"])
    message = str(body.get("message", body["error"]))
    if issubclass(cls, TransientError):
        return cls(message, status=status, body=merged, retry_after=_retry_after(response))
    return cls(message, status=status, body=merged)


def unreachable(error: httpx.TransportError, url: str) -> GatewayUnreachable:
    """A transport failure as a transient error that says whether a write could have
    been sent."""
    never_sent = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
    return GatewayUnreachable(
        f"no answer from the gateway at {url}: {type(error).__name__}: {error}",
        write_applied=False if never_sent else None,
    )
