"""Hybrid KV / recurrent-state cache: bookkeeping (pure Python), planning and storage.

    plan = plan_cache(cfg, CacheConfig(max_model_len=...), MemoryBudget(...), tp=4)   # revolta.plan: dry runs
    allocator = HybridAllocator(plan.allocator_config())                             # the scheduler's API
    tensors = CacheStorage(cfg, plan.layout, "cuda")     # revolta.cache.storage: the GPU tensors

See docs/cache.md for the layout, a request's lifecycle and the capacity method.
"""

from .block_pool import BlockPool, PoolError
from .capacity import (
    CacheConfig,
    CacheConfigError,
    CacheLayout,
    CachePlan,
    MemoryBudget,
    plan_cache,
    validate_cache_config,
)
from .hybrid import Allocation, AllocatorConfig, CacheRequest, HybridAllocator, SwapOuts, slot_mapping
from .state_pool import StatePool

__all__ = [
    "Allocation", "AllocatorConfig", "BlockPool", "CacheConfig", "CacheConfigError", "CacheLayout", "CachePlan",
    "CacheRequest", "HybridAllocator", "MemoryBudget", "PoolError", "StatePool", "SwapOuts", "plan_cache", "slot_mapping", "validate_cache_config",
]
