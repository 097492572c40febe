"""The fused mixture of experts (Triton, run by its interpreter on the CPU) against the
plain-torch experts: float32 and float16, one token (its own kernels, and the tile
sets'), many tokens, experts that get no token, experts held on other ranks, every tile
set; and the sorted layout itself."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from zmqworker.models.layers import fused_moe as fm  # noqa: E402
from zmqworker.models.layers import moe_sort  # noqa: E402
from zmqworker.models.layers import one_token_experts as one_token  # noqa: E402
from zmqworker.models.layers.activation import GatedActivation  # noqa: E402
from zmqworker.models.layers.experts import experts_reference, route  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or the interpreter",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, INTER, EXPERTS = 40, 24, 8


def problem(
    tokens: int,
    dtype: torch.dtype,
    local: int = EXPERTS,
    seed: int = 0,
    skew=None,
    hidden: int = HIDDEN,
    inter: int = INTER,
):
    """x, router logits, and a rank's experts (w13, w2) of a layer of EXPERTS experts.
    skew adds to each expert's logits: a large negative value leaves it without tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    if skew is not None:
        logits = logits + torch.tensor(skew)
    w13 = 0.2 * torch.randn(local, 2 * inter, hidden, generator=gen)
    w2 = 0.2 * torch.randn(local, hidden, inter, generator=gen)
    return [t.to(dtype).to(DEVICE) for t in (x, logits, w13, w2)]


def reference(x, logits, w13, w2, top_k, renormalize, first_expert) -> torch.Tensor:
    weights, ids = route(logits.float().cpu(), top_k, renormalize)
    args = [t.cpu() for t in (x, w13, w2)]
    if x.dtype == torch.float16:  # half products on the CPU: the same roundings, in float32
        out = experts_reference(*[a.float() for a in args], weights, ids, first_expert, _Half())
        return out.half()
    return experts_reference(args[0], args[1], args[2], weights, ids, first_expert, SILU)


SILU = GatedActivation("silu")


class _Half(torch.nn.Module):
    """SiLU-and-multiply rounding as float16 does, over float32 tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.half().float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate).half().float() * up).half().float()


def close(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize(
    ("dtype", "tokens", "renormalize"),
    [
        (torch.float32, 1, False),
        (torch.float32, 7, True),
        (torch.float32, 300, True),
        (torch.float16, 1, True),
        (torch.float16, 7, False),
        (torch.float16, 150, False),
    ],
)
def test_fused_moe_matches_the_torch_experts(dtype, tokens, renormalize):
    """Experts 2 and 5 get no token (their logits are far below)."""
    x, logits, w13, w2 = problem(tokens, dtype, skew=[0, 0, -30, 0, 2, -30, 0, 1])
    got = fm.fused_moe(x, logits, w13, w2, 3, renormalize, 0)
    expected = reference(x, logits, w13, w2, 3, renormalize, 0)
    torch.testing.assert_close(got.cpu(), expected, **close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("regime", range(len(fm._REGIMES)))
def test_every_tile_set_gives_the_same_result(regime, dtype):
    """Each regime's tiles as a step of its tokens takes them in this dtype, over 45 tokens."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    starts = fm.token_starts(2, EXPERTS)
    first = next(n for n in starts if fm.tiles_for(n, 2, EXPERTS) == fm._REGIMES[regime][1])
    tiles = fm.tiles_for(first, 2, EXPERTS, element_size)
    assert tiles.block_m == fm._REGIMES[regime][1].block_m
    x, logits, w13, w2 = problem(45, dtype, seed=1)
    got = fm.fused_moe(x, logits, w13, w2, 2, True, 0, tiles=tiles)
    torch.testing.assert_close(got.cpu(), reference(x, logits, w13, w2, 2, True, 0), **close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("top_k", "first_expert", "local"), [(3, 0, EXPERTS), (8, 0, EXPERTS), (2, 4, 4), (3, 2, 3)]
)
def test_one_token_takes_its_own_kernels(monkeypatch, dtype, top_k, first_expert, local):
    """One token's two kernels (one_token_experts.py), over intermediate features in three
    slices (the last one part full), summed two slices at a time, and outputs in several
    tiles, against the torch experts and fused_moe's first tile set: k of the 8 experts
    or all of them, and experts held on other ranks (expert parallelism)."""
    monkeypatch.setattr(one_token, "PART_TILE", 2)
    x, logits, w13, w2 = problem(1, dtype, EXPERTS, seed=5, hidden=300, inter=150)
    mine = slice(first_expert, first_expert + local)
    w13, w2 = w13[mine].contiguous(), w2[mine].contiguous()
    got = ran_one_token(monkeypatch, x, logits, w13, w2, top_k, True, first_expert)
    expected = reference(x, logits, w13, w2, top_k, True, first_expert)
    # float32: the down projection's 150 products summed in two slices, not in one run
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else close(dtype)
    torch.testing.assert_close(got.cpu(), expected, **tolerance)
    tiles = fm.tiles_for(1, top_k, local, x.element_size())
    tiled = fm.fused_moe(x, logits, w13, w2, top_k, True, first_expert, tiles=tiles)
    torch.testing.assert_close(got, tiled, **tolerance)


