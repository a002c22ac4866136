"""The pull protocol between two managers in one process, over real NIXL (UCX, DRAM): a
puller claims what a source pinned, READs it and says so."""

import json
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from serving.kv_transfer import CacheLayout, pull_items, source_record
from transfer import (Agent, ClaimError, CompatibilityError, FaultyAgent, HandshakeError,
                      ProgressThread, Region, Ticket, TransferManager, TransferParamsError,
                      allocate, host_view)

BLOCK, BLOCKS, SLOT, SLOTS, CONV = 4096, 64, 2048, 4, 512
# the regions above as a cache's blocks and slots (rows only matter between unequal splits)
LAYOUT = CacheLayout(BLOCK, CONV, SLOT, block_size=16, kv_rows=8, ssm_rows=4)
COMPAT = {"model": "test", "block_bytes": BLOCK, "slot_bytes": SLOT}
SECRET = "a secret of the test managers"


def make_manager(compat=COMPAT, port=0, seed=None, secret=SECRET):
    _, kv = allocate("kv", (BLOCKS, BLOCK), jnp.uint8)
    _, conv = allocate("conv", (SLOTS, CONV), jnp.uint8)
    _, ssm = allocate("ssm", (SLOTS, SLOT), jnp.uint8)
    if seed is not None:
        rng = np.random.default_rng(seed)
        for r in (kv, conv, ssm):
            host_view(r)[:] = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
    # the agent counts faults to inject (transfer.faults): the tests set them
    return TransferManager(FaultyAgent(Agent([kv, conv, ssm])), compat, port=port,
                           secret=secret)


def pull(puller, ticket, *args, **kw):
    """Claim ``ticket``'s lease (again, for a pull of the same puller), then pull it."""
    return puller.pull(puller.claim(ticket), *args, **kw)


def blocks(ids):
    return [("kv", i * BLOCK, BLOCK) for i in ids]


def slot(i):
    return [("ssm", i * SLOT, SLOT)]


def view(manager, name):
    return host_view(manager.agent.regions[name])


@pytest.fixture(scope="module")
def pair():
    source, puller = make_manager(seed=1), make_manager()
    yield source, puller
    puller.close()
    source.close()


@pytest.fixture
def source(pair):
    yield pair[0]
    for lease in list(pair[0]._leases):
        pair[0].unpin(lease)


@pytest.fixture
def puller(pair):
    yield pair[1]
    drive(pair[1], until=lambda done: pair[1].pending == 0)


def drive(*managers, until, timeout=20.0):
    """Poll every manager until ``until(completions)``; completions by pull id."""
    done = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for m in managers:
            done.update((c.pull_id, c) for c in m.poll())
        if until(done):
            return done
        time.sleep(0.001)
    raise AssertionError(f"condition not reached in {timeout} s; completions so far: {done}")


def poll_until(manager, stop):
    while not stop.is_set():
        manager.poll()
        time.sleep(0.001)


def freed_log():
    log = []
    return log, lambda lease, reason: log.append((lease, reason))


def test_pull_copies_bytes_with_few_descriptors_and_frees_the_lease(source, puller):
    log, on_free = freed_log()
    params = source.pin(blocks([5, 6, 7, 20]) + slot(2), on_free=on_free)
    pid = pull(puller, params, blocks([0, 1, 2, 9]) + slot(0))
    done = drive(source, puller, until=lambda d: pid in d and log)
    c = done[pid]
    assert c.ok, c.error
    assert c.descriptors == 3  # blocks 5-7 -> 0-2, block 20 -> 9, the slot
    assert c.nbytes == 4 * BLOCK + SLOT
    src, dst = view(source, "kv"), view(puller, "kv")
    np.testing.assert_array_equal(dst[:3 * BLOCK], src[5 * BLOCK:8 * BLOCK])
    np.testing.assert_array_equal(dst[9 * BLOCK:10 * BLOCK], src[20 * BLOCK:21 * BLOCK])
    np.testing.assert_array_equal(view(puller, "ssm")[:SLOT], view(source, "ssm")[2 * SLOT:3 * SLOT])
    assert log == [(params.lease, "done")] and source.leases == 0


