"""Side channel: two agents swap NIXL metadata, region tables and compatibility records,
and a puller claims a lease.

A small HTTP/JSON endpoint (standard library only). Every route requires the shared
secret of the workers (``Authorization: Bearer <secret>``, compared in constant time):
the metadata lets its holder READ and WRITE every registered region, so a process
without the secret never gets it (401). The connecting side first fetches the
server's hello (``GET /hello``) and checks compatibility itself, so a mismatch is reported
from its own point of view; then it posts its own hello (``POST /hello``), which the server
checks again before accepting the peer, so a careless client cannot slip through. Both
sides end up knowing each other: the puller must reach the source's memory, and the source
must be able to answer the puller's notifications.

``POST /claim`` (``{"lease", "agent", "key"}``, from an agent that has posted its hello)
binds a lease to the claiming agent and answers what the lease pinned
(``transfer.lease``): the puller reads exactly that. Bodies over ``MAX_BODY`` bytes are refused (413) unread.

Each connection holds a server thread. One that has not presented the secret within
``auth_timeout`` of its accept is cut, however it trickles its bytes, and at most
``max_connections`` are open at once (one more is closed unanswered), so strangers can
neither pile threads up nor hold the slots; an authorised one stays open while idle
(``idle_timeout``) for its puller's next claim, and a puller keeps at most
``IDLE_PER_PEER`` idle ones to each peer.

The compatibility record is whatever the two sides must agree on (model, dtypes, block
size, per-region layouts, ...): any JSON-able dict, compared exactly, key by key.
Quantities that may differ between peers, such as pool sizes, belong in the region table,
which is not compared.
"""

from __future__ import annotations

import base64
import dataclasses
import hmac
import json
import socket
import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from transfer.lease import ClaimError
from transfer.memory import Region

PROTOCOL_VERSION = 2
Address = tuple[str, int]
MAX_BODY = 1 << 20  # bytes: a hello (metadata and region table) or a claim is a few KiB
# bytes: a claim's answer lists a run of blocks an item, a few MiB at the longest prompt
# whose blocks all lie apart
MAX_ANSWER = 1 << 26
# idle kept-alive connections a puller keeps to one peer: enough for its claims in steady
# state; a burst's extra ones close after use rather than sit in the peer's slots
IDLE_PER_PEER = 8
# levels of a compatibility record (a few in practice): records are compared and shown by
# recursion, and one of many hundred levels would exhaust the recursion limit
MAX_NESTING = 32


class HandshakeError(RuntimeError):
    """The peer could not be reached, refused our secret or answered nonsense."""


class CompatibilityError(RuntimeError):
    """The peer's compatibility record differs from ours in ``field`` (a dotted path)."""

    def __init__(self, field: str, local, remote, peer: str = "peer"):
        self.field, self.local, self.remote = field, local, remote
        super().__init__(f"incompatible {peer}: field {field!r} differs: "
                         f"local {_show(local)}, remote {_show(remote)}")


_MISSING = "<missing>"


def check_compatible(local: dict, remote: dict, peer: str = "peer") -> None:
    """Raise CompatibilityError naming the first field where the two records differ."""
    field = _first_difference(_normalise(local), _normalise(remote), "")
    if field is not None:
        path, a, b = field
        raise CompatibilityError(path, a, b, peer)


