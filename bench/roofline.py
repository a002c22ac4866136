"""Rooflines: the device's measured ceilings, a model's costs, and the floors they imply.

    python -m bench.roofline --json ceilings.json      # measure the default device's ceilings

A step's floor is max(FLOPs / matmul rate, bytes / bandwidth) (``step_floor``);
``bench.offline`` sums it over the steps the engine dispatched, ``bench.disagg`` over
the steps a served workload needs at least (``serving_floor``).  Costs come from the
model's parameters by role (``model_costs``), or from its abstract shapes when the
model lives in another process (``abstract_costs``).
"""

import argparse
import json

import numpy as np

from bench.timing import seconds_per_call

GDN_FLOPS_PER_DKDV = 11  # per token and value head (anchors.md: 180 K at dk = dv = 128)


def measure_ceilings(nbytes: int, mm: int) -> dict:
    """Copy bandwidth (bytes read + written), read bandwidth (a reduction) and the
    bf16 matmul rate, on random data, on the default device."""
    import jax
    import jax.numpy as jnp

    kx, ka, kb = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (nbytes // 2,), jnp.bfloat16)
    copy_s = seconds_per_call(jax.jit(lambda v: v + 1), x)
    read_s = seconds_per_call(jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32)), x)
    del x
    a = jax.random.normal(ka, (mm, mm), jnp.bfloat16)
    b = jax.random.normal(kb, (mm, mm), jnp.bfloat16)
    mm_s = seconds_per_call(jax.jit(lambda p, q: p @ q), a, b)
    return {"copy_bytes_per_s": 2 * nbytes / copy_s, "read_bytes_per_s": nbytes / read_s,
            "matmul_flops_per_s": 2 * mm ** 3 / mm_s, "ceiling_bytes": nbytes, "matmul_size": mm}


def role_sizes(module) -> dict:
    """A module's parameter counts and bytes by role: {role: [params, bytes]}, the roles
    "expert", "embed", "lm_head" and "dense" (the rest)."""
    import jax
    from flax import nnx

    parts = {"expert": [0, 0], "embed": [0, 0], "lm_head": [0, 0], "dense": [0, 0]}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(module, nnx.Param)):
        name = jax.tree_util.keystr(path)
        role = ("expert" if "experts_" in name else "embed" if "embed_tokens" in name
                else "lm_head" if "lm_head" in name else "dense")
        parts[role][0] += leaf.size
        parts[role][1] += leaf.size * leaf.dtype.itemsize
    return parts


def touched(c: dict, tokens: int) -> float:
    """The share of the experts ``tokens`` routed tokens read (uniform routing)."""
    return 1 - (1 - c["expert_share"]) ** tokens if c["num_experts"] else 0.0


def model_costs(model, cache_report: dict, block_size: int) -> dict:
    """Parameter counts and bytes by role, and the cache bytes per token and slot."""
    cfg = model.config
    parts = role_sizes(model)
    head = parts["embed"] if cfg.tie_word_embeddings else parts["lm_head"]
    return {
        "dense_params": parts["dense"][0], "dense_bytes": parts["dense"][1],
        "expert_params": parts["expert"][0], "expert_bytes": parts["expert"][1],
        "head_params": head[0], "head_bytes": head[1],
        "expert_share": cfg.num_experts_per_tok / cfg.num_experts if cfg.is_moe else 0.0,
        "num_experts": cfg.num_experts,
        "kv_bytes_per_token": cache_report["block_bytes"] / block_size,
        "slot_bytes": cache_report["slot_bytes"],
        "attn_layers": cfg.num_groups, "gdn_layers": cfg.num_groups * cfg.gdn_per_group,
        "heads": cfg.num_attention_heads, "head_dim": cfg.head_dim,
        "gdn_value_heads": cfg.linear_num_value_heads,
        "gdn_dkdv": cfg.linear_key_head_dim * cfg.linear_value_head_dim,
    }


