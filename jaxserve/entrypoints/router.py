"""Choosing a replica for each request: prefix-cache-aware, least-loaded or round-robin.

Pure Python (no Ray, no HTTP) so the policies are tested and benchmarked on their own; the Ray
ingress (``jaxserve/entrypoints/ray_serve.py``) asks :meth:`Router.choose` before each request
and reports back with :meth:`Router.started` / :meth:`Router.finished` / :meth:`Router.update`.

Prefix-aware routing computes the prompt's chained block hashes with the KV-cache manager's own
function (``jaxserve.core.kv_cache_utils.hash_token_blocks``: same block size, same salt
handling, same chain start when every replica and the router share ``PYTHONHASHSEED``) for the
first ``max_prefix_blocks`` blocks. Per replica it keeps an LRU set of the hashes it sent
there, as large as that replica's KV pool: an estimate of what the replica's prefix cache holds
(the replica evicts by its own LRU, which this mirrors; a restart empties it). The request goes
to the replica holding the longest leading run of its hashes, unless that replica is
overloaded (``max_imbalance`` or more requests in flight beyond the least loaded one); then,
and when no replica holds any of its blocks, it goes to the replica with the fewest requests
in flight from this router, among equals the one whose index is emptiest (new prefixes
spread). ``least-loaded`` orders by requests in flight, then the KV usage and waiting depth
each replica last reported; ties take turns.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict

from jaxserve.core.kv_cache_utils import BlockHash, hash_token_blocks

POLICIES = ("prefix-aware", "least-loaded", "round-robin")


class NoReplicaError(RuntimeError):
    """No replica is up to take the request."""


@dataclasses.dataclass
class ReplicaState:
    """What the router knows of one replica.

    Attributes:
      up: answered its last health poll (a dead or restarting replica is skipped).
      in_flight: requests this router sent there that have not finished.
      num_waiting, kv_cache_usage: the replica's last reported queue depth and KV usage.
      capacity_blocks: blocks its prefix index may hold (the replica's usable KV blocks).
      prefix_index: hashes sent there, least recently used first.
    """

    up: bool = True
    in_flight: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    capacity_blocks: int = 1 << 30
    prefix_index: OrderedDict[BlockHash, None] = dataclasses.field(default_factory=OrderedDict)

    def matched_blocks(self, hashes: list[BlockHash]) -> int:
        """Leading hashes present in the index (the prefix the replica likely caches)."""
        n = 0
        for h in hashes:
            if h not in self.prefix_index:
                break
            n += 1
        return n

    def remember(self, hashes: list[BlockHash]) -> None:
        """Marks ``hashes`` most recently used, evicting the oldest beyond the capacity."""
        index = self.prefix_index
        for h in hashes:
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.capacity_blocks:
            index.popitem(last=False)


class Router:
    """Picks a replica per request under one of :data:`POLICIES`.

    Args:
      num_replicas: replicas behind the router (>= 1).
      policy: "prefix-aware", "least-loaded" or "round-robin".
      block_size: the engines' KV block size (tokens).
      none_hash: the engines' hash-chain start (``none_hash_from_seed`` of their
        ``PYTHONHASHSEED``).
      max_prefix_blocks: leading blocks hashed per prompt.
      max_imbalance: prefix-aware only: a matching replica with this many more requests in
        flight than the least loaded one counts as overloaded.

    Raises:
      ValueError: an unknown policy or num_replicas < 1 (naming the field).
    """

    def __init__(
        self,
        num_replicas: int,
        policy: str,
        block_size: int,
        none_hash: BlockHash,
        *,
        max_prefix_blocks: int = 64,
        max_imbalance: int = 8,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self.policy = policy
        self.block_size = block_size
        self.none_hash = none_hash
        self.max_prefix_blocks = max_prefix_blocks
        self.max_imbalance = max_imbalance
        self.replicas = [ReplicaState() for _ in range(num_replicas)]
        self._rr = itertools.count()
        self._tick = 0

    @property
    def num_up(self) -> int:
        """Replicas currently up."""
        return sum(r.up for r in self.replicas)

    def prefix_hashes(self, prompt_ids: list[int], cache_salt: str | None) -> list[BlockHash]:
        """The prompt's leading block hashes, as the engines compute them."""
        return hash_token_blocks(
            prompt_ids,
            self.block_size,
            cache_salt=cache_salt,
            none_hash=self.none_hash,
            max_blocks=self.max_prefix_blocks,
        )

    def choose(
        self,
        prompt_ids: list[int],
        cache_salt: str | None = None,
        exclude: frozenset[int] = frozenset(),
    ) -> tuple[int, list[BlockHash]]:
        """The replica for a request, and the block hashes to pass to :meth:`started`.

        Args:
          prompt_ids: the (first) prompt's token ids.
          cache_salt: the request's salt (part of the hashes).
          exclude: replicas not to use (ones that just failed this request).

        Raises:
          NoReplicaError: no replica is up (outside ``exclude``).
        """
        candidates = [i for i, r in enumerate(self.replicas) if r.up and i not in exclude]
        if not candidates:
            raise NoReplicaError(f"no replica is up ({self.num_up} of {len(self.replicas)})")
        if self.policy == "round-robin":
            n = len(self.replicas)
            for _ in range(n):
                i = next(self._rr) % n
                if i in candidates:
                    return i, []
        self._tick += 1
        if self.policy == "least-loaded":
            return min(candidates, key=self._load), []
        hashes = self.prefix_hashes(prompt_ids, cache_salt)
        # Without a match (or when the match is overloaded): the least loaded, and among equals
        # the one whose cache is emptiest, so new prefixes spread over the replicas.
        least = min(candidates, key=self._room)
        best, best_match = least, 0
        for i in candidates:
            match = self.replicas[i].matched_blocks(hashes)
            if match > best_match or (
                match == best_match and match and self._room(i) < self._room(best)
            ):
                best, best_match = i, match
        if (
            best_match
            and self.replicas[best].in_flight - self.replicas[least].in_flight >= self.max_imbalance
        ):
            best = least  # overloaded: its cache is not worth the queue
        return best, hashes

    def started(self, index: int, hashes: list[BlockHash]) -> None:
        """Records a request sent to replica ``index`` (its prompt blocks will be cached there)."""
        replica = self.replicas[index]
        replica.in_flight += 1
        if hashes:
            replica.remember(hashes)

    def finished(self, index: int) -> None:
        """Records the end (any outcome) of a request sent to ``index``."""
        replica = self.replicas[index]
        replica.in_flight = max(0, replica.in_flight - 1)

    def update(
        self,
        index: int,
        *,
        up: bool,
        num_waiting: int = 0,
        kv_cache_usage: float = 0.0,
        capacity_blocks: int | None = None,
        restarted: bool = False,
    ) -> None:
        """Folds in a health poll of replica ``index``. A replica that restarted lost its KV
        cache, so its prefix index is emptied (one that is only down keeps it: it may come back
        as it was, and a restart is seen when it answers again)."""
        replica = self.replicas[index]
        if restarted:
            replica.prefix_index.clear()
        replica.up = up
        if up:
            replica.num_waiting = num_waiting
            replica.kv_cache_usage = kv_cache_usage
            if capacity_blocks is not None:
                replica.capacity_blocks = max(1, capacity_blocks)

    def _rotation(self, index: int) -> int:
        """Last tie-break: rotates with each choice, so equals take turns."""
        return (index - self._tick) % len(self.replicas)

    def _load(self, index: int) -> tuple[int, float, int, int]:
        r = self.replicas[index]
        return (r.in_flight, r.kv_cache_usage, r.num_waiting, self._rotation(index))

    def _room(self, index: int) -> tuple[int, float, int]:
        r = self.replicas[index]
        return (r.in_flight, len(r.prefix_index) / r.capacity_blocks, self._rotation(index))
