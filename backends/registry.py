"""Backend types by name: the built-in ones and those registered through the entry point group
`llm_gateway.backends` (an entry point names a class with `type_name` and `Settings`)."""

from __future__ import annotations

from importlib.metadata import entry_points

from backends.base import Backend

ENTRY_POINT_GROUP = "llm_gateway.backends"
_BUILTIN = {
    "engine": "backends.engine_worker:ConfiguredEngine",  # a worker process, or in-process (`workers`)
    "openai": "backends.openai:OpenAIBackend",
    "tgi": "backends.tgi:TgiBackend",
    "triton": "backends.triton:TritonBackend",
}
_registered: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator (or plain call) that makes a backend type available by its `type_name`."""
    _registered[cls.type_name] = cls
    return cls


def _load(target: str) -> type[Backend]:
    module_name, _, attr = target.partition(":")
    module = __import__(module_name, fromlist=[attr])
    return getattr(module, attr)


def backend_types() -> dict[str, type[Backend] | str]:
    """Every known type name; built-ins are imported only when first used."""
    known: dict[str, type[Backend] | str] = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        known.setdefault(ep.name, ep.value)
    known.update(_registered)
    return known


def get_backend_class(type_name: str) -> type[Backend]:
    target = backend_types().get(type_name)
    if target is None:
        raise KeyError(type_name)
    cls = _load(target) if isinstance(target, str) else target
    _registered.setdefault(type_name, cls)
    return cls
