"""Prefill/decode disaggregation inside the engine: handing a request over after its first token, and taking
one over from another engine (the KV itself moves as transfer.py says). A part of LLMEngine, kept apart."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_core.kv.transfer import (
    KvHandle,
    KvImported,
    KvLayout,
    check_handle,
    export_kv,
    import_kv,
    remove_transfer,
    restore_generator,
)
from engine_core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine_core.kv.block_manager import BlockManager
    from engine_core.model_runner import ModelRunner
    from engine_core.models.decoder import DecoderModel
    from engine_core.scheduler import Scheduler
    from engine_core.spec_decode import SpecDecoder
    from engine_core.text.detokenizer import IncrementalDetokenizer

log = logging.getLogger("llmgw.engine")
PARKED_SECONDS = 60.0  # a handed-over request nobody released in this time frees its blocks anyway


class KvHandovers:
    """LLMEngine's handover methods; `parked` holds handed-over requests (by transfer id) whose blocks wait for
    `release_kv`."""

    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    model: DecoderModel
    spec: SpecDecoder | None
    kv_layout: KvLayout
    seqs: dict[str, Sequence]
    detokenizers: dict[str, IncrementalDetokenizer]
    parked: dict[str, tuple[Sequence, float]]
    _release: Callable[[Sequence], None]  # LLMEngine's: a request ends, its blocks free

    def _take_handover(self, seq: Sequence, handle: KvHandle) -> None:
        """Continue a request another engine prefilled: its prompt's KV into fresh blocks, then its first token
        as if sampled here (detokenizer, grammar and generator replayed). When the KV cannot be taken, the prompt
        and first token are prefilled here instead: the same tokens follow, later."""
        started = time.perf_counter()
        reason = check_handle(handle, self.kv_layout, seq.num_tokens)
        if reason is None and not self.block_manager.can_allocate(seq, handle.num_tokens + 1):
            reason = "no free KV blocks for it"
        if reason is None:
            try:
                self.block_manager.allocate(seq, handle.num_tokens)
                import_kv(seq, handle, self.model.k_caches, self.model.v_caches)
                seq.num_computed_tokens = handle.num_tokens
                self.block_manager.cache_full_blocks(seq)
            except Exception as exc:  # a file cut short under us: whatever was copied is dropped
                self.block_manager.free(seq)
                reason = f"reading the KV failed: {exc}"
        remove_transfer(handle.transfer_id)
        if reason is not None:
            log.warning("request %s: KV handover %s not taken (%s); prefilling here", seq.request_id,
                        handle.transfer_id, reason)
        seq.kv_imported = KvImported(reason is None, handle.num_bytes if reason is None else 0,
                                     time.perf_counter() - started, reason)
        seq.token_ids.append(handle.first_token)
        self.detokenizers[seq.request_id].step(handle.first_token)  # the client has its text already
        if seq.grammar is not None:
            seq.grammar.accept(handle.first_token)
        if handle.generator_state is not None and seq.generator is not None:
            seq.generator = restore_generator(handle.generator_state)
        if seq.params.prompt_logprobs:
            seq.prompt_logprobs = seq.prompt_logprobs or []  # sent with the first token, by the prefill engine

    def _hand_over(self, seq: Sequence, token: int) -> tuple[KvHandle | None, str | None]:
        """After the first token of a request to export: write its prompt's KV and park it (out of the batch,
        its blocks held until `release_kv`). Returns the handle, or why there is none (the request then ends)."""
        assert seq.kv_export is not None
        transfer_id = seq.kv_export
        try:
            handle = export_kv(seq, seq.num_prompt_tokens, self.model.k_caches, self.model.v_caches, self.kv_layout,
                               transfer_id, token, seq.kv_export_inline)
        except Exception as exc:
            remove_transfer(transfer_id)
            log.error("request %s: KV export failed: %s", seq.request_id, exc)
            self._release(seq)
            return None, f"the KV handover could not be written: {exc}"
        self.scheduler.running.remove(seq)
        seq.status = SequenceStatus.FINISHED  # out of every batch; its blocks stay until released
        self.parked[transfer_id] = (seq, time.monotonic())
        seq.grammar = None
        self.detokenizers.pop(seq.request_id, None)
        self.seqs.pop(seq.request_id, None)
        self.runner.forget(seq.request_id)
        if self.spec is not None:
            self.spec.finish(seq)
        return handle, None

    def release_kv(self, transfer_id: str) -> bool:
        """The decode side has the KV (or will not take it): free the parked request's blocks and its file."""
        remove_transfer(transfer_id)
        parked = self.parked.pop(transfer_id, None)
        if parked is None:
            return False
        self.block_manager.free(parked[0])
        return True

    def _release_stale(self) -> None:
        now = time.monotonic()
        for transfer_id in [t for t, (_, at) in self.parked.items() if now - at > PARKED_SECONDS]:
            log.warning("KV handover %s was not released in %.0f s; freeing its blocks", transfer_id,
                        PARKED_SECONDS)
            self.release_kv(transfer_id)

