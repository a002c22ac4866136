"""The side channel swaps metadata with holders of the shared secret only, and refuses a
mismatched peer, naming the field."""

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from transfer import handshake
from transfer.handshake import (MAX_BODY, MAX_NESTING, PROTOCOL_VERSION, CompatibilityError, HandshakeError,
                                HandshakeServer, Hello, check_compatible, exchange, ping)
from transfer.memory import Region

SECRET = "the workers' shared secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}
COMPAT = {"model": "tiny", "block_size": 16,
          "regions": {"kv": {"dtype": "bfloat16", "block_shape": (4, 2, 16, 2, 64)},
                      "ssm": {"dtype": "float32", "slot_shape": [1, 3, 4, 8, 8]}}}


def hello(agent, compat=COMPAT):
    return Hello(agent, b"\x00md-" + agent.encode(), {"kv": Region("kv", 4096, 1 << 20, 0, "DRAM")}, compat)


def with_field(path, value):
    record = json.loads(json.dumps(COMPAT))
    *parents, last = path.split(".")
    node = record
    for key in parents:
        node = node[key]
    node[last] = value
    return record


def test_check_compatible_accepts_equal_records_after_a_json_trip():
    check_compatible(COMPAT, json.loads(json.dumps(COMPAT)))


@pytest.mark.parametrize("path, value", [
    ("model", "27B"), ("block_size", 32), ("regions.kv.dtype", "float16"),
    ("regions.ssm.slot_shape", [1, 3, 4, 8, 16]), ("regions.kv.extra", 1),
])
def test_check_compatible_names_the_mismatched_field(path, value):
    with pytest.raises(CompatibilityError) as e:
        check_compatible(COMPAT, with_field(path, value))
    assert e.value.field == path and repr(value) in str(e.value)


@pytest.fixture
def server():
    accepted = []
    s = HandshakeServer(hello("server"), accepted.append, secret=SECRET)
    yield s, accepted
    s.close()


def test_exchange_swaps_hellos(server):
    s, accepted = server
    peer = exchange(s.address, hello("client"), SECRET)
    assert peer.agent == "server" and peer.metadata == b"\x00md-server"
    assert peer.regions["kv"] == Region("kv", 4096, 1 << 20, 0, "DRAM")
    assert [p.agent for p in accepted] == ["client"] and accepted[0].metadata == b"\x00md-client"
    assert ping(s.address)


def test_client_refuses_mismatched_server(server):
    s, accepted = server
    with pytest.raises(CompatibilityError, match=r"field 'regions.kv.dtype' differs: local 'float16', remote 'bfloat16'"):
        exchange(s.address, hello("client", with_field("regions.kv.dtype", "float16")), SECRET)
    assert accepted == []


def test_server_refuses_a_client_that_skips_the_check(server):
    s, accepted = server
    body = json.dumps(hello("client", with_field("block_size", 64)).to_json()).encode()
    req = urllib.request.Request(f"http://{s.address[0]}:{s.address[1]}/hello", body,
                                 {"Content-Type": "application/json", **AUTH})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 409 and json.loads(e.value.read())["field"] == "block_size"
    assert accepted == []


def test_server_refuses_malformed_hello(server):
    s, accepted = server
    req = urllib.request.Request(f"http://{s.address[0]}:{s.address[1]}/hello", json.dumps({"version": PROTOCOL_VERSION}).encode(),
                                 {"Content-Type": "application/json", **AUTH})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400 and "malformed hello" in json.loads(e.value.read())["error"]
    assert accepted == []


def test_unreachable_peer_is_a_handshake_error(server):
    s, _ = server
    address = s.address
    s.close()
    with pytest.raises(HandshakeError):
        exchange(address, hello("client"), SECRET, timeout=2)
    assert not ping(address)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer guess"},
                                     {"Authorization": SECRET}])