def test_many_concurrent_pulls_all_complete(source, puller):
    log, on_free = freed_log()
    params = [source.pin(blocks([i]), on_free=on_free) for i in range(16)]
    ids = [pull(puller, p, blocks([63 - i])) for i, p in enumerate(params)]
    done = drive(source, puller, until=lambda d: set(ids) <= d.keys() and len(log) == 16)
    assert all(done[i].ok for i in ids)
    src, dst = view(source, "kv").reshape(BLOCKS, BLOCK), view(puller, "kv").reshape(BLOCKS, BLOCK)
    np.testing.assert_array_equal(dst[48:][::-1], src[:16])
    assert source.leases == 0


def test_empty_lease_is_acknowledged_without_a_read(source, puller):
    log, on_free = freed_log()
    pid = pull(puller, source.pin([], on_free=on_free), [])
    done = drive(source, puller, until=lambda d: pid in d and log)
    assert done[pid].ok and done[pid].descriptors == 0 and log[0][1] == "done"


def test_lease_expiry_frees_and_a_late_claim_is_refused_as_stale(source, puller):
    log, on_free = freed_log()
    params = source.pin(blocks([1]), on_free=on_free, ttl=0.05)
    drive(source, until=lambda d: log)
    assert log == [(params.lease, "expired")] and source.leases == 0
    with pytest.raises(ClaimError, match=f"stale: lease {params.lease} is not held") as e:
        puller.claim(params)
    assert e.value.kind == "stale" and puller.pending == 0


def test_a_lease_freed_after_its_claim_is_acked_stale(source, puller):
    """The bytes were freed between the claim and the READ's end: "done" is answered
    stale, so nothing read from reused memory counts."""
    log, on_free = freed_log()
    params = source.pin(blocks([2]), on_free=on_free)
    claim = puller.claim(params)
    source.unpin(params.lease)
    pid = puller.pull(claim, blocks([2]))
    c = drive(source, puller, until=lambda d: pid in d)[pid]
    assert c.error.kind == "stale" and log == [(params.lease, "released")]


def test_the_claim_answers_what_the_source_pinned(source, puller):
    """The claim carries the source's own items and description, not the ticket's."""
    items = blocks([9, 10]) + slot(3)
    params = source.pin(items, meta={"what": "request r", "blocks": [9, 10]})
    assert set(Ticket.model_fields) == {"agent", "address", "lease", "ttl"}
    claim = puller.claim(params)
    assert claim.items == tuple(items) and claim.meta == {"what": "request r", "blocks": [9, 10]}
    assert (claim.agent, claim.lease) == (params.agent, params.lease)
    puller.release(claim)
    drive(source, until=lambda d: source.leases == 0)


def test_a_lease_answers_only_its_claimant():
    """A second agent cannot claim a claimed lease, and its done, extend and drop change
    nothing: the lease stays pinned for the first claimant, whose pull completes."""
    source, first, second = make_manager(seed=5), make_manager(), make_manager()
    try:
        log, on_free = freed_log()
        params = source.pin(blocks([3]), on_free=on_free, ttl=1.0)
        claim = first.claim(params)
        with pytest.raises(ClaimError, match="claimed: lease .* is claimed by another agent"):
            second.claim(params)
        for message in (f"done {params.lease} forged", f"drop {params.lease}"):
            second.agent.notify(source.agent.name, message.encode())
        answers = []
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            source.poll()
            answers += [m for ms in second.agent.notifications().values() for m in ms]
            time.sleep(0.005)
        assert answers == [f"ack {params.lease} forged stale".encode()]
        assert source.leases == 1 and not log  # neither done nor drop freed it
        pid = first.pull(claim, blocks([3]))
        assert drive(source, first, until=lambda d: pid in d and log)[pid].ok
        assert log == [(params.lease, "done")]
    finally:
        for m in (second, first, source):
            m.close()


def test_a_claim_with_another_key_is_refused_and_leaves_the_lease_alone(source, puller):
    """A lease keyed by the request whose state it holds answers only that key: a claim
    naming it for another request is refused without binding it, so its own request still
    claims and pulls it."""
    log, on_free = freed_log()
    params = source.pin(blocks([5]), on_free=on_free, key="request A")
    for key in ("request B", None):
        with pytest.raises(ClaimError, match="mismatch") as e:
            puller.claim(params, key)
        assert e.value.kind == "mismatch"
    pid = puller.pull(puller.claim(params, "request A"), blocks([5]))
    assert drive(source, puller, until=lambda d: pid in d and log)[pid].ok