def _first_difference(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return sub, a.get(key, _MISSING), b.get(key, _MISSING)
            diff = _first_difference(a[key], b[key], sub)
            if diff is not None:
                return diff
        return None
    return None if a == b else (path or "<record>", a, b)


def _normalise(record: dict) -> dict:
    """What the record looks like after a JSON trip (tuples become lists)."""
    return json.loads(json.dumps(record))


def _shallow(value, levels: int = MAX_NESTING) -> bool:
    """Whether ``value`` nests dicts and lists at most ``levels`` deep."""
    if not isinstance(value, (dict, list)):
        return True
    children = value.values() if isinstance(value, dict) else value
    return levels > 0 and all(_shallow(v, levels - 1) for v in children)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


@dataclasses.dataclass(frozen=True)
class Hello:
    """What one side tells the other."""

    agent: str
    metadata: bytes
    regions: dict[str, Region]
    compat: dict

    def to_json(self) -> dict:
        return {"version": PROTOCOL_VERSION, "agent": self.agent,
                "metadata": base64.b64encode(self.metadata).decode(),
                "regions": {n: r.to_json() for n, r in self.regions.items()}, "compat": self.compat}

    @classmethod
    def from_json(cls, d: dict) -> "Hello":
        """A peer's hello; HandshakeError unless well formed, with regions whose bounds fit
        descriptors (``transfer.descriptors``: offsets in int64, addresses in uint64) and a
        compatibility record at most ``MAX_NESTING`` levels deep."""
        if not isinstance(d, dict) or d.get("version") != PROTOCOL_VERSION:
            raise HandshakeError(f"unsupported handshake (want version {PROTOCOL_VERSION}): "
                                 f"{_show(d.get('version') if isinstance(d, dict) else d)}")
        try:
            hello = cls(str(d["agent"]), base64.b64decode(d["metadata"]),
                        {n: Region.from_json(n, r) for n, r in d["regions"].items()}, dict(d["compat"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HandshakeError(f"malformed hello: {e!r}") from None
        if not all(0 <= r.nbytes < 1 << 63 and 0 <= r.addr < 1 << 64 and 0 <= r.device_id < 1 << 64
                   for r in hello.regions.values()):
            raise HandshakeError("malformed hello: a region beyond 64-bit bounds")
        if not _shallow(hello.compat):
            raise HandshakeError(f"malformed hello: a compatibility record over {MAX_NESTING} "
                                 f"levels deep")
        return hello


class HandshakeServer:
    """Serves ``hello`` and claims to holders of ``secret``: accepts compatible peers by
    calling ``on_peer`` and answers claims with ``on_claim(lease, agent, key)`` (a JSON-able
    dict, or ClaimError), both from its own threads. A connection has ``auth_timeout``
    seconds from its accept to present the secret, then may idle ``idle_timeout``; at most
    ``max_connections`` are open at once (a pulling peer holds one per concurrent claim,
    and keeps at most ``IDLE_PER_PEER`` of them idle)."""

    def __init__(self, hello: Hello, on_peer: Callable[[Hello], None], *, secret: str,
                 on_claim: Callable[[str, str, str | None], dict] | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_connections: int = 1024,
                 auth_timeout: float = 5.0, idle_timeout: float = 300.0):
        if not secret:
            raise ValueError("the handshake needs the workers' shared secret")
        self.hello = hello
        self._on_peer, self._on_claim = on_peer, on_claim
        self._token = _bearer(secret)
        self._accepted: set[str] = set()  # agents whose hello this server accepted
        self._lock = threading.Lock()
        self._idle_timeout = idle_timeout
        self._http = _HTTPServer((host, port), _handler(self, auth_timeout), max_connections,
                                 auth_timeout)
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,), name="handshake",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> Address:
        host, port = self._http.server_address[:2]
        return host, port

    def authorised(self, header: str | None) -> bool:
        return header is not None and hmac.compare_digest(header.encode(), self._token.encode())

    def _accept(self, body: dict) -> tuple[int, dict]:
        try:
            peer = Hello.from_json(body)
            check_compatible(self.hello.compat, peer.compat, f"peer {peer.agent!r}")
        except CompatibilityError as e:
            return 409, {"error": str(e), "field": e.field, "local": e.local, "remote": e.remote}
        except HandshakeError as e:
            return 400, {"error": str(e)}
        with self._lock:  # before on_peer, whose owner may ``forget`` it at once
            self._accepted.add(peer.agent)
        try:
            self._on_peer(peer)
        except Exception as e:  # report to the peer rather than kill the server thread
            self.forget(peer.agent)
            return 500, {"error": f"could not add peer {peer.agent!r}: {e}"}
        return 200, {"agent": self.hello.agent}

    def _claim(self, body) -> tuple[int, dict]:
        if not (isinstance(body, dict) and set(body) == {"lease", "agent", "key"}
                and isinstance(body["lease"], str) and isinstance(body["agent"], str)
                and isinstance(body["key"], (str, type(None)))):
            return 400, {"error": "a claim is {\"lease\": str, \"agent\": str, "
                                  "\"key\": str | null}"}
        with self._lock:
            known = body["agent"] in self._accepted
        if not known or self._on_claim is None:
            return 403, {"error": f"agent {body['agent'][:100]!r} has not shaken hands here"}
        try:
            return 200, self._on_claim(body["lease"], body["agent"], body["key"])
        except ClaimError as e:
            return 409, {"error": e.detail, "kind": e.kind}

    def forget(self, agent: str) -> None:
        """Refuse ``agent``'s claims until it shakes hands again (its hello was refused
        after this server accepted it)."""
        with self._lock:
            self._accepted.discard(agent)

    def close(self) -> None:
        """Stop serving; kept-alive connections are cut too, so that no peer's next request
        reaches this server's state after a new server took its port."""
        if self._thread.is_alive():
            self._http.shutdown()
            self._http.server_close()
            self._thread.join()
        with self._http.lock:
            for conn in self._http.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection, for at most ``limit`` connections at once: one more is
    closed unanswered. A connection not authorised within ``auth_timeout`` of its accept
    is cut by the serving loop (``service_actions``): a read's timeout alone would let a
    request trickled a byte at a time hold its slot for ever."""

    daemon_threads = True

    def __init__(self, address: Address, handler, limit: int, auth_timeout: float):
        self.limit, self.auth_timeout = limit, auth_timeout
        # open connections, kept-alive ones included: the time to be authorised by, or
        # None once a request of it presented the secret
        self.connections: dict[socket.socket, float | None] = {}
        self.lock = threading.Lock()
        super().__init__(address, handler)

    def verify_request(self, request, client_address) -> bool:
        with self.lock:
            if len(self.connections) >= self.limit:
                return False
            self.connections[request] = time.monotonic() + self.auth_timeout
            return True

    def authorised(self, request) -> None:
        with self.lock:
            if request in self.connections:
                self.connections[request] = None

    def service_actions(self) -> None:  # serve_forever calls it every poll interval
        now = time.monotonic()
        with self.lock:
            late = [c for c, by in self.connections.items() if by is not None and by < now]
        for conn in late:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # its thread's read ends; it closes the rest
            except OSError:
                pass

    def shutdown_request(self, request) -> None:  # every accepted connection ends here
        with self.lock:
            self.connections.pop(request, None)
        super().shutdown_request(request)


def _bearer(secret: str) -> str:
    return f"Bearer {secret}"


def _handler(server: HandshakeServer, auth_timeout: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a claim reuses its puller's connection
        # seconds a read may wait while none of the connection's requests has presented
        # the secret (the server cuts it at its deadline anyway); ``_authorised`` lengthens it
        timeout = auth_timeout
        # headers and body go out in two writes: with Nagle's algorithm the second waits
        # for the peer's delayed ACK (40 ms a claim on a kept connection)
        disable_nagle_algorithm = True

        def do_GET(self):
            if not self._authorised():
                return
            if self.path == "/hello":
                self._reply(200, server.hello.to_json())
            elif self.path == "/ping":
                self._reply(200, {"agent": server.hello.agent})
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            if not self._authorised():
                return
            routes = {"/hello": server._accept, "/claim": server._claim}
            if self.path not in routes:
                return self._reply(404, {"error": f"no route {self.path}"})
            try:
                length = int(self.headers.get("Content-Length", 0))
            except ValueError:
                self.close_connection = True
                return self._reply(400, {"error": "bad Content-Length"})
            if not 0 <= length <= MAX_BODY:
                self.close_connection = True  # the body is never read
                return self._reply(413, {"error": f"bodies are at most {MAX_BODY} bytes"})
            try:
                body = json.loads(self.rfile.read(length))
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
                return self._reply(400, {"error": f"bad JSON: {e}"})
            self._reply(*routes[self.path](body))

        def _authorised(self) -> bool:
            if server.authorised(self.headers.get("Authorization")):
                server._http.authorised(self.connection)
                self.connection.settimeout(server._idle_timeout)
                return True
            self.close_connection = True  # the body, if any, is never read
            self._reply(401, {"error": "the workers' shared secret is required"})
            return False

        def _reply(self, status: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # keep request logs out of the workers' output
            pass

    return Handler


def exchange(address: Address, hello: Hello, secret: str, timeout: float = 5.0) -> Hello:
    """Handshake with the server at ``address``: returns its hello once both sides agree.

    Raises CompatibilityError on a mismatch (checked here first, then by the server) and
    HandshakeError if the peer is unreachable or refuses (our secret among other things).
    """
    peer = Hello.from_json(_call(address, "GET", "/hello", None, secret, timeout))
    check_compatible(hello.compat, peer.compat, f"peer {peer.agent!r} at {address[0]}:{address[1]}")
    _call(address, "POST", "/hello", hello.to_json(), secret, timeout)
    return peer


def claim(address: Address, secret: str, lease: str, agent: str, key: str | None,
          timeout: float = 5.0) -> dict:
    """Claim ``lease`` (whose key is ``key``) for ``agent`` from the source at ``address``:
    what the lease pinned (the source's ``on_claim`` answer). ClaimError if the source
    refuses the claim, HandshakeError if it cannot be asked."""
    return _call(address, "POST", "/claim", {"lease": lease, "agent": agent, "key": key},
                 secret, timeout)


class _Connections:
    """Keep-alive connections to peers' endpoints, the idle ones kept per address: a
    claim, on every request's path to its first decoded token, then costs one round trip
    on an open connection instead of a TCP connect as well (1.0-1.7 ms a claim on an H200
    host with a connection each, bench/RESULTS.md). Any thread."""

    def __init__(self):
        self._idle: dict[Address, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def request(self, address: Address, method: str, path: str, body: bytes | None,
                headers: dict, timeout: float) -> tuple[int, bytes]:
        while True:
            with self._lock:
                idle = self._idle.get(address)
                conn = idle.pop() if idle else None
            kept = conn is not None
            if conn is None:
                conn = http.client.HTTPConnection(address[0], address[1], timeout=timeout)
            conn.timeout = timeout
            try:
                conn.request(method, path, body, headers)
                resp = conn.getresponse()
                data = resp.read(MAX_ANSWER + 1)
            except (OSError, http.client.HTTPException):
                conn.close()
                if kept:  # the server closed it while idle: again on a new one
                    continue
                raise
            if len(data) > MAX_ANSWER:  # unread bytes left: the connection goes too
                conn.close()
                raise http.client.HTTPException(f"an answer over {MAX_ANSWER} bytes")
            with self._lock:
                idle = self._idle.setdefault(address, [])
                keep = not resp.will_close and len(idle) < IDLE_PER_PEER
                if keep:
                    idle.append(conn)
            if not keep:
                conn.close()
            return resp.status, data


_CONNECTIONS = _Connections()


def _call(address: Address, method: str, path: str, body: dict | None, secret: str,
          timeout: float) -> dict:
    """One JSON request to a peer's endpoint; the errors above for its failures."""
    where = f"http://{address[0]}:{address[1]}{path}"
    headers = {"Authorization": _bearer(secret)}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        status, answer = _CONNECTIONS.request(tuple(address), method, path, data, headers,
                                              timeout)
        detail = json.loads(answer)
    # RecursionError: JSON nested too deep to parse
    except (OSError, http.client.HTTPException, ValueError, RecursionError) as e:
        raise HandshakeError(f"{where}: {e!r}") from None
    if status == 200:
        return detail
    if not isinstance(detail, dict):
        detail = {"error": str(detail)}
    if status == 409 and "field" in detail:  # the server's "local" is our "remote"
        raise CompatibilityError(detail.get("field", "?"), detail.get("remote", _MISSING),
                                 detail.get("local", _MISSING), f"peer at {where}")
    if status == 409 and detail.get("kind") in ("stale", "claimed", "mismatch"):
        raise ClaimError(detail["kind"], str(detail.get("error")))
    raise HandshakeError(f"{where}: {status} {detail.get('error')}")


def ping(address: Address, timeout: float = 0.5) -> bool:
    """Whether something accepts connections on the peer's side channel."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False
