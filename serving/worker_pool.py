"""The router's view of the workers of one role: their outstanding requests and which
prompt prefixes each was sent, for picking where a request goes."""

from __future__ import annotations

import itertools
from collections import OrderedDict

from serving.engine.prefix_cache import block_key


class PrefixIndex:
    """Which workers were sent each prompt prefix, by the hash chain of its full blocks
    (``prefix_cache.block_key``): where a prompt's prefix is most likely cached. It is a
    bounded LRU and a guess (a worker may have evicted the prefix, or restarted), as
    llm-d's prefix scorer and Dynamo's approximate KV router are."""

    def __init__(self, block_size: int, max_keys: int = 1 << 17):
        self.block_size, self.max_keys = block_size, max_keys
        self._workers: OrderedDict[bytes, set[str]] = OrderedDict()

    def keys(self, prompt: list[int]) -> list[bytes]:
        out, prev, bs = [], b"router", self.block_size
        for j in range(len(prompt) // bs):
            prev = block_key(prev, prompt[j * bs:(j + 1) * bs])
            out.append(prev)
        return out

    def matched(self, keys: list[bytes]) -> dict[str, int]:
        """Per worker, how many of the leading blocks it was sent."""
        out: dict[str, int] = {}
        for j, key in enumerate(keys):
            workers = self._workers.get(key)
            if not workers:
                break
            self._workers.move_to_end(key)
            for u in workers:
                out[u] = j + 1
        return out

    def record(self, keys: list[bytes], url: str) -> None:
        for key in keys:
            self._workers.setdefault(key, set()).add(url)
            self._workers.move_to_end(key)
        while len(self._workers) > self.max_keys:
            self._workers.popitem(last=False)


class WorkerPool:
    """Workers of one role, picked by the least cost: outstanding requests, plus the share
    of the prompt's blocks a worker was not sent before (a worker holding the whole prefix
    is worth one request more of load); ties rotate."""

    def __init__(self, urls: list[str], block_size: int):
        if not urls:
            raise ValueError("need at least one worker of each role")
        self.urls = list(urls)
        self.load = dict.fromkeys(self.urls, 0)
        self.prefixes = PrefixIndex(block_size)
        self._turn = itertools.count()

    def pick(self, exclude=(), keys: list[bytes] = ()) -> str | None:
        """The worker of least cost among those not in ``exclude``, for a prompt of block
        ``keys`` (``PrefixIndex.keys``; none: by load alone); None if none is left."""
        choices = [u for u in self.urls if u not in exclude]
        if not choices:
            return None
        start = next(self._turn)
        rotated = choices[start % len(choices):] + choices[:start % len(choices)]
        matched = self.prefixes.matched(keys) if keys else {}
        return min(rotated, key=lambda u: self.load[u]
                   + (1 - matched.get(u, 0) / len(keys) if keys else 0))