def test_the_handshake_and_claims_require_the_shared_secret():
    """A manager with another secret gets neither the source's metadata nor a claim."""
    import urllib.error
    import urllib.request

    source, intruder = make_manager(), make_manager(secret="not the workers' secret")
    try:
        params = source.pin(blocks([1]))
        with pytest.raises(HandshakeError, match="401"):
            intruder.claim(params)
        host, port = source.address
        for path, body in (("/hello", None), ("/claim", b'{"lease": "x", "agent": "y", "key": null}')):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}{path}", body),
                                       timeout=5)
            assert e.value.code == 401 and b"metadata" not in e.value.read()
        assert source.leases == 1 and intruder.agent.name not in source._peers
    finally:
        intruder.close()
        source.close()


def test_pending_pull_extends_the_lease_until_it_ends(source, puller):
    log, on_free = freed_log()
    params = source.pin(blocks([3]), on_free=on_free, ttl=1.0)
    puller.agent.hang_next = 1  # posted never, so the pull stays pending until its deadline
    pid = pull(puller, params, blocks([3]), timeout=2.5)
    end = time.monotonic() + 2.0  # twice the lease's TTL
    drive(source, puller, until=lambda d: time.monotonic() > end)
    assert not log and source.leases == 1  # kept alive by the puller's extensions
    c = drive(source, puller, until=lambda d: pid in d and log)[pid]
    assert c.error.kind == "timeout" and "READ" in c.error.detail
    assert log == [(params.lease, "dropped")]  # freed at once, not at expiry


def test_a_pull_started_late_in_its_lease_extends_it_at_once(source, puller):
    log, on_free = freed_log()
    params = source.pin(blocks([4]), on_free=on_free, ttl=1.0)
    time.sleep(0.75)  # the pull starts with a quarter of the lease left
    puller.agent.hang_next = 1
    pid = pull(puller, params, blocks([4]), timeout=1.5)
    end = time.monotonic() + 0.6  # past the lease's first expiry
    drive(source, puller, until=lambda d: time.monotonic() > end)
    assert not log and source.leases == 1
    c = drive(source, puller, until=lambda d: pid in d and log)[pid]
    assert c.error.kind == "timeout"


def test_injected_transfer_error_is_reported_and_the_source_frees(source, puller):
    log, on_free = freed_log()
    params = source.pin(blocks([4]), on_free=on_free)
    puller.agent.fail_next = 1
    pid = pull(puller, params, blocks([4]))
    c = drive(source, puller, until=lambda d: pid in d and log)[pid]
    assert c.error.kind == "error" and "injected" in c.error.detail
    assert log == [(params.lease, "dropped")]
    # the next pull of fresh params works
    pid = pull(puller, source.pin(blocks([4])), blocks([4]))
    assert drive(source, puller, until=lambda d: pid in d)[pid].ok


@pytest.mark.parametrize("answers", [True, False])
def test_a_failed_pull_pings_its_peer_outside_the_lock(source, puller, monkeypatch, answers):
    """Whether the peer still answers decides error against peer_gone; the ping (up to
    0.2 s) must not hold the manager's lock, which every pin, pull and ack needs."""
    import transfer.manager

    held = []

    def ping(address, timeout):
        held.append(puller._lock.locked())
        return answers

    monkeypatch.setattr(transfer.manager, "ping", ping)
    params = source.pin(blocks([4]))
    puller.agent.fail_next = 1
    pid = pull(puller, params, blocks([4]))
    c = drive(source, puller, until=lambda d: pid in d)[pid]
    assert held == [False]
    assert c.error.kind == ("error" if answers else "peer_gone")
    if not answers:  # no drop was sent to a peer taken for gone: its lease expires instead
        source.unpin(params.lease)


