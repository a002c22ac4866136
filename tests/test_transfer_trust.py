"""A ticket travels through untrusted hands: one whose agent does not listen at its address
is refused, since the claim goes to the address and the READ to the agent, and a swapped
name would read memory the claimed lease never pinned. Three managers over real NIXL."""

import jax.numpy as jnp
import numpy as np
import pytest

from transfer import Agent, Ticket, TransferParamsError, allocate
from transfer.handshake import HandshakeError, HandshakeServer, Hello, claim, exchange
from transfer_pair import BLOCK, COMPAT, SECRET, blocks, drive, make_manager, view


@pytest.fixture
def managers():
    a, b, p = make_manager(seed=1), make_manager(seed=2), make_manager()
    yield a, b, p
    for m in (p, b, a):
        m.close()


def _naming(agent, ticket):
    return Ticket(agent=agent, address=ticket.address, lease=ticket.lease, ttl=ticket.ttl)


def test_a_ticket_naming_a_source_dialled_at_another_address_is_refused(managers):
    a, b, p = managers
    p.connect(a.address)
    p.connect(b.address)  # the puller has pulled from both before
    ticket = b.pin(blocks([3]), key="k")
    with pytest.raises(TransferParamsError, match="listens at"):
        p.claim(_naming(a.agent.name, ticket), key="k")
    # the lease is still B's to hand out: the genuine ticket reads B's pinned block
    pull_id = p.pull(p.claim(ticket, key="k"), blocks([5]), timeout=5.0)
    done = drive(a, b, p, until=lambda done: pull_id in done)
    assert done[pull_id].ok and b.leases == 0
    assert np.array_equal(view(p, "kv")[5 * BLOCK:6 * BLOCK], view(b, "kv")[3 * BLOCK:4 * BLOCK])


def test_a_ticket_naming_a_peer_that_only_connected_here_asks_its_address(managers):
    """A peer that connected to this side has no address on record: the handshake at
    the ticket's address finds another agent there, and the ticket is refused."""
    a, b, p = managers
    a.connect(p.address)
    p.progress()  # loads the peers that connected: A is known to the puller, at no address
    p.connect(b.address)
    ticket = b.pin(blocks([3]), key="k")
    with pytest.raises(TransferParamsError, match="is now agent"):
        p.claim(_naming(a.agent.name, ticket), key="k")
    assert b.leases == 1


@pytest.fixture
def impostor(managers):
    """A NIXL agent under A's name with memory of its own: metadata a liar could send."""
    _, mem = allocate("kv", (4, BLOCK), jnp.uint8)
    agent = Agent([mem], name=managers[0].agent.name)
    yield agent
    agent.close()


def test_a_source_whose_nixl_metadata_names_another_agent_is_refused(managers, impostor):
    """Its READs would go to the metadata's agent; and the name it loaded is unloaded, so
    the real A still shakes hands and is read afterwards."""
    a, b, p = managers
    liar = HandshakeServer(Hello("liar", impostor.metadata(), impostor.regions, COMPAT),
                           lambda hello: None, secret=SECRET)
    try:
        with pytest.raises(HandshakeError, match="NIXL metadata is agent"):
            p.connect(liar.address)
    finally:
        liar.close()
    p.connect(a.address)
    ticket = a.pin(blocks([3]), key="k")
    pull_id = p.pull(p.claim(ticket, key="k"), blocks([5]), timeout=5.0)
    done = drive(a, b, p, until=lambda done: pull_id in done)
    assert done[pull_id].ok
    assert np.array_equal(view(p, "kv")[5 * BLOCK:6 * BLOCK], view(a, "kv")[3 * BLOCK:4 * BLOCK])


def test_a_puller_whose_nixl_metadata_names_another_agent_cannot_claim(managers, impostor):
    a, b, p = managers
    exchange(p.address, Hello("liar", impostor.metadata(), impostor.regions, COMPAT), SECRET)
    p.poll()  # loads the pullers that connected: the liar's hello is refused there
    ticket = p.pin(blocks([1]), key="k")
    with pytest.raises(HandshakeError, match="403 agent 'liar' has not shaken hands"):
        claim(p.address, SECRET, ticket.lease, "liar", "k")
    assert p.leases == 1
    p.connect(a.address)  # the real A is still taken
