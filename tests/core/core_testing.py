"""Helpers for the scheduler and KV-cache tests: request factory and a fake model runner (no jax)."""

from __future__ import annotations

import hashlib

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.request import Request
from jaxserve.core.runner_output import ModelRunnerOutput
from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999


def make_request(
    req_id: str,
    prompt: list[int],
    *,
    max_tokens: int | None = 16,
    ignore_eos: bool = True,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    eos_token_id: int | None = EOS,
    **params,
) -> Request:
    """A request with SamplingParams(max_tokens, ignore_eos, **params)."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **params)
    return Request(
        req_id,
        prompt,
        sp,
        eos_token_id=eos_token_id,
        arrival_time=arrival_time if arrival_time is not None else 0.0,
        priority=priority,
        cache_salt=cache_salt,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    budget: int = 8192,
    max_num_seqs: int = 256,
    threshold: int = 0,
    chunked: bool = True,
    policy: str = "fcfs",
    max_model_len: int = 2048,
    prefix_caching: bool = True,
    watermark: float = 0.0,
    kv_cache_groups: tuple[int | None, ...] = (),
) -> Scheduler:
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=chunked,
        policy=policy,
        max_model_len=max_model_len,
    )
    cache_cfg = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        watermark=watermark,
        kv_cache_groups=kv_cache_groups,
    )
    return Scheduler(sched_cfg, cache_cfg, num_gpu_blocks=num_blocks)


def fake_token(req_id: str, position: int, tokens: list[int] | None = None) -> int:
    """Deterministic "model": the token at ``position`` depends only on the request and the position."""
    digest = hashlib.blake2b(f"{req_id}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (VOCAB - 1)  # never EOS


class FakeRunner:
    """Plays the model runner against a SchedulerOutput, mirroring its persistent batch.

    It keeps per request its token list and block tables (one per KV-cache group) the way the
    real runner must (adds rows from NewRequestData, appends CachedRequestData.new_block_ids,
    drops finished and preempted rows), checks the scheduler's bookkeeping against it, and
    samples ``token_fn(req_id, position)`` for each request that reached the end of its tokens.

    With sliding-window groups it also checks what attention would read there: after the step's
    writes, every key a scheduled token sees in its window sits, through the runner's own
    append-only tables, in a slot that holds exactly that token at that position (a
    full-attention group's tables only grow: its hits are checked at admission, as without
    groups).
    """

    def __init__(
        self, scheduler: Scheduler, token_fn=None, eos_at: dict[str, int] | None = None
    ) -> None:
        self.scheduler = scheduler
        self.token_fn = token_fn or (lambda req_id, pos: fake_token(req_id.split("#")[0], pos))
        self.eos_at = eos_at or {}
        self.rows: dict[str, dict] = {}
        self.finish_reasons: dict[str, str] = {}
        # Simulated device cache content: (group, slot) -> (token id, position).
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.windows = scheduler.kv_cache_manager.sliding_windows
        self.check_reads = any(w is not None for w in self.windows)

    def _check_reads(self, req_id: str, start: int, end: int) -> None:
        """Every key that tokens ``[start, end)`` of the request read, in every sliding group."""
        bs = self.scheduler.block_size
        row = self.rows[req_id]
        tokens = row["tokens"]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table = row["blocks"][g]
            lo = max(0, start - window + 1)
            for pos in range(lo, end):
                block = table[pos // bs]
                assert block != 0, (req_id, g, pos, "a key in the window sits in the null block")
                got = self.slots.get((g, block * bs + pos % bs))
                assert got == (tokens[pos], pos), (req_id, g, pos, got)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.scheduler.block_size
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows, new.req_id
            assert len(new.block_ids) == len(self.windows), new.block_ids
            assert len({len(t) for t in new.block_ids}) == 1, new.block_ids
            self.rows[new.req_id] = {
                "tokens": list(new.prompt_token_ids) + list(new.output_token_ids),
                "blocks": [list(t) for t in new.block_ids],
                "computed": new.num_computed_tokens,
            }
        cached = out.scheduled_cached_reqs
        for k, req_id in enumerate(cached.req_ids):
            row = self.rows[req_id]
            if cached.new_block_ids[k] is not None:
                assert len(cached.new_block_ids[k]) == len(self.windows)
                for table, ids in zip(row["blocks"], cached.new_block_ids[k]):
                    table.extend(ids)
            assert cached.num_computed_tokens[k] == row["computed"], req_id
            n = out.num_scheduled_tokens[req_id]
            start = row["computed"]
            if out.steady_decode:  # no ids sent: the runner knows them; the ledger must agree
                assert not cached.new_token_ids and n == 1, req_id
                request = self.scheduler.requests[req_id]
                assert request.all_token_ids[start : start + 1] == row["tokens"][start : start + 1]
            else:
                assert cached.new_token_ids[k] == row["tokens"][start : start + n], req_id
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        spans = {}
        for req_id in req_ids:
            row = self.rows[req_id]
            n = out.num_scheduled_tokens[req_id]
            start = row["computed"]
            assert start + n <= len(row["tokens"])
            for pos in range(start, start + n):  # "write" K/V through the slot mapping
                for g, table in enumerate(row["blocks"]):
                    assert table[pos // bs] != 0, "null block written"
                    self.slots[(g, table[pos // bs] * bs + pos % bs)] = (row["tokens"][pos], pos)
            spans[req_id] = (start, start + n)
        if self.check_reads:  # after every write of the step, as the kernels read
            for req_id, (start, end) in spans.items():
                self._check_reads(req_id, start, end)
        for req_id in req_ids:
            row = self.rows[req_id]
            start = row["computed"]
            n = out.num_scheduled_tokens[req_id]
            row["computed"] = start + n
            if row["computed"] == len(row["tokens"]):
                pos = len(row["tokens"])
                token = EOS if self.eos_at.get(req_id) == pos else self.token_fn(req_id, pos)
                row["tokens"].append(token)
                sampled.append([token])
            else:
                sampled.append([])
        # Prefix-cache hits must hold exactly this request's tokens (checked after this step's
        # writes: a block cached by a request earlier in the same step is written by this step).
        for new in out.scheduled_new_reqs:
            tokens = self.rows[new.req_id]["tokens"]
            for g, window in enumerate(self.windows):
                if window is not None:
                    continue  # a window's hit blocks are checked by _check_reads
                for pos in range(new.num_computed_tokens):
                    slot = new.block_ids[g][pos // bs] * bs + pos % bs
                    assert self.slots.get((g, slot)) == (tokens[pos], pos), (new.req_id, g, pos)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            sampled_flat=[t[0] for t in sampled] if all(len(t) == 1 for t in sampled) else None,
        )


def check_scheduler_invariants(s: Scheduler, out: SchedulerOutput) -> None:
    """Budget, max_num_seqs, chunk threshold, and ref counts == owners."""
    cfg = s.scheduler_config
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(s.running) <= cfg.max_num_seqs
    assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
    assert all(n >= 1 for n in out.num_scheduled_tokens.values())
    if cfg.enable_chunked_prefill and cfg.long_prefill_token_threshold > 0:
        assert max(out.num_scheduled_tokens.values(), default=0) <= cfg.long_prefill_token_threshold
    kv = s.kv_cache_manager
    owners: dict[int, int] = {}
    for tables in kv.req_to_blocks.values():
        assert len(tables) == kv.num_groups and len({len(t) for t in tables}) == 1
        for blocks in tables:
            for b in blocks:
                if not b.is_null:
                    owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for block in kv.block_pool.blocks[1:]:
        assert block.ref_cnt == owners.get(block.block_id, 0), block
    assert set(kv.req_to_blocks) == {r.request_id for r in s.running}
    used = sum(1 for b in kv.block_pool.blocks[1:] if b.ref_cnt > 0)
    assert used + kv.num_free_blocks == kv.num_gpu_blocks - 1


def run_until_done(
    s: Scheduler, runner: FakeRunner, max_steps: int = 10_000, on_step=None
) -> dict[str, list[int]]:
    """Steps until no request is unfinished; returns req_id -> output tokens (finished ones)."""
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        check_scheduler_invariants(s, out)
        if on_step is not None:
            on_step(out)
        result = runner.execute(out)
        for o in s.update_from_output(out, result):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                finish[o.req_id] = o.finish_reason
    else:
        raise AssertionError(f"not done after {max_steps} steps: {s.get_request_counts()}")
    runner.finish_reasons = finish
    return outputs


def expected_tokens(req_id: str, prompt_len: int, n: int) -> list[int]:
    """The FakeRunner's first ``n`` output tokens for a request with a ``prompt_len`` prompt."""
    return [fake_token(req_id, prompt_len + j) for j in range(n)]