def test_a_timed_out_read_still_in_flight_holds_its_destination_until_it_ends(
        source, puller, monkeypatch):
    """NIXL's UCX backend does not stop a released READ (its bytes may land later): a
    pull past its deadline is reported at once, unsettled, and its handle is kept and
    polled until NIXL ends the READ; only then does ``settled()`` list it."""
    states, released = {}, []

    def read(peer, local, remote, remote_mem_type, notif):
        states["h"] = "PROC"  # posted, and never ends by itself
        return "h", "PROC"

    real_state, real_release = puller.agent.state, puller.agent.release
    monkeypatch.setattr(puller.agent, "read", read)
    monkeypatch.setattr(puller.agent, "state",
                        lambda h: states[h] if h in states else real_state(h))
    monkeypatch.setattr(puller.agent, "release",
                        lambda h: released.append(h) or True if h in states else real_release(h))
    log, on_free = freed_log()
    params = source.pin(blocks([3]), on_free=on_free)
    pid = pull(puller, params, blocks([3]), timeout=0.2)
    c = drive(source, puller, until=lambda d: pid in d and log)[pid]
    assert c.error.kind == "timeout" and not c.settled
    assert log == [(params.lease, "dropped")]
    for _ in range(20):
        puller.poll()
    assert released == [] and puller.draining == 1 and puller.settled() == []
    states["h"] = "DONE"
    drive(puller, until=lambda d: puller.draining == 0)
    assert released == ["h"] and puller.settled() == [pid] and puller.settled() == []


def test_a_lost_peer_is_forgotten_only_once_its_reads_have_drained(monkeypatch):
    """NIXL answers ERR for the READs of a removed peer without asking UCX, so a lost
    peer with a READ in flight is removed only once that READ has ended."""
    source, puller = make_manager(seed=2), make_manager()
    states, removed = {"h": "PROC"}, []
    try:
        monkeypatch.setattr(puller.agent, "read", lambda *a: ("h", "PROC"))
        real_state, real_release = puller.agent.state, puller.agent.release
        monkeypatch.setattr(puller.agent, "state",
                            lambda h: states[h] if h in states else real_state(h))
        monkeypatch.setattr(puller.agent, "release",
                            lambda h: True if h in states else real_release(h))
        monkeypatch.setattr(puller.agent, "remove_peer", removed.append)
        pid = pull(puller, source.pin(blocks([1])), blocks([1]))  # posted: "h" runs
        puller.peer_lost(source.agent.name)
        c = drive(puller, until=lambda d: pid in d)[pid]
        assert c.error.kind == "peer_gone" and not c.settled
        for _ in range(20):
            puller.poll()
        assert removed == [] and puller.settled() == []
        states["h"] = "DONE"
        drive(puller, until=lambda d: puller.draining == 0)
        assert removed == [source.agent.name] and puller.settled() == [pid]
    finally:
        puller.close()
        source.close()


def test_a_lost_read_notification_is_repeated(source, puller):
    log, on_free = freed_log()
    params = source.pin(blocks([6]), on_free=on_free)
    puller.agent.lose_notif_next = 1
    pid = pull(puller, params, blocks([6]))
    c = drive(source, puller, until=lambda d: pid in d)[pid]
    assert c.ok and log == [(params.lease, "done")]


def test_params_of_a_completed_pull_are_stale_for_the_next_claim(source, puller):
    params = source.pin(blocks([7]))
    first = pull(puller, params, blocks([7]))
    assert drive(source, puller, until=lambda d: first in d)[first].ok
    with pytest.raises(ClaimError, match="stale"):  # the source may have reused block 7
        puller.claim(params)


@pytest.mark.parametrize("field, value, message", [
    ("agent", "two words", "String should match pattern"),
    ("agent", 1, "Input should be a valid string"),
    ("lease", "", "String should match pattern"),
    ("lease", "0000dead.0 x", "String should match pattern"),
    ("address", "localhost:1", "valid array"),
    ("address", ["localhost", 0], "greater than or equal to 1"),
    ("ttl", -1, "greater than 0"),
    ("items", [["kv", 0, 10**12]], "Extra inputs are not permitted"),
])
def test_malformed_tickets_are_refused(source, field, value, message):
    good = source.pin(blocks([12])).model_dump(mode="json")
    with pytest.raises(ValueError, match=message):
        Ticket.model_validate_json(json.dumps({**good, field: value}))


