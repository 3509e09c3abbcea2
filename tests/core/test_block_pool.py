"""Block pool and free queue: exact block ids and free-queue order."""

import pytest

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    compute_num_gpu_blocks,
    hash_block_tokens,
    kv_cache_bytes_per_token,
)


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_order_and_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    q.remove(blocks[3])
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 4, 5] and q.num_free_blocks == 5
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    assert q.popleft() is blocks[0]
    q.append(blocks[3])
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5, 3, 0]
    assert ids(q.popleft_n(3)) == [1, 2, 4]
    assert ids(q.get_all_free_blocks()) == [5, 3, 0] and q.num_free_blocks == 3
    q.remove(blocks[0])  # the tail
    q.remove(blocks[5])  # the head
    assert ids(q.get_all_free_blocks()) == [3]
    with pytest.raises(ValueError):
        q.remove(blocks[5])
    with pytest.raises(ValueError):
        q.popleft_n(2)
    assert q.popleft() is blocks[3]
    with pytest.raises(ValueError):
        q.popleft()
    q.append(blocks[4])
    assert ids(q.get_all_free_blocks()) == [4]


def test_pool_never_hands_out_null_block():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4]
    got = pool.get_new_blocks(4)
    assert ids(got) == [1, 2, 3, 4] and all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(got))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 2, 1]
    assert pool.get_usage() == 0.0
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        BlockPool(1)


def test_lazy_eviction_keeps_hash_until_reused():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h1 = hash_block_tokens(NONE_HASH, list(range(16)))
    h2 = hash_block_tokens(h1, list(range(16, 32)))
    pool.cache_full_blocks([a, b], [h1, h2], 0, 2)
    assert pool.get_cached_block(h1) is a and a.block_hash == h1
    pool.free_blocks([b, a])  # request order reversed: b is evicted first
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1]
    assert pool.get_cached_block(h2) is b  # still a hit while free
    pool.touch([a])  # a hit on a free cached block takes it out of the queue
    assert a.ref_cnt == 1 and ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2]
    assert pool.num_evictions == 0
    assert ids(pool.get_new_blocks(2)) == [3, 2]  # 3 was never cached; 2 (= b) is evicted now
    assert pool.num_evictions == 1 and b.block_hash is None and pool.get_cached_block(h2) is None
    assert pool.get_cached_block(h1) is a


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(NONE_HASH, [1] * 16)
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([a, b])
    assert pool.reset_prefix_cache() and pool.get_cached_block(h) is None and a.block_hash is None


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    assert not pool.reset_prefix_cache()


def test_block_hash_chain_and_salt():
    h1 = hash_block_tokens(NONE_HASH, list(range(16)))
    assert h1 == hash_block_tokens(NONE_HASH, list(range(16))) and len(h1) == 32
    assert h1 != hash_block_tokens(NONE_HASH, list(range(1, 17)))
    assert hash_block_tokens(h1, [5] * 16) != hash_block_tokens(NONE_HASH, [5] * 16)
    assert hash_block_tokens(NONE_HASH, [5] * 16, b"salt") != hash_block_tokens(NONE_HASH, [5] * 16)
    # Packed as int32: token 256 is not confused with tokens (0, 1).
    assert hash_block_tokens(NONE_HASH, [256]) != hash_block_tokens(NONE_HASH, [0, 1])


def test_sizing_helpers():
    # Llama-3-8B, bf16: 2 * 32 * 8 * 128 * 2 = 128 KiB per token.
    per_token = kv_cache_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, itemsize=2)
    assert per_token == 131072
    assert compute_num_gpu_blocks(10 * 2**30, per_token, 16) == 5120  # 10 GiB / 2 MiB
    assert compute_num_gpu_blocks(2 * 2**21 + 5, per_token, 16) == 2
    with pytest.raises(ValueError, match="at least 2"):
        compute_num_gpu_blocks(2**21, per_token, 16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_bytes_per_token(2, 0, 64, 2)


def test_request_block_hashes_incremental_equal_chained():
    from jaxserve.core.kv_cache_utils import salt_extra_keys, update_block_hashes
    from jaxserve.core.request import Request
    from jaxserve.sampling_params import SamplingParams

    for salt in (None, "tenant"):
        tokens = [(t * 31) % 1000 for t in range(16 * 5 + 3)]
        r = Request("a", tokens[:20], SamplingParams(), cache_salt=salt)
        assert len(update_block_hashes(r, 16)) == 1
        for t in tokens[20:]:  # generated tokens fill the later blocks
            r.append_output_token_ids(t)
            update_block_hashes(r, 16)
        want, parent = [], NONE_HASH
        for i in range(5):
            parent = hash_block_tokens(
                parent, tokens[16 * i : 16 * i + 16], salt_extra_keys(salt) if i == 0 else b""
            )
            want.append(parent)
        assert r.block_hashes == want
