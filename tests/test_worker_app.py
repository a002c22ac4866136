"""The workers' HTTP API (serving/worker/app.py) without processes or NIXL: the secret on
every route, bodies validated into their messages (400s naming the field), the body
size limit, and what a worker whose engine stopped answers; on stand-in workers and the
request builder of tests/test_worker_units.py."""
from types import SimpleNamespace

import pytest
from test_worker_units import SECRET, _request

from serving.errors import EngineDead, EngineOverloaded
from serving.worker import build_app


def _client(worker):
    from fastapi.testclient import TestClient

    return TestClient(build_app(worker, secret=SECRET, max_body_bytes=4096))


AUTH = {"Authorization": f"Bearer {SECRET}"}
PREFILL = {"request_id": "r", "prompt_token_ids": [1], "params": {}}


def test_every_worker_route_requires_the_secret():
    async def prefill(req):
        pytest.fail("reached the engine")

    worker = SimpleNamespace(role="prefill", engine=SimpleNamespace(check_health=lambda: None),
                             stats=dict, info=dict, prefill=prefill, peer_lost=pytest.fail,
                             abandon=pytest.fail)
    client = _client(worker)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
        for r in (client.get("/health", headers=headers), client.get("/info", headers=headers),
                  client.get("/stats", headers=headers),
                  client.post("/prefill", json=PREFILL, headers=headers),
                  client.post("/peer_lost", json={"agent": "a"}, headers=headers),
                  client.post("/abandon", json={"lease": "ab.1"}, headers=headers)):
            assert r.status_code == 401, (headers, r.request.url, r.text)
    assert client.get("/health", headers=AUTH).status_code == 200


@pytest.mark.parametrize("body, field", [
    ({"prompt_token_ids": [1], "params": {}}, "request_id"),
    ({**PREFILL, "prompt_token_ids": [-1]}, "prompt_token_ids.0"),
    ({**PREFILL, "prompt_token_ids": [2**40]}, "prompt_token_ids.0"),
    ({**PREFILL, "prompt_token_ids": ["5"]}, "prompt_token_ids.0"),
    ({**PREFILL, "prompt_token_ids": []}, "prompt_token_ids"),
    ({**PREFILL, "params": {"max_tokens": 0}}, "params.max_tokens"),
    ({**PREFILL, "params": {"temperature": "hot"}}, "params.temperature"),
    ({**PREFILL, "items": [["kv", 0, 10]]}, "items"),
])
def test_malformed_worker_bodies_are_400s_naming_the_field(body, field):
    async def prefill(req):
        pytest.fail("reached the engine")

    worker = SimpleNamespace(role="prefill", engine=SimpleNamespace(check_health=lambda: None),
                             prefill=prefill)
    r = _client(worker).post("/prefill", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["detail"].startswith(field + ":"), r.json()


def test_abandon_takes_a_lease_name_only():
    """The router's ``/abandon`` reaches the worker with a well-formed lease name; anything
    else is a 400 naming the field."""
    abandoned = []
    worker = SimpleNamespace(role="prefill", engine=SimpleNamespace(check_health=lambda: None),
                             abandon=lambda lease: abandoned.append(lease) or True)
    client = _client(worker)
    for body in ({"lease": "ab 1"}, {"lease": "../x"}, {"lease": 5}, {},
                 {"lease": "ab.1", "items": [["kv", 0, 8]]}):
        r = client.post("/abandon", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["detail"].split(":")[0] in ("lease", "items")
    r = client.post("/abandon", json={"lease": "ab12.7"}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"freed": True} and abandoned == ["ab12.7"]


def test_a_decode_body_names_no_items_or_cache_record():
    """What a decode worker reads comes from its claim: a body that tries to name blocks,
    slots or byte items is refused whole."""
    async def decode(req):
        pytest.fail("reached the worker")

    worker = SimpleNamespace(role="decode", engine=SimpleNamespace(check_health=lambda: None),
                             decode=decode)
    body = _request([1, 2], 3).model_dump(mode="json")
    for forged in ({**body["transfer"], "items": [["kv", 0, 64]]},
                   {**body["transfer"], "cache": {"blocks": [3], "slot": 1}}):
        r = _client(worker).post("/decode", json={**body, "transfer": forged}, headers=AUTH)
        assert r.status_code == 400 and "Extra inputs are not permitted" in r.json()["detail"]


def test_an_oversized_body_is_refused_unread():
    async def prefill(req):
        pytest.fail("reached the engine")

    worker = SimpleNamespace(role="prefill", engine=SimpleNamespace(check_health=lambda: None),
                             prefill=prefill)
    big = {**PREFILL, "prompt_token_ids": [1] * 5000}
    assert _client(worker).post("/prefill", json=big, headers=AUTH).status_code == 413


def test_a_worker_whose_engine_stopped_says_so_on_every_endpoint_the_router_reads():
    """/stats (the router's health poll) and /prefill answer 503 with engine_dead, which
    the router takes as "stop sending here" (a full engine's 503 does not carry it)."""
    def stopped():
        raise EngineDead("engine stopped: boom")

    async def prefill(req):
        stopped()

    worker = SimpleNamespace(role="prefill", engine=SimpleNamespace(check_health=stopped),
                             stats=dict, prefill=prefill)
    client = _client(worker)
    for r in (client.get("/stats", headers=AUTH), client.get("/health", headers=AUTH),
              client.post("/prefill", json=PREFILL, headers=AUTH)):
        assert r.status_code == 503 and r.json() == {"detail": "engine stopped: boom",
                                                     "engine_dead": True}

    async def full(req):
        raise EngineOverloaded("no free slot")

    worker.engine.check_health, worker.prefill = (lambda: None), full
    assert client.get("/stats", headers=AUTH).status_code == 200
    r = client.post("/prefill", json=PREFILL, headers=AUTH)
    assert r.status_code == 503 and "engine_dead" not in r.json()


def test_a_lease_whose_router_left_during_the_prefill_is_abandoned_at_once():
    """The router's connection closed while the prompt ran (its caller went away): the
    prefill worker frees the lease it pinned instead of holding the memory until the lease
    expires; a router still there gets its ticket, and the lease stays."""
    import asyncio
    import json

    from serving.messages import PrefillResult
    from transfer import Ticket

    ticket = Ticket(agent="prefill-x", address=("127.0.0.1", 9), lease="ab.1", ttl=30.0)
    abandoned = []

    async def prefill(req):
        return PrefillResult(token_ids=[7], transfer=ticket)

    worker = SimpleNamespace(role="prefill", engine=SimpleNamespace(check_health=lambda: None),
                             prefill=prefill, abandon=abandoned.append)
    app = build_app(worker, secret=SECRET, max_body_bytes=4096)

    def post(then):
        """POST /prefill over ASGI; after the body the connection sends ``then``."""
        body = json.dumps(PREFILL).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}, then]
        sent = []

        async def receive():
            return messages.pop(0) if messages else await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/prefill", "raw_path": b"/prefill",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 2),
                 "headers": [(b"authorization", AUTH["Authorization"].encode()),
                             (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
        return sent[0]["status"]

    assert post({"type": "http.request", "body": b"", "more_body": False}) == 200
    assert abandoned == []
    post({"type": "http.disconnect"})
    assert abandoned == ["ab.1"]