def test_claims_and_pulls_that_cannot_be_honoured_are_refused_and_disturb_nothing(
        source, puller, monkeypatch):
    log, on_free = freed_log()
    good = source.pin(blocks([10, 11]), on_free=on_free)
    pid = pull(puller, good, blocks([30, 31]))
    other = source.pin(blocks([12]))
    # a source answering items outside its own regions
    real = source._grant
    server = source._server
    for items, message in (([["kv", BLOCKS * BLOCK - 8, BLOCK]], r"bytes .* outside region 'kv'"),
                           ([["kv_cache", 0, BLOCK]], "unknown region 'kv_cache'"),
                           ([["kv", [12 * BLOCK], BLOCK]], r"expected \(str, int, int\)")):
        monkeypatch.setattr(server, "_on_claim", lambda lease, agent, key: {
            **real(lease, agent, key), "items": items})
        with pytest.raises(TransferParamsError, match=message):
            puller.claim(other)
    monkeypatch.setattr(server, "_on_claim", real)
    for params, local, message in (
            (other, blocks([12, 13]), "local items hold 8192 bytes but remote items 4096"),
            (good, blocks([40, 41]), "already being pulled")):
        with pytest.raises(TransferParamsError, match=message):
            pull(puller, params, local)
    done = drive(source, puller, until=lambda d: pid in d and log)
    assert done[pid].ok and puller.pending == 0
    np.testing.assert_array_equal(view(puller, "kv")[30 * BLOCK:32 * BLOCK],
                                  view(source, "kv")[10 * BLOCK:12 * BLOCK])
    assert log == [(good.lease, "done")] and source.leases == 1  # `other` still held


def test_remote_items_inside_the_pinned_ranges_are_read_in_their_order(source, puller):
    params = source.pin(blocks([5, 6]) + blocks([7]) + slot(2))
    # across the touching items of blocks 5 to 7, a re-read, and part of the slot
    remote = [("kv", 5 * BLOCK + 100, 2 * BLOCK), ("ssm", 2 * SLOT + 8, 16), ("kv", 5 * BLOCK, 100)]
    pid = pull(puller, params, [("kv", 40 * BLOCK, 2 * BLOCK + 116)], remote_items=remote)
    assert drive(source, puller, until=lambda d: pid in d)[pid].ok
    src, ssm = view(source, "kv"), view(source, "ssm")
    want = np.concatenate([src[5 * BLOCK + 100:7 * BLOCK + 100], ssm[2 * SLOT + 8:2 * SLOT + 24],
                           src[5 * BLOCK:5 * BLOCK + 100]])
    np.testing.assert_array_equal(view(puller, "kv")[40 * BLOCK:40 * BLOCK + len(want)], want)


def test_remote_items_outside_the_pinned_ranges_are_refused(source, puller):
    """The pinned items bound what remote items may read: params whose items and remote
    items disagree (malicious or stale) never reach unpinned memory."""
    log, on_free = freed_log()
    params = source.pin(blocks([5]) + slot(2), on_free=on_free)
    for remote in ([("kv", 5 * BLOCK + 8, BLOCK)],  # runs into block 6
                   [("kv", 4 * BLOCK + BLOCK - 1, 2)],  # starts in block 4
                   [("kv", 5 * BLOCK, 8), ("ssm", 1 * SLOT, 8)],  # another slot
                   [("conv", 2 * CONV, 16)]):  # a region the lease pins nothing of
        size = sum(n for _, _, n in remote)
        with pytest.raises(TransferParamsError, match=r"remote item \d+: bytes .* are not pinned"):
            pull(puller, params, [("kv", 0, size)], remote_items=remote)
    assert puller.pending == 0 and not log  # nothing posted, the lease untouched
    pid = pull(puller, params, [("kv", 0, 8)], remote_items=[("ssm", 2 * SLOT, 8)])
    assert drive(source, puller, until=lambda d: pid in d and log)[pid].ok


@pytest.mark.parametrize("forge, message", [
    (lambda r: "nonsense", "expected a dict"),
    (lambda r: {**r, "blocks": [1.5]}, "expected 'blocks'"),
    (lambda r: {**r, "slot": -1}, "expected 'blocks'"),
    (lambda r: {**r, "blocks": r["blocks"][:1]}, "70 tokens need 5 blocks"),
    (lambda r: {**r, "layout": {**r["layout"], "kv_rows": 0}}, "kv_rows: expected a positive"),
    (lambda r: {**r, "layout": {**r["layout"], "kv_parts": [["a"], ["b", "c"]]}}, "equally many"),
    (lambda r: {**r, "layout": {**r["layout"], "block_size": 32}}, "differ in block size"),
    (lambda r: {**r, "layout": {**r["layout"], "block_bytes": 2 * BLOCK}}, "KV bytes per block"),
])
def test_source_records_that_do_not_fit_are_refused(forge, message):
    record = source_record(LAYOUT, [5, 6, 7, 20, 21], 2, 70)
    with pytest.raises(TransferParamsError, match=message):
        pull_items(forge(record), LAYOUT, [0, 1, 2, 3, 4], 0, 70)


