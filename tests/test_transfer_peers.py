"""The manager's peer table (transfer/peers.py) alone, on a stand-in agent: a peer's
metadata reaches NIXL once, whichever way it shook hands; a dialled peer has an address
to ping; a forgotten peer is gone from both (tests/test_transfer_manager.py: over NIXL)."""

from __future__ import annotations

import pytest

from transfer.handshake import HandshakeError, Hello
from transfer.peers import Peers


class _Agent:
    def __init__(self):
        self.loaded, self.removed = [], []

    def add_peer(self, metadata: bytes) -> str:
        """NIXL's answer: the name inside the metadata."""
        self.loaded.append(metadata)
        return metadata.decode().removeprefix("metadata of ")

    def remove_peer(self, name: str) -> None:
        self.removed.append(name)


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


def test_a_hello_whose_metadata_names_another_agent_is_refused_and_unloaded():
    agent = _Agent()
    peers = Peers(agent)
    peers.add(_hello("source"))
    liar = Hello("liar", b"metadata of source", {}, {"model": "m"})  # a known agent's
    with pytest.raises(HandshakeError, match="'liar''s NIXL metadata is agent 'source''s"):
        peers.add(liar)
    assert agent.removed == [] and "liar" not in peers and "source" in peers
    squatter = Hello("liar", b"metadata of decode-1", {}, {"model": "m"})  # an unknown one's
    with pytest.raises(HandshakeError, match="agent 'decode-1''s"):
        peers.add(squatter)
    assert agent.removed == ["decode-1"] and "liar" not in peers
