"""Wire types of the LoRA admin routes: the gateway's `POST /admin/lora` and vLLM's runtime-update routes."""

from __future__ import annotations

import msgspec


class LoraAdminRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str  # the adapter's name: what clients put in OpenAI `model` or TGI `adapter_id`
    path: str | None = None  # a PEFT adapter directory on the gateway's machine; required to load
    unload: bool = False
    model: str | None = None  # whose engine backends load it; default: the default model
    backend: str | None = None  # or one backend by name


class LoraAdminResponse(msgspec.Struct, kw_only=True):
    name: str
    model: str | None
    backends: list[str]
    loaded: bool


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's `/v1/load_lora_adapter` body (vllm/entrypoints/openai/protocol.py)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name; here, unload then load


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; ignored