def step_floor(c: dict, seqs) -> dict:
    """FLOPs and bytes of one step (its floor's inputs), and of those bytes the weights';
    seqs: [(start, tokens)]."""
    t = sum(n for _, n in seqs)
    weight_bytes = c["dense_bytes"] + c["head_bytes"] + c["expert_bytes"] * touched(c, t)
    nbytes = weight_bytes
    flops = 2 * t * (c["dense_params"] + c["expert_params"] * c["expert_share"])
    flops += 2 * len(seqs) * c["head_params"]
    flops += t * c["gdn_layers"] * c["gdn_value_heads"] * GDN_FLOPS_PER_DKDV * c["gdn_dkdv"]
    causal = 0
    for start, n in seqs:
        nbytes += (start + n) * c["kv_bytes_per_token"] + n * c["kv_bytes_per_token"]
        nbytes += c["slot_bytes"] * (2 if start > 0 else 1)
        causal += n * start + n * (n + 1) // 2  # keys seen, summed over the step's queries
    flops += 4 * c["heads"] * c["head_dim"] * c["attn_layers"] * causal
    return {"flops": flops, "bytes": nbytes, "weight_bytes": weight_bytes, "tokens": t,
            "seqs": len(seqs)}


def bandwidth(ceilings: dict) -> float:
    """The faster of the measured copy and read rates, bytes a second."""
    return max(ceilings["copy_bytes_per_s"], ceilings["read_bytes_per_s"])


def floor_seconds(f: dict, ceilings: dict) -> float:
    """A ``step_floor``'s seconds: max(FLOPs / matmul rate, bytes / bandwidth)."""
    return max(f["flops"] / ceilings["matmul_flops_per_s"], f["bytes"] / bandwidth(ceilings))


def abstract_costs(model: str, dtype, block_size: int) -> dict:
    """``model_costs`` of a preset or checkpoint directory from shapes alone (no weights
    or cache are allocated)."""
    import jax.numpy as jnp

    from qwen35_jax.cache import HybridCache
    from qwen35_jax.loader import abstract_model
    from serving.llm import model_config

    cfg = model_config(model)
    report = {"block_bytes": HybridCache.bytes_per_block(cfg, block_size, dtype),
              "slot_bytes": HybridCache.bytes_per_slot(cfg, dtype, jnp.float32)}
    return model_costs(abstract_model(cfg, dtype), report, block_size)


def serving_floor(costs: dict, ceilings: dict, input_lens, output_lens, concurrency: int
                  ) -> dict:
    """The least device time a served workload needs: every prompt prefilled as one step,
    and its output tokens decoded in steps of ``concurrency`` sequences at the mean
    context (prompt + half the output).  The disaggregated pair overlaps the two on
    separate devices (its throughput floor is set by the slower); one aggregated device
    does both in turn."""
    prefill_s = sum(floor_seconds(step_floor(costs, [(0, int(n))]), ceilings)
                    for n in input_lens)
    batch = max(1, min(concurrency, len(output_lens)))
    context = int(np.mean(input_lens) + np.mean(output_lens) / 2)
    step = step_floor(costs, [(context, 1)] * batch)
    step_s = floor_seconds(step, ceilings)
    decode_s = sum(output_lens) / batch * step_s
    tokens = sum(input_lens) + sum(output_lens)
    return {"prefill_s": prefill_s, "decode_step_s": step_s,
            "decode_step_bytes": step["bytes"], "decode_s": decode_s,
            "prefill_tokens_per_s": sum(input_lens) / prefill_s,
            "disaggregated_tokens_per_s_per_gpu": tokens / max(prefill_s, decode_s) / 2,
            "aggregated_tokens_per_s": tokens / (prefill_s + decode_s)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ceiling-mib", type=int, default=4096, help="bytes moved per sample")
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--json", required=True, help="where to write the ceilings")
    a = p.parse_args(argv)
    ceilings = measure_ceilings(a.ceiling_mib << 20, a.matmul_size)
    with open(a.json, "w") as f:
        json.dump(ceilings, f, indent=1)
    print(json.dumps(ceilings))


if __name__ == "__main__":
    main()
