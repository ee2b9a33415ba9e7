"""The synchronous engine: add requests, then `step()` (schedule → run → postprocess) until done."""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine_core.attention import AttentionBackend, TorchReferenceAttention
from engine_core.attention.cpu_paged import CpuPagedAttention, paged_decode_kernel
from engine_core.config import EngineConfig
from engine_core.cpu.features import cpu_features
from engine_core.cpu.kernels import cpu_kernels, kernel_build
from engine_core.cuda_graphs import DecodeGraphs
from engine_core.gguf_blocks import describe as describe_blocks
from engine_core.kv.block_manager import BlockManager
from engine_core.kv.handover import KvHandovers
from engine_core.kv.transfer import KvExport, KvHandle, layout_of
from engine_core.loader import (
    conversion_due,
    load_state_dict,
    load_tokenizer,
    resolve_model_dir,
)
from engine_core.lora import LoraAdapter, LoraError, LoraInUseError, LoraRegistry
from engine_core.model_runner import ModelRunner, VerifyBatch
from engine_core.models.layers.linear import QUANT_KERNEL_MAX_ROWS
from engine_core.models.registry import build_model, load_model_args
from engine_core.outputs import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, RequestOutput
from engine_core.sampling.params import SamplingParams
from engine_core.sampling.sampler import Sampler
from engine_core.scheduler import ScheduledBatch, Scheduler
from engine_core.sequence import Sequence, SequenceStatus
from engine_core.spec_decode import SpecDecoder, build_spec_decoder, draft_accepted
from engine_core.spec_decode.draft_model import DraftModelProposer
from engine_core.startup import StartupProgress
from engine_core.structured.compiler import GrammarCompiler, GrammarError
from engine_core.structured.matcher import GrammarState
from engine_core.text.detokenizer import IncrementalDetokenizer

log = logging.getLogger("llmgw.engine")


class RequestError(ValueError):
    """A request the engine cannot serve as asked (empty, too long, bad parameters)."""


@dataclass(slots=True)
class StepStats:
    num_seqs: int
    num_tokens: int
    seconds: float


def select_attention(config: EngineConfig, device: torch.device) -> AttentionBackend:
    if config.attention_backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention_backend {config.attention_backend!r}; use 'auto', 'torch' or 'triton'")
    if config.attention_backend == "triton" or (config.attention_backend == "auto" and device.type == "cuda"):
        from engine_core.attention.triton_paged import TritonAttention

        return TritonAttention()
    # the compiled kernel for every dtype: it reads the blocks in place, where the reference gathers and
    # pads them: one layer's decode, batch 1-128, was 3.7-10x faster in fp32 and 6-38x in bf16, with the
    # AVX2 build as with the AVX-512 one (benchmarks/attention_paths.py, docs/benchmarks.md)
    if config.attention_backend == "auto":
        kernel = paged_decode_kernel()
        if kernel is not None:
            return CpuPagedAttention(kernel)
    return TorchReferenceAttention()


