"""The source's lease table (transfer/lease.py, ``Leases``) alone, without NIXL: who may
claim a lease, which messages it answers, when it ends and what its owner gets back.
The same rules over real transfers: test_transfer_leases.py."""

from __future__ import annotations

import time

import pytest

from transfer.lease import ID, ClaimError, Leases


def _table():
    t = Leases("ab12")
    lease = t.pin(ttl=10.0, on_free=None, items=[("r", 0, 8)], meta={"m": 1}, key="k")
    return t, lease


def test_a_lease_is_named_by_epoch_and_number_and_claimed_with_its_key_only():
    t, lease = _table()
    assert ID.fullmatch(lease) and lease.startswith("ab12.") and len(t) == 1
    with pytest.raises(ClaimError) as e:
        t.claim(lease, "a", now=0.0, key="other")
    assert e.value.kind == "mismatch"
    held = t.claim(lease, "a", now=0.0, key="k")
    assert (held.items, held.meta, held.claimant) == ([("r", 0, 8)], {"m": 1}, "a")
    assert t.claim(lease, "a", now=1.0, key="k") is held  # the same agent again
    with pytest.raises(ClaimError) as e:
        t.claim(lease, "b", now=1.0, key="k")
    assert e.value.kind == "claimed"
    with pytest.raises(ClaimError) as e:
        t.claim("ab12.99", "a", now=1.0, key="k")
    assert e.value.kind == "stale"


def test_only_the_claimant_ends_extends_or_drops_a_lease():
    t, lease = _table()  # pinned on the monotonic clock, for 10 s
    now = time.monotonic()
    t.claim(lease, "a", now=now, key="k")
    assert not t.done(lease, "b", "tag") and len(t) == 1
    t.drop(lease, "b")
    t.extend(lease, "b", now=now + 100.0)
    assert len(t) == 1
    t.expire(now=now + 10.5)  # b's extend moved nothing: the claim's expiry passed
    assert len(t) == 0 and [(x, r) for x, _, r in t.take_freed()] == [(lease, "expired")]


def test_done_is_ok_for_the_pull_that_ended_the_lease_and_stale_for_any_other():
    t, lease = _table()
    t.claim(lease, "a", now=0.0, key="k")
    assert t.done(lease, "a", "t1")
    assert [(x, r) for x, _, r in t.take_freed()] == [(lease, "done")] and not t.take_freed()
    assert t.done(lease, "a", "t1")  # the same pull repeating its "done": ok again
    assert not t.done(lease, "a", "t2")  # another pull of the spent lease: stale
    assert not t.done(lease, "b", "t1")


def test_extend_pushes_the_expiry_and_drop_or_a_lost_claimant_ends_at_once():
    t, lease = _table()
    now = time.monotonic()
    t.claim(lease, "a", now=now, key="k")
    t.extend(lease, "a", now=now + 5.0)  # expires 10 s after that
    t.expire(now=now + 14.0)
    assert len(t) == 1
    t.drop(lease, "a")
    assert [(x, r) for x, _, r in t.take_freed()] == [(lease, "dropped")]
    other = t.pin(ttl=10.0, on_free=None, items=[], meta={}, key=None)
    t.claim(other, "b", now=0.0)
    t.free_claimed_by("b", "peer_gone")
    assert [(x, r) for x, _, r in t.take_freed()] == [(other, "peer_gone")] and len(t) == 0


def test_an_owners_failing_on_free_does_not_stop_the_others():
    got = []

    def bad(lease, reason):
        raise RuntimeError("owner bug")

    t = Leases("e")
    first = t.pin(1.0, bad, [], {})
    second = t.pin(1.0, lambda lease, reason: got.append((lease, reason)), [], {})
    t.expire(now=float("inf"))
    for lease, held, reason in t.take_freed():
        held.run_on_free(lease, reason)
    assert got == [(second, "expired")] and first != second


def test_an_abandoned_lease_ends_unless_claimed():
    """The owner learns no puller will come (the router gave the request up): an unclaimed
    lease ends at once; a claimed one is its claimant's to end."""
    t, lease = _table()
    assert t.abandon(lease) and len(t) == 0
    assert [(x, r) for x, _, r in t.take_freed()] == [(lease, "abandoned")]
    assert not t.abandon(lease)  # ended already
    t, lease = _table()
    t.claim(lease, "a", now=0.0, key="k")
    assert not t.abandon(lease) and len(t) == 1 and not t.take_freed()
    assert t.done(lease, "a", "t1") and len(t) == 0