def test_equal_layouts_cost_what_the_pinned_items_cost():
    """The decode worker maps a request with ``kv_transfer.pull_items`` and reads explicit
    remote items; between equal (unsharded) layouts that must post as many descriptors as
    reading the pinned items themselves, and copy the same bytes."""
    source, puller = make_manager(seed=4), make_manager()
    try:
        src_blocks, n = [5, 6, 7, 20, 21], 70  # five blocks, in two runs
        pinned = source.pin(LAYOUT.items(src_blocks, 2, n))
        plain = pull(puller, pinned, LAYOUT.items([30, 31, 32, 33, 40], 0, n))
        mapped_blocks = [50, 51, 52, 53, 60]
        remote, local = pull_items(source_record(LAYOUT, src_blocks, 2, n), LAYOUT,
                                   mapped_blocks, 1, n)
        mapped = pull(puller, source.pin(LAYOUT.items(src_blocks, 2, n)), local,
                             remote_items=remote)
        done = drive(source, puller, until=lambda d: {plain, mapped} <= d.keys())
        assert done[plain].ok and done[mapped].ok
        assert done[mapped].descriptors == done[plain].descriptors == 5  # 3 KV + conv + ssm
        for name, size, a, b in (("kv", BLOCK, [30, 31, 32, 33, 40], mapped_blocks),
                                 ("conv", CONV, [0], [1]), ("ssm", SLOT, [0], [1])):
            got = view(puller, name).reshape(-1, size)
            np.testing.assert_array_equal(got[a], got[b])
        np.testing.assert_array_equal(view(puller, "kv").reshape(-1, BLOCK)[mapped_blocks],
                                      view(source, "kv").reshape(-1, BLOCK)[src_blocks])
    finally:
        puller.close()
        source.close()


def test_params_of_a_restarted_source_are_stale(puller):
    first = make_manager()
    params = first.pin(blocks([0]))
    port = first.address[1]
    first.close()
    second = make_manager(port=port)
    try:
        with pytest.raises(TransferParamsError, match=r"stale params: .*\(the source restarted\)"):
            puller.claim(params)
    finally:
        second.close()


def test_incompatible_source_is_refused(puller):
    other = make_manager(compat={**COMPAT, "block_bytes": 2 * BLOCK})
    try:
        with pytest.raises(CompatibilityError, match="field 'block_bytes' differs: local 4096, remote 8192"):
            puller.connect(other.address)
        with pytest.raises(TransferParamsError, match="block_bytes"):
            puller.claim(other.pin(blocks([0])))
    finally:
        other.close()


def test_dead_source_is_reported_as_peer_gone(puller):
    gone = make_manager()
    params = gone.pin(blocks([0]))
    claim = puller.claim(params)
    puller.agent.hang_next = 1
    pending = puller.pull(claim, blocks([0]), timeout=30)
    puller.peer_lost(params.agent)
    assert drive(puller, until=lambda d: pending in d)[pending].error.kind == "peer_gone"
    pid = puller.pull(claim, blocks([0]))  # the peer was forgotten since the claim
    assert drive(puller, until=lambda d: pid in d)[pid].error.kind == "peer_gone"
    gone.close()  # its side channel stops answering
    with pytest.raises(HandshakeError):  # a new claim must reconnect, and cannot
        puller.claim(params)


def test_a_lost_puller_frees_the_leases_it_claimed():
    """The owner learnt that a puller is gone (the router saw its worker die): the leases
    it claimed are freed now, not at their expiry; a lease it never claimed stays."""
    source, puller = make_manager(), make_manager()
    try:
        log, on_free = freed_log()
        claimed = source.pin(blocks([1]), on_free=on_free)
        unclaimed = source.pin(blocks([2]), on_free=on_free)
        puller.claim(claimed)
        source.peer_lost(puller.agent.name)
        source.collect()
        assert log == [(claimed.lease, "peer_gone")] and source.leases == 1
        source.unpin(unclaimed.lease)
    finally:
        puller.close()
        source.close()


