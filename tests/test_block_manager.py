"""The KV block pool: allocation, exhaustion, freeing, and prefix caching of full blocks."""

from __future__ import annotations

import pytest

from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.host_tier import HostKVTier


def test_allocate_append_free():
    kv = KVBlockManager(num_blocks=8, block_size=4)
    tokens = list(range(20))
    first = kv.allocate_slots("a", tokens[:6], 0, 6)
    assert len(first) == 2 and kv.num_free_blocks == 6
    # A decode step that still fits in the last block takes nothing new.
    assert kv.allocate_slots("a", tokens[:7], 6, 1) == []
    assert kv.allocate_slots("a", tokens[:8], 7, 1) == []
    third = kv.allocate_slots("a", tokens[:9], 8, 1)
    assert len(third) == 1 and kv.block_ids("a") == first + third
    other = kv.allocate_slots("b", tokens, 0, 20)
    assert len(other) == 5 and not set(other) & set(kv.block_ids("a"))
    assert kv.num_free_blocks == 0 and kv.usage == 1.0
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.block_ids("a") == []
    assert all(kv.ref_count(b) == 0 for b in range(8))


def test_exhaustion_changes_nothing():
    kv = KVBlockManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", list(range(12)), 0, 12) is not None
    assert kv.allocate_slots("b", list(range(8)), 0, 8) is None
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []
    assert kv.allocate_slots("a", list(range(16)), 12, 4) is not None
    assert kv.allocate_slots("a", list(range(17)), 16, 1) is None
    assert len(kv.block_ids("a")) == 4


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="num_blocks"):
        KVBlockManager(num_blocks=0, block_size=4)
    kv = KVBlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots("a", [1, 2], 0, 0)
    with pytest.raises(ValueError, match="token ids known"):
        kv.allocate_slots("a", [1, 2], 0, 3)
    with pytest.raises(ValueError, match="computed tokens"):
        kv.allocate_slots("a", [1] * 10, 8, 1)


def test_prefix_cache_hits_share_full_blocks_with_ref_counts():
    kv = KVBlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))  # two full blocks and a partial one
    kv.allocate_slots("a", prompt, 0, 10)
    kv.new_step()
    other = prompt[:8] + [99, 98, 97]
    hits, num_hit = kv.get_computed_blocks("b", other)
    assert hits == kv.block_ids("a")[:2] and num_hit == 8
    new = kv.allocate_slots("b", other, num_hit, len(other) - num_hit, hits)
    assert len(new) == 1 and kv.block_ids("b") == hits + new
    assert [kv.ref_count(b) for b in hits] == [2, 2]
    # The partial third block of "a" is not shared.
    assert kv.block_ids("a")[2] not in kv.block_ids("b")
    kv.free("a")
    assert [kv.ref_count(b) for b in hits] == [1, 1]
    kv.free("b")
    assert kv.num_free_blocks == 10
    # Freed cached blocks stay findable, and taking them back removes them from the pool.
    hits_again, num_hit = kv.get_computed_blocks("c", prompt)
    assert hits_again == hits and num_hit == 8
    kv.allocate_slots("c", prompt, num_hit, 2, hits_again)
    assert kv.num_free_blocks == 7 and [kv.ref_count(b) for b in hits] == [1, 1]


def test_prefix_hit_leaves_a_token_to_compute_and_needs_the_whole_chain():
    kv = KVBlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(8))
    kv.allocate_slots("a", prompt, 0, 8)
    kv.new_step()
    # All 8 tokens are cached, but the last one must run to give logits.
    assert kv.get_computed_blocks("b", prompt)[1] == 4
    # Same second block after a different first block: the chained hash differs.
    assert kv.get_computed_blocks("c", [9, 9, 9, 9, 4, 5, 6, 7, 1]) == ([], 0)


def test_block_computed_in_the_step_being_built_is_not_a_hit():
    kv = KVBlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    kv.allocate_slots("a", prompt, 0, 9)
    assert kv.get_computed_blocks("b", prompt) == ([], 0)
    kv.new_step()
    assert kv.get_computed_blocks("b", prompt)[1] == 8


