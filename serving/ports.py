"""A port for a server that binds it later (a worker process, after its start-up).

The kernel hands out ports for ``bind(("", 0))`` and for outgoing connections from its
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768-60999). A
port found free in that range and bound seconds later can be given to someone else in
between (a NIXL side channel binding port 0, a client's connection): one CI run lost a
whole test module's worker stack that way ("address already in use"). So the port is
drawn at random outside that range, where nothing is handed out unasked, and checked
free now.
"""

import random
import socket

_FLOOR = 10000  # below this: well-known and registered services
_TOP = 65535


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; other systems use 49152-65535


def _outside_ephemeral(span: int) -> list[range]:
    """First ports p with p .. p + span - 1 in [_FLOOR, _TOP] and outside the ephemeral
    range; where a tuned range leaves (almost) nothing outside, any such p (then only
    the check below stands between the port and a race)."""
    low, high = _ephemeral_range()
    outside = [r for r in (range(_FLOOR, low - span + 1), range(high + 1, _TOP - span + 2))
               if len(r) >= 100]
    return outside or [range(_FLOOR, _TOP - span + 2)]


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port p with p .. p + span - 1 free on `host` now, outside the ephemeral range."""
    rng = random.SystemRandom()
    ranges = _outside_ephemeral(span)
    total = sum(len(r) for r in ranges)
    for _ in range(200):
        k = rng.randrange(total)
        for r in ranges:
            if k < len(r):
                port = r[k]
                break
            k -= len(r)
        socks = []
        try:
            for p in range(port, port + span):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {span} free consecutive port(s) on {host} in {ranges}")
