"""Paged attention (pallas_kernels.attention) on the GPU: float64-oracle checks at the
model's head shapes, then timings against cuDNN's fused attention (prefill) and against
the bytes a decode step must read; run as ``python -m bench.kernels --parts attention``,
with the shared harness (bench/harness.py: ceilings, timing, checks, the results table)."""

from __future__ import annotations

import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.harness import RESULTS, cfg_label, check, f64, log, row, save, time_jax
from pallas_kernels import oracle

ATTN_H, ATTN_KV, ATTN_HD, ATTN_BS = 16, 2, 256, 64  # Qwen3.5-35B-A3B attention, cache blocks of 64


def _paged_case(seed, ctx_len, new, H, KV, hd, bs, dtype, pad=0, decode=False):
    """A random step over a paged cache whose block tables are a random permutation.

    Sequence n holds ctx_len[n] keys, the last new[n] of which are this step's
    queries (decode: new = 1 for every row with ctx_len > 0, one row per
    sequence).  Returns the op's arguments and the per-token validity mask.
    """
    rng = np.random.default_rng(seed)
    ctx_len, new = np.asarray(ctx_len), np.asarray(new)
    N = len(ctx_len)
    M = max(1, -(-int(ctx_len.max()) // bs))
    nb = N * M + 1
    bt = rng.permutation(nb)[:N * M].reshape(N, M).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    if decode:
        T = N
        seq = np.arange(N, dtype=np.int32)
        valid = ctx_len > 0
        pos = np.maximum(ctx_len - 1, 0).astype(np.int32)
    else:
        T = int(cu[-1]) + pad
        tok = np.arange(T)
        seq = np.minimum(np.searchsorted(cu[1:], tok, side="right"), N - 1).astype(np.int32)
        valid = tok < cu[-1]
        pos = np.where(valid, ctx_len[seq] - new[seq] + tok - cu[seq], 0).astype(np.int32)
    k1, k2 = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(k1, (T, H, hd), jnp.float32).astype(dtype)
    kv = jax.random.normal(k2, (nb, 1, 2, bs, KV, hd), jnp.float32).astype(dtype)
    return dict(q=q, kv=kv, bt=jnp.asarray(bt), seq=jnp.asarray(seq), pos=jnp.asarray(pos),
                cu=jnp.asarray(cu), valid=valid, bt_np=bt, seq_np=seq, pos_np=pos)


def _attn_fn(backend, is_decode, cfg=None):
    from pallas_kernels.attention import paged_attention
    return jax.jit(lambda q, kv, bt, seq, pos, cu: paged_attention(
        q, kv, 0, bt, seq, pos, scale=q.shape[-1] ** -0.5, cu_seqlens=cu, is_decode=is_decode,
        backend=backend, config=cfg))


def _attn_call(f, c):
    return f(c["q"], c["kv"], c["bt"], c["seq"], c["pos"], c["cu"])


def attention_checks():
    """Float64-oracle checks of the kernel at the model's head shapes (small batches)."""
    log("== paged attention: float64-oracle checks on the GPU ==")
    H, KV, hd = (4, 2, 32) if harness.TINY else (ATTN_H, ATTN_KV, ATTN_HD)
    cases = [  # (kind, ctx_len, new, block size, pad tokens, config)
        ("prefill fresh", [1, 63, 0, 64, 65, 200], [1, 63, 0, 64, 65, 200], 64, 7, None),
        ("prefill continuing", [70, 64, 131, 5], [5, 64, 1, 5], 16, 3, None),
        ("decode", [1, 63, 0, 64, 65, 200, 1000], None, 64, 0, None),
        ("decode", [1, 63, 0, 64, 65, 200, 1000], None, 16, 0, {"splits": 1}),
        ("decode", [1, 63, 0, 64, 65, 200, 1000], None, 64, 0, {"splits": 3}),
    ]
    seed = int(time.time()) % (1 << 20)
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)):
        for kind, ctx_len, new, bs, pad, cfg in cases:
            seed += 1
            dec = kind == "decode"
            try:
                c = _paged_case(seed, ctx_len, new if new is not None else [int(x > 0) for x in ctx_len],
                                H, KV, hd, bs, dtype, pad=pad, decode=dec)
                out = f64(_attn_call(_attn_fn(harness.BACKEND, dec, cfg), c))
                want = oracle.paged_attention_oracle(f64(c["q"]), f64(c["kv"]), 0, c["bt_np"],
                                                     c["seq_np"], c["pos_np"], hd ** -0.5,
                                                     c["valid"])
                tag = f"attn {kind} {jnp.dtype(dtype).name} bs{bs} {cfg_label(cfg)}"
                check(tag, oracle.rel_err(out[c["valid"]], want[c["valid"]]), tol)
                check(tag + " pad==0", float(np.abs(out[~c["valid"]]).max(initial=0.0)), 0.0)
            except Exception as e:  # noqa: BLE001
                log(f"  attention check {kind} FAILED to run:", repr(e)[:2000])
                RESULTS["errors"].append(("attention_check", traceback.format_exc()[-4000:]))
    save()


