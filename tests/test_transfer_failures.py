"""Pulls that go wrong: NIXL errors, timeouts, lost notifications, lost or restarted
peers; each is reported within its bound, and a READ still in flight holds its
destination until NIXL has ended it."""

import pytest

from transfer import CompatibilityError, HandshakeError, TransferParamsError
# pair, source and puller are pytest fixtures (module-scoped pair of managers)
from transfer_pair import (BLOCK, COMPAT, pair, make_manager, pull, blocks, source, puller,
                           drive, freed_log)


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