def test_one_token_whose_choices_are_all_elsewhere_gets_zeros(monkeypatch):
    x, logits, w13, w2 = problem(1, torch.float32, seed=6, skew=[9, 9, 9, 9, 0, 0, 0, 0])
    mine = w13[4:].contiguous(), w2[4:].contiguous()
    got = ran_one_token(monkeypatch, x, logits, *mine, 2, False, 4)
    assert got.shape == (1, HIDDEN) and not got.any()


def ran_one_token(monkeypatch, *args) -> torch.Tensor:
    """fused_moe(*args), asserting that it took one token's kernels."""
    calls = []
    run = one_token.one_token_experts
    monkeypatch.setattr(one_token, "one_token_experts", lambda *a: calls.append(a) or run(*a))
    out = fm.fused_moe(*args)
    assert len(calls) == 1, "not one token's kernels"
    return out


@pytest.mark.parametrize("first_expert", [0, 4])
@pytest.mark.parametrize("tokens", [33, 16])
def test_experts_held_elsewhere_add_nothing(first_expert, tokens):
    """Expert parallelism: this rank holds experts [first, first + 4); a token whose
    choices are all elsewhere gets zeros, and the ranks' parts sum to the whole. 33
    tokens route in chunks, 16 in one (route_place_kernel)."""
    x, logits, w13, w2 = problem(tokens, torch.float32, seed=2)
    mine = slice(first_expert, first_expert + 4)
    got = fm.fused_moe(
        x, logits, w13[mine].contiguous(), w2[mine].contiguous(), 2, False, first_expert
    )
    expected = reference(x, logits, w13[mine], w2[mine], 2, False, first_expert)
    torch.testing.assert_close(got.cpu(), expected)
    _, ids = route(logits.cpu(), 2, False)
    elsewhere = ((ids < first_expert) | (ids >= first_expert + 4)).all(dim=1)
    assert elsewhere.any() and not got.cpu()[elsewhere].any()


