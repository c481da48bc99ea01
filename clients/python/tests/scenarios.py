"""The replay harness's scenario files (``tests/scenarios/*.toml``), staged through this
package as a writer would use it.

The Rust harness (``tests/src/replay``) puts a network hop, writer processes and a
database link around the gateway; here the same timelines run through the client's
public API against a real gateway:

- ``acquire`` / ``renew``: the gateway's hosted lease, one step at a time
  (``acquire_lease``, ``renew_lease``), on the lease named after the scenario's
  resource. ``lease.start_epoch`` is where the Rust harness's lease table starts; here
  the resource's fence is advanced to it first, since a hosted lease's next token is
  above the fence's highest.
- ``expire``: the seed's forced expiry. The current term is released on its holder's
  behalf, which the gateway judges as it does an expired lease (free for the next
  holder, ``lease_lost`` to a renewal), at once and whatever the TTL.
- ``write`` with ``hold``, and writes of a ``pause``d actor: prepared with the token the
  actor holds at that step, and sent at their ``release`` / ``resume``: what the fence
  sees is the late arrival. ``duplicate`` sends the held write twice.
- ``write`` with ``idempotency_key``: the client's own ``idempotency_key=``, so a second
  step with the same key is a retry of the same write; ``replayed`` is the result's.
- ``txn``: one :meth:`fencegate.Gateway.txn` of the step's ``ops``, each with its own
  token, or its ``actor``'s (else the step's) at that step; held, queued and released
  as a write is. A refusal's ``presented`` / ``highest`` are the first stale resource's.
- ``restart_gateway`` restarts the gateway process on its address and store; two
  ``replicas`` are two gateways on one Postgres database.

Each step's ``expect`` is compared field by field with what the step observed; a field
the step did not observe fails, as in the Rust harness. Files that need what a client
cannot stage are listed in :data:`NOT_REPLAYED`.
"""

from __future__ import annotations

import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

import httpx

import fencegate

from harness import REPO, GatewayProcess

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SCENARIO_DIR = REPO / "tests" / "scenarios"

NOT_REPLAYED: dict[str, str] = {
    "11-database-outage": "cuts the gateway's connections to its database: a fault between gateway and store",
    "12-stale-flood": "10,000 held writes over 50 connections: a load test of the gateway, not of a client",
    "13-commit-reply-delayed": "holds the database's answers to the gateway: a fault between gateway and store",
    "14-keyed-retry": "holds the database's answers before a keyed retry: a fault between gateway and store",
    "16-etcd-pause": "the lease lives in an etcd election the Rust harness starts: a lease source, not a client",
    "17-zookeeper-pause": (
        "the lease lives in a ZooKeeper election the Rust harness starts: a lease source, not a client"
    ),
}
"""Scenario files these tests do not replay, each with why. A test keeps this equal to
the files that use an action the replayer cannot stage (:data:`NOT_STAGED`)."""

NOT_STAGED = frozenset(
    {
        "drop",
        "reorder",
        "flood",
        "cut_database",
        "restore_database",
        "hold_database_replies",
        "release_database_replies",
    }
)
"""Actions that need the Rust harness's network hop or database link."""

_TOP_FIELDS = {"name", "description", "resource", "lease", "gateway", "processes", "control", "step"}
_LEASE_FIELDS = {"name", "ttl", "start_epoch", "source"}
_STEP_FIELDS = {
    "actor",
    "action",
    "label",
    "labels",
    "resource",
    "key",
    "value",
    "token",
    "hold",
    "delay",
    "duration",
    "if_match",
    "idempotency_key",
    "ops",
    "via",
    "series",
    "count",
    "connections",
    "meanwhile",
    "expect",
}
_EXPECT_FIELDS = {
    "outcome",
    "status",
    "presented",
    "highest",
    "version",
    "token",
    "value",
    "delta",
    "accepted",
    "duplicate",
    "applied",
    "replayed",
}
_OP_FIELDS = {"op", "actor", "resource", "key", "value", "token"}

