"""End to end on the bundled model: the official ``openai`` client, streaming text, aborts, caching.

One server per module (small knobs, reference attention, two token buckets, float32), so the
module pays one engine start. Until the trained checkpoint lands, the bundled config runs with
random ("dummy") weights; every expectation here is derived from the model's own greedy output,
so it holds for any weights.
"""

from __future__ import annotations

import asyncio
import glob
import os
import time

import httpx2 as httpx
import openai
import pytest
from server_harness import (
    MODEL_DIR,
    assert_error,
    metric_values,
    running_server,
    small_engine_args,
    sse,
    wait_idle,
)

MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
PROMPT = "Once upon a time, there was a little"
COMPL = "/v1/completions"


def _has_weights(path: str) -> bool:
    """Safetensors files, or our orbax layout's ``params/`` (jaxserve.model.loader)."""
    return bool(
        glob.glob(os.path.join(path, "*.safetensors"))
        or os.path.isdir(os.path.join(path, "params"))
    )


@pytest.fixture(scope="module")
def server():
    if not os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        pytest.skip("the bundled model config is missing")
    args = small_engine_args(
        load_format="auto" if _has_weights(MODEL_DIR) else "dummy",
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=NUM_BLOCKS,
        long_prefill_token_threshold=0,
        kv_offloading_size=0.01,  # ~109 host blocks behind the 64 device blocks
    )
    with running_server(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _greedy(client, n_tokens=24, **extra):
    body = {"prompt": PROMPT, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return client.post(COMPL, json=body).json()["choices"][0]["text"]


# ---- the official client -----------------------------------------------------------------------


def test_openai_client_sync(server):
    oai = _oai(server)
    models = oai.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    done = oai.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=8, n=2, temperature=0.8, seed=1
    )
    assert len(done.choices) == 2 and {c.index for c in done.choices} == {0, 1}
    assert done.usage.completion_tokens <= 16 and done.usage.prompt_tokens > 0
    greedy = oai.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    streamed = oai.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == greedy.choices[0].text

    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = oai.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.message.role for c in chat.choices] == ["assistant", "assistant"]
    assert (
        chat.choices[0].message.content == chat.choices[1].message.content
    )  # greedy: both samples agree
    assert chat.usage.completion_tokens == 16
    chunks = list(
        oai.chat.completions.create(
            model="tiny-llama",
            messages=messages,
            max_completion_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="does-not-exist", messages=messages)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="tiny-llama", prompt=PROMPT, top_p=1.5)


def test_openai_client_async(server):
    async def main():
        oai = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with oai:
            prompts = [f"{PROMPT} {w}" for w in ("cat", "dog", "bird")]
            together = await asyncio.gather(
                *(
                    oai.completions.create(
                        model="tiny-llama",
                        prompt=p,
                        max_tokens=6,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for p in prompts
                )
            )
            assert [r.usage.completion_tokens for r in together] == [6, 6, 6]
            assert all(
                r.choices[0].finish_reason == "length" and r.id.startswith("cmpl-")
                for r in together
            )
            assert len({r.id for r in together}) == 3
            stream = await oai.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                n=2,
                stream=True,
                temperature=1.0,
                seed=3,
            )
            texts = {0: "", 1: ""}
            finish = {}
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
                    if choice.finish_reason:
                        finish[choice.index] = choice.finish_reason
            assert set(finish) == {0, 1} and set(finish.values()) <= {"stop", "length"}

    asyncio.run(main())


# ---- streaming text ----------------------------------------------------------------------------


def _token_boundaries(tokenizer, prompt_ids, out_ids):
    """Character offsets in the output text where each output token ends."""
    base = len(tokenizer.decode(prompt_ids))
    return [
        len(tokenizer.decode(prompt_ids + out_ids[: i + 1])) - base for i in range(len(out_ids))
    ]


def test_sentencepiece_spaces(server, client):
    """Case sentencepiece-spaces: joined deltas == non-streamed text == decode of the token ids."""
    tok = server.llm.tokenizer
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    full = client.post(COMPL, json=body).json()["choices"][0]
    chunks = sse(client, COMPL, {**body, "stream": True})[:-1]
    joined = "".join(c["choices"][0]["text"] for c in chunks)
    assert joined == full["text"]
    prompt_ids = tok.encode(PROMPT)
    engine_ids = _engine_token_ids(server, PROMPT, 32)
    reference = tok.decode(prompt_ids + engine_ids)[len(tok.decode(prompt_ids)) :]
    assert tok.decode(prompt_ids + engine_ids).startswith(tok.decode(prompt_ids))
    assert full["text"] == reference
    assert full["text"].strip() == tok.decode(engine_ids).strip()
    if " " in reference.strip():
        assert " " in joined  # word-boundary spaces survive streaming