def test_wait_returns_only_its_pulls_and_keeps_the_rest_for_poll(source, puller):
    first = pull(puller, source.pin(blocks([50])), blocks([50]))
    second = pull(puller, source.pin(blocks([51])), blocks([51]))
    stop = threading.Event()
    acker = threading.Thread(target=poll_until, args=(source, stop))  # the source's owner thread
    acker.start()
    try:
        got = puller.wait([second], timeout=20)
        assert got.keys() == {second} and got[second].ok
        assert drive(puller, until=lambda d: first in d)[first].ok  # not lost if it ended during wait
    finally:
        stop.set()
        acker.join()


def test_progress_thread_acks_while_the_owner_is_busy_and_on_free_waits_for_collect(source,
                                                                                     puller):
    """The source's owner does not poll during the pull (as if inside a long engine step):
    its progress thread acks the puller's "done" at once, tells the owner there is something
    to collect, and leaves the lease's on_free to the owner's collect(), on its own thread."""
    log, ready = [], threading.Event()
    params = source.pin(blocks([30]), on_free=lambda lease, why: log.append(
        (lease, why, threading.current_thread())))
    progress = ProgressThread(source, on_ready=ready.set)
    try:
        pid = pull(puller, params, blocks([30]))
        assert drive(puller, until=lambda d: pid in d)[pid].ok  # acked: nothing else polls source
        assert ready.wait(5) and source.leases == 0 and log == []
    finally:
        progress.stop()
    assert source.collect() == [] and log == [(params.lease, "done", threading.current_thread())]


def test_unpin_frees_at_once(source):
    log, on_free = freed_log()
    params = source.pin(blocks([0]), on_free=on_free)
    assert source.unpin(params.lease) and not source.unpin(params.lease)
    assert log == [(params.lease, "released")]


@pytest.mark.parametrize("regions, message", [
    ([], "at least one region"),
    ([Region("a", 4096, 64, 0, "DRAM"), Region("a", 8192, 64, 0, "DRAM")], "duplicate region names"),
    ([Region("a", 4096, 64, 0, "DRAM"), Region("b", 8192, 64, 0, "VRAM")], "share a memory type"),
])
def test_agent_refuses_bad_region_sets(regions, message):
    with pytest.raises(ValueError, match=message):
        Agent(regions)


def test_landed_reports_bytes_in_place_but_only_the_ack_makes_a_pull_ok(source, puller):
    puller.landed()  # drain what earlier tests left
    params = source.pin(blocks([4]))
    good = pull(puller, params, blocks([4]))
    done = drive(source, puller, until=lambda d: good in d)
    assert done[good].ok and puller.landed() == [good]

    freed = source.pin(blocks([5]))
    claim = puller.claim(freed)
    source.unpin(freed.lease)
    stale = puller.pull(claim, blocks([5]))
    c = drive(source, puller, until=lambda d: stale in d)[stale]
    assert puller.landed() == [stale] and c.error.kind == "stale"  # landed, yet refused

    puller.agent.hang_next = 1
    hung = pull(puller, source.pin(blocks([6])), blocks([6]), timeout=0.5)
    c = drive(source, puller, until=lambda d: hung in d)[hung]
    assert c.error.kind == "timeout" and puller.landed() == []


def test_first_pull_to_a_fresh_peer_goes_alone_then_the_rest_follow():
    """A burst on a connection still being set up lost messages (CPU/UCX), so pulls to a
    peer that has never completed one wait for the first; all complete, bytes intact."""
    source, puller = make_manager(seed=3), make_manager()
    try:
        params = [source.pin(blocks([i])) for i in range(4)]
        ids = [pull(puller, p, blocks([10 + i])) for i, p in enumerate(params)]
        assert [puller._pulls.pulls[i].queued for i in ids] == [False, True, True, True]
        done = drive(source, puller, until=lambda d: set(ids) <= d.keys())
        assert all(done[i].ok for i in ids)
        src, dst = view(source, "kv").reshape(BLOCKS, BLOCK), view(puller, "kv").reshape(BLOCKS, BLOCK)
        np.testing.assert_array_equal(dst[10:14], src[:4])
        later = [pull(puller, source.pin(blocks([i])), blocks([20 + i])) for i in range(2)]
        drive(source, puller, until=lambda d: set(later) <= d.keys())
    finally:
        puller.close()
        source.close()