Facts = dict[str, Union[str, bool, int, float, None]]
"""What a step observed, under the names of ``expect``."""

Refusal = Union[fencegate.StaleToken, fencegate.VersionMismatch, fencegate.BackendUnavailable]
"""The refusals that are a write's or a transaction's outcome; any other error is the
replayer's and fails the run."""


# ---------------------------------------------------------------- the file


@dataclass(frozen=True)
class Step:
    number: int
    action: str
    fields: dict[str, Any]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    @property
    def actor(self) -> str:
        actor = self.fields.get("actor")
        if not isinstance(actor, str):
            raise ScenarioError(f"step {self.number} ({self.action}) needs `actor`")
        return actor

    @property
    def label(self) -> str:
        label = self.fields.get("label")
        if not isinstance(label, str):
            raise ScenarioError(f"step {self.number} ({self.action}) needs `label`")
        return label

    @property
    def expect(self) -> dict[str, Any]:
        expect: dict[str, Any] = self.fields.get("expect", {})
        return expect


@dataclass(frozen=True)
class Scenario:
    name: str
    resource: str
    ttl: float
    start_epoch: int
    replicas: int
    steps: list[Step]
    source: str = "postgres"

    @property
    def not_staged(self) -> list[str]:
        """What in this file the replayer cannot stage: a lease source other than the
        gateway's own leases, and one entry per step."""
        source = [f"lease source {self.source}"] if self.source != "postgres" else []
        return source + [
            f"step {s.number}: {s.action}{' with delay' if 'delay' in s.fields else ''}"
            for s in self.steps
            if s.action in NOT_STAGED or "delay" in s.fields
        ]


class ScenarioError(Exception):
    """A scenario file the replayer cannot read, or a step it cannot run."""


def _unknown(where: str, found: dict[str, Any], known: set[str]) -> None:
    extra = sorted(set(found) - known)
    if extra:
        raise ScenarioError(f"{where}: unknown fields {extra}")


