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
        block_size=block_size, enable_prefix_caching=prefix_caching, watermark=watermark
    )
    return Scheduler(sched_cfg, cache_cfg, num_gpu_blocks=num_blocks)


def fake_token(req_id: str, position: int, tokens: list[int] | None = None) -> int:
    """Deterministic "model": the token at ``position`` depends only on the request and the position."""
    digest = hashlib.blake2b(f"{req_id}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (VOCAB - 1)  # never EOS


class FakeRunner:
    """Plays the model runner against a SchedulerOutput, mirroring its persistent batch.

    It keeps per request its token list and block table the way the real runner must (adds
    rows from NewRequestData, appends CachedRequestData.new_block_ids, drops finished and
    preempted rows), checks the scheduler's bookkeeping against it, and samples
    ``token_fn(req_id, position)`` for each request that reached the end of its tokens.
    """

    def __init__(
        self, scheduler: Scheduler, token_fn=None, eos_at: dict[str, int] | None = None
    ) -> None:
        self.scheduler = scheduler
        self.token_fn = token_fn or (lambda req_id, pos: fake_token(req_id.split("#")[0], pos))
        self.eos_at = eos_at or {}
        self.rows: dict[str, dict] = {}
        self.finish_reasons: dict[str, str] = {}
        # Simulated device cache content: slot -> (token id, position), to check block tables.
        self.slots: dict[int, tuple[int, int]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.scheduler.block_size
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows, new.req_id
            self.rows[new.req_id] = {
                "tokens": list(new.prompt_token_ids) + list(new.output_token_ids),
                "blocks": list(new.block_ids),
                "computed": new.num_computed_tokens,
            }
        cached = out.scheduled_cached_reqs
        for k, req_id in enumerate(cached.req_ids):
            row = self.rows[req_id]
            row["blocks"].extend(cached.new_block_ids[k])
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
        for req_id in req_ids:
            row = self.rows[req_id]
            n = out.num_scheduled_tokens[req_id]
            start = row["computed"]
            assert start + n <= len(row["tokens"])
            for pos in range(start, start + n):  # "write" K/V through the slot mapping
                slot = row["blocks"][pos // bs] * bs + pos % bs
                assert row["blocks"][pos // bs] != 0, "null block written"
                self.slots[slot] = (row["tokens"][pos], pos)
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
            for pos in range(new.num_computed_tokens):
                slot = new.block_ids[pos // bs] * bs + pos % bs
                assert self.slots.get(slot) == (tokens[pos], pos), (new.req_id, pos)
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
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
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
