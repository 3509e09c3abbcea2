"""A model-free engine with LLMEngine's interface (``jaxserve.engine.protocol.EngineCore``; the
conformance test ``tests/engine/test_engine_protocol.py`` keeps the two in step), for fast
server-logic tests.

It uses the bundled model's real tokenizer and the real incremental detokenizer (so streamed
deltas, stop strings and held-back text behave as in the engine), but "generates" a fixed
script of tokens instead of running a model: sample ``k`` of a request emits
``SCRIPT[(start + k + step) % len(SCRIPT)]``. It keeps a KV-block ledger (blocks per sample =
ceil(tokens / block_size)) so leak tests can check that aborted requests free their blocks, a
running cap (``max_num_seqs``) so requests wait, and can be told to raise in ``step()`` to
test engine death. Built with ``convert="embed"`` (a pooling runner) its prompt-only requests
finish with a stand-in pooled vector (``RequestOutput.pooled``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxserve.config import EngineArgs
from jaxserve.engine.llm_engine import EngineStats
from jaxserve.request_output import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tokenizer.detokenizer import IncrementalDetokenizer
from jaxserve.tokenizer.loading import load_served_tokenizer

FAKE_HIDDEN_SIZE = 16
"""The length of the stand-in pooled vectors of a pooling FakeEngine (``convert="embed"``)."""

SCRIPT_TEXT = " The quick brown fox jumps over the lazy dog. Café naïve 🙂 déjà vu, said the cat."


@dataclasses.dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None


@dataclasses.dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    running: bool = False
    prefilled: bool = False
    start: int = 0


class FakeEngine:
    """``EngineCore`` over a scripted "model" (see the module docstring); its ledgers are
    stand-ins (a finished request's id and token count).

    Args:
      model_dir: a model directory with a tokenizer (the bundled checkpoint).
      max_model_len: longest prompt + output.
      num_blocks, block_size: the fake KV pool.
      max_num_seqs: samples running at once; the rest wait.
      step_s: seconds each step sleeps (stands in for compute).
      fail_at_step: ``step()`` raises RuntimeError on this step number (1-based), or never.
      hang_at_step: ``step()`` blocks on this step number until ``release_hang`` is set (a
        device that never returns), or never.
      hang_at_add: ``add_request()`` blocks on this call number (1-based) until
        ``release_hang`` is set (host-side work that never returns, as #38 F1's bad-words
        masks did), or never.
      engine_args: further ``EngineArgs`` fields (``enable_sleep_mode``, serving flags).

    Attributes:
      num_steps: steps run so far (tests check the idle engine does not spin).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        max_model_len: int = 256,
        num_blocks: int = 64,
        block_size: int = 16,
        max_num_seqs: int = 8,
        step_s: float = 0.002,
        fail_at_step: int | None = None,
        hang_at_step: int | None = None,
        hang_at_add: int | None = None,
        served_model_name: str = "fake-model",
        max_waiting_requests: int = 0,
        max_num_batched_tokens: int = 8192,
        enable_chunked_prefill: bool = True,
        **engine_args: Any,
    ) -> None:
        config = EngineArgs(
            model=model_dir,
            served_model_name=served_model_name,
            max_model_len=max_model_len,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_waiting_requests=max_waiting_requests,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            **engine_args,
        ).create_engine_config(max_model_len)
        self.engine_config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, num_gpu_blocks=num_blocks)
        )
        self.tokenizer = load_served_tokenizer(  # --tokenizer, --chat-template as the engine
            model_dir, config.model.tokenizer, config.serving.chat_template
        )
        self.vocab_size = self.tokenizer.vocab_size
        self.script = self.tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.fail_at_step = fail_at_step
        self.hang_at_step = hang_at_step
        self.hang_at_add = hang_at_add
        self.num_adds = 0
        self.release_hang = threading.Event()
        self.num_steps = 0
        self.asleep: set[str] = set()  # sleep mode: what is "off the device"
        self.sleep_levels: list[int] = []  # every level it was put to sleep at
        self._reqs: dict[str, _Req] = {}
        self._ledgers: dict[str, dict[str, Any]] = {}  # finished requests (any thread reads)
        self._ledger_lock = threading.Lock()
        self._owner: threading.Thread | None = None
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    # EngineCore ----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self._check_thread()
        self.num_adds += 1
        if self.num_adds == self.hang_at_add:
            self.release_hang.wait()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError(
                "prompt_token_ids: the prompt is empty; at least one token is required"
            )
        if request_id in self._reqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if len(ids) > self.engine_config.scheduler.max_model_len:
            raise ValueError(
                f"prompt_token_ids: the prompt has {len(ids)} tokens, more than max_model_len"
            )
        samples = [
            _Sample(
                k,
                IncrementalDetokenizer(
                    self.tokenizer,
                    ids,
                    params.skip_special_tokens,
                    params.stop,
                    params.include_stop_str_in_output,
                ),
            )
            for k in range(params.n)
        ]
        self._reqs[request_id] = _Req(
            request_id,
            ids,
            params,
            samples,
            RequestMetrics(arrival_time=arrival_time or time.monotonic()),
            start=sum(ids) % len(self.script),
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        self._check_thread()
        for rid in (request_ids,) if isinstance(request_ids, str) else request_ids:
            self._reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        assert not self.asleep, "a step while asleep"
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.num_steps}")
        if self.num_steps == self.hang_at_step:
            self.release_hang.wait()
        time.sleep(self.step_s)
        now = time.monotonic()
        running = sum(1 for r in self._reqs.values() if r.running)
        for req in self._reqs.values():
            if not req.running and running < self.max_num_seqs:
                req.running = True
                running += 1
                req.metrics.first_scheduled_time = now
                req.metrics.time_in_queue = now - req.metrics.arrival_time
        outputs = []
        for req in list(self._reqs.values()):
            if not req.running:
                continue
            outputs.append(self._advance(req, now))
            if outputs[-1].finished:
                del self._reqs[req.request_id]
                with self._ledger_lock:
                    self._ledgers[req.request_id] = {
                        "request_id": req.request_id,
                        "output_tokens": sum(len(s.token_ids) for s in req.samples),
                    }
        return outputs

    def get_ledger(self, request_id: str) -> dict[str, Any] | None:
        """A stand-in ledger of a finished request (its id and output tokens; the scripted steps
        schedule nothing), by engine request id or response id (``{id}-0``, ``-1``, ...)."""
        with self._ledger_lock:
            if request_id in self._ledgers:
                return dict(self._ledgers[request_id])
            parts = []
            while (part := self._ledgers.get(f"{request_id}-{len(parts)}")) is not None:
                parts.append(dict(part))
        return {"request_id": request_id, "requests": parts} if parts else None

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int = 1) -> None:
        self._check_thread()
        if not self.engine_config.model.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with --enable-sleep-mode")
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self._reqs:
            raise ValueError(f"sleep: {len(self._reqs)} requests are unfinished")
        self.asleep = {"weights", "kv_cache"}
        self.sleep_levels.append(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self._check_thread()
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        if wanted - {"weights", "kv_cache"}:
            raise ValueError(f"tags: unknown {sorted(wanted - {'weights', 'kv_cache'})}")
        self.asleep -= wanted
        return not self.asleep

    def close(self) -> None:
        pass

    def get_stats(self) -> EngineStats:
        running = [r for r in self._reqs.values() if r.running]
        used = sum(
            math.ceil((len(r.prompt_ids) + len(s.token_ids)) / self.block_size)
            for r in running
            for s in r.samples
            if s.finish_reason is None
        )
        return EngineStats(
            num_running_reqs=sum(len(r.samples) for r in running),
            num_waiting_reqs=sum(len(r.samples) for r in self._reqs.values() if not r.running),
            kv_cache_usage=min(1.0, used / (self.num_blocks - 1)),
            num_prompt_tokens_total=self._prompt_tokens_total,
            num_generation_tokens_total=self._generation_tokens_total,
            num_steps_total=self.num_steps,
        )

    # scripted generation ----------------------------------------------------------------------

    def _check_thread(self) -> None:
        # Like the real engine, this object is not thread-safe: only one thread may drive it.
        current = threading.current_thread()
        if self._owner is None:
            self._owner = current
        assert self._owner is current, "FakeEngine used from two threads"

    def _logprob_dict(self, token: int, k: int) -> dict[int, Logprob]:
        d = {token: Logprob(-0.5, 1, self.tokenizer.decode([token], skip_special_tokens=False))}
        for j in range(k):
            alt = (token + 1 + j) % self.tokenizer.vocab_size
            d.setdefault(
                alt,
                Logprob(-1.0 - j, 2 + j, self.tokenizer.decode([alt], skip_special_tokens=False)),
            )
        return d

    def _advance(self, req: _Req, now: float) -> RequestOutput:
        params = req.params
        if not req.prefilled:
            req.prefilled = True
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None] + [
                    self._logprob_dict(t, params.prompt_logprobs) for t in req.prompt_ids[1:]
                ]
        completions = []
        for sample in req.samples:
            delta_ids: list[int] = []
            delta_lps: list | None = [] if params.logprobs is not None else None
            delta_text = ""
            if sample.finish_reason is None:
                max_tokens = params.max_tokens
                if max_tokens is None:
                    max_tokens = self.engine_config.scheduler.max_model_len - len(req.prompt_ids)
                if len(sample.token_ids) >= max_tokens:
                    delta_text, _ = sample.detok.update([], finished=True)
                    sample.finish_reason = "length"
                else:
                    token = self.script[
                        (req.start + sample.index + len(sample.token_ids)) % len(self.script)
                    ]
                    delta_ids = [token]
                    sample.token_ids.append(token)
                    if delta_lps is not None:
                        delta_lps.append(self._logprob_dict(token, params.logprobs))
                        sample.logprobs = (sample.logprobs or []) + delta_lps
                    stop_token = (
                        token in params.stop_token_ids and len(sample.token_ids) > params.min_tokens
                    )
                    length = len(sample.token_ids) >= max_tokens
                    delta_text, stop_str = sample.detok.update(
                        [] if stop_token else [token], finished=stop_token or length
                    )
                    if stop_str is not None:
                        sample.finish_reason, sample.stop_reason = "stop", stop_str
                    elif stop_token:
                        sample.finish_reason, sample.stop_reason = "stop", token
                    elif length:
                        sample.finish_reason = "length"
                    if req.metrics.first_token_time is None:
                        req.metrics.first_token_time = now
                    req.metrics.last_token_time = now
                    req.metrics.num_generation_tokens += 1
                sample.text += delta_text
            delta = params.output_kind == RequestOutputKind.DELTA  # only what is new
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=delta_text if delta else sample.text,
                    token_ids=delta_ids if delta else list(sample.token_ids),
                    logprobs=delta_lps
                    if delta
                    else list(sample.logprobs)
                    if sample.logprobs is not None
                    else None,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                    delta_logprobs=delta_lps,
                )
            )
        finished = all(s.finish_reason is not None for s in req.samples)
        new_tokens = sum(len(c.delta_token_ids) for c in completions)
        self._generation_tokens_total += new_tokens
        if req.metrics.num_generation_tokens == new_tokens and (new_tokens or finished):
            self._prompt_tokens_total += len(
                req.prompt_ids
            )  # first tokens (or a prompt-only finish)
        pooled = None
        if finished:
            req.metrics.finished_time = now
            if self.engine_config.model.runner == "pooling":  # --convert embed / --runner pooling
                pooled = self._pool(req.prompt_ids)
        return RequestOutput(
            request_id=req.request_id,
            prompt=None,
            prompt_token_ids=list(req.prompt_ids),
            prompt_logprobs=req.prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=0,
            metrics=dataclasses.replace(req.metrics),
            pooled=pooled,
        )

    def _pool(self, prompt_ids: list[int]) -> np.ndarray:
        """A stand-in pooled vector of ``FAKE_HIDDEN_SIZE`` floats, a function of the prompt."""
        rng = np.random.default_rng([len(prompt_ids), *prompt_ids[-8:]])
        return rng.standard_normal(FAKE_HIDDEN_SIZE).astype(np.float32)
