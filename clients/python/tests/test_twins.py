"""The asyncio classes held to the blocking ones they are hand-written twins of.

:class:`~fencegate.Gateway` / :class:`~fencegate.AsyncGateway` and
:class:`~fencegate.Lease` / :class:`~fencegate.AsyncLease` are written twice. The
blocking ones are the documented API (the README shows them and says the async ones
are used the same way; the async docstrings say "see ``Gateway.put``"), so each async
class is compared with its blocking twin, and a difference fails here rather than in a
user's program. Pure Python: no gateway, no database.

What is compared, for each pair of classes:

- Members: every public name of the blocking class (methods, properties, class and
  static methods), and ``__init__``, has a counterpart of the same name in the async
  class, except the pair's ``renamed`` in ``PAIRS`` (``close`` is ``aclose``, as in
  httpx); the async class has no public name beyond those and the pair's
  ``async_only`` (``AsyncLease.run``).
- Kind: a property is a property in both, with a setter in both or in neither; a class
  or static method is one in both. A method is a coroutine function in the async
  class, except the pair's ``plain_in_both``, which do no I/O (a factory, the clock,
  callbacks) and are plain functions in both. A ``@contextmanager`` method is an
  ``@asynccontextmanager`` one, a generator an async generator. The protocols:
  ``__enter__``/``__exit__`` are ``async def __aenter__``/``__aexit__``, and
  ``__iter__``/``__next__`` are ``__aiter__`` (plain) and ``async def __anext__``.
- Signatures: the same parameters in the same order, with the same names, kinds
  (positional, keyword-only, ...) and defaults, and the same annotations and return
  annotation, compared as text once each blocking name in the blocking one is replaced
  by its asyncio twin (``ASYNC_NAMES``: ``Gateway`` is ``AsyncGateway``, ``Iterator``
  is ``AsyncIterator``, ...). A coroutine's return is compared as ``async def`` writes
  it, without the ``Coroutine`` around it.
- Instance attributes: the public ones ``__init__`` sets (``lease.lost``,
  ``lease.resource``, ...), by name.

And for each pair of modules (``gateway``/``async_gateway``, ``lease``/``async_lease``):
``__all__`` holds the same names, each under its async name where it has one
(``Gateway``, ``AsyncGateway``), else the very same object (a constant or type the
twins share, such as ``DEFAULT_URL`` or ``LostReason``).

Docstrings, bodies and private members are not compared.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

import fencegate
from fencegate import async_gateway, async_lease, gateway, lease

ASYNC_NAMES = {
    "Gateway": "AsyncGateway",
    "Lease": "AsyncLease",
    "Iterator": "AsyncIterator",
    "Iterable": "AsyncIterable",
    "Generator": "AsyncGenerator",
    "ContextManager": "AsyncContextManager",
    # The connection type of Lease.transaction: psycopg's Connection; asyncio's drivers.
    "_Sync": "_Async",
}
"""Names in the blocking signatures and ``__all__`` that stand for another in the
asyncio ones."""

PROTOCOLS = {
    "__enter__": ("__aenter__", "coroutine"),
    "__exit__": ("__aexit__", "coroutine"),
    "__iter__": ("__aiter__", "plain"),
    "__next__": ("__anext__", "coroutine"),
}
"""A blocking protocol method: its asyncio name, and the kind that one is."""


@dataclass(frozen=True)
class Twins:
    sync: type[Any]
    async_: type[Any]
    renamed: dict[str, str] = field(default_factory=dict)
    """Blocking name: asyncio name, where the two differ."""
    async_only: frozenset[str] = frozenset()
    """Public members that only the asyncio class has."""
    plain_in_both: frozenset[str] = frozenset()
    """Methods that do no I/O: plain functions in both classes."""


PAIRS = [
    Twins(
        fencegate.Gateway,
        fencegate.AsyncGateway,
        renamed={"close": "aclose"},
        plain_in_both=frozenset({"lease"}),
    ),
    Twins(
        fencegate.Lease,
        fencegate.AsyncLease,
        async_only=frozenset({"run"}),
        plain_in_both=frozenset({"check", "on_lost", "remaining"}),
    ),
]

MODULES = [(gateway, async_gateway), (lease, async_lease)]


def own(cls: type[Any], name: str) -> bool:
    """Whether ``cls`` defines ``name`` itself or inherits it from a class of its own,
    not from ``object``."""
    return hasattr(cls, name) and inspect.getattr_static(cls, name) is not inspect.getattr_static(object, name, None)


def members(cls: type[Any]) -> dict[str, Any]:
    """The public members of ``cls``, with ``__init__`` and the protocol methods it
    defines, as they are stored on the class (a property, a classmethod, a function)."""
    names = [name for name in dir(cls) if not name.startswith("_")]
    names += [name for name in ("__init__", *PROTOCOLS, *(a for a, _ in PROTOCOLS.values())) if own(cls, name)]
    return {name: inspect.getattr_static(cls, name) for name in names}


def function_kind(function: Callable[..., Any]) -> str:
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is not None and not inspect.isgeneratorfunction(function):
        if inspect.isgeneratorfunction(wrapped):
            return "contextmanager"
        if inspect.isasyncgenfunction(wrapped):
            return "asynccontextmanager"
    if inspect.iscoroutinefunction(function):
        return "coroutine"
    if inspect.isasyncgenfunction(function):
        return "async generator"
    if inspect.isgeneratorfunction(function):
        return "generator"
    return "plain"


def kind(member: Any) -> str:
    if isinstance(member, property):
        return "property with setter" if member.fset is not None else "property"
    if isinstance(member, classmethod):
        return "classmethod " + function_kind(member.__func__)
    if isinstance(member, staticmethod):
        return "staticmethod " + function_kind(member.__func__)
    if isinstance(member, types.FunctionType):
        return function_kind(member)
    return type(member).__name__


ASYNC_KIND = {
    "plain": "coroutine",
    "contextmanager": "asynccontextmanager",
    "generator": "async generator",
}


def expected_kind(pair: Twins, sync_name: str, sync_kind: str) -> str:
    if sync_name in PROTOCOLS:
        return PROTOCOLS[sync_name][1]
    if sync_name == "__init__" or sync_name in pair.plain_in_both:
        return sync_kind
    prefix, _, function = sync_kind.rpartition(" ")
    if function not in ASYNC_KIND:
        return sync_kind  # a property, or something that is not a function
    return f"{prefix} {ASYNC_KIND[function]}".strip()


def async_name(pair: Twins, sync_name: str) -> str:
    if sync_name in PROTOCOLS:
        return PROTOCOLS[sync_name][0]
    return pair.renamed.get(sync_name, sync_name)


def pairs_of_members(pair: Twins) -> list[tuple[str, Any, str, Any]]:
    """(blocking name, member, asyncio name, its member or None), for every blocking member."""
    sync, async_ = members(pair.sync), members(pair.async_)
    return [(name, member, async_name(pair, name), async_.get(async_name(pair, name))) for name, member in sync.items()]


def as_async(annotation: Any) -> str:
    """An annotation of the blocking class as text, its blocking names replaced."""
    return re.sub(r"\w+", lambda word: ASYNC_NAMES.get(word.group(), word.group()), text(annotation))


def text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return "(none)"
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def function_of(member: Any) -> Callable[..., Any] | None:
    if isinstance(member, property):
        return member.fget
    if isinstance(member, (classmethod, staticmethod)):
        return member.__func__
    return member if callable(member) else None


def shape(function: Callable[..., Any], translate: Callable[[Any], str]) -> list[str]:
    """Each parameter and the return, as comparable lines."""
    signature = inspect.signature(function)
    lines = [
        f"{p.name}: {p.kind.description}, "
        + ("no default" if p.default is inspect.Parameter.empty else f"default {p.default!r}")
        + f", annotation {translate(p.annotation)}"
        for p in signature.parameters.values()
    ]
    return [*lines, f"returns {translate(signature.return_annotation)}"]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair.sync.__name__)
def test_every_member_has_its_twin(pair: Twins) -> None:
    missing = [
        f"{pair.async_.__name__}.{twin_name} (the twin of {pair.sync.__name__}.{name})"
        for name, _, twin_name, twin in pairs_of_members(pair)
        if twin is None
    ]
    assert missing == [], "members of the blocking class without an asyncio twin"
    twins = {twin_name for _, _, twin_name, _ in pairs_of_members(pair)}
    extra = set(members(pair.async_)) - twins - pair.async_only
    assert extra == set(), f"members of {pair.async_.__name__} without a blocking twin (or list them in async_only)"
    for name in pair.plain_in_both | set(pair.renamed):
        assert name in members(pair.sync), f"{pair.sync.__name__} has no {name}: the table names a member gone"
    for name in pair.async_only:
        assert name in members(pair.async_), f"{pair.async_.__name__} has no {name}: the table names a member gone"


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair.sync.__name__)
def test_every_twin_is_of_the_matching_kind(pair: Twins) -> None:
    wrong = [
        f"{pair.async_.__name__}.{twin_name} is {kind(twin)} where {pair.sync.__name__}.{name} "
        f"({kind(member)}) asks for {expected_kind(pair, name, kind(member))}"
        for name, member, twin_name, twin in pairs_of_members(pair)
        if twin is not None and kind(twin) != expected_kind(pair, name, kind(member))
    ]
    assert wrong == [], "asyncio members of the wrong kind (see plain_in_both in PAIRS)"


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair.sync.__name__)
def test_every_twin_has_the_same_signature(pair: Twins) -> None:
    differences = []
    for name, member, twin_name, twin in pairs_of_members(pair):
        function, twin_function = function_of(member), function_of(twin)
        if function is None or twin_function is None:
            continue
        expected, found = shape(function, as_async), shape(twin_function, text)
        if expected != found:
            differences.append(
                f"{pair.sync.__name__}.{name} / {pair.async_.__name__}.{twin_name}:\n"
                + "\n".join(f"  - {line}" for line in expected if line not in found)
                + "\n"
                + "\n".join(f"  + {line}" for line in found if line not in expected)
                + ("\n  (the order differs)" if sorted(expected) == sorted(found) else "")
            )
    assert differences == [], "\n".join(differences)


def public_attributes(instance: object) -> set[str]:
    return {name for name in vars(instance) if not name.startswith("_")}


def test_instances_have_the_same_attributes() -> None:
    sync_gateway = fencegate.Gateway()
    try:
        sync_lease = fencegate.Lease(sync_gateway, "twins", holder="node-a")
        sync_attributes = [public_attributes(sync_gateway), public_attributes(sync_lease)]
    finally:
        sync_gateway.close()

    async def make() -> list[set[str]]:
        # Inside a running loop, where the asyncio classes are made.
        async with fencegate.AsyncGateway() as async_gateway:
            async_lease = fencegate.AsyncLease(async_gateway, "twins", holder="node-a")
            return [public_attributes(async_gateway), public_attributes(async_lease)]

    assert asyncio.run(make()) == sync_attributes
    assert "lost" in sync_attributes[1], "the Lease was not read whole"


@pytest.mark.parametrize(("sync", "async_"), MODULES, ids=lambda module: module.__name__)
def test_the_modules_export_the_same_names(sync: types.ModuleType, async_: types.ModuleType) -> None:
    twins = {ASYNC_NAMES.get(name, name): name for name in sync.__all__}
    assert sorted(async_.__all__) == sorted(twins), f"__all__ of {async_.__name__}, against {sync.__name__}'s"
    for twin, name in twins.items():
        if twin == name:
            assert getattr(async_, name) is getattr(sync, name), f"{async_.__name__}.{name} is another object"
