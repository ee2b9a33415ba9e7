"""Render a model's chat template (Jinja, in a sandbox, as transformers does)."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(Exception):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the chat template does not compile: {exc}") from None


@functools.lru_cache(maxsize=32)
def uses_tools(template: str | None) -> bool:
    """Whether the template reads a `tools` variable: then it renders tools (and, as Hugging Face
    templates that know tools do, calls and tool results) itself."""
    if not template:
        return False
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def render_chat(template: str | None, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    if not template:
        raise TemplateError("this model has no chat template; configure one with `chat_template`")
    extra = {"tools": tools} if tools else {}  # templates test `tools is defined` or `if tools`
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token or "", eos_token=eos_token or "", **extra)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(str(exc)) from None
