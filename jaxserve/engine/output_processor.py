"""Engine-side request state: scheduler news -> detokenized, joined ``RequestOutput``s.

For each parent request (the id the user gave) the processor keeps one ``_SampleState`` per
sample (the ``n`` child requests the engine fanned out to the scheduler) with its incremental
detokenizer (stop strings), its tokens, logprobs and finish. Each step it turns the scheduler's
``EngineCoreOutput``s into one ``RequestOutput`` per parent that progressed (cumulative fields
plus this step's deltas), and reports the children whose text hit a stop string so the engine
can finish them in the scheduler (vLLM V1's ``OutputProcessor``).

Detokenizer contract: a sample that ended on EOS or a stop token id (finish_reason "stop" from
the scheduler) passes every token but that last one to the detokenizer, so its text never
shows up (vLLM V1's behaviour); the token id stays in ``token_ids``. A sample its grammar ended
("stop" on the token that completed it) keeps that token's text.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from jaxserve.core.engine_core_output import DecodeTokens, EngineCoreOutput
from jaxserve.core.request import FinishReason
from jaxserve.request_output import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from jaxserve.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from jaxserve.core.request import Request
    from jaxserve.core.runner_output import TokenLogprobs
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass
class _SampleState:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None


@dataclasses.dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_SampleState]
    final_only: bool
    arrival_time: float
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0
    prompt_counted: bool = False
    last_token_time: float | None = None
    # final_only, one sample, no detokenizer, no logprobs: a step that does not finish it only
    # records its tokens (process_outputs' lean path)
    lean: bool = False


def _stopped_on_token(sample: _SampleState, co: EngineCoreOutput) -> bool:
    """True when the step's last token is a stop token (EOS / stop_token_ids) that ended the
    sample: its text is left out. A grammar that completes ends a sample with "stop" on an
    ordinary token, which stays."""
    ids = co.new_token_ids
    return (
        co.finish_reason == FinishReason.STOP.value
        and bool(ids)
        and ids[-1] in sample.request.stop_token_set
    )


class OutputProcessor:
    """Per-request output state of an engine.

    Args:
      tokenizer: the model's tokenizer, or None (then texts stay empty and logprobs carry no
        decoded tokens).
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._child_to_parent: dict[str, tuple[_ParentState, _SampleState]] = {}
        self.num_prompt_tokens_step = 0
        self.num_generation_tokens_step = 0
        self._anchor: tuple[list[int], str] | None = None  # see _decode_token_uncached
        self._decode_token = functools.lru_cache(maxsize=65536)(self._decode_token_uncached)
        # Bumped whenever a child id is forgotten (finished, aborted): the DecodeTokens cache
        # below is valid only while it is unchanged.
        self._child_epoch = 0
        # (DecodeTokens.req_ids list, _child_epoch, its samples' token_ids.append or None when
        # some parent is not lean): a steady-decode run's per-step work is one loop of appends.
        self._decode_cache: tuple[list[str], int, list | None] | None = None

    def __len__(self) -> int:
        return len(self._parents)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def is_id_in_use(self, request_id: str) -> bool:
        """True when the id is a live parent or child id."""
        return request_id in self._parents or request_id in self._child_to_parent

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        children: list[Request],
        *,
        final_only: bool,
        arrival_time: float,
    ) -> None:
        """Registers a parent and its child requests (already accepted by the scheduler)."""
        samples = []
        for k, child in enumerate(children):
            p = child.sampling_params
            detok = None
            # final_only without stop strings: nobody reads the text before the end, so it is
            # decoded once when the sample finishes (same text, see _finish_text).
            if self.tokenizer is not None and (p.stop or not final_only):
                detok = self._new_detokenizer(prompt_token_ids, p)
            sample = _SampleState(
                index=k,
                request=child,
                detokenizer=detok,
                logprobs=[] if p.logprobs is not None else None,
                cumulative_logprob=0.0 if p.logprobs is not None else None,
            )
            samples.append(sample)
        parent = _ParentState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            samples=samples,
            final_only=final_only,
            arrival_time=arrival_time,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        parent.lean = (
            final_only
            and len(samples) == 1
            and samples[0].detokenizer is None
            and samples[0].logprobs is None
            and parent.prompt_logprobs is None
        )
        self._parents[request_id] = parent
        for child, sample in zip(children, samples):
            self._child_to_parent[child.request_id] = (parent, sample)

    def _new_detokenizer(
        self, prompt_token_ids: list[int], p: SamplingParams
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            p.skip_special_tokens,
            p.stop,
            p.include_stop_str_in_output,
        )

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets a parent; returns its child ids still unfinished (to abort in the
        scheduler). Unknown ids give []."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        ids = []
        self._child_epoch += 1
        for s in parent.samples:
            self._child_to_parent.pop(s.request.request_id, None)
            if s.finish_reason is None:
                ids.append(s.request.request_id)
        return ids

    def _decode_token_uncached(self, token_id: int) -> str | None:
        """The text one token adds after other text (logprobs' ``decoded_token``).

        Decoding a token alone drops sentencepiece's word-boundary space ("▁has" -> "has"), so
        the logprob tokens of a completion would not join into its text. The token is decoded
        after an anchor token instead and the anchor's own text is cut off (" has").
        """
        if not self.tokenizer:
            return None
        if self._anchor is None:
            ids = self.tokenizer.encode("a", add_special_tokens=False)[-1:]
            self._anchor = (ids, self.tokenizer.decode(ids, skip_special_tokens=False))
        anchor_ids, anchor_text = self._anchor
        text = self.tokenizer.decode(anchor_ids + [token_id], skip_special_tokens=False)
        if anchor_ids and text.startswith(anchor_text):
            return text[len(anchor_text) :]
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _to_logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        """Chosen token first (with its rank), then the top-k alternatives (ranks 1..k)."""
        out = {
            entry.token_ids[0]: Logprob(
                entry.logprobs[0], entry.rank, self._decode_token(entry.token_ids[0])
            )
        }
        for j, (tid, lp) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:])):
            if tid not in out:
                out[tid] = Logprob(lp, j + 1, self._decode_token(tid))
        return out

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput] | DecodeTokens, now: float
    ) -> tuple[list[RequestOutput], list[str]]:
        """Applies one step's scheduler news (``Scheduler.update_from_output``'s result).

        A ``DecodeTokens`` whose requests are all lean (``final_only``, one sample, no text
        until the end, no logprobs) only appends each token to its sample: their
        ``last_token_time`` is then that of the output that finishes them.

        Returns:
          ``(request_outputs, stop_string_child_ids)``: one RequestOutput per parent that
          progressed (for ``final_only`` parents only once, when finished), and the child ids
          whose text matched a stop string this step (the engine finishes them in the scheduler).
        """
        if isinstance(core_outputs, DecodeTokens):
            appends = self._decode_appends(core_outputs)
            if appends is not None:
                for append, token in zip(appends, core_outputs.token_ids):
                    append(token)
                self.num_prompt_tokens_step = 0
                self.num_generation_tokens_step = len(appends)
                return [], []
            core_outputs = self._expand(core_outputs)
        touched: dict[str, _ParentState] = {}
        stopped: list[str] = []
        n_prompt = n_gen = 0
        get = self._child_to_parent.get
        for co in core_outputs:
            entry = get(co.req_id)
            if entry is None:
                continue  # aborted parent
            parent, sample = entry
            if parent.lean and parent.prompt_counted and co.finish_reason is None:
                new_ids = co.new_token_ids  # nobody reads deltas before its final output
                if new_ids:
                    sample.token_ids += new_ids
                    parent.last_token_time = now
                    n_gen += len(new_ids)
                parent.num_cached_tokens = co.num_cached_tokens
                continue
            if parent.request_id not in touched:
                touched[parent.request_id] = parent
                for s in parent.samples:
                    s.delta_text, s.delta_token_ids, s.delta_logprobs = "", [], None
            new_ids = co.new_token_ids
            finished = co.finish_reason is not None
            if sample.index == 0:
                parent.num_cached_tokens = co.num_cached_tokens
                if co.new_prompt_logprobs and parent.prompt_logprobs is not None:
                    parent.prompt_logprobs.extend(
                        self._to_logprob_dict(e) for e in co.new_prompt_logprobs
                    )
            if not parent.prompt_counted and (new_ids or finished):
                parent.prompt_counted = True  # counted once per parent, when its prompt is done
                n_prompt += len(parent.prompt_token_ids)
            if new_ids:
                parent.last_token_time = now
            n_gen += len(new_ids)
            sample.token_ids.extend(new_ids)
            sample.delta_token_ids = list(new_ids)
            if co.new_logprobs and sample.logprobs is not None:
                self._add_logprobs(sample, co.new_logprobs)
            if sample.detokenizer is not None and self._update_text(sample, co) and not finished:
                stopped.append(co.req_id)  # a stop string; the engine finishes it in the scheduler
                finished = True
            if finished:
                self._finish_sample(parent, sample, co)
        self.num_prompt_tokens_step, self.num_generation_tokens_step = n_prompt, n_gen
        return self._collect_outputs(touched, now), stopped

    def _decode_appends(self, news: DecodeTokens) -> list | None:
        """Each request's ``sample.token_ids.append`` when every parent in ``news`` is lean and
        counted its prompt (cached per steady run: keyed on the req_ids list's identity)."""
        cache = self._decode_cache
        if cache is not None and cache[0] is news.req_ids and cache[1] == self._child_epoch:
            return cache[2]
        appends: list | None = []
        get = self._child_to_parent.get
        for req_id in news.req_ids:
            entry = get(req_id)
            if entry is None or not (entry[0].lean and entry[0].prompt_counted):
                appends = None
                break
            appends.append(entry[1].token_ids.append)
        self._decode_cache = (news.req_ids, self._child_epoch, appends)
        return appends

    def _expand(self, news: DecodeTokens) -> list[EngineCoreOutput]:
        """DecodeTokens as the EngineCoreOutputs the general path takes (num_cached_tokens
        as each parent already recorded it)."""
        get = self._child_to_parent.get
        outs = []
        for req_id, token in zip(news.req_ids, news.token_ids):
            entry = get(req_id)
            cached = 0 if entry is None else entry[0].num_cached_tokens
            outs.append(EngineCoreOutput(req_id, [token], num_cached_tokens=cached))
        return outs

    def _add_logprobs(self, sample: _SampleState, new_logprobs: list[TokenLogprobs]) -> None:
        """Appends the step's sampled-token logprobs to the sample (and its delta)."""
        delta = [self._to_logprob_dict(e) for e in new_logprobs]
        sample.logprobs.extend(delta)
        sample.delta_logprobs = delta
        sample.cumulative_logprob += sum(e.logprobs[0] for e in new_logprobs)

    @staticmethod
    def _update_text(sample: _SampleState, co: EngineCoreOutput) -> bool:
        """Detokenizes the step's tokens (a stop token's own text is left out); True when a stop
        string matched (the sample then finishes with "stop" and the string as stop_reason)."""
        new_ids = co.new_token_ids
        stopped_on_token = _stopped_on_token(sample, co)
        text_ids = new_ids[:-1] if stopped_on_token else new_ids
        delta_text, stop_str = sample.detokenizer.update(
            text_ids, finished=co.finish_reason is not None
        )
        sample.text += delta_text
        sample.delta_text = delta_text
        if stop_str is None:
            return False
        sample.finish_reason, sample.stop_reason = FinishReason.STOP.value, stop_str
        return True

    def _finish_sample(
        self, parent: _ParentState, sample: _SampleState, co: EngineCoreOutput
    ) -> None:
        """Records a finished sample: its finish reason (unless a stop string set it), its whole
        text when it was not streamed, and one more finished sample for its parent."""
        if sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = co.finish_reason, co.stop_reason
        if sample.detokenizer is None and self.tokenizer is not None:
            self._finish_text(parent, sample, _stopped_on_token(sample, co))
        parent.num_finished += 1
        self._child_to_parent.pop(co.req_id, None)
        self._child_epoch += 1

    def _collect_outputs(self, touched: dict[str, _ParentState], now: float) -> list[RequestOutput]:
        """One RequestOutput per parent that progressed (``final_only`` ones once, when done);
        finished parents are forgotten."""
        outputs = []
        for parent in touched.values():
            done = parent.num_finished == len(parent.samples)
            if done:
                del self._parents[parent.request_id]
            if parent.final_only and not done:
                continue
            outputs.append(self._make_output(parent, done, now))
        return outputs

    def _finish_text(
        self, parent: _ParentState, sample: _SampleState, stopped_on_token: bool
    ) -> None:
        """The whole text of a sample decoded at once (final_only samples without stop strings)."""
        ids = sample.token_ids[:-1] if stopped_on_token and sample.token_ids else sample.token_ids
        detok = self._new_detokenizer(parent.prompt_token_ids, sample.request.sampling_params)
        sample.text, _ = detok.update(ids, finished=True)
        sample.delta_text = sample.text

    def _make_output(self, parent: _ParentState, finished: bool, now: float) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                delta_text=s.delta_text,
                delta_token_ids=s.delta_token_ids,
                delta_logprobs=s.delta_logprobs,
            )
            for s in parent.samples
        ]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=list(parent.prompt_logprobs)
            if parent.prompt_logprobs is not None
            else None,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=self._metrics(parent, finished, now),
            ledgers=[s.request.ledger for s in parent.samples] if finished else None,
        )

    @staticmethod
    def _metrics(parent: _ParentState, finished: bool, now: float) -> RequestMetrics:
        """Times over the parent's samples: the earliest first scheduling and first token, the
        latest finish (``now`` if none has one yet)."""
        reqs = [s.request for s in parent.samples]
        first_scheduled = min(
            (t for r in reqs if (t := r.first_scheduled_time) is not None), default=None
        )
        finish_times = [t for r in reqs if (t := r.finished_time) is not None]
        return RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=first_scheduled,
            first_token_time=min(
                (t for r in reqs if (t := r.first_token_time) is not None), default=None
            ),
            last_token_time=parent.last_token_time,
            finished_time=(max(finish_times) if finish_times else now) if finished else None,
            time_in_queue=None
            if first_scheduled is None
            else first_scheduled - parent.arrival_time,
            num_generation_tokens=sum(len(s.token_ids) for s in parent.samples),
        )
