"""Multi-LoRA through the engine (#33) on the llama golden fixture with two tiny PEFT adapters
(scripts/make_lora_fixtures.py): greedy tokens equal transformers + peft's and their
logprobs are within 1e-4 (float32) for every adapter alone and in mixed batches with more
adapters than device slots; adapters load and unload at run time; bad names and adapters are
refused with the engine still serving. One engine for the module (no warm-up compile)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from jaxserve.engine.llm import LLM
from jaxserve.lora.peft import LoRAAdapterError
from jaxserve.sampling_params import SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "lora")
BASE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden", "llama")
GOLDEN = np.load(os.path.join(FIXTURES, "golden.npz"))
PROMPTS = [GOLDEN[f"prompt_{i}"].tolist() for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
# served name -> the golden entry it must reproduce ("a3" is a1's files under another name)
EXPECTED = {None: "base", "a1": "a1", "a2": "a2", "a3": "a1"}


@pytest.fixture(scope="module")
def llm():
    return LLM(
        BASE,
        tokenizer=os.path.join(BASE, "..", "gemma2"),  # a 256-token one: the server needs one
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=8,
        lora_modules=[f"a1={FIXTURES}/a1", f"a2={FIXTURES}/a2", f"a3={FIXTURES}/a1"],
        block_size=8,  # the prompts fill blocks: base and adapter K/V must not be shared
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        token_buckets="64",  # one bucket: two forward executables (with and without adapters)
        warmup=False,
        enable_sleep_mode=True,
    )


def check(outputs, names, prompt_index):
    for out, name, i in zip(outputs, names, prompt_index):
        key = EXPECTED[name]
        c = out.outputs[0]
        assert c.token_ids == GOLDEN[f"{key}_tokens_{i}"].tolist(), (name, i)
        lps = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        np.testing.assert_allclose(lps, GOLDEN[f"{key}_logprobs_{i}"], atol=1e-4, rtol=0)


def test_each_adapter_alone_matches_peft(llm):
    for name in (None, "a1", "a2", None):  # base again after the adapters: no stale K/V
        check(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_name=name), [name] * 3, range(3))


def test_mixed_batch_over_more_adapters_than_slots(llm):
    lora = llm.llm_engine.runner.lora
    writes = lora.stats.slot_writes
    names = [None, "a1", "a2", "a3"] * 3
    index = [i % 3 for i in range(len(names))]
    outputs = llm.generate([PROMPTS[i] for i in index], GREEDY, use_tqdm=False, lora_name=names)
    check(outputs, names, index)
    assert lora.stats.slot_writes > writes  # 3 adapters over 2 slots: swapped in and out
    assert lora.stats.disk_loads > 3  # and over a host tier of 2: read from disk again


def test_bad_names_are_refused_and_the_engine_serves_on(llm):
    with pytest.raises(ValueError, match="prompts\\[0\\]: lora_name 'nope': no such LoRA"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_name="nope")
    with pytest.raises(ValueError, match="lora_name: got 1 names for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_name=["a1"])
    check(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_name="a2"), ["a2"], [0])
    assert not llm.llm_engine.has_unfinished_requests()


def test_load_and_unload_at_run_time(llm, tmp_path):
    engine = llm.llm_engine
    before = engine.list_loras()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 8}')
    with pytest.raises(LoRAAdapterError, match="rank 64 is over --max-lora-rank 8"):
        engine.add_lora("bad", str(bad))
    with pytest.raises(LoRAAdapterError, match="'a1' is already loaded"):
        engine.add_lora("a1", f"{FIXTURES}/a2")
    assert engine.list_loras() == before
    engine.add_lora("a4", f"{FIXTURES}/a2")
    EXPECTED["a4"] = "a2"
    check(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_name="a4"), ["a4"] * 3, range(3))
    engine.remove_lora("a4")
    assert engine.list_loras() == before
    with pytest.raises(ValueError, match="no such LoRA adapter"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_name="a4")


@pytest.mark.parametrize("level", [1, 2])
def test_adapters_survive_sleep_mode(llm, level):
    """Level 2 reloads the weights from the checkpoint: the pools come back empty and the
    adapters are written into them again."""
    llm.sleep(level)
    assert llm.wake_up()
    names = ["a1", "a2", None]
    check(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_name=names), names, range(3))


def test_openai_client_selects_adapters_by_model_name(llm):
    """Last in the module: the engine moves behind an HTTP server (AsyncLLM takes it over)."""
    import httpx2 as httpx
    from openai import OpenAI
    from server_harness import LiveServer

    from jaxserve.engine.async_llm import AsyncLLM

    async_llm = AsyncLLM(llm.llm_engine)
    srv = LiveServer(async_llm, api_key="k")
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="k")
        cards = {m.id: m for m in client.models.list().data}
        base = next(n for n, m in cards.items() if m.parent is None)
        assert {n: m.parent for n, m in cards.items() if n != base} == dict.fromkeys(
            ("a1", "a2", "a3"), base
        )
        for name in (None, "a1", "a2"):
            out = client.completions.create(
                model=name or base, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=1
            )
            lps = out.choices[0].logprobs.token_logprobs
            np.testing.assert_allclose(lps, GOLDEN[f"{EXPECTED[name]}_logprobs_1"], atol=1e-4)
        http = httpx.Client(base_url=srv.url, timeout=30)
        metrics = http.get("/metrics").text
        assert 'lora_requests_info{max_lora="2",running_lora_adapters="",' in metrics, metrics
        load = "/v1/load_lora_adapter"
        body = {"lora_name": "a5", "lora_path": f"{FIXTURES}/a2"}
        assert http.post(load, json=body).status_code == 401  # behind --api-key
        auth = {"Authorization": "Bearer k"}
        r = http.post(load, json={**body, "lora_path": "/nope"}, headers=auth)
        assert r.status_code == 400 and "no directory /nope" in r.json()["error"]["message"]
        r = http.post(load, json={**body, "lora_name": base}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        assert http.post(load, json=body, headers=auth).json()["status"] == "loaded"
        out = client.completions.create(
            model="a5", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=1
        )
        np.testing.assert_allclose(
            out.choices[0].logprobs.token_logprobs, GOLDEN["a2_logprobs_1"], atol=1e-4
        )
        unload = "/v1/unload_lora_adapter"
        assert http.post(unload, json={"lora_name": "a5"}, headers=auth).status_code == 200
        r = http.post(unload, json={"lora_name": "a5"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = client.with_options(max_retries=0).completions.with_raw_response
        with pytest.raises(Exception, match="404"):
            r.create(model="a5", prompt=PROMPTS[1], max_tokens=1)
        assert srv.internal_errors == []
    finally:
        srv.close()
        async_llm.shutdown()