def test_no_metadata_and_no_peer_without_the_secret(server, headers):
    """Metadata lets its holder READ and WRITE the registered memory: a request without
    the secret gets a 401 and nothing of it, on every route."""
    s, accepted = server
    base = f"http://{s.address[0]}:{s.address[1]}"
    body = json.dumps(hello("intruder").to_json()).encode()
    for req in (urllib.request.Request(f"{base}/hello", headers=headers),
                urllib.request.Request(f"{base}/ping", headers=headers),
                urllib.request.Request(f"{base}/hello", body, headers),
                urllib.request.Request(f"{base}/claim", b'{"lease": "a.0", "agent": "x", "key": null}', headers)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401 and b"md-server" not in e.value.read()
    assert accepted == []
    with pytest.raises(HandshakeError, match="401"):
        exchange(s.address, hello("client"), "not the secret at all")


def test_a_claim_needs_a_handshake_first_and_an_oversized_body_is_not_read(server):
    s, accepted = server
    base = f"http://{s.address[0]}:{s.address[1]}"
    claim = urllib.request.Request(f"{base}/claim", b'{"lease": "a.0", "agent": "stranger", "key": null}',
                                   {"Content-Type": "application/json", **AUTH})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(claim, timeout=5)
    assert e.value.code == 403 and "has not shaken hands" in json.loads(e.value.read())["error"]
    # a body over the limit is refused from its declared length, none of it read (sent)
    conn = http.client.HTTPConnection(*s.address, timeout=5)
    conn.putrequest("POST", "/hello")
    for k, v in {**AUTH, "Content-Length": str(MAX_BODY + 1)}.items():
        conn.putheader(k, v)
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and r.getheader("Connection") == "close" and accepted == []
    conn.close()


def _closed_by_server(sock, within):
    """Whether the server closes ``sock`` (unanswered) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _ping(conn):
    """The status of an authorised ping on ``conn``."""
    conn.request("GET", "/ping", headers=AUTH)
    r = conn.getresponse()
    r.read()
    return r.status


def test_a_connection_without_the_secret_is_cut_soon_an_authorised_one_kept():
    """A stranger's silent connection holds a server thread only ``auth_timeout``; one
    whose request presented the secret stays open longer, for its puller's next claim."""
    s = HandshakeServer(hello("server"), lambda h: None, secret=SECRET, auth_timeout=0.2,
                        idle_timeout=5.0)
    try:
        stranger = socket.create_connection(s.address)
        assert _closed_by_server(stranger, within=4.0)  # long before idle_timeout
        kept = http.client.HTTPConnection(*s.address, timeout=5)
        assert _ping(kept) == 200
        time.sleep(0.5)  # idle past auth_timeout
        before = kept.sock
        assert _ping(kept) == 200 and kept.sock is before  # the same connection
        kept.close()
        stranger.close()
    finally:
        s.close()


def test_a_stranger_trickling_its_request_is_cut_at_its_deadline():
    """Bytes every 0.1 s never let a read time out: the connection is cut because it has
    not presented the secret by ``auth_timeout`` after its accept, so strangers cannot
    hold the connection slots pullers need."""
    s = HandshakeServer(hello("server"), lambda h: None, secret=SECRET, auth_timeout=0.5,
                        max_connections=2)
    try:
        trickler = socket.create_connection(s.address)
        trickler.settimeout(0.1)
        cut, end = False, time.monotonic() + 5.0
        while not cut and time.monotonic() < end:
            try:
                trickler.send(b"G")
                cut = trickler.recv(1) == b""
            except TimeoutError:
                pass
            except OSError:  # reset, or a send after the cut
                cut = True
        trickler.close()
        assert cut
    finally:
        s.close()


def test_connections_beyond_the_cap_are_closed_unanswered():
    """Each connection holds a server thread: while ``max_connections`` are open, a new
    one is closed unanswered; once one ends, peers are served again."""
    s = HandshakeServer(hello("server"), lambda h: None, secret=SECRET, max_connections=2)
    try:
        idle = [socket.create_connection(s.address) for _ in range(2)]
        third = socket.create_connection(s.address)
        assert _closed_by_server(third, within=2.0)
        with pytest.raises(HandshakeError):
            exchange(s.address, hello("client"), SECRET)
        third.close()
        idle[0].close()
        end = time.monotonic() + 2.0
        while True:  # until the server's thread has seen the close
            try:
                peer = exchange(s.address, hello("client"), SECRET)
                break
            except HandshakeError:
                assert time.monotonic() < end
                time.sleep(0.01)
        assert peer.agent == "server"
        idle[1].close()
    finally:
        s.close()


def _nested(levels):
    value = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def _one_answer(body: bytes) -> HTTPServer:
    """A server that answers one request, GET or POST, with ``body``."""
    class Handler(BaseHTTPRequestHandler):
        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    return server


def test_json_nested_too_deep_is_bad_json_on_either_side(server):
    """Parsing it raises RecursionError: the server answers 400 (its connection thread
    goes on), the client raises HandshakeError."""
    s, accepted = server
    conn = http.client.HTTPConnection(*s.address, timeout=5)
    conn.request("POST", "/hello", b"[" * 100_000, AUTH)
    r = conn.getresponse()
    assert r.status == 400 and "bad JSON" in json.loads(r.read())["error"]
    assert _ping(conn) == 200
    conn.close()
    deep = _one_answer(b"[" * 100_000)
    try:
        with pytest.raises(HandshakeError, match="recursion"):
            exchange(deep.server_address, hello("client"), SECRET)
    finally:
        deep.server_close()
    assert accepted == []


def test_an_answer_over_the_bound_is_not_read_whole(monkeypatch):
    monkeypatch.setattr(handshake, "MAX_ANSWER", 1 << 20)
    huge = _one_answer(json.dumps({"items": [], "pad": "a" * (2 << 20)}).encode())
    try:
        with pytest.raises(HandshakeError, match=f"an answer over {1 << 20} bytes"):
            handshake.claim(huge.server_address, SECRET, "lease", "agent", None)
    finally:
        huge.server_close()


def test_a_compatibility_record_nested_too_deep_is_a_malformed_hello(server):
    """Records are compared and shown by recursion: one of many hundred levels would end
    the connection's thread unanswered, so any over MAX_NESTING is refused."""
    s, accepted = server
    body = json.dumps(hello("client", _nested(MAX_NESTING + 1)).to_json()).encode()
    req = urllib.request.Request(f"http://{s.address[0]}:{s.address[1]}/hello", body,
                                 {"Content-Type": "application/json", **AUTH})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400 and "levels deep" in json.loads(e.value.read())["error"]
    assert accepted == []


@pytest.mark.parametrize("field, value", [
    ("nbytes", 2**63), ("nbytes", -1), ("addr", -1), ("addr", 2**64), ("device_id", -1),
])
def test_a_region_past_64_bit_bounds_is_a_malformed_hello(field, value):
    """Descriptors hold offsets in int64 and addresses in uint64: such a region would make
    NumPy raise OverflowError (or wrap) when a claim is checked against it."""
    d = hello("peer").to_json()
    d["regions"]["kv"][field] = value
    with pytest.raises(HandshakeError, match="malformed hello: a region"):
        Hello.from_json(d)
