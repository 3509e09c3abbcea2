"""Sleep mode benchmark: what ``sleep(level)`` frees and what waking up costs, per level.

For each level (1: weights to host memory; 2: weights dropped, reloaded from the checkpoint),
``--repeats`` times: run a greedy request (warm), sleep, wake up, run it again, and print

- device bytes before / asleep / awake: on an accelerator the device's ``bytes_in_use``
  (``memory_stats``); on CPU the live jax buffers' bytes (``sleep_mode.live_device_bytes``),
  which is what "device memory" means there: the host's RSS is not what the runner frees;
- the weights' and the KV pool's bytes (what the runner deletes);
- seconds to sleep and to wake up (median and range), and the first request's latency after
  waking vs before sleeping (it shows any recompile or cold cache);
- whether the greedy tokens after waking equal those before (must be "yes").

No peer: vLLM's sleep mode needs CUDA's memory pool (its CPU build refuses it).

Run:  .venv/bin/python benchmarks/bench_sleep_mode.py [MODEL] [--load-format ...] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from jaxserve.config import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sleep_mode import live_device_bytes


def device_bytes() -> int:
    """Bytes in use on the first device (accelerators), else the live jax buffers' bytes."""
    stats = jax.local_devices()[0].memory_stats()
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    return live_device_bytes()


def run_once(
    engine: LLMEngine, tag: str, prompt: str | list[int], max_tokens: int
) -> tuple[list[int], float]:
    """Greedy tokens of ``prompt`` and the request's latency, seconds."""
    t0 = time.perf_counter()
    engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    return tokens, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool blocks")
    parser.add_argument("--token-buckets", default="16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            num_gpu_blocks_override=args.num_gpu_blocks,
            token_buckets=args.token_buckets,
            max_num_batched_tokens=int(args.token_buckets.split(",")[-1]),
            enable_sleep_mode=True,
        )
    )
    runner = engine.runner
    weights = sum(p.nbytes for p in runner.params)
    kv = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    print(
        f"model {engine.config.model.model} on {jax.local_devices()[0].platform}: weights "
        f"{weights / 2**20:.1f} MiB, KV pool {kv / 2**20:.1f} MiB "
        f"({engine.config.cache.num_gpu_blocks} blocks)"
    )
    prompt: str | list[int] = "Once upon a time, in a small village by the sea,"
    if engine.tokenizer is None:  # a dummy preset: token ids
        prompt = [1 + (37 * i) % (engine.vocab_size - 1) for i in range(12)]
    reference, _ = run_once(engine, "warm", prompt, args.max_tokens)
    compiles = runner.compile_counts()
    for level in (1, 2):
        sleeps, wakes, before_lat, after_lat, freed, equal = [], [], [], [], [], True
        awake_bytes = asleep_bytes = 0
        for i in range(args.repeats):
            _, latency = run_once(engine, f"before-{level}-{i}", prompt, args.max_tokens)
            before_lat.append(latency)
            awake_bytes = device_bytes()
            t0 = time.perf_counter()
            engine.sleep(level)
            sleeps.append(time.perf_counter() - t0)
            asleep_bytes = device_bytes()
            freed.append(awake_bytes - asleep_bytes)
            t0 = time.perf_counter()
            assert engine.wake_up()
            wakes.append(time.perf_counter() - t0)
            tokens, latency = run_once(engine, f"after-{level}-{i}", prompt, args.max_tokens)
            after_lat.append(latency)
            equal = equal and tokens == reference
        print(
            f"level {level}: device bytes awake {awake_bytes / 2**20:.1f} MiB -> asleep "
            f"{asleep_bytes / 2**20:.3f} MiB (freed {statistics.median(freed) / 2**20:.1f} MiB); "
            f"sleep {statistics.median(sleeps) * 1e3:.1f} ms [{min(sleeps) * 1e3:.1f}-"
            f"{max(sleeps) * 1e3:.1f}], wake {statistics.median(wakes) * 1e3:.1f} ms "
            f"[{min(wakes) * 1e3:.1f}-{max(wakes) * 1e3:.1f}]; first request after waking "
            f"{statistics.median(after_lat) * 1e3:.1f} ms vs {statistics.median(before_lat) * 1e3:.1f}"
            f" ms before; outputs equal: {'yes' if equal else 'NO'}"
        )
    print(f"recompiles while sleeping and waking: {runner.compile_counts() != compiles}")


if __name__ == "__main__":
    main()
