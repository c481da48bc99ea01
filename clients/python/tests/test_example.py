"""The example sweeper, run as a process: a real pause (SIGSTOP) of the leader."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fencegate

from harness import GatewayProcess

SWEEPER = Path(__file__).resolve().parents[1] / "examples" / "sweeper" / "sweeper.py"


class Sweeper:
    """The example program, its output read line by line."""

    def __init__(self, url: str, node: str, ttl: float) -> None:
        self.node = node
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(SWEEPER), "--gateway", url, "--node", node, "--lease", "sweeper",
             "--ttl", str(ttl), "--interval", "0.05", "--invoices", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip())

    def expect(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        give_up = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, give_up - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.node} never printed /{pattern}/; it printed {self.seen}") from None
            self.seen.append(line)
            found = re.search(pattern, line)
            if found:
                return found

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        return self.proc.wait(10)


def test_a_paused_sweeper_stops_on_waking_and_its_writes_never_land(gateway_process: GatewayProcess) -> None:
    ttl = 1.0
    a = Sweeper(gateway_process.url, "node-a", ttl)
    try:
        token_a = int(a.expect(r"node-a: leading with token (\d+)").group(1))
        a.expect(r"invoice-002/reminder written with token")
        os.kill(a.proc.pid, signal.SIGSTOP)  # a long GC pause, a VM migration

        with fencegate.Gateway(gateway_process.url, holder="node-b") as gateway:
            with gateway.lease("sweeper", ttl=ttl) as b:
                assert b.token == token_a + 1
                written = b.put("invoice-001/reminder", "reminder sent by node-b")
                os.kill(a.proc.pid, signal.SIGCONT)
                over = a.expect(r"node-a: term of token (\d+) over: (\w+)")
                assert int(over.group(1)) == token_a
                assert over.group(2) in ("deadline", "stale_token")
                a.expect(r"node-a: waiting for the lease")
                stored = gateway.get("sweeper", "invoice-001/reminder")
                assert stored is not None
                assert (stored.text(), stored.version, stored.token) == (
                    "reminder sent by node-b",
                    written.version,
                    b.token,
                ), "node-a wrote after node-b took over"
                assert b.held
            # node-b released: node-a takes over at once with the next token.
            assert int(a.expect(r"node-a: leading with token (\d+)").group(1)) == b.token + 1
    finally:
        assert a.stop() == 0
    assert not any("over: unknown" in line for line in a.seen)
