"""Reading compiled programs (optimized HLO text) for what moves or copies the cache.

A program of a sharded engine should leave each cache shard where it is: no
collective that changes a layout (all-gather, all-to-all, collective-permute) may
produce a cache array, and no ``copy`` may produce a device's whole shard (the
donated pools are updated in place).  The layers hand the kernels views of the
state pools ((group, layer) dims merged, then merged into the slot dim too), so
those shapes count as the pool as well.  ``tests/test_sharding.py`` and
``bench/sharded_step.py`` both read programs through this module.
"""

import re

RESHARDING = ("all-gather", "all-to-all", "collective-permute")


def produced_by(hlo: str, ops, shapes) -> list:
    """Shapes among ``shapes`` that an instruction ``ops`` (names, e.g. ``RESHARDING``;
    their async ``-start`` forms count too) produces in the program text ``hlo``."""
    op = re.compile(r" (" + "|".join(map(re.escape, ops)) + r")(-start)?\(")
    found = set()
    for line in hlo.splitlines():
        m = op.search(line)
        if not m or "=" not in line[:m.start()]:
            continue
        result = line[:m.start()].split("=", 1)[1]
        for dims in re.findall(r"\[([\d,]*)\]", result):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if shape in shapes:
                found.add(shape)
    return sorted(found)


def pool_views(shapes: dict) -> set:
    """The shapes of a HybridCache's arrays (``{"kv": shape, "conv": ..., "ssm": ...}``,
    whole or one device's shard) and of the state pool views the layers pass on."""
    out = {tuple(s) for s in shapes.values()}
    for name in ("conv", "ssm"):
        p, g, r, *rest = shapes[name]
        out |= {(p, g * r, *rest), (p * g * r, *rest)}
    return out


def cache_moves(hlo: str, cache) -> dict:
    """For a program running on ``cache`` (a HybridCache of arrays): the cache shapes that
    a layout-changing collective produces (``resharded``) and the per-device shard
    shapes that a copy produces (``copied``: an update that was not in place)."""
    arrays = {k: getattr(cache, k) for k in ("kv", "conv", "ssm")}
    whole = pool_views({k: a.shape for k, a in arrays.items()})
    shard = pool_views({k: a.sharding.shard_shape(a.shape) for k, a in arrays.items()})
    return {"resharded": produced_by(hlo, RESHARDING, whole),
            "copied": produced_by(hlo, ("copy",), shard)}
