"""Public GDN ops with backend dispatch."""
from __future__ import annotations

from .._dispatch import resolve
from . import reference as _ref


def gdn_prefill(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                output_final_state=True, use_qk_l2norm=False, snapshot_ends=None,
                backend="auto", config=None):
    """Chunked gated-delta-rule prefill (FLA layout).

    q, k [B,T,Hk,dk]; v [B,T,Hv,dv] (Hv % Hk == 0; value head h reads key head
    h // (Hv//Hk)); g (log decay) and beta [B,T,Hv]; initial_state
    [N,Hv,dk,dv] float32 or None (zeros).  With cu_seqlens (int32 [N+1],
    traced values allowed) B must be 1 and sequences are packed; zero-length
    sequences keep their initial state, tokens at index >= cu_seqlens[N] are
    padding (output 0).  scale defaults to dk**-0.5 (applied after the optional
    l2norm).  Returns (o in v.dtype [B,T,Hv,dv], final_state float32
    [N,Hv,dk,dv] or None).

    snapshot_ends (int32 [S], traced values allowed): packed token indices e; the
    state after a sequence's tokens before e (cu[n] < e <= cu[n+1]) is returned as a
    third output, float32 [S,Hv,dk,dv], zero for an e inside no sequence; an e given
    more than once gets the state at each of its places.  The walk
    over chunks ends a chunk at each e and stores the state it carries there: a
    prefix cache's GDN snapshots at block boundaries cost no second pass.
    """
    kw = dict(scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
              output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
              snapshot_ends=snapshot_ends)
    b = resolve("gdn_prefill", backend)
    if b == "reference":
        return _ref.gdn_chunked_reference(q, k, v, g, beta, **kw)
    if b == "recurrent":
        return _ref.gdn_recurrent_reference(q, k, v, g, beta, **kw)
    from .pallas_triton import gdn_prefill_pallas
    return gdn_prefill_pallas(q, k, v, g, beta, interpret=(b == "interpret"),
                              config=config, **kw)


def gdn_decode(q, k, v, g, beta, state_pool, slots, *, out_slots=None, lengths=None,
               scale=None, use_qk_l2norm=False, backend="auto", config=None):
    """Decode tokens against a state pool: one a sequence, or a verify step's few.

    One token a sequence: q, k [N,Hk,dk]; v [N,Hv,dv]; g, beta [N,Hv]. A verify step's:
    q, k [N,R,Hk,dk]; v [N,R,Hv,dv]; g, beta [N,R,Hv], sequence n's first ``lengths[n]``
    tokens in turn (the rest padding: output 0, nothing written). state_pool [P,Hv,dk,dv]
    float32 or bfloat16; slots int32 [N]: the row each sequence's state is read from, a
    slot outside [0, P) being a padding row (no read, no write, output 0); out_slots
    int32 [N] (or [N,R]: after each token; default ``slots``): the row the updated state
    is written to, none where outside [0, P).  Rows written must not be rows another
    sequence reads.  Math in fp32; the state is stored, and carried to a sequence's next
    token, in the pool's dtype.  Returns (o shaped as v, in v.dtype; updated pool); the
    Pallas path aliases the pool (in place under jit with donation).
    """
    if q.ndim == 4 and (out_slots is None or lengths is None):
        raise ValueError("a verify step's tokens need out_slots [N, R] and lengths [N]")
    if out_slots is None:
        out_slots = slots
    b = resolve("gdn_decode", backend)
    if b in ("reference", "recurrent"):
        return _ref.gdn_decode_reference(q, k, v, g, beta, state_pool, slots, out_slots,
                                         lengths, scale=scale, use_qk_l2norm=use_qk_l2norm)
    from .pallas_triton_decode import gdn_decode_pallas
    return gdn_decode_pallas(q, k, v, g, beta, state_pool, slots, out_slots, lengths,
                             scale=scale, use_qk_l2norm=use_qk_l2norm,
                             interpret=(b == "interpret"), config=config)
