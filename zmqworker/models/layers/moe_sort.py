"""Routing and sorting for the fused mixture of experts (fused_moe.py), on the device and
without a host synchronisation: two Triton kernels over chunks of the step's tokens, or
one (route_place_kernel) when the step is a single chunk, as decode steps are.

- route: each program takes `chunk` tokens' router logits, picks every token's top k
  experts (softmax in float32, then k rounds of a max over packed (probability, expert)
  keys, renormalised where the family does) and counts how many of its (token, choice)
  pairs go to each expert held here.
- place: each program sums the chunks' counts into every expert's total and the totals
  of the chunks before its own, so it knows where its pairs go: the pairs sorted by
  expert, each expert's run padded to a multiple of BLOCK_M (vLLM's
  moe_align_block_size). It also writes, for its share of the blocks, the expert of each
  block (-1 past the last) and the padding of each (the sentinel num_pairs).

Every size is bounded by what the host knows (the step's tokens), so the buffers and
grids are fixed for a CUDA graph: at most max_blocks(num_pairs, ...) blocks of BLOCK_M.
"""

from __future__ import annotations

import triton
import triton.language as tl

from zmqworker.pdl import release_dependents, wait_for_inputs


def max_blocks(num_pairs: int, num_local: int, block_m: int) -> int:
    """The most blocks the padded runs take: each expert that gets a pair adds at most
    one partly filled block."""
    return triton.cdiv(num_pairs, block_m) + min(num_local, num_pairs)


@triton.jit
def _route_rows(
    ids_ptr,
    weights_ptr,
    logits_ptr,
    rows,
    num_tokens,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SUB: tl.constexpr,
):
    """The top k experts of these rows' tokens and their weights (top_experts), stored;
    returns each expert's place among its row's choices [rows, EXPERTS_P2] (-1: not
    chosen, or a row past num_tokens)."""
    experts = tl.arange(0, EXPERTS_P2)
    real = experts < NUM_EXPERTS
    slots = tl.arange(0, TOP_K_P2)
    row_ok = rows < num_tokens
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_logits + experts[None, :]
    logits = tl.load(ptrs, mask=row_ok[:, None] & real[None, :], other=0.0).to(tl.float32)
    logits = tl.where(real[None, :], logits, float("-inf"))
    chosen, weights, choice = top_experts(logits, EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE, SUB)
    out = rows[:, None] * TOP_K + slots[None, :]
    ok = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + out, chosen, mask=ok)
    tl.store(weights_ptr + out, weights, mask=ok)
    return tl.where(row_ok[:, None], choice, -1)


@triton.jit
def top_experts(
    logits,
    EXPERTS_P2: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SUB: tl.constexpr,
):
    """For router logits [SUB, EXPERTS_P2] (float32, -inf past the experts): each row's
    top k experts [SUB, TOP_K_P2] and their weights, and each expert's place among its
    row's choices [SUB, EXPERTS_P2] (-1: not chosen). Softmax in float32, then k rounds of
    a max: each probability and its expert pack into one int64 (the float's bits above,
    the expert reversed below, so that a tie goes to the lower expert), so that a round
    is one max, not a max and an argmax."""
    experts = tl.arange(0, EXPERTS_P2)
    slots = tl.arange(0, TOP_K_P2)
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    # Non-negative floats order as their bits do.
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    keys = (bits << 32) | (EXPERTS_P2 - 1 - experts)[None, :].to(tl.int64)
    chosen = tl.zeros([SUB, TOP_K_P2], dtype=tl.int32)
    weights = tl.zeros([SUB, TOP_K_P2], dtype=tl.float32)
    choice = tl.full([SUB, EXPERTS_P2], -1, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)
        index = EXPERTS_P2 - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        weight = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        chosen = tl.where(slots[None, :] == j, index[:, None], chosen)
        weights = tl.where(slots[None, :] == j, weight[:, None], weights)
        hit = keys == best[:, None]
        choice = tl.where(hit, j, choice)
        keys = tl.where(hit, -1, keys)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    return chosen, weights, choice


