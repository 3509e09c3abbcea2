"""LoRA adapters in the serving layer (#33), transport-free: the load and unload routes'
bodies and work, the adapters' model cards, and the engine view that runs a request on the
adapter its ``model`` names.

vLLM's interface: a request selects an adapter by sending its name as ``model``; ``GET
/v1/models`` lists each adapter with ``parent`` (its ``base_model_name``, or the served model);
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
/v1/unload_lora_adapter`` ``{"lora_name"}`` change the set at run time (served with
``--enable-lora``, 404 otherwise; behind ``--api-key`` like every ``/v1/`` route). A bad
adapter is a 400 naming what is wrong and changes nothing.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.engine.protocol import EngineClient, EngineDeadError, RequestOutputStream
from jaxserve.sampling_params import SamplingParams
from jaxserve.serving.engine_calls import engine_error
from jaxserve.serving.errors import APIError, from_value_error
from jaxserve.serving.validation import ServingInfo


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): a PEFT adapter directory served as a name."""

    model_config = ConfigDict(strict=True, extra="allow")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): forget a loaded adapter."""

    model_config = ConfigDict(strict=True, extra="allow")
    lora_name: str = Field(min_length=1)


LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def check_enabled(engine: EngineClient, path: str) -> None:
    """Raises the 404 of a LoRA route on a server without ``--enable-lora``."""
    if engine.engine_config.lora is None:
        raise APIError(
            f"POST {path} is served only with --enable-lora", status=404, code="not_found"
        )


async def load_lora_adapter(
    engine: EngineClient, info: ServingInfo, request: LoadLoRAAdapterRequest
) -> dict[str, Any]:
    """Loads the adapter ``request`` names (the body validated).

    Raises:
      APIError: 400 for a name in use (the served model's too) or a bad adapter (the engine's
        one-line reason); 503 when the engine died.
    """
    if request.lora_name in info.model_names:
        raise APIError(
            f"lora_name {request.lora_name!r} is the served model's name",
            status=400,
            param="lora_name",
        )
    try:
        await engine.load_lora_adapter(request.lora_name, request.lora_path)
    except ValueError as exc:
        raise from_value_error(exc) from None
    except EngineDeadError as exc:
        raise engine_error(exc) from None
    return {"status": "loaded", "lora_name": request.lora_name}


async def unload_lora_adapter(
    engine: EngineClient, info: ServingInfo, request: UnloadLoRAAdapterRequest
) -> dict[str, Any]:
    """Unloads the adapter ``request`` names (the body validated).

    Raises:
      APIError: 404 for an adapter not loaded; 400 for one that unfinished requests use; 503
        when the engine died.
    """
    if request.lora_name not in info.lora_adapters():
        raise APIError(
            f"LoRA adapter {request.lora_name!r} is not loaded",
            status=404,
            param="lora_name",
            code="model_not_found",
        )
    try:
        await engine.unload_lora_adapter(request.lora_name)
    except ValueError as exc:
        raise from_value_error(exc) from None
    except EngineDeadError as exc:
        raise engine_error(exc) from None
    return {"status": "unloaded", "lora_name": request.lora_name}


def adapter_cards(info: ServingInfo, base_card: dict[str, Any]) -> list[dict[str, Any]]:
    """The loaded adapters' model cards: the served model's, under the adapter's name, with
    ``parent`` its ``base_model_name`` (default: the served model) and ``root`` its name."""
    return [
        {**base_card, "id": name, "root": name, "parent": parent or info.model_name}
        for name, parent in info.lora_adapters().items()
    ]


class AdapterEngine:
    """``engine`` as the serving functions see it for a request on LoRA adapter ``lora_name``:
    every request it adds runs on that adapter; everything else is ``engine``'s."""

    def __init__(self, engine: EngineClient, lora_name: str):
        self._engine, self.lora_name = engine, lora_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> RequestOutputStream:
        """``engine.add_request`` on this view's adapter (``lora_name`` overrides it)."""
        return await self._engine.add_request(
            request_id,
            prompt,
            params,
            priority=priority,
            cache_salt=cache_salt,
            lora_name=lora_name or self.lora_name,
        )
