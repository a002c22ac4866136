"""Public paged attention op with backend dispatch."""
from __future__ import annotations

from .._dispatch import resolve
from .reference import paged_attention_reference


def paged_attention(q, kv, layer, block_tables, seq_ids, positions, *, scale,
                    cu_seqlens=None, is_decode=False, backend="auto", config=None):
    """Causal attention of packed query tokens over their sequences' paged keys.

    q [T,H,hd]; kv [num_blocks, L, 2, block_size, KV, hd] with this step's keys
    already written; layer: traced index into L; block_tables int32 [N,M];
    seq_ids, positions int32 [T] (each token's sequence and absolute position:
    it sees keys 0..position of its sequence).  The kernels also take
    cu_seqlens [N+1] (traced; tokens past cu[N] are padding) to build their
    query tiles, and ``is_decode`` (static) to pick the decode variant, a
    tile per query row: one token a sequence (T == N), or a verify step's few
    packed by cu_seqlens.  Returns [T,H,hd] in q's dtype, softmax in fp32.
    Padding tokens get 0 from the kernels (the reference computes them over
    the clipped sequence's first key); their values are never used.
    backend: see ``pallas_kernels._dispatch``; "reference" (and "recurrent")
    run the pure-JAX reference.
    """
    b = resolve("paged_attention", backend)
    if b in ("reference", "recurrent"):
        return paged_attention_reference(q, kv, layer, block_tables, seq_ids, positions,
                                         scale=scale)
    from .pallas_triton import paged_attention_pallas
    return paged_attention_pallas(q, kv, layer, block_tables, seq_ids, positions, scale=scale,
                                  cu_seqlens=cu_seqlens, is_decode=is_decode,
                                  interpret=(b == "interpret"), config=config)