def duration(text: str) -> float:
    """Seconds of a humantime duration such as ``"1500ms"`` or ``"15s"``."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != re.sub(r"\s", "", text):
        raise ScenarioError(f"not a duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def load(path: Path) -> Scenario:
    """Reads a scenario file, refusing fields the format does not have (as the Rust
    harness does), so a typo fails here rather than being ignored."""
    with path.open("rb") as file:
        data = tomllib.load(file)
    _unknown(path.name, data, _TOP_FIELDS)
    lease: dict[str, Any] = data.get("lease", {})
    _unknown(f"{path.name}: lease", lease, _LEASE_FIELDS)
    steps = []
    for number, raw in enumerate(data.get("step", []), start=1):
        _unknown(f"{path.name}: step {number}", raw, _STEP_FIELDS)
        _unknown(f"{path.name}: step {number}: expect", raw.get("expect", {}), _EXPECT_FIELDS)
        for index, op in enumerate(raw.get("ops", []), start=1):
            _unknown(f"{path.name}: step {number}: op {index}", op, _OP_FIELDS)
        steps.append(Step(number, str(raw["action"]), raw))
    if not steps:
        raise ScenarioError(f"{path.name}: a scenario needs at least one [[step]]")
    return Scenario(
        name=str(data["name"]),
        resource=str(data.get("resource", "orders")),
        ttl=duration(lease.get("ttl", "15s")),
        start_epoch=int(lease.get("start_epoch", 0)),
        replicas=int(data.get("gateway", {}).get("replicas", 1)),
        steps=steps,
        source=str(lease.get("source", "postgres")),
    )


def scenario_files() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.toml"))


# ---------------------------------------------------------------- the run


@dataclass
class Write:
    """A write prepared at its step, with the token of that moment; sent later if held."""

    label: str
    actor: str
    via: int
    resource: str
    key: str
    value: str
    token: int
    if_match: int | None
    idempotency_key: str | None


@dataclass
class Txn:
    """A transaction prepared at its step, with the tokens of that moment; sent later if
    held."""

    label: str
    actor: str
    via: int
    operations: list[fencegate.TxnOp]
    idempotency_key: str | None


Request = Union[Write, Txn]
"""What a step sends, at once or at its release."""


@dataclass
class Replay:
    """One run of a scenario against ``gateways`` (replica ``n`` is ``gateways[n - 1]``)."""

    scenario: Scenario
    gateways: list[GatewayProcess]
    timeline: list[str] = field(default_factory=list)
    _clients: dict[tuple[str, int], fencegate.Gateway] = field(default_factory=dict)
    _tokens: dict[str, int] = field(default_factory=dict)
    _term: tuple[str, int] | None = None
    _held: dict[str, Request] = field(default_factory=dict)
    _paused: dict[str, list[Request]] = field(default_factory=dict)
    _answered: dict[str, tuple[Facts, str]] = field(default_factory=dict)
    _baselines: dict[str, float] = field(default_factory=dict)

    def run(self) -> list[str]:
        """Runs every step and checks its ``expect``; raises ``AssertionError`` at the
        first step that differs, and if a write is still in flight at the end."""
        scenario = self.scenario
        if scenario.not_staged:
            raise ScenarioError(f"{scenario.name} cannot be replayed here: {', '.join(scenario.not_staged)}")
        try:
            if scenario.start_epoch:
                self._client("-", 1).advance(scenario.resource, token=scenario.start_epoch)
            for step in scenario.steps:
                if step.action == "metric":
                    series = self._series(step)
                    self._baselines[series] = self._metric(series)
            for step in scenario.steps:
                facts, text = self._step(step)
                self.timeline.append(f"#{step.number:<3} {step.get('actor', '-'):<8} {self._describe(step)} -> {text}")
                self._check(step, facts)
            queued = [write.label for writes in self._paused.values() for write in writes]
            left = sorted(self._held) + sorted(self._answered) + sorted(queued)
            assert not left, f"{scenario.name}: writes {left} are still in flight at the end: release or await them"
            assert len(self.timeline) == len(scenario.steps)
            return self.timeline
        finally:
            for client in self._clients.values():
                client.close()

    def _check(self, step: Step, facts: Facts) -> None:
        expected, observed = [], []
        for name, want in step.expect.items():
            got = facts.get(name)
            if got is None or got != want:
                expected.append(f"{name}={want}")
                observed.append(f"{name}={'-' if got is None else got}")
        if expected:
            raise AssertionError(
                f"{self.scenario.name}: step {step.number} differs\n"
                f"  step:     {self.timeline[-1]}\n"
                f"  expected: {' '.join(expected)}\n"
                f"  observed: {' '.join(observed)}\n" + "\n".join(self.timeline)
            )

    def _client(self, actor: str, via: int) -> fencegate.Gateway:
        """The actor's client of replica ``via``: its name is the writes' ``Fencing-Holder``
        and the lease holder."""
        if (actor, via) not in self._clients:
            url = self.gateways[via - 1].url
            self._clients[actor, via] = fencegate.Gateway(url, holder=actor, timeout=15)
        return self._clients[actor, via]

    def _via(self, step: Step) -> int:
        via = int(step.get("via", 1))
        if not 1 <= via <= len(self.gateways):
            raise ScenarioError(f"step {step.number}: `via` names a replica the scenario does not have")
        return via

    def _resource(self, step: Step) -> str:
        return str(step.get("resource", self.scenario.resource))

    def _step(self, step: Step) -> tuple[Facts, str]:
        handlers: dict[str, Callable[[Step], tuple[Facts, str]]] = {
            "acquire": self._acquire,
            "renew": self._renew,
            "expire": self._expire,
            "wait": self._wait,
            "write": self._write,
            "txn": self._txn,
            "advance": self._advance,
            "release": self._release,
            "await": self._await,
            "duplicate": self._duplicate,
            "pause": self._pause,
            "resume": self._resume,
            "restart_gateway": self._restart,
            "read": self._read,
            "fence": self._fence,
            "metric": self._metric_step,
        }
        handler = handlers.get(step.action)
        if handler is None:
            raise ScenarioError(f"step {step.number}: no such action {step.action!r}")
        if step.get("actor") in self._paused and step.action not in ("write", "txn", "resume"):
            raise ScenarioError(f"step {step.number}: {step.actor} is paused and cannot {step.action}")
        return handler(step)

    # -- the lease

    def _acquire(self, step: Step) -> tuple[Facts, str]:
        client = self._client(step.actor, self._via(step))
        try:
            state = client.acquire_lease(self.scenario.resource, ttl=self.scenario.ttl)
        except fencegate.LeaseHeld as held:
            return {"outcome": "refused"}, f"refused: held by {held.body.get('holder')}"
        assert state.token is not None
        self._tokens[step.actor] = state.token
        self._term = (step.actor, state.token)
        return {"outcome": "granted", "token": state.token}, f"granted token {state.token}"

    def _renew(self, step: Step) -> tuple[Facts, str]:
        token = self._token(step)
        client = self._client(step.actor, self._via(step))
        try:
            client.renew_lease(self.scenario.resource, token=token, ttl=self.scenario.ttl)
        except fencegate.LeaseLost:
            return {"outcome": "refused", "token": token}, f"refused: token {token} was replaced"
        return {"outcome": "granted", "token": token}, f"granted: renewed at token {token}"

    def _expire(self, step: Step) -> tuple[Facts, str]:
        if self._term is None:
            raise ScenarioError(f"step {step.number}: nobody holds the lease")
        holder, token = self._term
        self._client(holder, 1).release_lease(self.scenario.resource, token=token)
        self._term = None
        return {}, f"term of token {token} ended ({holder} not told)"

    def _wait(self, step: Step) -> tuple[Facts, str]:
        seconds = duration(str(step.get("duration")))
        time.sleep(seconds)
        return {}, f"waited {seconds} s"

    def _token(self, step: Step) -> int:
        if "token" in step.fields:
            return int(step.get("token"))
        token = self._tokens.get(step.actor)
        if token is None:
            raise ScenarioError(f"step {step.number}: {step.actor} holds no token")
        return token

    # -- writes

    def _write(self, step: Step) -> tuple[Facts, str]:
        if_match = step.get("if_match")
        write = Write(
            label=str(step.get("label", f"step-{step.number}")),
            actor=str(step.get("actor", "-")),
            via=self._via(step),
            resource=self._resource(step),
            key=str(step.get("key", "k")),
            value=str(step.get("value")),
            token=self._token(step),
            if_match=None if if_match is None else int(if_match),
            idempotency_key=self._idempotency_key(step),
        )
        return self._dispatch(step, write)

    def _txn(self, step: Step) -> tuple[Facts, str]:
        ops: list[dict[str, Any]] = step.get("ops", [])
        if not ops:
            raise ScenarioError(f"step {step.number} (txn) needs `ops`")
        txn = Txn(
            label=str(step.get("label", f"step-{step.number}")),
            actor=str(step.get("actor", "-")),
            via=self._via(step),
            operations=[self._operation(step, index, op) for index, op in enumerate(ops, start=1)],
            idempotency_key=self._idempotency_key(step),
        )
        return self._dispatch(step, txn)

    @staticmethod
    def _idempotency_key(step: Step) -> str | None:
        key = step.get("idempotency_key")
        return None if key is None else str(key)

    def _operation(self, step: Step, index: int, op: dict[str, Any]) -> fencegate.TxnOp:
        """One of a ``txn`` step's ``ops``, with the token its actor holds now."""
        resource = str(op.get("resource", self.scenario.resource))
        key = str(op.get("key", "k"))
        if "token" in op:
            token = int(op["token"])
        else:
            actor = op.get("actor", step.get("actor"))
            held = self._tokens.get(actor) if isinstance(actor, str) else None
            if held is None:
                raise ScenarioError(f"step {step.number}: op {index} needs `token`, or an actor that holds one")
            token = held
        kind = op.get("op")
        if kind == "put":
            if "value" not in op:
                raise ScenarioError(f"step {step.number}: op {index} (put) needs `value`")
            return fencegate.TxnPut(resource, key, str(op["value"]), token=token)
        if kind == "delete":
            return fencegate.TxnDelete(resource, key, token=token)
        if kind == "advance":
            return fencegate.TxnAdvance(resource, token=token)
        if kind == "check":
            return fencegate.TxnCheck(resource, token=token)
        raise ScenarioError(f"step {step.number}: op {index} is {kind!r}, not put, delete, advance or check")

    def _dispatch(self, step: Step, request: Request) -> tuple[Facts, str]:
        """Sends a prepared write or transaction now, or keeps it for its writer's
        ``resume`` or its ``release``."""
        if request.actor in self._paused:
            self._paused[request.actor].append(request)
            return {}, "queued in the paused writer (pending)"
        if step.get("hold", False):
            self._held[request.label] = request
            return {}, "held in the network (pending)"
        return self._send(request)

    def _send(self, request: Request) -> tuple[Facts, str]:
        client = self._client(request.actor, request.via)
        try:
            if isinstance(request, Txn):
                return _committed(client.txn(request.operations, idempotency_key=request.idempotency_key))
            result = client.put(
                request.resource,
                request.key,
                request.value,
                token=request.token,
                if_match=request.if_match,
                idempotency_key=request.idempotency_key,
            )
        except (fencegate.StaleToken, fencegate.VersionMismatch, fencegate.BackendUnavailable) as error:
            return _refusal(error)
        status = 201 if result.created else 200
        facts: Facts = {
            "outcome": "accepted",
            "status": status,
            "token": result.token,
            "version": result.version,
            "replayed": result.replayed,
        }
        text = f"accepted {status} token={result.token} version={result.version}"
        return facts, text + (" (replayed)" if result.replayed else "")

    def _advance(self, step: Step) -> tuple[Facts, str]:
        token = self._token(step)
        try:
            state = self._client(step.actor, self._via(step)).advance(self._resource(step), token=token)
        except fencegate.StaleToken as stale:
            return {"outcome": "rejected", "presented": stale.presented, "highest": stale.highest}, "rejected"
        return {"outcome": "accepted", "highest": state.highest}, f"accepted highest={state.highest}"

    def _release(self, step: Step) -> tuple[Facts, str]:
        labels: list[str] = [step.label] if "label" in step.fields else list(step.get("labels", []))
        writes = [self._take_held(step, label) for label in labels]
        if len(writes) == 1:
            return self._send(writes[0])
        # Released at once: the writes race at the gateway.
        with ThreadPoolExecutor(len(writes)) as pool:
            answers = list(pool.map(self._send, writes))
        accepted = sum(facts["outcome"] == "accepted" for facts, _ in answers)
        return {"accepted": accepted}, f"{accepted} of {len(writes)} accepted: " + "; ".join(t for _, t in answers)

    def _take_held(self, step: Step, label: str) -> Request:
        request = self._held.pop(label, None)
        if request is None:
            raise ScenarioError(f"step {step.number}: nothing held is labelled {label!r}")
        return request

    def _duplicate(self, step: Step) -> tuple[Facts, str]:
        write = self._take_held(step, step.label)
        facts, text = self._send(write)
        copy, copy_text = self._send(write)
        return {**facts, "duplicate": copy["outcome"]}, f"{text}; copy: {copy_text}"

    def _pause(self, step: Step) -> tuple[Facts, str]:
        self._paused[step.actor] = []
        return {}, "paused"

    def _resume(self, step: Step) -> tuple[Facts, str]:
        queued = self._paused.pop(step.actor, None)
        if queued is None:
            raise ScenarioError(f"step {step.number}: {step.actor} is not paused")
        for request in queued:
            self._answered[request.label] = self._send(request)
        return {}, f"running; {len(queued)} queued writes sent"

    def _await(self, step: Step) -> tuple[Facts, str]:
        answer = self._answered.pop(step.label, None)
        if answer is None:
            raise ScenarioError(f"step {step.number}: write {step.label!r} was not sent: resume its writer first")
        return answer

    # -- the gateway

    def _restart(self, step: Step) -> tuple[Facts, str]:
        self.gateways[self._via(step) - 1].restart()
        return {}, "restarted, ready"

    def _read(self, step: Step) -> tuple[Facts, str]:
        stored = self._client("-", self._via(step)).get(self._resource(step), str(step.get("key", "k")))
        if stored is None:
            return {"outcome": "absent"}, "absent"
        facts: Facts = {
            "outcome": "accepted",
            "status": 200,
            "value": stored.text(),
            "version": stored.version,
            "token": stored.token,
        }
        return facts, f"{stored.text()!r} token={stored.token} version={stored.version}"

    def _fence(self, step: Step) -> tuple[Facts, str]:
        highest = self._client("-", self._via(step)).fence(self._resource(step)).highest
        return {"highest": highest}, f"highest={highest}"

    def _series(self, step: Step) -> str:
        return str(step.get("series")).replace("{resource}", self.scenario.resource)

    def _metric(self, series: str) -> float:
        """The series summed over the replicas (0 where it is absent)."""
        total = 0.0
        for gateway in self.gateways:
            for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
                if line.startswith(series + " "):
                    total += float(line.split()[-1])
        return total

    def _metric_step(self, step: Step) -> tuple[Facts, str]:
        series = self._series(step)
        delta = self._metric(series) - self._baselines[series]
        return {"delta": delta}, f"{series} rose by {delta}"

    def _describe(self, step: Step) -> str:
        parts = [step.action, *step.get("labels", [])]
        parts += [str(step.get(name)) for name in ("label", "resource", "key", "value") if name in step.fields]
        if "token" in step.fields:
            parts.append(f"token={step.get('token')}")
        for op in step.get("ops", []):
            target = str(op.get("resource", self.scenario.resource))
            if op.get("op") in ("put", "delete"):
                target += f"/{op.get('key', 'k')}"
            parts.append(f"[{op.get('op')} {target}]")
        if "idempotency_key" in step.fields:
            parts.append(f"idempotency-key={step.get('idempotency_key')}")
        if step.get("hold"):
            parts.append("(held)")
        if "via" in step.fields:
            parts.append(f"via gateway {step.get('via')}")
        return " ".join(parts)


def _committed(outcome: fencegate.TxnOutcome) -> tuple[Facts, str]:
    facts: Facts = {"outcome": "accepted", "status": 200, "replayed": outcome.replayed}
    text = f"accepted 200, {len(outcome.results)} operations applied"
    return facts, text + (" (replayed)" if outcome.replayed else "")


def _refusal(error: Refusal) -> tuple[Facts, str]:
    """A write's or a transaction's refusal as facts (of a transaction: the first stale
    resource's tokens, as the answer's top-level fields give them)."""
    if isinstance(error, fencegate.StaleToken):
        facts: Facts = {
            "outcome": "rejected",
            "status": error.status,
            "presented": error.presented,
            "highest": error.highest,
        }
        return facts, f"rejected {error.status} presented={error.presented} highest={error.highest}"
    if isinstance(error, fencegate.VersionMismatch):
        return {"outcome": "precondition_failed", "status": error.status}, f"412 current={error.current}"
    applied = {False: "no", True: "yes", None: "unknown"}[error.write_applied]
    return {"outcome": "unavailable", "status": error.status, "applied": applied}, f"unavailable {applied}"
