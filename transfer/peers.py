"""The agents a transfer manager has shaken hands with, by name.

Each peer's ``Hello`` (its NIXL metadata, regions and compatibility record) is kept from
the handshake on; its metadata is loaded into this side's agent once, when the peer is
first seen, since NIXL keeps a known name's metadata. Sources this side connected to
also have their handshake address, which is pinged to tell a gone peer from a failed
READ (``TransferManager.progress``); pullers that connected to this side have none.
Not thread-safe: the manager calls it under its lock.
"""

from __future__ import annotations

from transfer.handshake import Address, HandshakeError, Hello


class Peers:
    def __init__(self, agent):
        self._agent = agent
        self._hellos: dict[str, Hello] = {}
        self._addresses: dict[str, Address] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._hellos

    def add(self, hello: Hello, address: Address | None = None) -> None:
        """A peer from a handshake (``address``: where it listens, if this side dialled).
        HandshakeError if its NIXL metadata names another agent than its hello: READs go
        to the metadata's name, so a hello that lied about it would have tickets of one
        name read another agent's memory. A name NIXL had not loaded before is unloaded
        again, so the lie cannot keep that agent's own hello out later (NIXL refuses new
        metadata for a name it holds)."""
        if hello.agent not in self._hellos:
            name = self._agent.add_peer(hello.metadata)
            if name != hello.agent:
                if name not in self._hellos:
                    self._agent.remove_peer(name)
                raise HandshakeError(f"peer {hello.agent[:100]!r}'s NIXL metadata is agent "
                                     f"{name[:100]!r}'s")
            self._hellos[hello.agent] = hello
        if address is not None:
            self._addresses[hello.agent] = tuple(address)

    def get(self, name: str) -> Hello | None:
        return self._hellos.get(name)

    def address(self, name: str) -> Address | None:
        """Where the peer listens, if this side connected to it."""
        return self._addresses.get(name)

    def forget(self, name: str) -> bool:
        """The peer is gone (the owner says so); whether it was known."""
        self._addresses.pop(name, None)
        return self._hellos.pop(name, None) is not None