def _engine_token_ids(server, prompt, n):
    async def run():
        from jaxserve.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        last = None
        async for out in server.llm.generate(prompt, params, f"ids-{time.monotonic_ns()}"):
            last = out
        return last.outputs[0].token_ids

    return asyncio.run(run())


def test_stop_string_leak(server, client):
    """Case stop-string-leak: a stop string across a token boundary and one inside a token, streamed
    and not, with and without include_stop_str_in_output."""
    tok = server.llm.tokenizer
    greedy = _greedy(client, 24)
    ids = _engine_token_ids(server, PROMPT, 24)
    ends = _token_boundaries(tok, tok.encode(PROMPT), ids)
    assert ends[-1] == len(greedy)
    cuts = set(ends)
    spanning = inside = None
    for start in range(1, len(greedy) - 3):
        candidate = greedy[start : start + 3]
        first = greedy.index(candidate)
        crosses = any(first < b < first + 3 for b in cuts)
        if crosses and spanning is None and candidate.strip():
            spanning = candidate
        if not crosses and inside is None and candidate.strip() and len(candidate) == 3:
            inside = candidate
    stops = [s for s in (spanning, inside) if s]
    assert stops, greedy
    print(f"greedy={greedy!r} token ends={ends} stops={stops}")
    for stop in stops:
        cut = greedy.index(stop)
        for include in (False, True):
            expected = greedy[: cut + len(stop)] if include else greedy[:cut]
            body = {
                "prompt": PROMPT,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
                "stop": [stop],
                "include_stop_str_in_output": include,
            }
            full = client.post(COMPL, json=body).json()["choices"][0]
            assert (full["text"], full["finish_reason"], full["stop_reason"]) == (
                expected,
                "stop",
                stop,
            )
            sent = ""
            chunks = sse(client, COMPL, {**body, "stream": True})[:-1]
            for c in chunks:
                sent += c["choices"][0]["text"]
                assert expected.startswith(sent), (stop, include, sent)
            assert sent == expected and chunks[-1]["choices"][0]["finish_reason"] == "stop"


# ---- aborts, queue, scoring, caching -----------------------------------------------------------


