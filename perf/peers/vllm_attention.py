"""Time vLLM's CPU attention kernel on a varlen batch of causal sequences.

Measures `torch.ops._C.cpu_attention_with_kv_cache` (what vLLM's CPU_ATTN
backend, vllm/v1/attention/backends/cpu_attn.py, calls for prefill/encoder
attention), alone and together with `cpu_attn_reshape_and_cache` (writing
k/v into the paged cache first). Every sequence is a fresh prefill: its
queries attend causally to its own keys, with no prefix. The paged cache,
block table, slot mapping, isa and scheduler metadata are built as
CPUAttentionMetadataBuilder does for encoder-only attention, with vLLM's CPU
defaults (block size 128, VLLM_CPU_ATTN_SPLIT_KV from vllm.envs).

Runs in vLLM's own venv, not ours:
    .cache/peers/vllm/venv/bin/python perf/peers/vllm_attention.py \
        --lens 128,128 --heads 16 --kv-heads 8 --head-dim 128 \
        --dtype bfloat16 --threads 2 --reps 10 [--check]
Prints one line of JSON: best seconds per call (minimum over reps, after a
warm-up), with and without the cache write, the isa, the block size and,
with --check, the max abs error against float32 torch SDPA.
"""

import argparse
import json
import time

import torch
from vllm import _custom_ops as ops
from vllm import envs

BLOCK_SIZE = 128  # vllm/platforms/cpu.py default when the user sets none


def best_time(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lens", required=True, help="comma-separated sequence lengths")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--check", action="store_true")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    lens = [int(x) for x in a.lens.split(",")]
    H, KVH, D, bs = a.heads, a.kv_heads, a.head_dim, BLOCK_SIZE

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    if dtype not in CPUAttentionBackend.supported_dtypes:
        print(json.dumps({"error": f"CPU_ATTN does not support dtype {a.dtype}"}))
        return
    if D not in CPUAttentionBackend.get_supported_head_sizes():
        print(json.dumps({"error": f"CPU_ATTN does not support head_dim {D}"}))
        return
    isa = _get_attn_isa(dtype, bs, D, "auto")
    if isa == "amx":
        # Linux hands out AMX tile state only on request (arch_prctl); in a vLLM
        # server oneDNN's GEMMs have asked for it before attention first runs.
        torch.cpu._init_amx()

    torch.manual_seed(0)
    T = sum(lens)
    q = torch.randn(T, H, D).to(dtype)
    k = torch.randn(T, KVH, D).to(dtype)
    v = torch.randn(T, KVH, D).to(dtype)

    # Metadata, as CommonAttentionMetadata + the encoder-only branch of build().
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query_start_loc = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(seq_lens, 0, out=query_start_loc[1:])
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    block_nums = (seq_lens + bs - 1) // bs
    start_block_ids = torch.zeros_like(block_nums)
    torch.cumsum(block_nums[:-1], 0, out=start_block_ids[1:])
    num_blocks = int(block_nums.sum())
    offsets = torch.arange(int(block_nums.max()), dtype=torch.int32)
    block_table = start_block_ids[:, None] + offsets[None, :]
    slot_mapping = torch.empty(T, dtype=torch.int64)
    torch.ops._C.compute_slot_mapping_kernel_impl(
        query_start_loc, positions, block_table, slot_mapping, bs
    )
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(lens),
        num_heads=H,
        num_kv_heads=KVH,
        head_dim=D,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
    )

    # kv cache [num_blocks, kv_heads, block_size, 2*D] viewed as key/value halves.
    kv_cache = torch.zeros(num_blocks, KVH, bs, 2 * D, dtype=dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, KVH, 2 * bs, D).chunk(2, dim=2)

    def write_cache():
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, isa)

    def attend():
        # The output allocated per call, as vLLM's Attention layer does and as our operator does
        # inside its call: both pay the same allocator (at 8,192 tokens a fresh 32 MiB mapping).
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=D**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0,
            scheduler_metadata=scheduler_metadata,
            s_aux=None,
        )
        return out

    def write_and_attend():
        write_cache()
        return attend()

    with_write = best_time(write_and_attend, a.reps)
    attn_only = best_time(attend, a.reps)  # the cache now holds k/v

    err = None
    if a.check:
        out = attend()
        err = 0.0
        for s, e in zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), strict=True):
            qs, ks, vs = (x[s:e].float().transpose(0, 1) for x in (q, k, v))
            ref = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True, scale=D**-0.5
            ).transpose(0, 1)
            err = max(err, (out[s:e].float() - ref).abs().max().item())

    print(
        json.dumps(
            {
                "seconds": attn_only,
                "seconds_with_cache_write": with_write,
                "isa": isa,
                "block_size": bs,
                "max_abs_error": err,
            }
        )
    )


if __name__ == "__main__":
    main()
