"""Every engine implementation matches its Protocol (``jaxserve.engine.protocol``) member by member:
``LLMEngine`` and the server tests' scripted ``FakeEngine`` against ``EngineCore``; ``AsyncLLM``
and the Ray clients (``ReplicaClient``, ``ReplicaSet``) against ``EngineClient``. A
method that one of them lacks, or whose parameters, defaults or async-ness differ, fails here,
and so does a public method of the fake that the protocol does not declare."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))

from fake_engine import FakeEngine  # noqa: E402
from server_harness import MODEL_DIR  # noqa: E402

from jaxserve.engine.async_llm import AsyncLLM, RequestStream  # noqa: E402
from jaxserve.engine.protocol import EngineClient, EngineCore, RequestOutputStream  # noqa: E402


def members(protocol: type) -> dict[str, object]:
    """The protocol's declared members: public names, plus the iterator dunders it defines."""
    return {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") or name in ("__aiter__", "__anext__")
    }


def _params(fn: object) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def problems(impl: object, protocol: type, *, extras_allowed: bool = True) -> list[str]:
    """How ``impl`` (an instance) departs from ``protocol``; empty when it conforms.

    A data member (a property in the protocol) must be present and not a method. A method must
    be a method with the same async-ness and the same parameters (name, kind, default and
    annotation text), in order; the implementation may add keyword-only parameters with
    defaults (LLMEngine's ``final_only``). With ``extras_allowed=False`` a public method the
    protocol does not declare is a problem too (a fake must not grow an interface of its own).
    """
    found = []
    cls = type(impl)
    declared = members(protocol)
    for name, spec in declared.items():
        if isinstance(spec, property):
            if not hasattr(impl, name):
                found.append(f"{name}: missing")
            elif inspect.ismethod(getattr(impl, name)):
                found.append(f"{name}: a method, the protocol has a value")
            continue
        mine = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(mine):
            found.append(f"{name}: missing, or not a method")
            continue
        if inspect.iscoroutinefunction(mine) != inspect.iscoroutinefunction(spec):
            found.append(f"{name}: async-ness differs from the protocol")
        want, have = _params(spec), _params(mine)
        extra = have[len(want) :]
        if [(p.name, p.kind, p.default, p.annotation) for p in have[: len(want)]] != [
            (p.name, p.kind, p.default, p.annotation) for p in want
        ]:
            found.append(
                f"{name}{inspect.signature(mine)}: parameters differ from {name}"
                f"{inspect.signature(spec)}"
            )
        elif any(p.kind is not p.KEYWORD_ONLY or p.default is p.empty for p in extra):
            found.append(f"{name}: extra parameters must be keyword-only with defaults")
    if not extras_allowed:
        for name, _ in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_") and name not in declared:
                found.append(f"{name}: a public method the protocol does not declare")
    return found


@pytest.fixture(scope="module")
def fake():
    return FakeEngine(MODEL_DIR)


def test_fake_engine_matches_engine_core(fake):
    assert problems(fake, EngineCore, extras_allowed=False) == []


def test_llm_engine_matches_engine_core(make_engine):
    assert problems(make_engine(), EngineCore) == []


def test_async_llm_matches_engine_client(fake):
    llm = AsyncLLM(fake, step_timeout_s=0)

    async def stream() -> RequestStream:
        return RequestStream("r", 1, llm, asyncio.get_running_loop())

    try:
        assert problems(llm, EngineClient) == []
        assert problems(asyncio.run(stream()), RequestOutputStream) == []
    finally:
        llm.shutdown()


def test_ray_clients_match_engine_client(fake):
    pytest.importorskip("ray")
    from jaxserve.entrypoints.ray_clients import RelayedStream, ReplicaSet
    from jaxserve.entrypoints.router import Router
    from jaxserve.serving.validation import ServingInfo

    info = ServingInfo("m", MODEL_DIR, 256, fake.vocab_size, 64, True)
    described = [{"info": info, "engine_config": fake.engine_config}] * 2
    router = Router(2, "round-robin", 16, b"")
    replicas = ReplicaSet([None, None], described, router, fake.tokenizer)  # no actors needed
    assert problems(replicas, EngineClient) == []
    assert problems(replicas.clients[0], EngineClient) == []
    assert problems(RelayedStream(replicas.clients[0], "r", None), RequestOutputStream) == []


def test_the_check_catches_drift(fake):
    class Drifted(FakeEngine):
        def step(self, budget: int) -> list:  # a parameter the protocol does not have
            return []

        async def get_ledger(self, request_id: str) -> None:  # async where it is not
            return None

        def abort_request(self, request_ids: list[str], now: bool = False) -> None:
            pass

        def warm_up(self) -> None:  # an interface of its own
            pass

    drifted = Drifted.__new__(Drifted)
    drifted.__dict__.update(vars(fake))
    del drifted.__dict__["vocab_size"]
    found = problems(drifted, EngineCore, extras_allowed=False)
    assert [line.split("(")[0].split(":")[0] for line in found] == [
        "vocab_size",
        "abort_request",
        "step",
        "get_ledger",
        "warm_up",
    ], found