def test_abort_n2_leak(server, client):
    """Case abort-n2-leak: close an n=2 stream after 3 chunks, 20 times; then a client timeout.
    Within 2 s nothing runs and every KV block is free."""
    body = {"prompt": PROMPT, "n": 2, "ignore_eos": True, "max_tokens": None, "stream": True}
    for _ in range(20):
        with client.stream("POST", COMPL, json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
    m, idle = wait_idle(client, server.llm, timeout=2.0)
    assert idle, m
    with httpx.Client(base_url=server.url, timeout=0.5) as short:
        with pytest.raises(httpx.ReadTimeout):
            short.post(COMPL, json={**body, "stream": False})
    m, idle = wait_idle(client, server.llm, timeout=2.0)
    assert idle, m
    assert server.llm.engine.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1


@pytest.mark.slow
def test_disconnect_storm(server, client):
    """Soak (short): 24 clients at once, streaming and non-streaming, each leaving after 1-3
    chunks or a 0.3 s read timeout, while two clients finish normally. Afterwards nothing runs,
    every KV block is free, no 5xx was logged, and greedy output is unchanged."""
    import threading

    before = _greedy(client, 8)
    body = {"prompt": PROMPT, "n": 2, "ignore_eos": True, "max_tokens": None, "stream": True}
    finished: list[int] = []

    def leaver(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=0.3 if i % 4 == 3 else 30) as c:
            try:
                if i % 4 == 3:  # a non-streaming client that gives up
                    c.post(COMPL, json={**body, "stream": False})
                    return
                with c.stream("POST", COMPL, json={**body, "seed": i}) as r:
                    got = 0
                    for line in r.iter_lines():
                        got += line.startswith("data: ")
                        if got == 1 + i % 3:
                            break
            except httpx.TimeoutException:
                pass

    def stayer() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post(COMPL, json={"prompt": PROMPT, "max_tokens": 8})
            finished.append(r.status_code)

    threads = [threading.Thread(target=leaver, args=(i,)) for i in range(24)]
    threads += [threading.Thread(target=stayer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert finished == [200, 200]
    m, idle = wait_idle(client, server.llm, timeout=5.0)
    assert idle, m
    assert server.llm.engine.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1
    assert not server.internal_errors
    assert _greedy(client, 8) == before


@pytest.mark.slow
def test_fuzz_real_engine_no_5xx(server):
    """The schemathesis run of test_openapi_fuzz.py, a few cases against the real engine."""
    from fuzz import fuzz_server

    fuzz_server(server.url, max_examples=16, strict=False)
    assert not server.internal_errors


def test_echo_max_tokens_0(server, client):
    """Case echo-max-tokens-0 on the model: prompt scoring with logprobs, then max_tokens 0 and 1."""
    n_prompt = len(server.llm.tokenizer.encode(PROMPT))
    body = client.post(
        COMPL, json={"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    ).json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and body["usage"]["completion_tokens"] == 0
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == n_prompt and lps[0] is None and all(x <= 0 for x in lps[1:])
    assert (
        client.post(COMPL, json={"prompt": PROMPT, "max_tokens": 0}).json()["usage"][
            "completion_tokens"
        ]
        == 0
    )
    one = client.post(COMPL, json={"prompt": PROMPT, "max_tokens": 1, "ignore_eos": True}).json()
    assert one["usage"]["completion_tokens"] == 1


def test_long_prompt_does_not_block_queue(server, client):
    """Case long-prompt-blocks-queue (a) on the engine: 400 naming both lengths, then a 200."""
    too_long = client.post(COMPL, json={"prompt": [1] + [100] * MAX_MODEL_LEN, "max_tokens": 1})
    error = assert_error(too_long, 400, "prompt")
    assert str(MAX_MODEL_LEN) in error["message"] and str(MAX_MODEL_LEN + 1) in error["message"]
    start = time.monotonic()
    assert (
        client.post(COMPL, json={"prompt": "one two three four", "max_tokens": 5}).status_code
        == 200
    )
    assert time.monotonic() - start < 30
    assert wait_idle(client, server.llm)[1]


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client):
    """A repeated 3-block prompt reports cached_tokens from prefix caching, in usage and metrics."""
    prompt = [1] + [(7 * i) % 3000 + 10 for i in range(60)]
    before = metric_values(client)
    first = client.post(COMPL, json={"prompt": prompt, "max_tokens": 2}).json()
    second = client.post(COMPL, json={"prompt": prompt, "max_tokens": 2}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 61
    after = metric_values(client)
    assert (
        after["jaxserve:prefix_cache_hits_total"] - before["jaxserve:prefix_cache_hits_total"] >= 48
    )
    assert after["jaxserve:prompt_tokens_total"] - before["jaxserve:prompt_tokens_total"] == 122
    assert (
        after["jaxserve:time_to_first_token_seconds_count"]
        > before["jaxserve:time_to_first_token_seconds_count"]
    )


def test_prefix_evicted_from_the_device_comes_back_from_the_host_tier(client):
    """KV offloading end to end: a 4-block prefix pushed out of the 64-block device pool by
    ~80 blocks of other prompts is a host hit the next time, with the same greedy text."""
    prompt = [1] + [(11 * i) % 3000 + 17 for i in range(64)]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = client.post(COMPL, json=body).json()
    for k in range(6):  # 6 x 13 blocks of other prompts
        filler = [1] + [(13 * i + 101 * k) % 3000 + 5 for i in range(200)]
        assert client.post(COMPL, json={"prompt": filler, "max_tokens": 1}).status_code == 200
    before = metric_values(client)
    second = client.post(COMPL, json=body).json()
    after = metric_values(client)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    host_hits = "jaxserve:host_prefix_cache_hits_total"
    assert after[host_hits] - before[host_hits] == 64
    loaded = "jaxserve:kv_offload_loaded_tokens_total"
    assert after[loaded] - before[loaded] == 64
    assert after["jaxserve:kv_offload_stored_tokens_total"] > 0


def test_top_p_boundaries_on_the_model(client):
    """Case top-p-boundaries: top_p 0 keeps only the most probable token (greedy); top_p 1 is off."""
    greedy = _greedy(client, 8)
    assert _greedy(client, 8, temperature=1.0, top_p=0, seed=5) == greedy
    sampled = _greedy(client, 8, temperature=1.0, seed=5)
    assert _greedy(client, 8, temperature=1.0, top_p=1, seed=5) == sampled


# ---- request ledgers --------------------------------------------------------------------------


def _without_wall(ledger):
    return {k: v for k, v in ledger.items() if k != "arrival_time"}  # re-read from the clock


def test_ledger_in_the_body_and_by_id(client):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = client.post(COMPL, json=body).json()
    assert "ledger" not in plain
    r = client.post(COMPL, json={**body, "include_ledger": True}).json()
    led = r["ledger"]
    prompt_tokens = r["usage"]["prompt_tokens"]
    hits = led["prefix_cache_hit_tokens"]["device"]
    assert led["request_id"] == r["id"] + "-0"
    assert led["num_prompt_tokens"] == prompt_tokens and led["num_output_tokens"] == 5
    assert led["finish_reason"] == "length"
    assert led["prefix_cache_hit_tokens"]["host"] == 0  # offloading is on in this module
    assert sum(e["tokens"] for e in led["steps"]) == prompt_tokens + 5 - 1 - hits
    assert 0 <= led["queued_s"] <= led["first_token_s"] <= led["finished_s"]
    for rid in (r["id"], r["id"] + "-0"):  # the response id or the engine request id
        got = client.get(f"/v1/requests/{rid}/ledger")
        assert got.status_code == 200
        assert _without_wall(got.json()) == _without_wall(led)
    assert_error(client.get("/v1/requests/cmpl-nope/ledger"), 404, "request_id", "ledger_not_found")


def test_ledger_in_the_last_streamed_chunk(client):
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True}
    events = sse(client, COMPL, {**body, "prompt": PROMPT, "include_ledger": True})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["ledger"]["num_output_tokens"] == 3
    assert all("ledger" not in e for e in events[:-2])
    chat = {**body, "messages": [{"role": "user", "content": "hi"}], "include_ledger": True}
    events = sse(client, "/v1/chat/completions", chat)
    assert events[-2]["ledger"]["request_id"].startswith(events[0]["id"])
    assert events[-2]["ledger"]["finish_reason"] == "length"


def test_preempted_request_ledger_shows_recompute(server, client):
    """Five long prompts, queued together in one request, outgrow the 64-block pool as they
    decode (78 blocks at the end): somebody is preempted, and its ledger (body and GET) shows
    the discarded and the recomputed tokens. One request, so they run together whatever the
    machine's speed (separate ones could finish one by one)."""
    body = {
        # lengths apart mod 16: a victim's last block is part-filled (recomputed)
        "prompt": [[1 + (7 * i + j) % 200 for j in range(150 + 5 * i)] for i in range(5)],
        "max_tokens": 80,  # the longest: 170 + 80 <= max_model_len 256
        "temperature": 0,
        "ignore_eos": True,
        "include_ledger": True,
    }
    r = client.post(COMPL, json=body)
    assert r.status_code == 200, r.text
    responses = [{"ledger": led} for led in r.json()["ledger"]["prompts"]]
    preempted = [r["ledger"] for r in responses if r["ledger"]["num_preemptions"]]
    assert preempted, [r["ledger"]["num_preemptions"] for r in responses]
    assert any(led["num_recomputed_tokens"] > 0 for led in preempted)
    led = max(preempted, key=lambda led: led["num_recomputed_tokens"])
    for p in led["preemptions"]:
        # Freed blocks stay cached: full ones come back as restored (never as hits), the rest
        # is recomputed (less if it was preempted again before catching up).
        assert p["tokens_restored_from_cache"] + p["tokens_recomputed"] <= p["tokens_discarded"]
        assert p["resumed_step"] > p["step"]
    assert sum(p["tokens_recomputed"] for p in led["preemptions"]) == led["num_recomputed_tokens"]
    assert led["prefix_cache_hit_tokens"]["device"] == 0  # its prompt shares no block
    got = client.get(f"/v1/requests/{led['request_id']}/ledger").json()
    assert got["preemptions"] == led["preemptions"]
