"""The manager's peer table (transfer/peers.py) alone, on a stand-in agent: a peer's
metadata reaches NIXL once, whichever way it shook hands; a dialled peer has an address
to ping; a forgotten peer is gone from both (tests/test_transfer_manager.py: over NIXL)."""

from __future__ import annotations

from transfer.handshake import Hello
from transfer.peers import Peers


class _Agent:
    def __init__(self):
        self.loaded = []

    def add_peer(self, metadata: bytes) -> None:
        self.loaded.append(metadata)


def _hello(name: str) -> Hello:
    return Hello(name, f"metadata of {name}".encode(), {}, {"model": "m"})


def test_a_peer_is_loaded_once_and_only_a_dialled_one_has_an_address():
    agent = _Agent()
    peers = Peers(agent)
    peers.add(_hello("puller"))  # it connected to us
    peers.add(_hello("source"), ("10.0.0.2", 7000))  # we dialled it
    peers.add(_hello("source"), ("10.0.0.2", 7000))  # again: nothing reloaded
    peers.add(_hello("puller"))
    assert agent.loaded == [b"metadata of puller", b"metadata of source"]
    assert "puller" in peers and "source" in peers and "other" not in peers
    assert peers.address("puller") is None and peers.address("source") == ("10.0.0.2", 7000)
    assert peers.get("source").compat == {"model": "m"} and peers.get("other") is None


def test_a_forgotten_peer_is_gone_and_a_later_handshake_loads_it_again():
    agent = _Agent()
    peers = Peers(agent)
    peers.add(_hello("source"), ("10.0.0.2", 7000))
    assert peers.forget("source") and not peers.forget("source")
    assert "source" not in peers and peers.address("source") is None
    peers.add(_hello("source"))  # it shook hands again after the owner gave it up
    assert agent.loaded == [b"metadata of source"] * 2
