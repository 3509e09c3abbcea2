"""``jaxserve bench throughput``: offline throughput through ``LLM.generate`` (vLLM ``bench throughput``).

All requests are queued at once and the engine's continuous batching runs them; the figures are
over the wall time of that one ``generate`` call (the engine was loaded and compiled before):
requests/s, output tokens/s and total (prompt + output) tokens/s. The engine's own counters add
the prefix-cache hit rate and the preemptions of the run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxserve.bench.workloads import BenchRequest

if TYPE_CHECKING:
    from jaxserve.engine.llm import LLM


def run_throughput(
    llm: LLM,
    requests: Sequence[BenchRequest],
    *,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    warmup_requests: Sequence[BenchRequest] = (),
    use_tqdm: bool = False,
) -> dict[str, Any]:
    """Generates ``requests`` with ``llm`` and returns the run's figures.

    Args:
      llm: a ``jaxserve.LLM``.
      requests: the measured requests.
      ignore_eos: every request produces exactly its ``output_len`` tokens.
      temperature: sampling temperature (0: greedy).
      warmup_requests: generated first, not measured.
      use_tqdm: show the progress bar.

    Returns:
      ``num_requests``, ``elapsed_s``, ``total_input_tokens``, ``total_output_tokens``,
      ``requests_per_s``, ``output_tokens_per_s``, ``total_tokens_per_s``, ``preemptions``,
      ``prefix_cache_hit_rate`` (fraction, None without queries), ``num_steps``.

    Raises:
      ValueError: no requests, or the engine refused one (names it).
    """
    from jaxserve.sampling_params import SamplingParams

    if not requests:
        raise ValueError("num_prompts: the workload has no requests")

    def params(reqs: Sequence[BenchRequest]) -> list[SamplingParams]:
        return [
            SamplingParams(max_tokens=r.output_len, ignore_eos=ignore_eos, temperature=temperature)
            for r in reqs
        ]

    if warmup_requests:
        llm.generate([r.prompt for r in warmup_requests], params(warmup_requests), use_tqdm=False)
    engine = llm.llm_engine
    before = engine.get_stats()
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params(requests), use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    after = engine.get_stats()
    total_in = sum(len(o.prompt_token_ids) for o in outputs)
    total_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    return {
        "num_requests": len(outputs),
        "elapsed_s": elapsed,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": total_out / elapsed,
        "total_tokens_per_s": (total_in + total_out) / elapsed,
        "preemptions": after.num_preemptions_total - before.num_preemptions_total,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "num_steps": after.num_steps_total - before.num_steps_total,
    }


def format_throughput(result: dict[str, Any]) -> str:
    """vLLM ``bench throughput``'s summary line, plus the totals and engine counters."""
    rate = result["prefix_cache_hit_rate"]
    return "\n".join(
        [
            f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.2f} total tokens/s, "
            f"{result['output_tokens_per_s']:.2f} output tokens/s",
            f"Total num prompt tokens:  {result['total_input_tokens']}",
            f"Total num output tokens:  {result['total_output_tokens']}",
            f"Elapsed: {result['elapsed_s']:.2f} s over {result['num_steps']} engine steps; "
            f"preemptions: {result['preemptions']}; prefix-cache hit rate: "
            + ("n/a" if rate is None else f"{100 * rate:.1f}%"),
        ]
    )
