"""A port for a server that binds it later (a worker process, after its start-up).

The kernel hands out ports for ``bind(("", 0))`` and for outgoing connections from its
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768-60999). A
port found free in that range and bound seconds later can be given to someone else in
between (a NIXL side channel binding port 0, a client's connection): one CI run lost a
whole test module's worker stack that way ("address already in use"). So the port is
drawn at random below that range, where nothing is handed out unasked, and checked free
now.
"""

import random
import socket

_FLOOR = 10000  # below this: well-known and registered services


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems use 49152 and up


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port p with p .. p + span - 1 free on `host` now, below the ephemeral range."""
    rng = random.SystemRandom()
    high = max(_ephemeral_low() - span, _FLOOR + 1)
    for _ in range(200):
        port = rng.randrange(_FLOOR, high)
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
    raise RuntimeError(f"no {span} free consecutive port(s) on {host} in [{_FLOOR}, {high})")