@pytest.mark.parametrize(("tokens", "chunk"), [(37, 16), (13, 16)])
def test_pairs_are_sorted_by_expert_in_padded_runs(tokens, chunk):
    """37 tokens route in three chunks (route_kernel, place_kernel); 13 in one
    (route_place_kernel)."""
    top_k, block_m = 3, 16
    _, logits, _, _ = problem(tokens, torch.float32, skew=[0, 0, -30, 0, 2, -30, 0, 1])
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=DEVICE)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=DEVICE)
    chunks = -(-tokens // chunk)
    blocks = moe_sort.max_blocks(tokens * top_k, EXPERTS, block_m)
    sorted_pairs = torch.full((blocks * block_m,), -7, dtype=torch.int32, device=DEVICE)
    block_expert = torch.full((blocks,), -7, dtype=torch.int32, device=DEVICE)
    both = dict(NUM_LOCAL=EXPERTS, TOP_K=top_k, CHUNK=chunk, BLOCK_M=block_m, PDL=False)
    routing = dict(NUM_EXPERTS=EXPERTS, EXPERTS_P2=EXPERTS, TOP_K_P2=4, RENORMALIZE=False)
    if chunks == 1:
        moe_sort.route_place_kernel[(1,)](
            ids, weights, sorted_pairs, block_expert, logits, tokens, logits.stride(0),
            blocks, 0, **both, **routing, BLOCK_TILE=16,
        )  # fmt: skip
    else:
        counts = torch.empty(chunks, EXPERTS, dtype=torch.int32, device=DEVICE)
        both.pop("BLOCK_M")
        moe_sort.route_kernel[(chunks,)](
            ids, weights, counts, logits, tokens, logits.stride(0), 0, **both, **routing, SUB=16
        )
        moe_sort.place_kernel[(chunks,)](
            sorted_pairs, block_expert, counts, ids, tokens, chunks, blocks,
            -(-blocks // chunks), 0, **both, LOCAL_P2=EXPERTS, BLOCK_M=block_m, SUB_PAIRS=32,
            BLOCK_TILE=16, CHUNK_TILE=64,
        )  # fmt: skip
    expected_weights, expected_ids = route(logits.cpu(), top_k, False)
    assert torch.equal(ids.cpu().long(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights)
    per_expert = torch.bincount(expected_ids.flatten(), minlength=EXPERTS)
    assert per_expert[2] == per_expert[5] == 0
    used = int(sum(-(-int(n) // block_m) for n in per_expert))
    assert block_expert[used:].eq(-1).all()
    runs = sorted_pairs.cpu()[: used * block_m].view(used, block_m)
    flat_ids = expected_ids.flatten()
    seen = []
    for block, expert in zip(runs, block_expert.cpu()[:used].tolist(), strict=True):
        pairs = block[block < tokens * top_k]
        assert pairs.numel() and (flat_ids[pairs.long()] == expert).all()
        assert (block[pairs.numel() :] == tokens * top_k).all()  # the padding, at the end
        seen += pairs.tolist()
    assert sorted(seen) == list(range(tokens * top_k))


def test_warm_up_token_counts_reach_every_tile_set():
    starts = fm.token_starts(top_k=8, num_local=128)
    # 1: one token's kernels (one_token_experts.py); 2: the first tile set's first step;
    # 17: its first step of two routing chunks (two kernels, not one)
    assert starts == [1, 2, 17, 257, 1025, 4097]
    assert [fm.tiles_for(n, 8, 128) for n in starts[1:]] == [fm._REGIMES[0][1]] + [
        t for _, t in fm._REGIMES
    ]
    assert fm.tiles_for(256, 8, 128) == fm._REGIMES[0][1]
    # float32: the same block rows, half the K tile (shared memory)
    wide = fm.tiles_for(256, 8, 128, element_size=4)
    assert (wide.block_m, wide.gate_up[1], wide.down[1]) == (16, 64, 64)


def test_tiles_fit_the_shared_memory_of_the_device():
    """Hopper's 227 KiB keep every tile set's stages; Ada's 99 KiB take the decode tiles'
    gate/up to two stages of 36 KiB (every stage counted: triton_device.fit_stages), and
    no stage count under two."""
    hopper, ada = 227 * 1024, 99 * 1024
    for n in fm.token_starts(top_k=8, num_local=128):
        for size in (2, 4):
            assert fm.tiles_for(n, 8, 128, size, hopper) == fm.tiles_for(n, 8, 128, size)
    decode = fm.tiles_for(1, 8, 128, 2, ada)
    assert decode.gate_up == fm._REGIMES[0][1].gate_up[:3] + (2,)
    assert decode.down == fm._REGIMES[0][1].down
    assert fm.tiles_for(1, 8, 128, 2, 1024).gate_up[3] == 2


def test_no_tokens_and_bad_shapes():
    x, logits, w13, w2 = problem(1, torch.float32)
    assert fm.fused_moe(x[:0], logits[:0], w13, w2, 2, True, 0).shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="fused_moe: x"):
        fm.fused_moe(x, logits, w13, w2[:, :, :-1], 2, True, 0)
