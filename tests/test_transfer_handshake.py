"""The side channel swaps metadata with holders of the shared secret only, and refuses a
mismatched peer, naming the field."""

import http.client
import json
import urllib.error
import urllib.request

import pytest

from transfer.handshake import (MAX_BODY, PROTOCOL_VERSION, CompatibilityError, HandshakeError, HandshakeServer,
                                Hello, check_compatible, exchange, ping)
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
