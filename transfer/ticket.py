"""What a source hands a puller (a ``Ticket``), and what claiming it returns (a ``Claim``).

A ticket travels through hands the transfer layer does not trust (the router, an HTTP
body), so it names only where the source is and which lease to claim; a forged or
altered one can at worst name a lease that the source refuses or another agent holds.
What a pull reads comes from the ``Claim``, which only ``TransferManager.claim`` makes,
from the source's own answer over the authenticated handshake channel.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from transfer import descriptors
from transfer.lease import ID as LEASE_ID
from transfer.memory import Region

# names and leases travel in space-separated notifications: printable, no spaces
_Word = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")]


class Ticket(BaseModel):
    """The source's agent, its handshake address, the lease and its TTL in seconds.
    ``TransferManager.claim`` refuses a ticket whose agent does not listen at its address:
    the claim goes to the address, the READ to the agent."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    agent: _Word
    address: tuple[Annotated[str, Field(min_length=1, max_length=255)],
                   Annotated[int, Field(ge=1, le=65535)]]
    lease: Annotated[str, Field(max_length=64, pattern=f"^{LEASE_ID.pattern}$")]
    ttl: Annotated[float, Field(gt=0, le=86400)]


@dataclasses.dataclass(frozen=True)
class Claim:
    """A lease this manager's agent has claimed: the source's agent, the lease, its TTL,
    the items it pins (region, offset, length, in the source's regions) and the owner's
    description of them (``meta``), all as the source answered."""

    agent: str
    lease: str
    ttl: float
    items: tuple[tuple[str, int, int], ...]
    meta: dict

    @classmethod
    def from_answer(cls, ticket: Ticket, answer, regions: Mapping[str, Region]) -> Claim:
        """The claim the source answered for ``ticket`` (JSON: its items, meta and TTL),
        checked against the source's ``regions``; DescriptorError for an answer that is
        malformed or names bytes outside them."""
        if not (isinstance(answer, dict) and isinstance(answer.get("meta"), dict)
                and isinstance(answer.get("items"), list)
                and isinstance(answer.get("ttl"), (int, float)) and answer["ttl"] > 0):
            raise descriptors.DescriptorError(f"malformed claim answer {str(answer)[:200]}")
        items = tuple(descriptors.validate(answer["items"], regions, "claimed"))
        return cls(ticket.agent, ticket.lease, float(answer["ttl"]), items, answer["meta"])

    def plan(self, local_items: Sequence, local_regions: Mapping[str, Region],
             regions: Mapping[str, Region], remote_items: Sequence | None = None
             ) -> descriptors.Plan:
        """The descriptors of a pull of this claim into ``local_items``: of the claimed
        items in stream order, or of ``remote_items``, ranges inside them (``regions``:
        the source's). DescriptorError for items outside either side's."""
        if remote_items is None:
            remote_items = self.items
        else:
            descriptors.check_inside(remote_items, self.items, regions)
        return descriptors.plan(local_items, local_regions, remote_items, regions)
