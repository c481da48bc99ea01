"""The seed's invoice sweeper: processes compete for one lease, and the leader writes a
reminder per unpaid invoice, every interval, under its term's fencing token.

Run a gateway, then two sweepers::

    python examples/sweeper/sweeper.py --node node-a
    python examples/sweeper/sweeper.py --node node-b

Freeze the leader (``kill -STOP <pid>``) for longer than the TTL: the other one takes
over with the next token. Wake it (``kill -CONT <pid>``): it sees on its own clock that
its term is over, or has its late write refused, and goes back to waiting. Stop a
sweeper with Ctrl-C: it releases the lease, and the other takes over at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import FrameType

import fencegate


def say(message: str) -> None:
    print(message, flush=True)


def sweep(lease: fencegate.Lease, node: str, invoices: int, round_: int) -> None:
    """One pass over the unpaid invoices, each reminder written under the term's token."""
    for number in range(1, invoices + 1):
        key = f"invoice-{number:03}/reminder"
        written = lease.put(key, f"reminder sent by {node} (token {lease.token}, sweep {round_})")
        say(f"{node}: {key} written with token {written.token}, version {written.version}")


def lead(lease: fencegate.Lease, node: str, invoices: int, interval: float) -> None:
    """Sweeps until the term ends, for whatever reason."""
    say(f"{node}: leading with token {lease.token}")
    round_ = 0
    while not lease.lost.is_set():
        round_ += 1
        try:
            sweep(lease, node, invoices, round_)
        except fencegate.StaleToken as stale:
            # A newer term has written: stop this term's work, never retry it.
            say(f"{node}: write refused, presented {stale.presented}, highest {stale.highest}")
            break
        except fencegate.LeaseLost:
            break  # the term ended between two writes: nothing more was sent
        except fencegate.TransientError as error:
            # Down or busy: the term lasts until its deadline; try again next sweep.
            say(f"{node}: transient error, retrying in the next sweep: {error}")
        lease.lost.wait(interval)
    reason = lease.reason.value if lease.reason else "unknown"
    say(f"{node}: term of token {lease.token} over: {reason}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default=os.environ.get("FENCEGATE_URL", "http://127.0.0.1:7070"))
    parser.add_argument("--node", required=True, help="this sweeper's name, unique among the running ones")
    parser.add_argument("--lease", default="invoice-sweeper", help="the lease, and the resource it fences")
    parser.add_argument("--ttl", type=float, default=15.0, help="seconds the lease holds without renewal")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between sweeps")
    parser.add_argument("--invoices", type=int, default=3)
    args = parser.parse_args()

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)  # unwinds through `with lease`, which releases it

    signal.signal(signal.SIGTERM, stop)
    key = os.environ.get("FENCEGATE_KEY")  # with --auth-file on the gateway
    with fencegate.Gateway(args.gateway, key=key, holder=args.node) as gateway:
        while True:
            say(f"{args.node}: waiting for the lease {args.lease}")
            with gateway.lease(args.lease, ttl=args.ttl) as lease:
                lead(lease, args.node, args.invoices, args.interval)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
