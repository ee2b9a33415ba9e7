"""The in-process backend: drives engine_core's AsyncEngine in this process."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

import msgspec

from backends.base import (
    AdapterInUseError,
    BackendInfo,
    BackendUnavailableError,
    BackendValidationError,
    FinishReason,
    GenerationRequest,
    KvHandoff,
    TokenEvent,
    TokenLogprob,
    TokenSpan,
    UpstreamError,
    Usage,
    describe,
)
from backends.engine_constraint import ENGINE_CONSTRAINT_KINDS, structured_outputs
from backends.pool.settings import PD_THRESHOLD_TOKENS  # one default for engine and vLLM pools
from engine_core import AsyncEngine, EngineConfig, EngineDeadError, LLMEngine, RequestError, SamplingParams
from engine_core import TokenLogprob as EngineLogprob
from engine_core.kv.transfer import KvExport, KvHandle
from engine_core.lora import LoraError, LoraInUseError
from engine_core.spec_decode import SpeculativeConfig
from engine_core.startup import StartupProgress

# in-process engines are built one at a time: transformers' lazy imports are not thread-safe (two threads
# loading tokenizers at once can get "cannot import name 'AutoTokenizer'"), and two loads would only share
# the cores anyway
_BUILD_LOCK = threading.Lock()


class EngineSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`type = "engine"`: the in-house engine (engine_core) serving a model from local weights."""

    type: str = "engine"
    """Selects this backend type."""
    model: str = "embedded"
    """The model: "embedded" (the packaged default), a local HF directory, a .gguf file, or a hub id."""
    dtype: str = "auto"
    """The weights' dtype. "auto": bf16 on CUDA and CPUs with native bf16 (AVX512-BF16, AMX), else float32;
    or "float32", "bfloat16", "float16" (CUDA)."""
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    """Weight quantization. "auto": as stored (a .gguf keeps its block formats); "none": all in the dtype;
    "int8" / "int4": quantized at load."""
    kv_cache_mb: int = 512
    """Memory budget of the paged KV cache, in MiB (per worker process)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    max_num_seqs: int = 64
    """Sequences in one engine step at most."""
    max_num_batched_tokens: int = 2048
    """Tokens computed in one engine step at most (longer prefills are chunked)."""
    long_prefill_token_threshold: int = 0
    """vLLM's: above 0, one prompt gets at most this many tokens a step, so a long prompt's chunks leave room in
    the budget for short prompts that arrive while it prefills (they start a step later, not after it); 0: off."""
    max_model_len: int | None = None
    """Context length; default: the model's max_position_embeddings."""
    enable_prefix_caching: bool = False
    """Reuse the KV blocks of prompt prefixes seen before."""
    num_threads: int | None = None
    """Torch intra-op threads; default: in worker processes the cores divided among the replicas, in a thread
    torch's default."""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """Attention kernels. "auto": Triton on CUDA; on CPU the compiled kernels for bf16 when they build, else the
    torch reference."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs. "auto": CUDA when torch sees a GPU, else the CPU."""
    cuda_graphs: bool = True
    """CUDA only: decode steps replayed from graphs captured per batch size."""
    lora_adapters: dict[str, str] = {}
    """LoRA adapter name -> PEFT adapter directory, loaded at start."""
    max_loras: int = 4
    """Distinct adapters in one engine step (requests of others wait a step)."""
    max_lora_rank: int = 16
    """Adapters of a higher rank are refused."""
    workers: Literal["process", "thread"] = "process"
    """How the engine runs. "process": in a worker process of its own (backends/engine_worker), so the gateway's
    event loop does not share a GIL with the step loop; "thread": in the gateway's process (tests, debugging)."""
    replicas: int = 1
    """Over 1: that many worker processes, each with its own KV cache and num_threads (default: the cores
    divided among them), behind one balancer (backends/pool/balance.py explains the policies)."""
    balance: Literal["round_robin", "least_load", "prefix"] = "prefix"
    """How the replicas share requests: "prefix" (prompt-prefix affinity), "least_load" or "round_robin"."""
    prefill_replicas: int = 0
    """Prefill/decode disaggregation (backends/pool/disaggregated.py): this many of the `replicas` workers prefill
    and hand the KV over, the rest decode; 0: every worker does both."""
    pd_threshold_tokens: int = PD_THRESHOLD_TOKENS
    """Uncached prompt tokens from which prefill goes to a prefill worker."""
    prefill_timeout: float = 60.0
    """Seconds for a prefill leg's handover before the decode worker prefills itself."""
    kv_transport: Literal["shm", "zmq"] = "shm"
    """How the KV moves: "shm", a file in /dev/shm (workers on one host); "zmq", inside the workers' ZeroMQ
    messages through the gateway (workers that share no memory); the layout is checked on both sides."""
    speculative: dict[str, Any] | None = None
    """`[backends.<name>.speculative]`: speculative decoding (engine_core/spec_decode/config.py's fields, vLLM's
    names); absent: off."""

    def __post_init__(self) -> None:
        self.speculative_config()  # a bad table is refused when the config is read
        if self.replicas < 1:
            raise ValueError("`replicas` must be >= 1")
        if self.replicas > 1 and self.workers == "thread":
            raise ValueError("`replicas` > 1 runs worker processes: it needs workers = \"process\"")
        if not 0 <= self.prefill_replicas < self.replicas:
            raise ValueError("`prefill_replicas` must be >= 0 and leave at least one of the `replicas` to decode")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("`long_prefill_token_threshold` must be >= 0 (0: off)")
        if self.pd_threshold_tokens < 0 or self.prefill_timeout <= 0:
            raise ValueError("`pd_threshold_tokens` must be >= 0 and `prefill_timeout` > 0")

    def describe(self) -> str:
        """What `llmgw check-config` prints: the model and the dtype it would load, with the reason."""
        try:
            dtype, reason = self.engine_config().dtype_choice()
        except ValueError as exc:
            return f"model {self.model}; {exc}"
        served = f"model {self.model}, dtype {self.dtype} -> {str(dtype).removeprefix('torch.')} ({reason})"
        spec = self.speculative_config()
        if spec is not None:
            served += f"; speculative decoding {spec.describe()}"
        if self.long_prefill_token_threshold:
            served += f"; at most {self.long_prefill_token_threshold} tokens of a prompt a step"
        if self.prefill_replicas:
            return served + (f"; {self.replicas} worker processes: {self.prefill_replicas} prefill (balance prefix), "
                             f"{self.replicas - self.prefill_replicas} decode (balance least_load); prefill goes "
                             f"remote from {self.pd_threshold_tokens} uncached prompt tokens, KV "
                             + ("through shared memory" if self.kv_transport == "shm" else "in ZeroMQ messages"))
        return served + (f"; {self.replicas} worker processes, balance {self.balance}" if self.replicas > 1 else "")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, dtype=self.dtype, quantization=self.quantization,
                            block_size=self.block_size,
                            kv_cache_bytes=self.kv_cache_mb * 1024**2, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            long_prefill_token_threshold=self.long_prefill_token_threshold,
                            max_model_len=self.max_model_len,
                            enable_prefix_caching=self.enable_prefix_caching, num_threads=self.num_threads,
                            attention_backend=self.attention_backend, device=self.device,
                            cuda_graphs=self.cuda_graphs, lora_adapters=dict(self.lora_adapters),
                            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            speculative=self.speculative_config())

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative is None:
            return None
        unknown = sorted(set(self.speculative) - {f.name for f in dataclasses.fields(SpeculativeConfig)})
        if unknown:
            raise ValueError(f"unknown field(s) in `speculative`: {', '.join(unknown)}")
        return msgspec.convert(self.speculative, SpeculativeConfig)


