"""The decode worker's book of requests (serving/worker/pull_book.py) alone: each claim
handed back exactly once, to whichever side gives it up or pulls it, and every request's
future resolved once, whatever order the event loop and the engine thread act in
(tests/test_worker_units.py runs it inside a worker)."""

from __future__ import annotations

import asyncio

import pytest

from serving.errors import EngineDead, TransferFailed
from serving.worker.pull_book import PullBook


def _opened(*ids):
    loop = asyncio.new_event_loop()
    book = PullBook()
    futures = {r: book.open(r, f"claim {r}", loop) for r in ids}
    return book, loop, futures


def _settle(loop):
    """Run the callbacks ``confirm`` scheduled on the caller's loop."""
    loop.run_until_complete(asyncio.sleep(0))


def test_an_id_enters_once_and_a_duplicate_changes_nothing():
    book, loop, futures = _opened("r")
    with pytest.raises(ValueError, match="duplicate request id r"):
        book.open("r", "another claim", loop)
    assert book.claims == {"r": "claim r"} and len(book) == 1 and not futures["r"].done()
    loop.close()


def test_withdrawn_before_admission_the_claim_goes_back_and_admission_is_refused():
    book, loop, _ = _opened("r")
    assert book.withdraw("r") == "claim r" and len(book) == 0
    with pytest.raises(ValueError, match="withdrawn"):
        book.admit("r", lambda: pytest.fail("reached the engine"))
    assert not book.queued
    loop.close()


def test_withdrawn_while_queued_the_claim_goes_back_once_and_the_tick_ends_the_request():
    """The caller went away after admission: it releases the claim now (not at the
    lease's expiry); the engine thread, finding the request aborted, has no claim left to
    release and ends the request with an error."""
    book, loop, futures = _opened("r")
    book.admit("r", lambda: None)
    assert book.withdraw("r") == "claim r"
    assert book.is_open("r")  # its future is the tick's to resolve
    assert book.aborted(live=lambda r: False) == [("r", None)]
    book.confirm("r", TransferFailed("aborted while waiting for memory"))
    _settle(loop)
    assert isinstance(futures["r"].exception(), TransferFailed) and len(book) == 0
    assert book.reserved("r") is None
    loop.close()


def test_a_reserved_request_is_pulled_and_confirmed_by_its_completion():
    """Memory reserved: the engine thread owns the claim; a withdrawal then gets nothing
    (the pull has it) and leaves the future to the completion."""
    book, loop, futures = _opened("r", "s")
    for r in ("r", "s"):
        book.admit(r, lambda: None)
    assert book.reserved("r") == "claim r" and book.queued == {"s"}
    book.pulling(7, "r")
    assert book.withdraw("r") is None and book.is_open("r")
    assert book.landed([7, 7, 8]) == ["r"] and book.landed([7]) == []  # once, and ours only
    assert book.completed(7) == ("r", True) and book.completed(7) == (None, False)
    book.confirm("r")
    _settle(loop)
    assert futures["r"].result() is None and not book.is_open("r")
    assert book.stats() == {"pending_pulls": 0, "draining_pulls": 0, "queued_transfers": 1}
    loop.close()


def test_a_refused_admission_leaves_the_request_unqueued():
    book, loop, _ = _opened("r")

    def refuse():
        raise ValueError("token id out of range")

    with pytest.raises(ValueError, match="out of range"):
        book.admit("r", refuse)
    assert not book.queued and book.withdraw("r") == "claim r" and len(book) == 0
    loop.close()


def test_memory_of_a_failed_pull_is_handed_back_once_its_read_ends():
    book = PullBook()
    book.drain(7, ([1, 2], 3))
    book.drain(9, ([4], None))
    assert book.drained([8]) == [] and book.drained([7]) == [([1, 2], 3)]
    assert book.drained([7]) == [] and list(book.draining) == [9]


def test_close_ends_every_request_and_hands_back_every_claim():
    book, loop, futures = _opened("q", "r", "s")
    book.admit("q", lambda: None)
    book.reserved("s")  # pulled: its claim is the pull's
    claims = book.close(EngineDead("device lost"))
    _settle(loop)
    assert sorted(claims) == ["claim q", "claim r"] and len(book) == 0
    assert all(isinstance(f.exception(), EngineDead) for f in futures.values())
    loop.close()


def test_a_confirmation_for_a_closed_loop_is_dropped():
    """The caller's loop has ended (its server stopped): nothing is left to tell."""
    book, loop, futures = _opened("r")
    loop.close()
    book.confirm("r")
    assert len(book) == 1 and not futures["r"].done()  # its claim is still the book's
