"""Random allocate / append / hit / free sequences against the KV-cache manager (hypothesis).

Invariants after every step: a block is in two block tables only if it was shared through a
prefix-cache hit (then it is cached, at the same position, under the same hash, in both); ref
counts equal owners; the free queue holds exactly the unreferenced blocks; free + used =
total - 1; the null block is never handed out; every block a request holds contains that
request's tokens (a simulated device cache is written through the block tables). At the end
everything is freed and usage is back to 0.

The manager runs with one of a few KV-cache group layouts (one full-attention group as before
the hybrid cache; full attention plus one or two sliding windows; one sliding window alone):
each group's tables are written and checked apart, a sliding group must hold every block a
future token can still read (its window) and never more than its peak, and a table changes
only by appending, or by a sliding group putting the null block where its window left.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from jaxserve.config import CacheConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request
from jaxserve.sampling_params import SamplingParams

B = 8
NUM_BLOCKS = 24
MAX_CHUNK = 3 * B  # the most tokens a rule computes at once (the manager's bound)
# KV-cache groups: each group's sliding window (None: full attention)
LAYOUTS = [(), (None, 2 * B + 3), (None, B, 3 * B), (B + 1,)]
# Prompts are built from a few shared prefixes so that hits are frequent.
PREFIXES = [[1] * (2 * B), [2] * B + [3] * B, [1] * (2 * B) + [4] * (B + 3), [5] * 5]


class KVCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(caching=st.booleans(), groups=st.sampled_from(LAYOUTS))
    def setup(self, caching, groups):
        self.kv = KVCacheManager(
            CacheConfig(block_size=B, enable_prefix_caching=caching, kv_cache_groups=groups),
            NUM_BLOCKS,
            MAX_CHUNK,
        )
        self.windows = self.kv.sliding_windows
        self.live: dict[str, Request] = {}
        self.device: dict[tuple[int, int], int] = {}  # (group, slot) -> token id written there
        self.count = 0

    def _write(self, r: Request, start: int, end: int) -> None:
        for g, table in enumerate(self.kv.get_block_ids(r.request_id)):
            for pos in range(start, end):
                assert table[pos // B] != 0, "a token written into the null block"
                self.device[(g, table[pos // B] * B + pos % B)] = r.all_token_ids[pos]

    def _same_but_freed(self, old: tuple, new: tuple) -> None:
        """``new`` is ``old`` extended, except that sliding groups may have nulled blocks."""
        for window, a, b in zip(self.windows, old, new):
            assert len(b) >= len(a)
            for x, y in zip(a, b):
                assert y == x or (window is not None and y == 0), (a, b)

    @rule(
        target=requests,
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=2 * B),
        salt=st.sampled_from([None, None, "s"]),
        chunk=st.integers(1, 3 * B),
    )
    def admit(self, prefix, tail, salt, chunk):
        self.count += 1
        r = Request(
            f"r{self.count}", prefix + tail, SamplingParams(max_tokens=None), cache_salt=salt
        )
        hits, num_hit = self.kv.get_computed_blocks(r)
        assert num_hit % B == 0 and num_hit < r.num_tokens
        n = min(chunk, r.num_tokens - num_hit)
        before = ([b.ref_cnt for b in self.kv.block_pool.blocks], self.kv.num_free_blocks)
        new = self.kv.allocate_slots(r, n, num_hit, hits, new_request=True)
        if new is None:
            assert (
                [b.ref_cnt for b in self.kv.block_pool.blocks],
                self.kv.num_free_blocks,
            ) == before
            return None
        self.live[r.request_id] = r
        r.num_computed_tokens = num_hit + n
        self._write(r, num_hit, num_hit + n)
        return r

    @rule(r=requests, chunk=st.integers(1, 2 * B), token=st.integers(0, 3))
    def step(self, r, chunk, token):
        """Computes the next chunk of a live request; when it catches up, a token is sampled."""
        if r is None or r.request_id not in self.live:
            return
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token_ids(token)
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        old = self.kv.get_block_ids(r.request_id)
        if self.kv.allocate_slots(r, n) is None:
            new = self.kv.get_block_ids(r.request_id)
            self._same_but_freed(old, new)
            assert all(len(a) == len(b) for a, b in zip(old, new))
            return
        self._same_but_freed(old, self.kv.get_block_ids(r.request_id))
        self._write(r, r.num_computed_tokens, r.num_computed_tokens + n)
        r.num_computed_tokens += n

    @rule(r=consumes(requests))
    def free(self, r):
        if r is not None and self.live.pop(r.request_id, None) is not None:
            self.kv.free(r)

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv, pool = self.kv, self.kv.block_pool
        owners: dict[int, list[tuple[str, int]]] = {}
        for req_id, tables in kv.req_to_blocks.items():
            for g, (window, blocks) in enumerate(zip(self.windows, tables)):
                for pos, b in enumerate(blocks):
                    if b.is_null:
                        assert window is not None, "a null block in a full-attention table"
                        continue
                    owners.setdefault(b.block_id, []).append((req_id, g, pos))
                if window is not None:  # the window and the chunk, never more
                    held = sum(1 for b in blocks if not b.is_null)
                    assert held <= -(-(window - 1 + MAX_CHUNK) // B) + 1
        assert 0 not in owners, "null block handed out"
        for block in pool.blocks[1:]:
            held = owners.get(block.block_id, [])
            assert block.ref_cnt == len(held)
            if len(held) > 1:  # shared: only through a hit on a cached, full block
                assert block.block_hash is not None
                positions = {(g, pos) for _, g, pos in held}
                assert len(positions) == 1, "one block in two groups or at two positions"
                ((_, pos),) = positions
                assert all(self.live[r].block_hashes[pos] == block.block_hash for r, _, _ in held)
                assert len({self.live[r].cache_salt for r, _, _ in held}) == 1, (
                    "tenants with different salts share"
                )
            if block.block_hash is not None:
                assert pool.cached_blocks[block.group][block.block_hash] is block
        free = pool.free_block_queue.get_all_free_blocks()
        assert len(free) == kv.num_free_blocks
        assert {b.block_id for b in free} == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert used + kv.num_free_blocks == NUM_BLOCKS - 1
        assert abs(kv.usage - used / (NUM_BLOCKS - 1)) < 1e-9
        # Every computed token a future token can read (its window, or all of them) is what the
        # device holds at its slot, in every group.
        for req_id, r in self.live.items():
            nc = r.num_computed_tokens
            for g, (window, table) in enumerate(zip(self.windows, kv.get_block_ids(req_id))):
                assert len(table) * B >= nc
                lo = 0 if window is None else max(0, nc - window + 1)
                for pos in range(lo, nc):
                    slot = table[pos // B] * B + pos % B
                    assert table[pos // B] != 0, (req_id, g, pos, "freed while in the window")
                    assert self.device[(g, slot)] == r.all_token_ids[pos], (req_id, g, pos)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for r in list(self.live.values()):
            self.kv.free(r)
        assert self.kv.usage == 0.0
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)
        assert self.kv.num_free_blocks == NUM_BLOCKS - 1


KVCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase
