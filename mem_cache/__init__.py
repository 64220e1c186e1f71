"""KV cache: SGLang-style token pools for dense and block-sparse attention layers, and the manager that owns
token slots, request rows and the prefix cache. Knows no model and no HTTP: nothing here imports engine/ or server/."""

from mem_cache.allocator import TokenSlotAllocator
from mem_cache.errors import KOnlyPoolError, LayerIdError, MissingBufferError, PoolExhaustedError
from mem_cache.hicache import HiCache
from mem_cache.kv_manager import KVCacheManager, ReqKV, ReqToTokenPool
from mem_cache.kv_pool import MHATokenToKOnlyPool, MHATokenToKVPool
from mem_cache.pool_info import BUFFER_NAMES, LAYER_KINDS, BufferLocation
from mem_cache.radix_cache import RadixCache, TreeNode
from mem_cache.sparse_pool import MiniMaxSparseKVPool

__all__ = ["BUFFER_NAMES", "LAYER_KINDS", "BufferLocation", "HiCache", "KOnlyPoolError", "KVCacheManager",
           "LayerIdError", "MHATokenToKOnlyPool", "MHATokenToKVPool", "MiniMaxSparseKVPool", "MissingBufferError",
           "PoolExhaustedError", "RadixCache", "ReqKV", "ReqToTokenPool", "TokenSlotAllocator", "TreeNode"]