# The token count changes with every step: specialised, each new kind would cost a compile.
@triton.jit(do_not_specialize=["num_tokens"])
def route_kernel(
    ids_ptr,
    weights_ptr,
    counts_ptr,
    logits_ptr,
    num_tokens,
    stride_logits,
    first_expert,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    NUM_LOCAL: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P2)
    counts = tl.zeros([EXPERTS_P2], dtype=tl.int32)
    for t0 in range(0, CHUNK, SUB):
        rows = pid * CHUNK + t0 + tl.arange(0, SUB)
        choice = _route_rows(
            ids_ptr, weights_ptr, logits_ptr, rows, num_tokens, stride_logits,
            NUM_EXPERTS, EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE, SUB,
        )  # fmt: skip
        counts += tl.sum((choice >= 0).to(tl.int32), axis=0)
    local = experts - first_expert
    held = (local >= 0) & (local < NUM_LOCAL)
    tl.store(counts_ptr + pid * NUM_LOCAL + local, counts, mask=held)


@triton.jit(do_not_specialize=["num_tokens", "num_chunks", "num_blocks", "blocks_each"])
def place_kernel(
    sorted_ptr,
    block_expert_ptr,
    counts_ptr,
    ids_ptr,
    num_tokens,
    num_chunks,
    num_blocks,
    blocks_each,
    first_expert,
    NUM_LOCAL: tl.constexpr,
    LOCAL_P2: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB_PAIRS: tl.constexpr,
    CHUNK_TILE: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, LOCAL_P2)
    held = experts < NUM_LOCAL
    totals = tl.zeros([LOCAL_P2], dtype=tl.int32)
    before = tl.zeros([LOCAL_P2], dtype=tl.int32)  # this expert's pairs in earlier chunks
    for c0 in range(0, num_chunks, CHUNK_TILE):
        chunks = c0 + tl.arange(0, CHUNK_TILE)
        ptrs = counts_ptr + chunks[:, None] * NUM_LOCAL + experts[None, :]
        counts = tl.load(ptrs, mask=(chunks < num_chunks)[:, None] & held[None, :], other=0)
        totals += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((chunks < pid)[:, None], counts, 0), axis=0)
    _place(
        sorted_ptr, block_expert_ptr, ids_ptr, pid, num_tokens, num_blocks, blocks_each,
        first_expert, totals, before, NUM_LOCAL, LOCAL_P2, TOP_K, BLOCK_M, CHUNK, SUB_PAIRS,
        BLOCK_TILE,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def route_place_kernel(
    ids_ptr,
    weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    logits_ptr,
    num_tokens,
    stride_logits,
    num_blocks,
    first_expert,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    NUM_LOCAL: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """route_kernel then place_kernel for a step of at most CHUNK tokens (decode-sized), in
    one program that keeps the step's choices in registers: a choice's sorted place is
    its expert's run start plus the earlier tokens that chose the same expert (a token
    chooses an expert once), so nothing stored is read back."""
    wait_for_inputs(PDL)
    release_dependents(PDL)
    rows = tl.arange(0, CHUNK)
    choice = _route_rows(
        ids_ptr, weights_ptr, logits_ptr, rows, num_tokens, stride_logits, NUM_EXPERTS,
        EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE, CHUNK,
    )  # fmt: skip
    # Every expert by its global index; those held here are a contiguous range.
    local = tl.arange(0, EXPERTS_P2) - first_expert
    held = (local >= 0) & (local < NUM_LOCAL)
    here = (choice >= 0) & held[None, :]
    ones = here.to(tl.int32)
    totals = tl.sum(ones, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    slot = starts[None, :] + tl.cumsum(ones, axis=0) - ones
    tl.store(sorted_ptr + slot, rows[:, None] * TOP_K + choice, mask=here)
    _mark_blocks(
        sorted_ptr, block_expert_ptr, 0, num_blocks, num_blocks, totals, starts, ends, total,
        local, held, num_tokens * TOP_K, BLOCK_M, BLOCK_TILE,
    )  # fmt: skip


@triton.jit
def _pairs_experts(ids_ptr, pairs, num_pairs, first_expert, experts, NUM_LOCAL: tl.constexpr):
    """(each pair's one-hot over the experts held here [pairs, LOCAL_P2], its local expert,
    whether that is held here)."""
    expert = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) - first_expert
    mine = (pairs < num_pairs) & (expert >= 0) & (expert < NUM_LOCAL)
    return (expert[:, None] == experts[None, :]) & mine[:, None], expert, mine


@triton.jit
def _place(
    sorted_ptr,
    block_expert_ptr,
    ids_ptr,
    pid,
    num_tokens,
    num_blocks,
    blocks_each,
    first_expert,
    totals,
    before,
    NUM_LOCAL: tl.constexpr,
    LOCAL_P2: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB_PAIRS: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
):
    """Chunk pid's pairs into their sorted places, given every expert's pairs (totals) and
    those of earlier chunks (before); then blocks [pid * blocks_each, +blocks_each): the
    expert of each, and the sentinel in its padding."""
    experts = tl.arange(0, LOCAL_P2)
    held = experts < NUM_LOCAL
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    num_pairs = num_tokens * TOP_K
    # This chunk's pairs, in order: each goes after its expert's pairs placed before it.
    next_slot = starts + before
    sub = tl.arange(0, SUB_PAIRS)
    for p0 in range(0, CHUNK * TOP_K, SUB_PAIRS):
        pairs = pid * CHUNK * TOP_K + p0 + sub
        onehot, expert, mine = _pairs_experts(
            ids_ptr, pairs, num_pairs, first_expert, experts, NUM_LOCAL
        )
        earlier = (expert[:, None] == expert[None, :]) & (sub[None, :] < sub[:, None])
        rank = tl.sum((earlier & mine[None, :]).to(tl.int32), axis=1)
        slot = tl.sum(tl.where(onehot, next_slot[None, :], 0), axis=1) + rank
        tl.store(sorted_ptr + slot, pairs, mask=mine)
        next_slot += tl.sum(onehot.to(tl.int32), axis=0)
    first = pid * blocks_each
    _mark_blocks(
        sorted_ptr, block_expert_ptr, first, tl.minimum(first + blocks_each, num_blocks),
        blocks_each, totals, starts, ends, total, experts, held, num_pairs, BLOCK_M, BLOCK_TILE,
    )  # fmt: skip


@triton.jit
def _mark_blocks(
    sorted_ptr,
    block_expert_ptr,
    first,
    last,
    count,
    totals,
    starts,
    ends,
    total,
    local,
    held,
    num_pairs,
    BLOCK_M: tl.constexpr,
    BLOCK_TILE: tl.constexpr,
):
    """Blocks [first, last) of at most count: the local expert of each (-1 past the last
    run) and the sentinel num_pairs in its padding. The runs' totals, starts and ends are
    indexed as local gives each its local expert; held marks those held here."""
    lane = tl.arange(0, BLOCK_M)
    for b0 in range(0, count, BLOCK_TILE):
        blocks = first + b0 + tl.arange(0, BLOCK_TILE)
        block_ok = blocks < last
        begin = blocks * BLOCK_M
        used = begin < total
        # The run that holds the block: the held runs that end at or before it, counted.
        expert = tl.sum(((ends[None, :] <= begin[:, None]) & held[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(used, expert, -1), mask=block_ok)
        onehot = expert[:, None] == local[None, :]
        run_start = tl.sum(tl.where(onehot, starts[None, :], 0), axis=1)
        run_count = tl.sum(tl.where(onehot, totals[None, :], 0), axis=1)
        position = begin[:, None] + lane[None, :]
        padding = (position - run_start[:, None]) >= run_count[:, None]
        keep = padding & (used & block_ok)[:, None]
        tl.store(sorted_ptr + position, num_pairs + 0 * position, mask=keep)