class EngineBackend:
    type_name: ClassVar[str] = "engine"
    Settings: ClassVar[type[msgspec.Struct]] = EngineSettings

    def __init__(self, name: str, settings: EngineSettings) -> None:
        self.name = name
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.progress = StartupProgress()

    async def start(self) -> None:
        config = self.settings.engine_config()
        def build() -> LLMEngine:  # in its step thread
            with _BUILD_LOCK:
                return LLMEngine(config, self.progress)

        engine = AsyncEngine(build)
        try:
            await engine.ready()
        except asyncio.CancelledError:  # the gateway stopped or reloaded while loading: no thread left behind
            engine.shutdown(timeout=0)  # the thread ends once the build does
            raise
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        self.engine = engine  # engine.engine.load_seconds says how long loading took

    @property
    def llm(self) -> LLMEngine:
        if self.engine is None:
            raise BackendUnavailableError(self.load_error or "the model is still loading")
        return self.engine.engine

    def startup_step(self) -> str | None:
        """What a starting engine is doing now (for /health), or None once it is up or has failed."""
        current = self.progress.current()
        if self.engine is not None or self.load_error is not None:
            return None
        return f"{current[0]} ({current[1]:.0f} s so far)" if current else "starting"

    def speculative(self) -> str | None:
        """How the engine speculates, for /info; None: it does not."""
        spec = self.settings.speculative_config()
        return spec.describe() if spec is not None else None

    def dtype(self) -> tuple[str, str] | None:
        """The weights' dtype and why, once loaded."""
        if self.engine is None:
            return None
        llm = self.engine.engine
        return str(llm.model.dtype).removeprefix("torch."), llm.dtype_reason

    async def health(self) -> bool:
        return self.engine is not None and self.engine.alive

    def info(self) -> BackendInfo:
        if self.engine is None:
            return BackendInfo(backend_type=self.type_name, model_id=self.settings.model,
                               constraint_kinds=ENGINE_CONSTRAINT_KINDS)
        llm = self.engine.engine
        tok = llm.tokenizer
        return BackendInfo(backend_type=self.type_name, model_id=llm.model_dir.name, max_model_len=llm.max_model_len,
                           chat_template=tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token,
                           constraint_kinds=ENGINE_CONSTRAINT_KINDS)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        encoding = self.llm.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        byte_offsets = _char_to_byte_offsets(text)
        return [TokenSpan(id=t, text=text[s:e], start=byte_offsets[s], stop=byte_offsets[e])
                for t, (s, e) in zip(encoding["input_ids"], encoding["offset_mapping"])]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.engine is None or not self.engine.alive:
            raise BackendUnavailableError(self.load_error or "the model is not loaded")
        params = SamplingParams(
            temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, min_p=request.min_p,
            typical_p=request.typical_p, repetition_penalty=request.repetition_penalty,
            frequency_penalty=request.frequency_penalty, presence_penalty=request.presence_penalty,
            seed=request.seed, max_new_tokens=request.max_new_tokens, min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos, stop=list(request.stop), stop_token_ids=list(request.stop_token_ids),
            logprobs=request.top_logprobs if (request.logprobs or request.top_logprobs) else None,
            prompt_logprobs=request.prompt_logprobs, structured_outputs=structured_outputs(request.constraint),
            adapter=request.adapter, speculative=request.speculative)
        prompt: str | list[int] | None = request.prompt_token_ids or request.prompt
        if prompt is None:
            raise BackendValidationError("the engine backend needs a prompt; chat is rendered by the gateway")
        kv = _kv_leg(request, inline=self.settings.kv_transport == "zmq")
        try:
            async for out in self.engine.generate(prompt, params, request.request_id, kv):
                if out.kv_error is not None:
                    raise UpstreamError(f"{self.name}: {out.kv_error}")
                event = TokenEvent(
                    token_id=out.token_id, text=out.text, token_text=out.token_text, special=out.special,
                    logprob=out.logprob, top_logprobs=[self._logprob(t) for t in out.top_logprobs],
                    seed=out.seed, queue_seconds=out.queue_seconds)
                if out.kv_handle is not None:
                    handle = out.kv_handle
                    event.kv_handoff = KvHandoff(params=handle, num_bytes=handle.num_bytes, seconds=handle.seconds)
                elif out.kv_imported is not None:
                    taken = out.kv_imported
                    event.kv_handoff = KvHandoff(imported=taken.imported, reason=taken.reason,
                                                 num_bytes=taken.num_bytes, seconds=taken.seconds)
                if out.prompt_logprobs is not None:
                    event.prompt_tokens = self._prompt_tokens(prompt, out.prompt_logprobs)
                if out.finish_reason is not None:
                    event.finish_reason = FinishReason(out.finish_reason)
                    event.stop_string = out.stop_string
                    event.usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
                yield event
        except RequestError as exc:
            raise BackendValidationError(str(exc)) from None
        except UpstreamError:
            raise
        except EngineDeadError as exc:
            raise BackendUnavailableError(str(exc)) from None
        except Exception as exc:  # a failed step: every request in it ends with this error, the engine goes on
            raise UpstreamError(f"{self.name}: engine step failed: {describe(exc)}") from None

    def _logprob(self, entry: EngineLogprob) -> TokenLogprob:
        return TokenLogprob(entry.token_id, self.llm.tokenizer.decode([entry.token_id]), entry.logprob)

    def _prompt_tokens(self, prompt: str | list[int], scored: list[EngineLogprob]) -> list[TokenLogprob]:
        ids = prompt if isinstance(prompt, list) else self.llm.tokenize(prompt)
        decode = self.llm.tokenizer.decode
        first = [TokenLogprob(ids[0], decode([ids[0]]), None)]  # the first token has nothing to score it
        return first + [TokenLogprob(e.token_id, decode([e.token_id]), e.logprob) for e in scored]

    async def release_kv(self, transfer_id: str) -> bool:
        """A prefill leg's KV was taken by its decode leg, or will not be: free its blocks (and its file)."""
        if self.engine is None or not self.engine.alive:
            return False
        return await self.engine.call(lambda engine: engine.release_kv(transfer_id))

    # LoRA adapters (a worker-process engine forwards these three)

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters it serves: name -> directory (the configured ones until the engine is up)."""
        if self.engine is None:
            return dict(self.settings.lora_adapters)
        return self.engine.engine.loras.paths()

    async def load_adapter(self, name: str, path: str) -> None:
        """Read and validate off the step thread, then register between two steps."""
        llm = self.llm
        if self.engine is None or not self.engine.alive:
            raise BackendUnavailableError(self.load_error or "the model is not loaded")
        try:
            adapter = await asyncio.to_thread(llm.loras.read, name, path)
            await self.engine.call(lambda engine: engine.add_adapter(adapter))
        except LoraError as exc:
            raise BackendValidationError(str(exc)) from None

    async def unload_adapter(self, name: str) -> None:
        """Refused with AdapterInUseError while requests in flight use it; they finish on it."""
        if self.engine is None or not self.engine.alive:
            raise BackendUnavailableError(self.load_error or "the model is not loaded")
        try:
            await self.engine.call(lambda engine: engine.unload_adapter(name))
        except LoraInUseError as exc:
            raise AdapterInUseError(str(exc)) from None
        except LoraError as exc:
            raise BackendValidationError(str(exc)) from None

    async def aclose(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)


def _kv_leg(request: GenerationRequest, inline: bool) -> KvExport | KvHandle | None:
    """What the engine does with a disaggregated request's leg: export after the first token, or continue from
    a handle (relayed through the gateway as msgpack, so a dict here unless it never left this process)."""
    leg = request.kv_transfer
    if leg is None:
        return None
    if leg.role == "prefill":
        return KvExport(leg.transfer_id, inline)
    if isinstance(leg.params, KvHandle):
        return leg.params
    try:
        return msgspec.convert(leg.params, KvHandle)
    except msgspec.ValidationError as exc:
        raise BackendValidationError(f"the decode leg's KV handle is not one this engine reads: {exc}") from None


def _char_to_byte_offsets(text: str) -> list[int]:
    offsets = [0]
    for ch in text:
        offsets.append(offsets[-1] + len(ch.encode()))
    return offsets
