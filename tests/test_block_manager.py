"""The KV block pool: allocation, reverse-order freeing, and prefix-cache reuse with eviction."""

from __future__ import annotations

from engine_core.kv.block_manager import BlockManager
from engine_core.sampling.params import SamplingParams
from engine_core.scheduler import Scheduler
from engine_core.sequence import Sequence


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def test_allocate_covers_new_tokens_and_free_returns_blocks_tail_first() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    bm.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2] and bm.num_free_blocks == 5
    bm.free(seq)
    assert list(bm.free_blocks) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.check_all_free()


def test_prefix_cache_hits_full_blocks_and_verifies_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _seq(list(range(10)), "a")
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full
    b = _seq(list(range(8)) + [99, 98], "b")
    bm.match_prefix(b)
    assert b.block_table == [0, 1] and b.num_computed_tokens == 8
    assert bm.blocks[0].ref_count == 2
    c = _seq([0, 1, 2, 7] + list(range(4, 10)), "c")  # differs inside block 0: no hit at all
    bm.match_prefix(c)
    assert c.block_table == [] and c.num_computed_tokens == 0
    bm.free(a)
    bm.free(b)
    assert bm.check_all_free()
    d = _seq(list(range(8)) + [5], "d")  # freed blocks keep their hash until reused
    bm.match_prefix(d)
    assert d.block_table == [0, 1]
    bm.free(d)


def test_reused_free_block_loses_its_hash() -> None:
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    a = _seq([1, 2, 3], "a")
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    bm.free(a)
    other = _seq([7, 8, 9, 10], "o")
    bm.allocate(other, 4)  # takes both blocks, evicting the cached one
    bm.free(other)
    again = _seq([1, 2, 3], "again")
    bm.match_prefix(again)
    assert again.block_table == []


def test_scheduler_preempts_the_newest_and_readmits_it_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = _seq(list(range(8)), "old"), _seq(list(range(8)), "new")
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["old", "new"] and bm.num_free_blocks == 0
    for seq in batch.seqs:
        seq.num_computed_tokens = 8
        seq.token_ids.append(1)  # each now needs a third block
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["old"] and list(sched.waiting)[0] is new
    assert new.block_table == [] and new.num_computed_tokens == 0 and sched.num_preemptions == 1


def test_a_waiting_sequence_holds_no_cached_blocks_so_the_pool_never_deadlocks() -> None:
    """A waiting sequence that matched cached prefix blocks but could not get the rest gives them back. Before,
    it kept them: a running sequence then preempted itself for want of blocks, went back to waiting ahead of it,
    could not fit beside the blocks it held, and with nothing running no step ever freed one (an engine replica
    of benchmarks/replica_routing.py spun at 100% CPU with two requests waiting, found this way)."""
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512)
    outputs = {"cached": 1, "long": 30, "sharer": 2}

    def step() -> None:  # what the engine does around a step: the KV computed, a token sampled, a finish
        batch = sched.schedule()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            bm.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_tokens - seq.num_prompt_tokens == outputs[seq.request_id]:
                    sched.finish(seq)

    cached = list(range(100, 121))  # 5 full blocks, kept in the prefix cache once it finished
    sched.add(_seq(cached, "cached"))
    step()
    assert not sched.has_work() and bm.num_free_blocks == 12
    long = _seq(list(range(200, 204)), "long")  # will grow to 34 tokens: 9 blocks
    sched.add(long)
    while len(long.block_table) < 5:
        step()
    sharer = _seq(cached[:20] + list(range(300, 310)), "sharer")  # matches the 5 cached blocks, needs 3 more
    sched.add(sharer)
    lookups = (bm.prefix_queries, bm.prefix_hits)
    step()
    assert sharer in sched.waiting and sharer.block_table == []  # it could not start: it holds nothing
    assert (bm.prefix_queries, bm.prefix_hits) == lookups  # and its lookup counts once it starts, not every step
    for _ in range(200):
        if not sched.has_work():
            break
        step()
    assert not sched.has_work() and bm.check_all_free()
    assert long.num_tokens == 34 and sharer.num_tokens == 32
