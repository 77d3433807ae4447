"""Emitted hidden rows for prefix-cached positions, stored the way the KV cache is.

A stage whose consumers read its hidden states (the thinker feeding a talker) must hand them one row
for every prompt position, but with vLLM's prefix caching a request's cached prefix is never run
again. So the runner keeps the emitted row of every position it computes at that position's KV
slot (block id * block size + offset: the slot mapping vLLM builds for the step), written in the
same step as its KV. A cached block's rows then live exactly as long as its KV does: a reused block
is rewritten by the step that rewrites its KV, and there is no eviction to mirror. A request that
starts on a cache hit gets its prefix rows read back from the slots of its cached blocks.

Memory: hidden size x dtype bytes per KV token (7 KB beside the 7B thinker's 56 KB of KV). The stage's
KV budget covers both: the worker hands vLLM the KV share of it (`kv_share`).
"""

from __future__ import annotations

import numpy as np
import torch

from omni_server.stage.transfer import to_device

# vLLM `additional_config` key (set by the stage when a consumer reads its hidden rows): keep the store.
PREFIX_ROWS = "omni_prefix_rows"


def wanted(vllm_config) -> bool:
    """Whether this engine keeps the store: its stage asked, and prefix caching is on."""
    extra = vllm_config.additional_config or {}
    return bool(extra.get(PREFIX_ROWS)) and bool(vllm_config.cache_config.enable_prefix_caching)


def row_bytes(vllm_config) -> int:
    model = vllm_config.model_config
    return model.get_hidden_size() * torch.empty((), dtype=model.dtype).element_size()


def kv_share(budget: int, kv_specs: dict, vllm_config) -> int:
    """Of `budget` bytes for the KV cache and the rows beside it, the bytes vLLM may give the KV cache:
    the same number of tokens then fits in both."""
    kv = sum(spec.page_size_bytes / spec.block_size for spec in kv_specs.values())
    if kv <= 0:
        return budget
    return int(budget * kv / (kv + row_bytes(vllm_config)))


class RowsBudget:
    """Mixin over a vLLM worker: the KV memory it reports leaves room for the store."""

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        if wanted(self.vllm_config):
            available = kv_share(available, self.get_kv_cache_spec(), self.vllm_config)
        return available


class PrefixRows:
    def __init__(self, kv_cache_config, width: int, dtype: torch.dtype, device: torch.device):
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            # One slot mapping for all layers is what makes a slot name one position.
            raise ValueError(f"prefix caching with emitted hidden rows needs one KV cache group, this model "
                             f"has {len(groups)}; set enable_prefix_caching: false in the stage's engine_args")
        self.block_size = groups[0].kv_cache_spec.block_size
        self.rows = torch.empty(kv_cache_config.num_blocks * self.block_size, width, dtype=dtype, device=device)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of one step's tokens at their slots (`slots`: the step's slot mapping, unpadded)."""
        self.rows.index_copy_(0, slots, rows.to(self.rows.dtype))

    def read(self, block_ids: list[int], count: int) -> torch.Tensor:
        """The rows of a request's first `count` positions (a private copy), from its block ids."""
        blocks = np.asarray(block_ids[: -(-count // self.block_size)], dtype=np.int64)
        slots = (blocks[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)[:count]
        return self.rows.index_select(0, to_device(torch.from_numpy(slots), self.rows.device))