def test_lru_reuse_evicts_least_recently_freed_cached_blocks_last():
    kv = KVBlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    prompts = {name: [i, i, 50 + i] for i, name in enumerate("abc")}  # one full block each
    for name, prompt in prompts.items():
        kv.allocate_slots(name, prompt, 0, 3)
    for name in "abc":
        kv.free(name)
    kv.new_step()
    # Uncached blocks go first: these three take no cached block.
    kv.allocate_slots("x", list(range(6)), 0, 6)
    assert all(kv.get_computed_blocks(n, p)[1] == 2 for n, p in prompts.items())
    kv.free("x")
    kv.new_step()
    # Then the least recently freed cached block ("a"'s) is evicted first.
    kv.allocate_slots("y", [100, 101], 0, 2)
    assert kv.get_computed_blocks("a", prompts["a"]) == ([], 0)
    assert kv.get_computed_blocks("b", prompts["b"])[1] == 2
    assert kv.get_computed_blocks("c", prompts["c"])[1] == 2


def test_no_hits_without_prefix_caching():
    kv = KVBlockManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)
    kv.new_step()
    assert kv.get_computed_blocks("b", [1, 2, 3]) == ([], 0)


def test_reset_prefix_cache_forgets_every_cached_block():
    kv = KVBlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))
    kv.allocate_slots("a", prompt, 0, 10)  # running: holds two full blocks
    kv.allocate_slots("b", prompt[:5], 0, 5)
    kv.free("b")  # finished: its full block stays cached while free
    kv.new_step()
    assert kv.get_computed_blocks("c", prompt)[1] == 8
    held = kv.block_ids("a")
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks("c", prompt) == ([], 0)
    assert kv.block_ids("a") == held and all(kv.ref_count(b) == 1 for b in held)
    # The running request goes on; a new request computes the prefix again and caches it.
    assert kv.allocate_slots("a", list(range(12)), 10, 2) == []  # room in its last block
    kv.allocate_slots("e", prompt, 0, 10)
    kv.new_step()
    assert kv.get_computed_blocks("f", prompt) == (kv.block_ids("e")[:2], 8)
    # The running request's blocks filled since attend to KV from before the reset: none
    # is cached, so a prompt of its tokens finds the new request's blocks and no more.
    kv.allocate_slots("a", list(range(13)), 12, 1)
    kv.new_step()
    assert kv.get_computed_blocks("g", list(range(13))) == (kv.block_ids("e")[:2], 8)
    kv.free("a")  # a request freed after it (preempted: recomputed) registers anew
    kv.allocate_slots("a", list(range(13)), 0, 13)
    kv.new_step()
    assert kv.get_computed_blocks("g", list(range(13)))[1] == 12


def test_num_cached_tokens_counts_the_cache_and_the_host_tier():
    """What a router asks of a decode instance's cache: full blocks of the longest
    cached prefix, in the device cache or the host tier, a token short of all at most."""
    kv = KVBlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True,
                        host_tier=HostKVTier(4))  # fmt: skip
    prompt = list(range(12))
    kv.allocate_slots("a", prompt, 0, 12)
    kv.new_step()
    assert kv.num_cached_tokens(prompt + [50]) == 12
    assert kv.num_cached_tokens(prompt) == 8  # the last token is computed
    assert kv.num_cached_tokens([99, *prompt[1:], 50]) == 0  # the chain breaks at once
    kv.free("a")
    kv.allocate_slots("b", list(range(100, 116)), 0, 16)  # evicts all three to the host
    kv.new_step()
    assert kv.num_cached_tokens(prompt + [50]) == 12
    assert kv.get_computed_blocks("c", prompt + [50]) == ([], 0)
    assert len(kv.get_host_hits("c", prompt + [50], 0)) == 3
    assert KVBlockManager(4, 4).num_cached_tokens(prompt) == 0  # no prefix caching
