"""The host tier's copies (worker/kv_offload.py) on tiny caches: saves land in the named host
slots, loads write the named device blocks, and pending saves are ordered right (a load of a
slot an unfinished save writes sees that save; a slot saved twice keeps the newer block)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.kv_cache_utils import KVTransfers
from jaxserve.worker.kv_offload import HostKVCache


def caches():
    """2 layers of (K, V) [6 blocks, 4 tokens, 1 head, 2 dims]; block b of layer l holds
    100 * l + 10 * b (K) and its negative (V)."""
    base = jnp.arange(6, dtype=jnp.float32)[:, None, None, None] * 10 * jnp.ones((6, 4, 1, 2))
    return [(base + 100 * layer, -(base + 100 * layer)) for layer in range(2)]


def block(kv, b):
    return [(float(k[b, 0, 0, 0]), float(v[b, 0, 0, 0])) for k, v in kv]


@pytest.mark.parametrize("memory_kind", [None, "pinned_host"])
def test_saves_loads_and_pending_order(memory_kind):
    host = HostKVCache(3, caches(), memory_kind)
    kv = host.warmup(caches(), 4)
    # Step 1 saves blocks 1 and 2 into slots 0 and 1; nothing waits for them.
    kv = host.start(kv, KVTransfers(save_src=[1, 2], save_dst=[0, 1]))
    # Step 2 loads slot 0 into block 5 while step 1's save may still be pending: it is
    # finished first, so block 5 gets block 1's K/V.
    kv = host.start(kv, KVTransfers(load_src=[0], load_dst=[5]))
    assert block(kv, 5) == block(caches(), 1)
    # Step 3 saves block 3 into slot 1 again (a newer hash); step 4 saves block 4 into slot 2
    # and loads slot 1 into block 1: it must see block 3, not block 2.
    kv = host.start(kv, KVTransfers(save_src=[3], save_dst=[1]))
    kv = host.start(kv, KVTransfers(save_src=[4], save_dst=[2], load_src=[1], load_dst=[1]))
    assert block(kv, 1) == block(caches(), 3)
    host.finish()
    expected = np.stack([np.asarray([[k[b], v[b]] for k, v in caches()]) for b in (1, 3, 4)])
    np.testing.assert_array_equal(host.data, expected)
    assert host.timing.saved_blocks == 4 and host.timing.loaded_blocks == 2
    # Blocks not named keep their contents.
    assert [block(kv, b) for b in (2, 3, 4)] == [block(caches(), b) for b in (2, 3, 4)]
