"""Float64 NumPy oracles written from the token recurrences, not from the chunked
form: the CPU tests and the GPU checks in bench/kernels.py both measure against them."""
from __future__ import annotations

import numpy as np


def gdn_prefill_oracle(q, k, v, g, beta, cu, init, scale, l2):
    """q,k [T,Hk,dk]; v [T,Hv,dv]; g,beta [T,Hv]; cu [N+1]; init [N,Hv,dk,dv]|None."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    r = Hv // Hk
    N = len(cu) - 1
    if l2:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = np.repeat(q, r, axis=1) * scale
    k = np.repeat(k, r, axis=1)
    o = np.zeros((T, Hv, dv))
    fin = np.zeros((N, Hv, dk, dv)) if init is None else np.array(init, np.float64)
    for n in range(N):
        S = fin[n].copy()
        for t in range(int(cu[n]), int(cu[n + 1])):
            S *= np.exp(g[t])[:, None, None]
            vn = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
            S += k[t][:, :, None] * vn[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", S, q[t])
        fin[n] = S
    return o, fin


def gdn_decode_oracle(q, k, v, g, beta, pool, slots, scale, l2):
    N = q.shape[0]
    P = pool.shape[0]
    o = np.zeros((N,) + tuple(v.shape[1:]))
    pool = np.array(pool, np.float64)
    for n in range(N):
        s = int(slots[n])
        if not 0 <= s < P:
            continue
        on, fn = gdn_prefill_oracle(q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1],
                                    beta[n:n + 1], [0, 1], pool[s][None], scale, l2)
        o[n] = on[0]
        pool[s] = fn[0]
    return o, pool


def _act(y, activation):
    return y / (1.0 + np.exp(-y)) if activation == "silu" else y


def conv1d_prefill_oracle(x, w, cu, init, activation):
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    T, C = x.shape
    K = w.shape[1]
    N = len(cu) - 1
    y = np.zeros((T, C))
    fin = np.zeros((N, K - 1, C))
    for n in range(N):
        hist = list(np.zeros((K - 1, C)) if init is None else np.asarray(init[n], np.float64))
        for t in range(int(cu[n]), int(cu[n + 1])):
            hist.append(x[t])
            y[t] = _act((np.stack(hist[-K:]) * w.T).sum(0), activation)
        fin[n] = np.stack(hist[-(K - 1):])
    return y, fin


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def paged_attention_oracle(q, kv, layer, block_tables, seq_ids, positions, scale, valid):
    """Causal GQA attention read through the block table, token by token.

    q [T,H,hd]; kv [num_blocks, L, 2, block_size, KV, hd]; a valid token t of
    sequence s at position p attends keys 0..p of s (key j lives in block
    block_tables[s, j // block_size] at offset j % block_size); invalid tokens
    are 0 (what the kernels write for padding)."""
    q = np.asarray(q, np.float64)
    kv = np.asarray(kv, np.float64)
    T, H, hd = q.shape
    bs, KV = kv.shape[3], kv.shape[4]
    g = H // KV
    o = np.zeros((T, H, hd))
    for t in range(T):
        if not valid[t]:
            continue
        p = int(positions[t])
        j = np.arange(p + 1)
        blk = np.asarray(block_tables)[int(seq_ids[t]), j // bs]
        k = kv[blk, layer, 0, j % bs]  # [p+1, KV, hd]
        v = kv[blk, layer, 1, j % bs]
        for h in range(H):
            s = k[:, h // g] @ q[t, h] * scale
            w = np.exp(s - s.max())
            o[t, h] = (w / w.sum()) @ v[:, h // g]
    return o
