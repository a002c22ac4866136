"""Slot pool for the Gated DeltaNet conv and recurrent state.

Unlike KV, the GDN state of a request does not grow with its length: it is one
fixed-size record per request, rewritten in place by every step that runs the
request. One slot per live request; slot ids index the slot-major `cache.conv`
and `cache.ssm` arrays. Slots are never zeroed: a step with `start_pos == 0`
starts from a zero state without reading the slot, so there is no zeroing
write that could race with a transfer filling the slot.

Like blocks, slots are reference counted so that a transfer lease can keep a
finished request's state alive while a remote worker reads it.
"""


class SlotPool:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._ref = [0] * num_slots
        # A stack: the most recently returned slot is reused first, which keeps
        # the working set of state memory small.
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free state slot")
        s = self._free.pop()
        self._ref[s] = 1
        return s

    def incref(self, s: int) -> None:
        if self._ref[s] <= 0:
            raise ValueError(f"incref of free slot {s}")
        self._ref[s] += 1

    def free(self, s: int) -> None:
        if self._ref[s] <= 0:
            raise ValueError(f"double free of slot {s}")
        self._ref[s] -= 1
        if self._ref[s] == 0:
            self._free.append(s)

    def ref_count(self, s: int) -> int:
        return self._ref[s]