def _arow(shape, impl, ms, flops=None, nbytes=None, extra=None):
    ex = dict(extra or {})
    if flops:
        ex["tflops"] = flops / (ms * 1e-3) / 1e12
        if RESULTS.get("bf16_matmul_flops"):
            ex["frac_matmul"] = flops / (ms * 1e-3) / RESULTS["bf16_matmul_flops"]
    r = row("attn", shape, impl, ms, nbytes=nbytes, extra=ex)
    if flops:
        log(f"{'':37s}{impl[:28]:28s} {ex['tflops']:6.0f} TFLOP/s "
            f"({ex.get('frac_matmul', 0) * 100:3.0f}% of the bf16 matmul ceiling)")
    return r


# Changes against the tuning table's sm90 entry (the sweep's figures: bench/RESULTS.md).
ATTN_PREFILL_VARIANTS = [None, dict(bk=32, stages=4), dict(bk=32, stages=5), dict(warps=16),
                         dict(bm=256, bk=32, warps=16), dict(bm=256, warps=16, stages=2)]
ATTN_DECODE_VARIANTS = [None, dict(splits=1), dict(bk=32, stages=3), dict(min_programs=528),
                        dict(bk=32, stages=3, min_programs=528), dict(bk=32, stages=4)]


def attention_bench(variants):
    """Fresh prefill against cuDNN's fused attention on the same keys (dense), then
    decode against the bytes it must read (and the reference at 1024 keys)."""
    log(f"== paged attention (bf16, H{ATTN_H} KV{ATTN_KV} hd{ATTN_HD}, cache block {ATTN_BS}) ==")
    H, KV, hd, bs = (4, 2, 32, 16) if harness.TINY else (ATTN_H, ATTN_KV, ATTN_HD, ATTN_BS)
    prefill = ([("tiny 2x40", [40, 40])] if harness.TINY
               else [("1x8192", [8192]), ("4x2048", [2048] * 4)])
    best = None
    for si, (name, lens) in enumerate(prefill):
        c = _paged_case(200 + si, lens, lens, H, KV, hd, bs, jnp.bfloat16)
        B, Tb = len(lens), lens[0]
        flops = 4 * H * hd * sum(t * (t + 1) // 2 for t in lens)  # causal QK^T and PV
        shape = f"prefill {name}"
        cfgs = ATTN_PREFILL_VARIANTS if (variants and si == 0) else [best]
        timed = []
        for cfg in cfgs:
            label = "ours " + cfg_label(cfg)
            try:
                f = _attn_fn(harness.BACKEND, False, cfg)
                ms, spread = time_jax(lambda: _attn_call(f, c))
                _arow(shape, label, ms, flops=flops, extra=dict(spread=spread, cfg=cfg))
                timed.append((ms, cfg, f))
            except Exception as e:  # noqa: BLE001
                log(f"  {label} FAILED: {repr(e)[:3000]}")
                RESULTS["errors"].append((shape + " " + label, traceback.format_exc()[-6000:]))
        if not timed:
            continue
        ms_ours, cfg_ours, f_ours = min(timed, key=lambda x: x[0])
        if si == 0:
            best = cfg_ours
            RESULTS["best_attention_prefill_cfg"] = best
            log(f"  best prefill config: {cfg_label(best)}")
        o_ours = _attn_call(f_ours, c)
        # the same keys as dense [B, T, KV, hd] tensors, read back through the block table
        paged = c["kv"][c["bt"], 0]  # [B, M, 2, bs, KV, hd]
        kd = paged[:, :, 0].reshape(B, -1, KV, hd)[:, :Tb]
        vd = paged[:, :, 1].reshape(B, -1, KV, hd)[:, :Tb]
        qd = c["q"].reshape(B, Tb, H, hd)
        for impl in ("cudnn", "xla"):
            try:
                fd = jax.jit(lambda q, k, v, _i=impl: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation=None if harness.TINY else _i))
                o_d = fd(qd, kd, vd)
                check(f"{shape} ours vs {impl}", oracle.rel_err(f64(o_ours).reshape(B, Tb, H, hd),
                                                                 f64(o_d)), 1e-2)
                ms, spread = time_jax(lambda: fd(qd, kd, vd), reps=10 if impl == "xla" else 30)
                _arow(shape, f"jax.nn.dot_product_attention {impl}", ms, flops=flops,
                      extra=dict(spread=spread, ours_over_it=ms_ours / ms))
                log(f"  => ours / {impl} = {ms_ours / ms:.2f}x time")
            except Exception as e:  # noqa: BLE001
                log(f"  {impl} FAILED: {repr(e)[:2000]}")
                RESULTS["errors"].append((shape + " " + impl, traceback.format_exc()[-4000:]))
        del c, paged, kd, vd, qd, o_ours
        save()

    decode = ([(4, 40), (8, 300)] if harness.TINY
              else [(64, 1024), (256, 1024), (64, 8192), (256, 8192)])
    for si, (N, ctx) in enumerate(decode):
        c = _paged_case(300 + si, [ctx] * N, [1] * N, H, KV, hd, bs, jnp.bfloat16, decode=True)
        nbytes = N * ctx * KV * hd * 2 * 2 + 2 * N * H * hd * 2  # K and V once, q and o
        shape = f"decode N{N} ctx{ctx}"
        cfgs = ATTN_DECODE_VARIANTS if variants else [None]
        o_first = None
        for cfg in cfgs:
            label = "ours " + cfg_label(cfg)
            try:
                f = _attn_fn(harness.BACKEND, True, cfg)
                o = _attn_call(f, c)
                if o_first is None:
                    o_first = o
                else:  # every variant computes the same function
                    check(f"{shape} {label} vs default", oracle.rel_err(f64(o), f64(o_first)), 1e-2)
                ms, spread = time_jax(lambda: _attn_call(f, c))
                _arow(shape, label, ms, nbytes=nbytes, extra=dict(spread=spread, cfg=cfg))
            except Exception as e:  # noqa: BLE001
                log(f"  {label} FAILED: {repr(e)[:3000]}")
                RESULTS["errors"].append((shape + " " + label, traceback.format_exc()[-6000:]))
        if ctx <= 1024 or harness.TINY:
            try:
                fr = _attn_fn("reference", True)
                o_r = _attn_call(fr, c)
                if o_first is not None:
                    check(f"{shape} ours vs reference", oracle.rel_err(f64(o_first), f64(o_r)), 1e-2)
                ms, spread = time_jax(lambda: _attn_call(fr, c), reps=10)
                _arow(shape, "reference (XLA gather)", ms, nbytes=nbytes, extra=dict(spread=spread))
            except Exception as e:  # noqa: BLE001
                log(f"  reference FAILED: {repr(e)[:2000]}")
                RESULTS["errors"].append((shape + " reference", traceback.format_exc()[-4000:]))
        del c, o_first
        save()
