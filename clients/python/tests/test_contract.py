"""The error classes against the gateway's contract, and the package as installed."""

from __future__ import annotations

import json
import re
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

import fencegate
from fencegate import errors
from fencegate.fenced import fence_error_from_sqlstate

from harness import REPO

OPENAPI = REPO / "gateway" / "openapi.json"
README = REPO / "README.md"


def openapi_codes() -> set[str]:
    document = json.loads(OPENAPI.read_text())
    return set(document["components"]["schemas"]["ErrorCode"]["enum"])


def readme_codes() -> set[str]:
    """The codes of the README's error table (the one with an ``error`` column)."""
    codes: set[str] = set()
    in_table = False
    for line in README.read_text().splitlines():
        if line.startswith("| Status | `error` |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if in_table:
            cells = line.split("|")
            codes.update(re.findall(r"`([a-z_]+)`", cells[2]) if len(cells) > 2 else [])
    return codes


def test_every_code_of_openapi_has_a_class_and_every_class_a_code() -> None:
    documented = openapi_codes()
    assert len(documented) >= 30, "the ErrorCode enum of openapi.json was not found whole"
    classes = set(errors.ERROR_CLASSES)
    assert documented - classes == set(), "codes of gateway/openapi.json without an exception class"
    assert classes - documented == set(), "exception classes whose code gateway/openapi.json does not list"


def test_the_readme_error_table_lists_the_same_codes() -> None:
    assert readme_codes() == set(errors.ERROR_CLASSES)


def test_classes_are_exported_and_named_after_their_code() -> None:
    for code, cls in errors.ERROR_CLASSES.items():
        assert getattr(fencegate, cls.__name__) is cls
        assert cls.__name__.lower() == code.replace("_", "").lower(), (code, cls.__name__)
        assert issubclass(cls, fencegate.FencegateError)


def answer(status: int, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers)


def test_a_stale_answer_carries_its_fields_and_is_not_transient() -> None:
    from fencegate._protocol import Request, error_from_answer

    request = Request("PUT", "/v1/kv/orders/o-1", context={"resource": "orders", "presented": 41})
    error = error_from_answer(
        answer(409, {"error": "stale_token", "message": "stale", "resource": "orders", "presented": 41, "highest": 42}),
        request,
    )
    assert isinstance(error, fencegate.StaleToken)
    assert isinstance(error, fencegate.FenceError)
    assert not isinstance(error, fencegate.TransientError)
    assert (error.resource, error.presented, error.highest, error.status) == ("orders", 41, 42, 409)


@pytest.mark.parametrize(
    ("body", "headers", "cls", "applied", "retry_after"),
    [
        ({"error": "backend_unavailable", "message": "m", "write_applied": None}, {}, "BackendUnavailable", None, None),
        (
            {"error": "backend_unavailable", "message": "m", "write_applied": False},
            {},
            "BackendUnavailable",
            False,
            None,
        ),
        ({"error": "overloaded", "message": "m"}, {"Retry-After": "1"}, "Overloaded", False, 1.0),
        ({"error": "shutting_down", "message": "m"}, {"Retry-After": "1"}, "ShuttingDown", False, 1.0),
    ],
)
def test_transient_answers_say_whether_the_write_may_have_been_applied(
    body: dict[str, object], headers: dict[str, str], cls: str, applied: bool | None, retry_after: float | None
) -> None:
    from fencegate._protocol import Request, error_from_answer

    error = error_from_answer(answer(503, body, headers), Request("PUT", "/v1/kv/r/k"))
    assert type(error) is getattr(fencegate, cls)
    assert isinstance(error, fencegate.TransientError)
    assert (error.write_applied, error.retry_after) == (applied, retry_after)


def test_a_proxy_answer_without_json_is_unreachable_and_in_doubt() -> None:
    from fencegate._protocol import Request, error_from_answer

    error = error_from_answer(httpx.Response(502, text="<html>bad gateway</html>"), Request("PUT", "/v1/kv/r/k"))
    assert isinstance(error, fencegate.GatewayUnreachable)
    assert error.write_applied is None


def test_an_unknown_code_is_still_a_fencegate_error() -> None:
    from fencegate._protocol import Request, error_from_answer

    error = error_from_answer(answer(418, {"error": "teapot", "message": "short and stout"}), Request("GET", "/"))
    assert type(error) is fencegate.FencegateError
    assert (error.status, error.message, error.body["error"]) == (418, "short and stout", "teapot")


def test_sql_fence_errors_are_parsed_from_their_detail() -> None:
    stale = fence_error_from_sqlstate("ZF001", "stale", "resource=sweeper presented=1 highest=2")
    assert isinstance(stale, fencegate.StaleToken)
    assert (stale.resource, stale.presented, stale.highest, stale.sqlstate) == ("sweeper", 1, 2, "ZF001")
    assert stale.status is None
    unissued = fence_error_from_sqlstate("ZF005", "not issued", "resource=orders presented=9 issued=3")
    assert isinstance(unissued, fencegate.TokenNotIssued)
    assert (unissued.resource, unissued.presented, unissued.issued) == ("orders", 9, 3)
    other = fence_error_from_sqlstate("ZF002", "no token", "resource=sweeper")
    assert type(other) is fencegate.FenceError
    assert (other.sqlstate, other.detail) == ("ZF002", {"resource": "sweeper"})


def test_tokens_are_checked_before_anything_is_sent() -> None:
    with fencegate.Gateway("http://127.0.0.1:9") as gateway:
        for token in (0, -1, 2**63):
            with pytest.raises(ValueError, match="fencing token"):
                gateway.put("r", "k", b"v", token=token)
        with pytest.raises(TypeError):
            gateway.put("r", "k", b"v", token=True)


def test_lease_timing_defaults_and_checks() -> None:
    timing = fencegate.LeaseTiming.of(15.0)
    # The same numbers in every client: step down 2 s before the lease can pass, retry a
    # failed renewal every 0.5 s, each attempt at most 1 s; acquire retries unchanged.
    assert (timing.renew_every, timing.margin) == pytest.approx((5.0, 2.0))
    assert (timing.renew_retry_every, timing.renew_timeout) == pytest.approx((0.5, 1.0))
    assert timing.retry_every == pytest.approx(1.5)
    assert fencegate.LeaseTiming.of(3.0, renew_retry_every=0.05, renew_timeout=0.3).renew_retry_every == 0.05
    with pytest.raises(ValueError, match="renew_every"):
        fencegate.LeaseTiming.of(1.0, margin=0.5, renew_every=0.6)
    with pytest.raises(ValueError, match="margin"):
        fencegate.LeaseTiming.of(1.0, margin=1.0)
    # A renewal sent just before the step-down must be able to land before the lease passes.
    with pytest.raises(ValueError, match=r"margin \(1\.0 s\) must be above renew_timeout \(1\.0 s\)"):
        fencegate.LeaseTiming.of(15.0, margin=1.0)
    with pytest.raises(ValueError, match="must be above renew_timeout"):
        fencegate.LeaseTiming.of(3.0, renew_timeout=0.5)
    assert fencegate.LeaseTiming.of(15.0, margin=1.0, renew_timeout=0.5).margin == 1.0
    for setting in ("renew_retry_every", "renew_timeout"):
        with pytest.raises(ValueError, match=setting):
            fencegate.LeaseTiming.of(15.0, **{setting: 0})


def test_the_package_under_test_is_the_installed_artifact() -> None:
    """The tests import the wheel installed into this environment, not the sources."""
    installed = Path(sysconfig.get_paths()["purelib"]).resolve()
    module = Path(fencegate.__file__).resolve()
    assert installed in module.parents, f"fencegate imported from {module}, not from {installed}"
    assert (module.parent / "py.typed").exists()
    assert sys.prefix != sys.base_prefix, "the tests run in a virtual environment"
