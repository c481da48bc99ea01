"""Real things for the tests to run against: the gateway binary, and a TCP hop that can
hold what a client sends. No fixed ports: everything binds port 0."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Callable, TypeVar

REPO = Path(__file__).resolve().parents[3]
"""The root of the fencegate workspace."""

BINARY = Path(os.environ.get("FENCEGATE_BIN", REPO / "target" / "debug" / "fencegate"))
"""The gateway binary under test."""

START_TIMEOUT = 30.0

_T = TypeVar("_T")


def eventually(probe: Callable[[], _T | None], timeout: float = 5.0, interval: float = 0.01) -> _T:
    """The first truthy value of ``probe()``, polled until ``timeout``; fails if none."""
    give_up = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"not true within {timeout} s: {probe}")
        time.sleep(interval)


class GatewayProcess:
    """The ``fencegate`` binary, started with ``args`` on a free port, JSON logs kept.

    Readiness is the "fencegate ready" log line, which also names the addresses.
    """

    def __init__(self, args: Sequence[str], *, scheme: str = "http") -> None:
        self.args = list(args)
        self.scheme = scheme
        self.addr = ""
        self.pg_addr: str | None = None
        self.logs: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.addr}"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self, listen: str = "127.0.0.1:0") -> GatewayProcess:
        assert BINARY.exists(), f"{BINARY} is missing: cargo build -p fencegate-gateway --bin fencegate"
        command = [str(BINARY), "--listen", listen, "--log-format", "json", *self.args]
        if "--database-url" in self.args and "--pg-listen" not in self.args:
            command += ["--pg-listen", "127.0.0.1:0"]
        # Only what is passed here configures the gateway.
        env = {"PATH": os.environ.get("PATH", ""), "RUST_BACKTRACE": "1"}
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        self._proc = proc
        ready = threading.Event()
        assert proc.stderr is not None
        threading.Thread(target=self._read_logs, args=(proc.stderr, ready), daemon=True).start()
        if not ready.wait(START_TIMEOUT) or not self.addr:
            self.kill()
            raise RuntimeError(f"the gateway did not start: {command}\n" + "\n".join(self.logs))
        return self

    def _read_logs(self, stream: IO[bytes], ready: threading.Event) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            self.logs.append(line)
            if not ready.is_set():
                try:
                    fields = json.loads(line).get("fields", {})
                except ValueError:
                    continue
                if fields.get("message") == "fencegate ready":
                    self.addr = fields["addr"]
                    self.pg_addr = fields.get("pg_addr")
                    ready.set()
        ready.set()  # the process ended: wake the starter, which sees no address

    def restart(self) -> GatewayProcess:
        """Stops the gateway and starts it again on the same address and store."""
        self.stop()
        return self.start(listen=self.addr)

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it has not exited within 10 s."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGCONT)  # a paused process cannot exit
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: the gateway dies at once, as on a crash."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing is answered."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


class Hop:
    """A TCP hop in front of ``target`` that records what clients send and can hold it.

    ``hold()`` keeps every byte sent from then on (on open and new connections) until
    ``release()``: to the client it looks like a network that delays its packets, to
    the gateway like requests that arrive late. ``lose_answers(n)`` drops the next
    ``n`` answers and cuts their connections: the gateway has done the request, the
    client never hears of it. ``sent_at(marker)`` says when requests were sent.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._sent = bytearray()
        self._chunks: list[tuple[float, bytes]] = []
        self._losing = 0
        self.lost = 0
        """Answers dropped so far."""
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    def sent(self) -> bytes:
        """Everything clients sent through the hop so far."""
        with self._lock:
            return bytes(self._sent)

    def sent_at(self, marker: bytes) -> list[float]:
        """When (``time.monotonic()``) the hop read each chunk a client sent that holds
        ``marker``, such as a request line: one per request, in order."""
        with self._lock:
            return [at for at, chunk in self._chunks if marker in chunk]

    def lose_answers(self, count: int) -> None:
        """Drops the next ``count`` answers, cutting the connection each came on."""
        with self._lock:
            self._losing = count

    def _lose(self) -> bool:
        with self._lock:
            if self._losing == 0:
                return False
            self._losing -= 1
            self.lost += 1
            return True

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while True:
                chunk = source.recv(65536)
                if not chunk:
                    break
                if from_client:
                    with self._lock:
                        self._sent += chunk
                        self._chunks.append((time.monotonic(), chunk))
                    self._flowing.wait()
                elif self._lose():
                    break  # the answer is dropped; the finally cuts both ends
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)


CUT = None
"""A scripted answer of :class:`ScriptedGateway`: read the request, answer nothing,
close the connection."""


class ScriptedGateway:
    """An HTTP server that answers each request with the next answer of a script: a
    ``(status, body, headers)`` triple, or :data:`CUT`. It keeps every request's
    headers, to check what a client sent on each attempt. A request past the end of the
    script is answered ``500``, and :meth:`assert_done` fails unless the whole script
    was consumed."""

    def __init__(self, script: Sequence[tuple[int, dict[str, object], dict[str, str]] | None]) -> None:
        self._script = list(script)
        self.requests: list[dict[str, str]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                with outer._lock:
                    outer.requests.append({name.lower(): value for name, value in self.headers.items()})
                    step = outer._script.pop(0) if outer._script else (500, {"error": "internal"}, {})
                if step is None:  # CUT
                    self.close_connection = True
                    return
                status, body, headers = step
                payload = json.dumps({"message": "scripted", **body}).encode()
                self.send_response(status)
                for name, value in {"content-type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_PUT = do_POST = do_DELETE = do_GET = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def keys(self) -> list[str | None]:
        """The ``Idempotency-Key`` of every request so far."""
        return [request.get("idempotency-key") for request in self.requests]

    def assert_done(self) -> None:
        assert self._script == [], f"the script was not consumed: {self._script}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