def step(s: Scheduler, runner: FakeRunner):
    """One checked step: schedule, invariants, fake runner, update; returns (SchedulerOutput,
    EngineCoreOutputs)."""
    out = s.schedule()
    check_scheduler_invariants(s, out)
    return out, s.update_from_output(out, runner.execute(out))


def run_random_workload(
    s: Scheduler,
    rng,
    *,
    num_requests: int = 40,
    max_prompt: int = 100,
    max_len: int = 160,
    abort_rate: float = 0.03,
) -> None:
    """Random arrivals (prompts of 1..``max_prompt`` tokens from a few shared bases, outputs up
    to ``max_len`` in all, random priorities) and aborts, stepped through ``s`` and a
    FakeRunner until drained, checking the invariants each step; then every request's tokens
    are the fake model's (an aborted one's a prefix of them) and no block is held."""
    runner = FakeRunner(s)
    bases = [[rng.randrange(900) for _ in range(64)] for _ in range(3)]
    want, outs, aborted, arrivals = {}, {}, set(), 0
    for step in range(3000):
        if arrivals < num_requests and rng.random() < 0.3:
            p = rng.randint(1, max_prompt)
            m = rng.randint(0, max_len - 1 - p) if rng.random() < 0.9 else rng.randint(1, 3)
            prompt = (rng.choice(bases) + [rng.randrange(900) for _ in range(max_prompt)])[:p]
            req_id = f"q{arrivals}"
            try:
                s.add_request(
                    make_request(
                        req_id,
                        prompt,
                        max_tokens=m,
                        priority=rng.randint(0, 3),
                        arrival_time=float(step),
                    )
                )
                want[req_id] = expected_tokens(req_id, p, m)
            except ValueError as e:
                assert not s.enable_chunked_prefill and p > s.max_num_scheduled_tokens, e
            arrivals += 1
        if s.requests and rng.random() < abort_rate:
            victim = rng.choice(sorted(s.requests))
            s.abort_requests(victim)
            aborted.add(victim)
        if not s.has_unfinished_requests() and arrivals >= num_requests:
            break
        out = s.schedule()
        check_scheduler_invariants(s, out)
        for o in s.update_from_output(out, runner.execute(out)):
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
    else:
        raise AssertionError("workload did not drain")
    for req_id, tokens in want.items():
        if req_id in aborted:
            assert tokens[: len(outs.get(req_id, []))] == outs.get(req_id, [])
        else:
            assert outs.get(req_id, []) == tokens, req_id
    kv = s.kv_cache_manager
    assert kv.usage == 0.0 and kv.req_to_blocks == {} and len(s.waiting) == 0 and s.running == []
