"""Side channel: two agents swap NIXL metadata, region tables and compatibility records.

A small HTTP/JSON endpoint (standard library only). The connecting side first fetches the
server's hello (``GET /hello``) and checks compatibility itself, so a mismatch is reported
from its own point of view; then it posts its own hello (``POST /hello``), which the server
checks again before accepting the peer, so a careless client cannot slip through. Both
sides end up knowing each other: the puller must reach the source's memory, and the source
must be able to answer the puller's notifications.

The compatibility record is whatever the two sides must agree on (model, dtypes, block
size, per-region layouts, ...): any JSON-able dict, compared exactly, key by key.
Quantities that may differ between peers, such as pool sizes, belong in the region table,
which is not compared.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from transfer.memory import Region

PROTOCOL_VERSION = 1
Address = tuple[str, int]


class HandshakeError(RuntimeError):
    """The peer could not be reached or answered nonsense."""


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
        if not isinstance(d, dict) or d.get("version") != PROTOCOL_VERSION:
            raise HandshakeError(f"unsupported handshake (want version {PROTOCOL_VERSION}): "
                                 f"{_show(d.get('version') if isinstance(d, dict) else d)}")
        try:
            return cls(str(d["agent"]), base64.b64decode(d["metadata"]),
                       {n: Region.from_json(n, r) for n, r in d["regions"].items()}, dict(d["compat"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HandshakeError(f"malformed hello: {e!r}") from None


class HandshakeServer:
    """Serves ``hello`` and accepts compatible peers by calling ``on_peer`` (from its own thread)."""

    def __init__(self, hello: Hello, on_peer: Callable[[Hello], None], host: str = "127.0.0.1",
                 port: int = 0):
        self.hello = hello
        self._on_peer = on_peer
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,), name="handshake",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> Address:
        host, port = self._http.server_address[:2]
        return host, port

    def _accept(self, body: dict) -> tuple[int, dict]:
        try:
            peer = Hello.from_json(body)
            check_compatible(self.hello.compat, peer.compat, f"peer {peer.agent!r}")
        except CompatibilityError as e:
            return 409, {"error": str(e), "field": e.field, "local": e.local, "remote": e.remote}
        except HandshakeError as e:
            return 400, {"error": str(e)}
        try:
            self._on_peer(peer)
        except Exception as e:  # report to the peer rather than kill the server thread
            return 500, {"error": f"could not add peer {peer.agent!r}: {e}"}
        return 200, {"agent": self.hello.agent}

    def close(self) -> None:
        if self._thread.is_alive():
            self._http.shutdown()
            self._http.server_close()
            self._thread.join()


def _handler(server: HandshakeServer):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/hello":
                self._reply(200, server.hello.to_json())
            elif self.path == "/ping":
                self._reply(200, {"agent": server.hello.agent})
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            if self.path != "/hello":
                return self._reply(404, {"error": f"no route {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError as e:
                return self._reply(400, {"error": f"bad JSON: {e}"})
            self._reply(*server._accept(body))

        def _reply(self, status: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # keep request logs out of the workers' output
            pass

    return Handler


def exchange(address: Address, hello: Hello, timeout: float = 5.0) -> Hello:
    """Handshake with the server at ``address``: returns its hello once both sides agree.

    Raises CompatibilityError on a mismatch (checked here first, then by the server) and
    HandshakeError if the peer is unreachable or refuses.
    """
    url = f"http://{address[0]}:{address[1]}/hello"
    peer = Hello.from_json(_request(urllib.request.Request(url), timeout))
    check_compatible(hello.compat, peer.compat, f"peer {peer.agent!r} at {address[0]}:{address[1]}")
    body = json.dumps(hello.to_json()).encode()
    _request(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout)
    return peer


def _request(req: urllib.request.Request, timeout: float) -> dict:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read())
        except ValueError:
            detail = {"error": str(e)}
        if e.code == 409:  # the server's "local" is our "remote"
            raise CompatibilityError(detail.get("field", "?"), detail.get("remote", _MISSING),
                                     detail.get("local", _MISSING), f"peer at {req.full_url}") from None
        raise HandshakeError(f"{req.full_url}: {e.code} {detail.get('error')}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise HandshakeError(f"{req.full_url}: {e}") from None


def ping(address: Address, timeout: float = 0.5) -> bool:
    """Whether something accepts connections on the peer's side channel."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False
