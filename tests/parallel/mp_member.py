"""One process of a two-process job for test_multiprocess.py (2 simulated CPU devices each).

    python mp_member.py PROCESS_ID PORT

Process 0 prints ``RESULT <json tokens>`` for the harness workload on the llama fixture at
TP 4 across both processes, then waits for a line on stdin and runs the workload again
(the test kills process 1 in between). Process 1 never returns from ``LLM(...)``: it runs the
steps process 0 publishes until process 0 stops.
"""

from __future__ import annotations

import json
import sys

from tp_harness import ENGINE_KWARGS, MAX_TOKENS, PROMPTS, model_path


def main() -> None:
    process_id, port = int(sys.argv[1]), sys.argv[2]
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    from jaxserve import LLM, SamplingParams

    llm = LLM(
        model_path("llama"),
        tensor_parallel_size=4,
        distributed_coordinator=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        **ENGINE_KWARGS,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    print("RESULT", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    if sys.stdin.readline():
        llm.generate(PROMPTS, params, use_tqdm=False)
        print("SECOND RUN FINISHED", flush=True)


if __name__ == "__main__":
    main()
