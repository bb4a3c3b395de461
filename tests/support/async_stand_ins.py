"""What the asynchronous-trainer tests change in TRL 1.16's `trl.experimental.async_grpo`, test-only: the two pieces
of it that need a CUDA GPU, replaced so that `AsyncGRPOTrainer` (and `trl_gspo.AsyncGSPOTrainer`) build and train on
a CPU. A GPU needs neither: it has the FlashAttention-3 kernel and a CUDA device name.

1. **Tree attention without FlashAttention-3.** TRL packs a micro-batch's samples into one row per rank as a prefix
   trie and computes attention with FA3's `flash_attn_varlen_func` over, for each segment of the trie, the keys of its
   root-to-segment path (`packing.tree_attention`, FA3 fetched through `kernels`: CUDA only). Here the same function
   (same arguments, same output layout) is computed with PyTorch's `scaled_dot_product_attention`, one segment at a
   time, causal in FlashAttention's convention (query row `i` of a segment sees key `j` when `j <= i + Lk - Lq`: the
   query block is the end of its path). Installed at TRL's seam `packing._flash_attn`, so TRL's `tree_attention`,
   its packing and its indexing all run as they do on a GPU.
2. **No CUDA device name at construction.** `AsyncGRPOTrainer.__init__` reads `torch.cuda.get_device_name` to price
   MFU (`get_peak_flops_per_device`); here it returns None, which TRL itself returns for an unknown device (MFU
   metrics off, every other metric on).

Beside them, for tests and benchmarks that feed the trainer themselves (no server): `QueueWorker`, TRL's rollout
worker as a queue the caller fills, and `NoWeightTransfer`, a weight transfer that sends nothing (TRL accepts both
injected, `rollout_worker=` / `weight_transfer=`).
"""

from __future__ import annotations

import math
import queue
import types

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=True, window_size=(-1, -1), softcap=None):
    """FlashAttention's varlen attention on a CPU: `query` `(total_q, Hq, D)`, `key`/`value` `(total_k, Hkv, D)`,
    segment `s` = query rows `cu_seqlens_q[s]:cu_seqlens_q[s+1]` against key rows `cu_seqlens_k[s]:cu_seqlens_k[s+1]`;
    grouped-query heads repeated. Returns `(total_q, Hq, D)`."""
    if softcap:
        raise NotImplementedError("softcap: no test model uses it")
    heads, kv_heads = query.shape[1], key.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    out = torch.empty_like(query)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        if q1 == q0:
            continue
        q = query[q0:q1].transpose(0, 1)  # (H, Lq, D)
        k = key[k0:k1].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        v = value[k0:k1].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        lq, lk = q1 - q0, k1 - k0
        rows = torch.arange(lq)[:, None] + (lk - lq)
        cols = torch.arange(lk)[None, :]
        allowed = cols <= rows if causal else torch.ones(lq, lk, dtype=torch.bool)
        if window_size[0] >= 0:
            allowed &= cols >= rows - window_size[0]
        out[q0:q1] = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


def install() -> None:
    """Apply both stand-ins to this process (idempotent)."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None


class QueueWorker:
    """TRL's `RolloutWorkerProtocol` as a queue the caller fills with `RolloutSample`s (TRL reads `rollout_buffer`)."""

    def __init__(self, samples=()):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        for sample in samples:
            self.rollout_buffer.put(sample)

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, version):
        pass

    def check_health(self, stale_after_s):
        pass


class NoWeightTransfer:
    """TRL's `WeightTransferProtocol` sending nothing (there is no server); the weights streamed to it are read."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, weights):
        for _ in weights:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass
