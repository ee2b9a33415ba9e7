"""TGI's request validation (router/src/validation.rs), with its messages word for word,
and the translation of `GenerateParameters` into a core `GenerationRequest`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from backends.base import GenerationRequest
from gateway.config import ServerConfig
from gateway.errors import GatewayError
from gateway.generation import tokenize_prompt
from gateway.params.tgi_grammar import tgi_constraint, tgi_route
from gateway.protocol.tgi import GenerateParameters, GenerateRequest
from gateway.routing.router import ModelRoute, with_adapter


def default_parameters() -> GenerateParameters:
    """TGI's `default_parameters()`: used when the request has no `parameters` at all."""
    return GenerateParameters(do_sample=True, details=False)


@dataclass
class ValidTgiRequest:
    core: GenerationRequest
    params: GenerateParameters
    best_of: int
    input_length: int | None
    return_full_text: bool
    sampling: bool
    route: ModelRoute  # narrowed to the backends that enforce the grammar, if there is one


def _invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(message, kind="validation", param=param)


def check_parameters(p: GenerateParameters, server: ServerConfig, stream: bool) -> bool:
    """Validate in TGI's order; returns whether the request samples."""
    sampling = p.do_sample or any([
        p.temperature is not None and p.temperature != 1.0, p.top_k is not None and p.top_k != 0,
        p.top_p is not None and p.top_p < 1.0, p.typical_p is not None and p.typical_p < 1.0])
    if p.best_of is not None:
        if p.best_of == 0 or p.best_of > server.max_best_of:
            raise _invalid(f"`best_of` must be > 0 and <= {server.max_best_of}. Given: {p.best_of}", "best_of")
        if p.best_of > 1:
            if not sampling:
                raise _invalid("you must use sampling when `best_of` is > 1", "best_of")
            if p.seed is not None:
                raise _invalid("`seed` must not be set when `best_of` > 1", "seed")
            if stream:
                raise _invalid("`best_of` != 1 is not supported when streaming tokens", "best_of")
    if p.temperature is not None and p.temperature <= 0:
        raise _invalid("`temperature` must be strictly positive", "temperature")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise _invalid("`repetition_penalty` must be strictly positive", "repetition_penalty")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise _invalid("`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise _invalid("`top_p` must be > 0.0 and < 1.0", "top_p")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise _invalid("`typical_p` must be > 0.0 and < 1.0", "typical_p")
    if p.top_k is not None and p.top_k <= 0:
        raise _invalid("`top_k` must be strictly positive", "top_k")
    if p.max_new_tokens is not None and p.max_new_tokens == 0:
        raise _invalid("`max_new_tokens` must be strictly positive", "max_new_tokens")
    if len(p.stop) > server.max_stop_sequences:
        raise _invalid(f"`stop` supports up to {server.max_stop_sequences} stop sequences. Given: {len(p.stop)}",
                       "stop")
    if p.top_n_tokens is not None and p.top_n_tokens > server.max_top_n_tokens:
        raise _invalid(f"`top_n_tokens` must be >= 0 and <= {server.max_top_n_tokens}. Given: {p.top_n_tokens}",
                       "top_n_tokens")
    if stream and p.decoder_input_details:
        raise _invalid("`decoder_input_details` == true is not supported when streaming tokens",
                       "decoder_input_details")
    return sampling


async def validate_tgi(req: GenerateRequest, route: ModelRoute, server: ServerConfig, *, stream: bool,
                       compat: bool = False, traceparent: str | None = None) -> ValidTgiRequest:
    p = req.parameters if req.parameters is not None else default_parameters()
    sampling = check_parameters(p, server, stream)
    if not req.inputs:
        raise _invalid("`inputs` cannot be empty", "inputs")
    max_input = route.max_input_tokens
    if p.truncate is not None and not 0 < p.truncate <= max_input:
        raise _invalid(f"`truncate` must be strictly positive and less than {max_input}. Given: {p.truncate}",
                       "truncate")
    ids = await tokenize_prompt(route, req.inputs)
    if ids is not None and p.truncate is not None:
        ids = ids[-p.truncate:]  # TGI keeps the last `truncate` tokens
    n_input = len(ids) if ids is not None else None
    if n_input is not None and n_input > max_input:
        raise _invalid(f"`inputs` must have less than {max_input} tokens. Given: {n_input}", "inputs")
    max_new = p.max_new_tokens
    cap = route.config.max_new_tokens
    if max_new is not None and cap is not None and max_new > cap:
        raise _invalid(f"`max_new_tokens` must be <= {cap}. Given: {max_new}", "max_new_tokens")
    if max_new is None:
        max_new = route.default_new_tokens(n_input or 0)
    total = route.max_total_tokens
    if n_input is not None and n_input + max_new > total:
        raise _invalid(f"`inputs` tokens + `max_new_tokens` must be <= {total}. "
                       f"Given: {n_input} `inputs` tokens and {max_new} `max_new_tokens`", "max_new_tokens")
    # TGI checks the grammar last, after the input's length
    constraint = tgi_constraint(p.grammar) if p.grammar is not None else None
    if p.adapter_id is not None:  # TGI's multi-LoRA selection; an unknown id is a 404 here, not the base model
        route = with_adapter(route, p.adapter_id, "adapter_id")
    route = tgi_route(route, constraint)
    want_details = p.details or p.decoder_input_details
    core = GenerationRequest(
        request_id=uuid.uuid4().hex, model=route.name, prompt=req.inputs, prompt_token_ids=ids,
        temperature=(p.temperature or 1.0) if sampling else 0.0, top_k=p.top_k or 0,
        top_p=p.top_p if p.top_p is not None else 1.0, typical_p=p.typical_p if p.typical_p is not None else 1.0,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        frequency_penalty=p.frequency_penalty or 0.0, seed=p.seed, max_new_tokens=max_new, stop=list(p.stop),
        logprobs=True, top_logprobs=p.top_n_tokens or 0,
        prompt_logprobs=p.decoder_input_details and want_details, traceparent=traceparent, stream=stream,
        constraint=constraint, adapter=route.adapter)
    return_full_text = p.return_full_text if p.return_full_text is not None else compat
    return ValidTgiRequest(core, p, p.best_of or 1, n_input, return_full_text, sampling, route)
