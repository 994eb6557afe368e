"""The KV-cache manager (``tokenmill.engine.kv_cache``): the one owner of which blocks each sequence holds
and of the prefix cache. Exercised on the real paged pool, with real sequences, no model."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.prefix import full_block_hashes
from tokenmill.engine.sequence import GenerationRequest, Sequence
from tokenmill.model.sharding.mirror import MirroredPool, apply_changes
from tokenmill.sampling import SamplingParams
from tokenmill_plugins.kv.paged import PagedPool

BLOCK = 4


def new_pool(blocks: int = 16) -> PagedPool:
    return PagedPool(layers=1, num_blocks=blocks, block_size=BLOCK, kv_heads=1, head_dim=2, dtype=torch.float32,
                     device=torch.device("cpu"))


def sequence(prompt: list[int], salt: str | None = None) -> Sequence:
    request = GenerationRequest("", prompt, 4, SamplingParams(), cache_salt=salt)
    return Sequence(request, lambda event: None, None)


PROMPT = list(range(1, 12))  # 11 tokens: two full blocks can come from the cache, the last token never


def test_a_block_is_findable_only_after_the_forward_that_filled_it_committed() -> None:
    kv = KVCacheManager(new_pool(), prefix_caching=True)
    first = sequence(PROMPT)
    kv.allocate(first, 0, len(PROMPT))
    assert kv.pool.lookup(full_block_hashes(first, BLOCK, 2)) == [], "named before its forward ran"
    kv.commit([first])
    kv.free([first])
    second = sequence(PROMPT)
    assert kv.lookup(second).tokens == 2 * BLOCK


def test_a_sequence_planned_later_in_the_same_step_shares_the_blocks_an_earlier_one_fills() -> None:
    kv = KVCacheManager(new_pool(), prefix_caching=True)
    first, second = sequence(PROMPT), sequence(PROMPT)
    kv.allocate(first, 0, len(PROMPT))
    hit = kv.lookup(second)
    assert hit.tokens == 2 * BLOCK
    kv.allocate(second, hit.tokens, len(PROMPT) - hit.tokens)
    assert kv.pool.blocks_of(second.id)[:2] == kv.pool.blocks_of(first.id)[:2]
    assert second.num_computed == 2 * BLOCK


def test_the_blocks_of_a_forward_that_failed_never_get_their_names() -> None:
    kv = KVCacheManager(new_pool(), prefix_caching=True)
    failed = sequence(PROMPT)
    kv.allocate(failed, 0, len(PROMPT))
    kv.free([failed])  # its step failed: the scheduler fails and frees it
    assert kv.pool.cached_blocks() == 0
    assert kv.lookup(sequence(PROMPT)).tokens == 0
    assert kv.usage()["blocks_used"] == 0


def test_tenants_with_different_salts_never_share_a_block() -> None:
    kv = KVCacheManager(new_pool(), prefix_caching=True)
    owner = sequence(PROMPT, salt="a")
    kv.allocate(owner, 0, len(PROMPT))
    kv.commit([owner])
    assert kv.lookup(sequence(PROMPT, salt="b")).tokens == 0
    assert kv.lookup(sequence(PROMPT, salt="a")).tokens == 2 * BLOCK


def test_allocation_that_does_not_fit_takes_nothing_and_says_memory() -> None:
    kv = KVCacheManager(new_pool(blocks=2), prefix_caching=True)
    seq = sequence(PROMPT)  # 3 blocks
    with pytest.raises(MemoryError):
        kv.allocate(seq, 0, len(PROMPT))
    assert kv.pool.free_blocks() == 2 and seq.num_computed == 0


def test_rollback_keeps_the_accepted_draft_and_names_the_blocks_it_filled() -> None:
    kv = KVCacheManager(new_pool(), prefix_caching=True)
    seq = sequence(list(range(1, 8)))  # 7 tokens
    kv.allocate(seq, 0, 7)
    kv.commit([seq])
    seq.num_computed = 7
    seq.generated_ids.append(8)  # decoding: its 8th token is fed with a draft of three
    fed = kv.allocate_decode([seq], [(9, 10, 11)])
    assert fed == [(9, 10, 11)] and len(kv.pool.blocks_of(seq.id)) == 3
    kv.commit([seq])
    seq.generated_ids += [9, 99]  # the first draft token was accepted, the second rejected
    seq.num_computed = seq.total_len - 1  # 9 tokens in its KV
    kv.rollback(seq)
    assert len(kv.pool.blocks_of(seq.id)) == 3  # positions 0-8 need three blocks, the fourth never came
    assert kv.pool.cached_blocks() == 2  # block 0 at its prefill, block 1 (tokens 4-7) by the decode step


def test_reset_forgets_every_block_and_every_sequences_progress() -> None:
    kv = KVCacheManager(new_pool(), prefix_caching=True)
    running, waiting = sequence(PROMPT), sequence(PROMPT)
    kv.allocate(running, 0, len(PROMPT))
    kv.commit([running])
    kv.reset([running, waiting])
    assert kv.usage() == {"bytes": 0, "blocks_used": 0, "blocks_total": 16, "blocks_cached": 0}
    assert running.num_computed == 0 and kv.lookup(sequence(PROMPT)).tokens == 0


def test_a_shard_that_makes_rank_0s_pool_changes_holds_the_same_block_tables() -> None:
    rank0, shard = MirroredPool(new_pool()), new_pool()
    kv = KVCacheManager(rank0, prefix_caching=True)
    seqs = [sequence(PROMPT), sequence(PROMPT), sequence([7] * 9)]
    for seq in seqs:
        kv.allocate(seq, kv.lookup(seq).tokens, seq.pending_len - kv.lookup(seq).tokens)
    kv.commit(seqs)
    kv.free(seqs[:1])
    apply_changes(shard, rank0.take_changes())
    assert all(shard.blocks_of(s.id) == rank0.blocks_of(s.id) for s in seqs)
    assert shard.free_blocks() == rank0.free_blocks() and rank0.take_changes() == []


def test_freed_blocks_are_handed_out_again_before_blocks_never_written() -> None:
    pool = new_pool(blocks=16)
    assert pool.reserve(1, 3 * BLOCK)
    first = pool.blocks_of(1)
    pool.free(1)
    for seq_id in range(2, 6):  # one after another: the pool's other 13 blocks stay untouched, out of memory
        assert pool.reserve(seq_id, 3 * BLOCK)
        assert sorted(pool.blocks_of(seq_id)) == sorted(first)
        pool.free(seq_id)
