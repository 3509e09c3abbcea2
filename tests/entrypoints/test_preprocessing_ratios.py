"""#38 deliverable 1: a small request beside the worst allowed case of each request feature whose
preprocessing grows with the request stays within 2x of its latency alone (measured as a ratio
in one run, interleaved; tests/entrypoints/preprocessing_cases.py has the cases, and
benchmarks/bench_preprocessing.py prints the same figures for benchmarks/RESULTS.md).

Before the caps and the off-thread preparation, 30,000 bad words froze every other request for
30 s, and 8 heavy regexes made a small request 60x slower.
"""

from __future__ import annotations

import asyncio
import os

import httpx2 as httpx
import pytest
from preprocessing_cases import CASES, measure_ratio
from server_harness import MODEL_DIR, running_server, small_engine_args

from jaxserve.entrypoints.http.api_server import SERVING

pytest.importorskip("llguidance")

MAX_RATIO = 2.0
ATTEMPTS = 3
"""Measurements per case until one is within MAX_RATIO: load from other processes delays the
small request at random; a preprocessing cost delays it every time."""


@pytest.fixture(scope="module")
def server():
    if not os.path.isdir(os.path.join(MODEL_DIR, "params")):
        pytest.skip("the bundled weights are missing")
    with running_server(small_engine_args(num_gpu_blocks_override=96, max_num_seqs=16)) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "plain"])
def test_small_request_beside_the_worst_allowed_case_stays_within_2x(server, case):
    max_prompt_bytes = server.app[SERVING].info.max_prompt_bytes

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            best = None
            for _ in range(ATTEMPTS):  # a loaded box can spike one measurement; a cost cannot
                result = await measure_ratio(client, case, max_prompt_bytes, reps=2)
                best = result if best is None or result.ratio < best.ratio else best
                if best.ratio < MAX_RATIO:
                    break
            return best

    result = asyncio.run(run())
    assert result.worst_status == (400 if case in ("prompt", "heavy_regex_x8") else 200)
    assert result.ratio < MAX_RATIO, (
        f"{case}: {1e3 * result.alone_s:.0f} ms alone, {1e3 * result.beside_s:.0f} ms beside"
    )
