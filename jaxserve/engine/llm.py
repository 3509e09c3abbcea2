"""``LLM``: the offline API (vLLM's ``LLM``): load once, ``generate`` many prompts in a batch.

    from jaxserve import LLM, SamplingParams
    llm = LLM()                                   # the bundled checkpoint
    outs = llm.generate(["Hello", "Once upon"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)

All prompts are queued at once; the engine's continuous batching runs them together and the
outputs come back in input order.

A pooling model (``LLM(model, runner="pooling")``, or ``convert="embed"`` for a causal-LM
checkpoint) embeds instead (vLLM's ``LLM.embed``)::

    outs = LLM("Qwen3-Embedding-0.6B", runner="pooling").embed(["a query", "a passage"])
    vector = outs[0].outputs.embedding              # list[float], L2-normalised
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from jaxserve.config import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.pooling import finish_embedding
from jaxserve.request_output import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams


class LLM:
    """An engine for offline batched generation.

    Args:
      model: model directory (HF or our orbax layout), a dummy preset name with
        ``load_format="dummy"``, or None for the bundled checkpoint
        (``jaxserve.model.default_model_path()``).
      **engine_args: any ``EngineArgs`` field (``dtype``, ``max_model_len``,
        ``max_num_batched_tokens``, ``enable_prefix_caching``, ``attention_backend``, ...).

    Raises:
      ValueError: an unknown engine argument (named) or a bad value (the field named), or the
        model cannot be loaded (ModelLoadError names the path).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer (None for a dummy preset without one)."""
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[int],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for ``prompts``; returns one finished RequestOutput per prompt,
        in input order.

        Args:
          prompts: one text, a list of texts, a list of token-id lists, or one token-id list.
          sampling_params: one SamplingParams for all prompts, one per prompt, or None for
            ``SamplingParams()`` (16 tokens, temperature 1).
          use_tqdm: show a progress bar (requests done, output tokens/s).
          lora_name: the LoRA adapter (``LLM(enable_lora=True, lora_modules=[...])``) of every
            prompt, one per prompt (None: the base model), or None (vLLM's ``lora_request``).

        Raises:
          ValueError: bad ``prompts`` (empty list, wrong type, empty or too-long prompt, token
            ids outside the vocabulary), ``sampling_params`` (wrong type, list length differs
            from the prompts) or ``lora_name`` (unknown adapter, wrong length). Requests
            already queued by this call are aborted first.
        """
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} SamplingParams for "
                    f"{len(prompt_list)} prompts; pass one, or one per prompt"
                )
        else:
            raise ValueError(
                f"sampling_params must be a SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__}"
            )
        if lora_name is None or isinstance(lora_name, str):
            loras = [lora_name] * len(prompt_list)
        else:
            loras = list(lora_name)
            if len(loras) != len(prompt_list):
                raise ValueError(
                    f"lora_name: got {len(loras)} names for {len(prompt_list)} prompts"
                )
        return self._run(self._add_all(prompt_list, params_list, loras), use_tqdm)

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[int],
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embeds ``prompts`` with a pooling model (``runner="pooling"``); one output per
        prompt, in input order, each with ``outputs.embedding`` (float32 values as floats).

        Args:
          prompts: one text, a list of texts, a list of token-id lists, or one token-id list.
          normalize: L2-normalise (default: the model's pooler config, e.g. its
            sentence-transformers ``Normalize`` module).
          dimensions: keep the first ``dimensions`` values (Matryoshka), before normalising.

        Raises:
          ValueError: the engine is not a pooling one (names ``--runner pooling``), bad prompts
            (as ``generate``), or ``dimensions`` outside ``[1, hidden_size]``.
        """
        model_config = self.llm_engine.config.model
        if model_config.runner != "pooling":
            raise ValueError(
                "embed needs a pooling model: LLM(model, runner='pooling') (or convert='embed' "
                "for a causal-LM checkpoint); this engine runs --runner generate"
            )
        if normalize is None:
            normalize = model_config.pooling_normalize
        prompt_list = _normalize_prompts(prompts)
        params = SamplingParams(max_tokens=0)
        ids = self._add_all(prompt_list, [params] * len(prompt_list))
        outputs = []
        for out in self._run(ids, use_tqdm):
            vec = finish_embedding(out.pooled, normalize=normalize, dimensions=dimensions)
            outputs.append(
                EmbeddingRequestOutput(
                    out.request_id, out.prompt_token_ids, EmbeddingOutput(vec.tolist())
                )
            )
        return outputs

    def _add_all(
        self,
        prompt_list: list,
        params_list: list[SamplingParams],
        loras: list[str | None] | None = None,
    ) -> list[str]:
        """Queues every prompt (on its LoRA adapter, if any); returns their request ids (aborts
        the queued ones on an error)."""
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                rid = str(next(self._ids))
                lora = None if loras is None else loras[i]
                try:
                    engine.add_request(rid, prompt, params, final_only=True, lora_name=lora)
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from e
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)
            raise
        return ids

    def sleep(self, level: int = 1) -> None:
        """Frees device memory between uses (``LLM(..., enable_sleep_mode=True)``; vLLM's
        ``LLM.sleep``): level 1 keeps the weights in host memory, level 2 reloads them from the
        checkpoint at ``wake_up``; the KV cache is freed either way.

        Raises:
          ValueError: sleep mode is off, or a bad level.
        """
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Puts back the weights and the KV cache (``tags``: "weights", "kv_cache"; None: both);
        True once fully awake (``generate`` needs it)."""
        return self.llm_engine.wake_up(tags)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from jaxserve.logging_config import progress_bar_class

        tqdm = progress_bar_class()

        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        num_tokens = 0
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        num_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict.get("elapsed") or 0.0
                        if elapsed > 0:
                            bar.set_postfix_str(
                                f"{num_tokens / elapsed:.1f} out tok/s", refresh=False
                            )
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _normalize_prompts(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(
            "prompts must be a non-empty string, list of strings or list of token-id lists"
        )
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p
        ):
            out.append(list(p))
        else:
            raise ValueError(
                f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}"
            )
    return out
