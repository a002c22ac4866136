"""The source's side of the pull protocol: leases expire, answer only their claimant and
key, are extended while pulled, are freed by unpin or a lost puller; claims and tickets
that cannot be honoured are refused and disturb nothing."""

import json
import time

import numpy as np
import pytest

from serving.kv_transfer import pull_items, source_record
from transfer import ClaimError, HandshakeError, Ticket, TransferParamsError
# pair, source and puller are pytest fixtures (module-scoped pair of managers)
from transfer_pair import (BLOCK, BLOCKS, SLOT, CONV, LAYOUT, pair, make_manager, pull,
                           blocks, slot, view, source, puller, drive, freed_log)


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


def test_an_abandoned_lease_is_freed_unless_a_puller_claimed_it(source, puller):
    """No puller will come (the router gave the request up): an unclaimed lease is freed
    at the next collect; a claimed one stays its claimant's, whose release frees it."""
    log, on_free = freed_log()
    unclaimed = source.pin(blocks([3]), on_free=on_free)
    claimed = source.pin(blocks([4]), on_free=on_free)
    claim = puller.claim(claimed)
    assert source.abandon(unclaimed.lease) and not source.abandon(claimed.lease)
    source.collect()
    assert log == [(unclaimed.lease, "abandoned")] and source.leases == 1
    puller.release(claim)
    drive(source, puller, until=lambda d: len(log) == 2)
    assert log[1] == (claimed.lease, "dropped") and source.leases == 0


def test_unpin_frees_at_once(source):
    log, on_free = freed_log()
    params = source.pin(blocks([0]), on_free=on_free)
    assert source.unpin(params.lease) and not source.unpin(params.lease)
    assert log == [(params.lease, "released")]


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