class LLMEngine(KvHandovers):
    def __init__(self, config: EngineConfig, progress: StartupProgress | None = None) -> None:
        started = time.perf_counter()
        progress = progress or StartupProgress()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.threads = torch.get_num_threads()
        self.config = config
        self.device = config.torch_device()
        dtype, self.dtype_reason = config.dtype_choice()
        log.info("engine: dtype %s (%s) on %s; CPU %s", str(dtype).removeprefix("torch."), self.dtype_reason,
                 self.device, cpu_features().describe())
        due = conversion_due(config.model)
        with progress.step(f"converting {due} (once)") if due else contextlib.nullcontext():
            self.model_dir = resolve_model_dir(config.model)
        self.model_args = load_model_args(self.model_dir)
        with progress.step("loading the tokenizer"):
            self.tokenizer = load_tokenizer(self.model_dir)
        self.max_model_len = min(config.max_model_len or self.model_args.max_position_embeddings,
                                 self.model_args.max_position_embeddings)
        if self.device.type == "cpu" and config.attention_backend == "auto":
            with progress.step("loading the compiled CPU kernels") as details:
                build = kernel_build()
                details.append(build.describe() if build else "unavailable: torch reference paths")
        with progress.step(f"loading weights from {self.model_dir}") as details:
            state = load_state_dict(self.model_dir, keep_quantized=config.quantization == "auto")
            self.model = build_model(self.model_args, state, dtype, self.max_model_len,
                                     select_attention(config, self.device), self.device, config.quantization)
            paths = ", ".join(f"{n} {path}" for path, n in self.model.linear_paths.items())
            layers = ("Python" if self.model.stack is None
                      else f"compiled decoder stack for steps of <= {QUANT_KERNEL_MAX_ROWS} rows")
            details.append(f"attention {self.model.attention.name}, layer ops {type(self.model.ops).__name__}, "
                           f"decoder layers {layers}, "
                           f"quantization {config.quantization}, linear layers: {paths}")
            kept = describe_blocks(self.model_dir) if config.quantization == "auto" else ""
            if kept:
                details.append(f"GGUF tensors {kept}")
        with progress.step("allocating the KV cache") as details:
            block_bytes = self.model.kv_block_bytes(config.block_size)
            num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // block_bytes)
            self.model.allocate_kv_cache(num_blocks, config.block_size)
            self.kv_layout = layout_of(self.model_dir.name, self.model.k_caches)
            details.append(f"{num_blocks} blocks of {config.block_size} tokens = {num_blocks * config.block_size} "
                           f"tokens, {num_blocks * block_bytes / 2**20:.0f} MiB")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   max(config.max_num_batched_tokens, 1), config.max_loras,
                                   config.long_prefill_token_threshold)
        self.loras = LoraRegistry(self.model_args, config.max_loras, config.max_lora_rank, dtype, self.device,
                                  cpu_kernels() if self.device.type == "cpu" else None)
        if config.lora_adapters:
            with progress.step(f"loading {len(config.lora_adapters)} LoRA adapter(s)"):
                for name, path in config.lora_adapters.items():
                    self.load_adapter(name, path)
        eos = set(self.model_args.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        # constraints compile into grammars over the model's vocab (its logits width); xgrammar loads lazily
        self.grammars = GrammarCompiler(self.tokenizer, self.model_args.vocab_size, self.eos_token_ids)
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self.runner = ModelRunner(self.model, config.block_size, Sampler(self.eos_token_ids))
        self.runner.loras = self.loras
        if self.device.type == "cuda" and config.cuda_graphs and getattr(self.model.attention, "graph_safe", False):
            with progress.step("capturing CUDA graphs for decode"):
                self.runner.graphs = DecodeGraphs(self.model, config.max_num_seqs, self.max_model_len,
                                                  config.block_size)
        self.spec: SpecDecoder | None = None
        if config.speculative is not None:
            draft = None
            if config.speculative.method == "draft_model":
                with progress.step(f"loading the draft model {config.speculative.model}"):
                    draft = DraftModelProposer(
                        config.speculative.model or "", self.tokenizer.get_vocab(), self.model_args.vocab_size, dtype,
                        self.max_model_len, select_attention(config, self.device), self.device, config.quantization,
                        num_blocks, config.block_size)
            self.spec = build_spec_decoder(config.speculative, self.max_model_len, draft)
            log.info("engine: speculative decoding, %s", config.speculative.describe())
        self.seqs: dict[str, Sequence] = {}
        self.parked: dict[str, tuple[Sequence, float]] = {}  # handed-over requests by transfer id: blocks held
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self.last_step: StepStats | None = None
        self.load_seconds = time.perf_counter() - started

    # requests

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    kv: KvExport | KvHandle | None = None) -> int:
        """Queue a request; returns its prompt length in tokens. Raises RequestError if it cannot run.
        `kv` (prefill/decode disaggregation): KvExport hands the request over after its first token;
        KvHandle continues one handed over by another engine (kv/transfer.py)."""
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        try:
            params.validate()
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.model_args.vocab_size for t in token_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.model_args.vocab_size})")
        total = len(token_ids) + params.max_new_tokens
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens; the model takes at most "
                               f"{self.max_model_len - 1}")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if min(total, self.max_model_len) > capacity:
            raise RequestError(f"prompt + max_new_tokens = {total} tokens exceed the KV cache ({capacity} tokens)")
        lora = None
        if params.adapter is not None:
            lora = self.loras.get(params.adapter)
            if lora is None:
                raise RequestError(f"no LoRA adapter named {params.adapter!r} is loaded "
                                   f"(loaded: {sorted(self.loras.adapters)})")
        grammar = self._grammar(params)  # before the sequence exists: a bad constraint holds nothing
        seq = Sequence(request_id, token_ids, params, arrival=next(self._arrivals), arrival_time=time.monotonic())
        seq.grammar = grammar
        seq.lora = lora
        if not params.greedy:
            seq.seed = params.seed if params.seed is not None else random.getrandbits(63)
            seq.generator = torch.Generator().manual_seed(seq.seed)
        if params.prompt_logprobs and len(token_ids) == 1:
            seq.prompt_logprobs = []
        self.seqs[request_id] = seq
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, token_ids, list(params.stop), params.skip_special_tokens, self.special_ids)
        if isinstance(kv, KvExport):
            seq.kv_export, seq.kv_export_inline = kv.transfer_id, kv.inline
        elif isinstance(kv, KvHandle):
            self._take_handover(seq, kv)
        self.scheduler.add(seq)
        return len(token_ids)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks are free when this returns."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self._release(seq)
        return True

    # LoRA adapters; call between steps (the async engine's thread): a step sees one consistent set

    def load_adapter(self, name: str, path: str) -> LoraAdapter:
        """Read, validate and register an adapter; LoraError says why one is refused."""
        adapter = self.loras.read(name, path)
        self.add_adapter(adapter)
        return adapter

    def add_adapter(self, adapter: LoraAdapter) -> None:
        """Register an adapter already read (off the step thread) with `self.loras.read`."""
        self.loras.add(adapter)
        log.info("engine: LoRA adapter %s loaded from %s (rank %d, %s)", adapter.name, adapter.path, adapter.rank,
                 ", ".join(adapter.target_modules))

    def unload_adapter(self, name: str) -> None:
        """Refused (LoraInUseError) while any request in flight uses the adapter: they finish on it."""
        if name not in self.loras.adapters:
            raise LoraError(f"no adapter named {name!r} is loaded")
        users = sum(1 for seq in self.seqs.values() if seq.lora is not None and seq.lora.name == name)
        if users:
            raise LoraInUseError(f"adapter {name!r} is in use by {users} request(s) in flight; "
                                 f"unload it once they finish")
        self.loras.remove(name)
        log.info("engine: LoRA adapter %s unloaded", name)

    def _grammar(self, params: SamplingParams) -> GrammarState | None:
        """A fresh matcher for a constrained request. The async engine compiles in the compiler's thread
        before it adds the request, so this is a cache hit there; a direct caller compiles here."""
        if params.structured_outputs is None:
            return None
        try:
            return GrammarState(self.grammars.compile(params.structured_outputs))
        except GrammarError as exc:
            raise RequestError(str(exc)) from None

    def _grammar_done(self, seq: Sequence, token: int) -> bool:
        """Feed the sampled token to the sequence's matcher (only while the request goes on). True when the
        grammar is complete, i.e. it accepted a stop token, which ends the request even with ignore_eos
        since nothing may follow; or when it refused the token, which the mask makes impossible short of
        a library bug, so the request ends there rather than run on unconstrained."""
        assert seq.grammar is not None
        if not seq.grammar.accept(token):
            log.error("request %s: sampled token %d is outside its grammar; ending it", seq.request_id, token)
        return seq.grammar.finished

    def _release(self, seq: Sequence) -> None:
        seq.grammar = None  # the matcher goes with the request, whichever way it ended
        self.scheduler.finish(seq)
        self.detokenizers.pop(seq.request_id, None)
        self.seqs.pop(seq.request_id, None)
        self.runner.forget(seq.request_id)
        if self.spec is not None:
            self.spec.finish(seq)

    def has_unfinished(self) -> bool:
        if self.parked:
            self._release_stale()
        return self.scheduler.has_work()

    # the step loop

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        outputs = self.postprocess(batch, *self.runner.run(batch))
        if self.spec is not None:  # drafts for the next step, from the sequences that just sampled
            self.spec.propose([s for s in batch.seqs if s.status == SequenceStatus.RUNNING
                               and s.num_computed_tokens == s.num_tokens - 1], len(self.scheduler.running))
        self.last_step = StepStats(len(batch.seqs), batch.total_tokens, time.perf_counter() - started)
        return outputs

    def postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], result: Any,
                    verify: VerifyBatch | None = None) -> list[RequestOutput]:
        drafts = batch.spec_token_ids or [[]] * len(batch.seqs)
        for seq, n, draft in zip(batch.seqs, batch.num_new_tokens, drafts):
            seq.num_computed_tokens += n - len(draft)  # a draft's KV counts once it is verified
            self.block_manager.cache_full_blocks(seq)
        outputs = []
        for i, seq in enumerate(sampled):
            token = result.token_ids[i]
            first = seq.num_output_tokens == 0
            seq.token_ids.append(token)
            outputs.append(self._output(seq, token, result.logprobs[i], result.top_logprobs[i], first))
        if verify is not None:
            outputs.extend(self._verify(verify))
        return outputs

    def _verify(self, verify: VerifyBatch) -> list[RequestOutput]:
        """Emit each drafting sequence's tokens position by position: sample the position as speculation-off
        would (spec_decode/decoder.py says why that is exact), keep going while it matches the draft. A
        rejected position's KV slot stays allocated and is overwritten next step."""
        assert self.spec is not None
        outputs = []
        alive = list(range(len(verify.seqs)))
        position = 0
        while alive:
            rows = [verify.offsets[i] + position for i in alive]
            seqs = [verify.seqs[i] for i in alive]
            # a copy (the sampler masks its rows in place): index_select takes 9-12 us for 1-2 rows of SmolLM2's
            # logits, advanced indexing 22-36 (its parallel kernel also wakes the other torch thread)
            picked = verify.logits.index_select(0, torch.tensor(rows))
            result = self.runner.sampler(picked, seqs)
            still = []
            for j, i in enumerate(alive):
                seq, draft = seqs[j], verify.drafts[i]
                sampled = result.token_ids[j]
                accepted = position < len(draft) and draft_accepted(sampled, draft[position], verify.logits[rows[j]])
                token = draft[position] if accepted else sampled
                seq.token_ids.append(token)
                output = self._output(seq, token, result.logprobs[j], result.top_logprobs[j], False)
                outputs.append(output)
                if accepted:
                    seq.num_computed_tokens += 1
                finished = output.finish_reason is not None
                if accepted and not finished:
                    still.append(i)
                    continue
                self.spec.record(seq, len(draft), position + int(accepted), position + 1, finished)
                if not finished:
                    self.block_manager.cache_full_blocks(seq)
            alive = still
            position += 1
        return outputs

    def _output(self, seq: Sequence, token: int, logprob: float | None, top: list, first: bool) -> RequestOutput:
        p = seq.params
        detok = self.detokenizers[seq.request_id].step(token)
        text, reason = detok.text, None
        if detok.stop_string is not None:
            reason = FINISH_STOP
        elif (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = FINISH_EOS
        elif seq.grammar is not None and self._grammar_done(seq, token):
            reason = FINISH_EOS
        elif seq.num_output_tokens >= p.max_new_tokens or seq.num_tokens >= self.max_model_len:
            reason = FINISH_LENGTH
        if reason is not None and reason != FINISH_STOP:
            text += self.detokenizers[seq.request_id].flush()
        output = RequestOutput(
            request_id=seq.request_id, token_id=token, token_text=detok.token_text, text=text,
            special=token in self.special_ids, num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, logprob=logprob, top_logprobs=top,
            finish_reason=reason, stop_string=detok.stop_string, seed=seq.seed,
            prompt_logprobs=seq.prompt_logprobs if first else None, num_cached_tokens=seq.num_cached_tokens,
            queue_seconds=(seq.first_scheduled_time or seq.arrival_time) - seq.arrival_time if first else None,
            kv_imported=seq.kv_imported)
        seq.kv_imported = None
        if reason is not None:
            self._release(seq)
        elif first and seq.kv_export is not None:
            output.kv_handle, output.kv_error = self._hand_over(seq, token)
        return output

    # convenience for scripts and tests

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[RequestOutput]]:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._arrivals)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].append(out)
        return [results[rid] for rid in ids]
