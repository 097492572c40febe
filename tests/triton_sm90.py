"""Compile every Triton kernel of zmqworker for sm_90 (Hopper) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which does not apply the compiler's
front-end rules (a name redefined in a branch with another shape, say): a kernel can pass
them all and still fail to compile on CUDA. Here Triton's driver reports a CUDA device, and
every launch compiles the kernel to a cubin (Triton's bundled ptxas) instead of running it.
The launch wrappers are called with small CPU tensors in the variants the CUDA step takes:
for sm_90 with PDL on and, once per kernel, off; with PDL off for an A100 (sm_80) and Ada
(sm_89, 99 KiB of shared memory a program), the attention kernels and every tile set of
those whose tiles shared memory sizes. Registers are read from each cubin (cuobjdump): a
half-precision sm_90 variant that spills fails, a slowdown no CPU test would see.

`python tests/triton_sm90.py [--shard i/n]` prints one JSON line: "defined" (the kernels no
other kernel calls), "compiled", "failed", "spills_reported" (float32's, older GPUs'); it
exits 1 if a case failed. tests/test_triton_sm90.py runs the shards at once.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be defined as JITFunctions

import ast  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import pkgutil  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# (capability, the most shared memory a program may take, multiprocessors): Hopper, where
# the step runs with PDL; then, with PDL off, an A100 and Ada (an L4), whose limits the
# tiles must fit too.
SM90 = (90, 227 * 1024, 132)
OLDER = ((80, 163 * 1024, 108), (89, 99 * 1024, 58))

compiled: set[str] = set()
state = {"pdl": True, "kernel": None, "case": None, "target": SM90}
spills: list[dict] = []  # kernels compiled with registers spilled to local memory


class FakeDriver:
    """The active driver as the launch path asks it: device 0 of state's CUDA target."""

    def __init__(self):
        self.utils = self  # get_device_properties, as Triton's driver.utils has it

    def get_device_properties(self, device):
        _, shared, sms = state["target"]
        return {"max_shared_mem": shared, "multiprocessor_count": sms}

    def get_current_device(self, *args):
        return 0

    get_current_stream = get_current_device  # (device) -> stream 0

    def get_current_target(self):
        return GPUTarget("cuda", state["target"][0], 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def compile_only(self, grid):
    """kernel[grid](*args) compiles for the target (warmup) and launches nothing. Loading
    it would check its shared memory against the device's: checked here instead."""

    def launch(*args, **kwargs):
        state["kernel"] = self.__name__
        kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
        capability, most, _ = state["target"]
        if kernel.metadata.shared > most:
            raise RuntimeError(
                f"{kernel.metadata.shared} bytes of shared memory, over sm_{capability}'s {most}"
            )
        usage = resource_usage(kernel.asm["cubin"])
        if usage["STACK"] or usage["LOCAL"]:
            case = f"{state['case']}, sm_{capability}, PDL {'on' if state['pdl'] else 'off'}"
            spills.append({"case": case, "kernel": self.__name__, "usage": usage})
        compiled.add(self.__name__)

    return launch


def resource_usage(cubin: bytes) -> dict[str, int]:
    """The registers, stack and local memory a cubin's kernel takes (cuobjdump, bundled with
    Triton): stack or local bytes are registers spilled."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name]
        text = subprocess.run(tool, capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[-500:]}")
    return dict(zip(("REG", "STACK", "LOCAL"), map(int, found.groups()), strict=True))


def launch_options(device):
    return {"PDL": state["pdl"], "launch_pdl": state["pdl"]}


def zmqworker_kernels() -> tuple[dict[str, JITFunction], list[dict]]:
    """zmqworker's kernels (helpers included) by name, and the modules of kernels that
    failed to import."""
    import zmqworker

    kernels: dict[str, JITFunction] = {}
    failed = []
    for info in pkgutil.walk_packages(zmqworker.__path__, "zmqworker.", onerror=lambda _: None):
        path = Path(info.module_finder.path) / f"{info.name.rpartition('.')[2]}.py"
        if info.ispkg or not path.is_file() or "triton.jit" not in path.read_text():
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception as e:
            failed.append({"case": f"import {info.name}", "error": error_tail(e)})
            continue
        for obj in vars(module).values():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == info.name:
                kernels[obj.__name__] = obj

    return kernels, failed


def not_called(kernels: dict[str, JITFunction]) -> list[str]:
    """The kernels no other kernel calls: helpers are compiled inside those that call them."""
    called = {name for k in kernels.values() for name in calls(k.src)}
    return sorted(n for n in kernels if n not in called)


def calls(source: str) -> set[str]:
    """The names a kernel's source calls (f(...) or module.f(...)); not its comments."""
    called = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            called.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return called


def patch_launch_options() -> None:
    """Every zmqworker module's launch_options (PDL off on CPU tensors) gives state's;
    zmqworker.pdl's own too, for the modules the cases import later (triton_attention)."""
    from zmqworker.pdl import launch_options as original

    for name, module in list(sys.modules.items()):
        if name.startswith("zmqworker.") and getattr(module, "launch_options", 0) is original:
            module.launch_options = launch_options


def error_tail(e: BaseException, lines: int = 12) -> str:
    """The error's last lines, and its innermost cause's (a helper's error is chained
    below the call site that compiled it)."""
    text = "".join(traceback.format_exception_only(type(e), e)).rstrip()
    tail = "\n".join(text.splitlines()[-lines:])
    cause = e
    while cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is not e:
        tail += "\ncaused by: " + "".join(traceback.format_exception_only(cause)).strip()
    return tail


def i32(*shape):
    return torch.zeros(shape, dtype=torch.int32)


def zeros(*shape, dtype=BF16):
    return torch.zeros(shape, dtype=dtype)


# The cases: (name, function of no arguments that calls a launch wrapper).


def attention(dtype, head_dim, block_size, query_len, splits=1, norms=False, heads=(8, 2),
              reqs=3):  # fmt: skip
    """paged_attention of reqs requests of query_len tokens each over heads (query heads,
    kv heads): decode_attention (and its merge past one split; a lone request's history
    asked ahead) when query_len is 1, else rope_and_cache then varlen_attention."""
    from zmqworker.attention.head_norms import HeadNorms
    from zmqworker.attention.kv_cache import allocate_kv_cache
    from zmqworker.attention.triton_attention import paged_attention
    from zmqworker.attention.triton_metadata import TritonAttentionMetadata

    heads, kv_heads = heads
    n = reqs * query_len
    meta = TritonAttentionMetadata(
        num_tokens=n, num_reqs=reqs, max_query_len=query_len, decode_only=query_len == 1,
        num_splits=splits, slot_mapping=i32(n), positions=i32(n),
        query_start_loc=torch.arange(0, n + 1, query_len, dtype=torch.int32),
        seq_lens=i32(reqs), block_tables=i32(reqs, 8),
    )  # fmt: skip
    qkv = zeros(n, heads + 2 * kv_heads, head_dim, dtype=dtype)
    cache = allocate_kv_cache(16, block_size, kv_heads, head_dim, dtype, "cpu")
    weights = zeros(head_dim, dtype=dtype), zeros(head_dim, dtype=dtype)
    head_norms = HeadNorms(*weights, 1e-6) if norms else None
    paged_attention(qkv, heads, zeros(64, head_dim, dtype=dtype), cache, meta, 0.1, head_norms)


def copy_blocks(dtype):
    from zmqworker.kv_transfer.block_copy_kernel import copy_blocks

    layers = [zeros(2, 4, 2, 128, dtype=dtype) for _ in range(3)]
    table = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    ids = torch.arange(2, dtype=torch.int64)
    copy_blocks(layers, table, ids, table, ids, (4, 2))
    copy_blocks(layers, table, ids, table, ids, (4, 2), heads=(1, 0, 1))


def penalties():
    from zmqworker.model_runner import penalty_kernels as pk

    logits, rows = zeros(4, 1024, dtype=F32), i32(4)
    pk.apply_dense(logits, i32(4, 1024), i32(4, 32), i32(4), rows, zeros(3, 4, dtype=F32), True)
    pk.add_entries(logits, i32(4), rows, i32(4), zeros(4, dtype=F32))
    pk.add_entries(logits, i32(4), rows, i32(4), None)
    pk.count_outputs(i32(4, 1024), i32(4), i32(4), rows)


def greedy_ids():
    from zmqworker.model_runner.greedy_ids import GreedyIds

    greedy, logits = GreedyIds(8, torch.device("cpu")), zeros(4, 10240, dtype=F32)
    greedy(logits, i32(4))
    greedy(logits, i32(4), i32(1))


def grammar_bitmask():
    from zmqworker.model_runner.grammar_kernel import apply_bitmask

    apply_bitmask(zeros(4, 1024, dtype=F32), i32(2), i32(2, 32))


def token_feed():
    from zmqworker.model_runner.token_feed import feed_tokens

    feed_tokens(i32(8), i32(8), i32(8))


def elementwise(dtype):
    from zmqworker.models.layers.triton_ops import rms_norm, silu_and_mul

    x = zeros(5, 2048, dtype=dtype)
    rms_norm(x, zeros(2048, dtype=dtype), 1e-6)
    rms_norm(x, zeros(2048, dtype=dtype), 1e-6, zeros(5, 2048, dtype=dtype))
    silu_and_mul(x)


def gate_up_silu(dtype, rows, bias, tiles=None, size=256, k=512):
    """tiles: the (BLOCK_N, BLOCK_K, warps, stages) of larger weights than these; or a
    weight of those sizes, whose tiles fit each target's shared memory."""
    from zmqworker.models.layers.skinny_gate_up import gate_up_silu

    b = zeros(2 * size, dtype=dtype) if bias else None
    gate_up_silu(zeros(rows, k, dtype=dtype), zeros(2 * size, k, dtype=dtype), b, tiles)


def skinny_linear(dtype, rows, n, k, bias):
    """n outputs over k inputs: k of one BLOCK_K step runs unsplit, a longer one splits;
    1025 to 1536 outputs take narrow two-warp tiles."""
    from zmqworker.models.layers import skinny_linear as skinny

    counters = i32(skinny.counter_slots(n))
    x, w, b = zeros(rows, k, dtype=dtype), zeros(n, k, dtype=dtype), zeros(n, dtype=dtype)
    skinny.skinny_linear(x, w, b if bias else None, counters)


def fused_moe(dtype, tokens, renormalize, experts=8, top_k=2):
    """One routing chunk (route_place_kernel) or several (route_kernel and place_kernel),
    in the tile set of the token count (and of experts and top_k)."""
    from zmqworker.models.layers.fused_moe import fused_moe

    x, logits = zeros(tokens, 256, dtype=dtype), zeros(tokens, experts, dtype=dtype)
    w13 = zeros(experts, 2 * 128, 256, dtype=dtype)
    w2 = zeros(experts, 256, 128, dtype=dtype)
    fused_moe(x, logits, w13, w2, top_k, renormalize, 0)


def cases() -> list[tuple[str, object]]:
    def case(fn, *args, **kwargs):
        spelled = [repr(a).replace("torch.", "") for a in args]
        spelled += [f"{k}={v!r}" for k, v in kwargs.items()]
        name = f"{fn.__name__}({', '.join(spelled)})"
        return name, lambda: fn(*args, **kwargs)

    out = []
    # Decode: one split, a few (<= FEW_SPLITS), many; pages of 16 (tiles within a page)
    # and of 8 (gathered tiles); a head dim of a power of two and one below it (masked).
    for block, head_dim in ((16, 128), (16, 80), (8, 80)):
        for splits in (1, 4):
            for norms in (False, True):
                out.append(case(attention, BF16, head_dim, block, 1, splits, norms))
    out.append(case(attention, BF16, 128, 16, 1, 64, True))
    # One request asks its history ahead; pages of 24 (not a power of two) do not.
    for block, head_dim, dtype in ((16, 128, BF16), (8, 80, BF16), (16, 128, F32), (24, 128, BF16)):
        out.append(case(attention, dtype, head_dim, block, 1, 4, reqs=1))
    out.append(case(attention, BF16, 128, 128, 1, 4, False))  # 64-position tiles
    out.append(case(attention, F16, 128, 16, 1, 4, True))
    out.append(case(attention, F32, 128, 16, 1, 4, True))
    # Prefill and mixed steps: rope_and_cache, then varlen_attention.
    for block, head_dim in ((16, 128), (16, 80), (8, 80), (128, 128)):
        for norms in (False, True):
            out.append(case(attention, BF16, head_dim, block, 5, norms=norms))
    # Other head layouts: a group of 6 (Qwen2.5-1.5B's 12 over 2), 32 query heads over 4.
    for heads in ((12, 2), (32, 4)):
        out.append(case(attention, BF16, 128, 16, 1, 4, True, heads=heads))
        out.append(case(attention, BF16, 128, 16, 5, norms=True, heads=heads))
    out.append(case(attention, F16, 128, 16, 5, norms=True))
    out.append(case(attention, F32, 128, 16, 5, norms=True))
    out.append(case(copy_blocks, BF16))
    out.append(case(copy_blocks, F32))
    out += [case(penalties), case(greedy_ids), case(grammar_bitmask), case(token_feed)]
    for dtype in (BF16, F16, F32):
        out.append(case(elementwise, dtype))
    for rows, bias in ((1, False), (20, True), (64, True)):  # each row tile
        out.append(case(gate_up_silu, BF16, rows, bias))
    out.append(case(gate_up_silu, BF16, 1, True, (64, 128, 4, 3)))
    out.append(case(gate_up_silu, BF16, 64, False, (64, 64, 4, 3)))
    out.append(case(gate_up_silu, F32, 1, True))
    # From 32 rows, a large weight's four stages (64 and 128 wide K), fitted to each target.
    for size, k in ((2048, 2048), (8960, 1536)):
        out.append(case(gate_up_silu, BF16, 64, False, size=size, k=k))
    out.append(case(gate_up_silu, F32, 64, False, size=2048, k=2048))
    for rows in (1, 16, 32):
        out.append(case(skinny_linear, BF16, rows, 256, 2048, rows == 16))  # split K
        out.append(case(skinny_linear, BF16, rows, 256, 128, rows == 1))  # one split
    out.append(case(skinny_linear, BF16, 1, 1536, 256, False))
    out.append(case(skinny_linear, BF16, 1, 2048, 2048, False))  # 64 wide
    out.append(case(skinny_linear, BF16, 16, 3072, 2048, True))  # large and wide: 32 wide
    out.append(case(skinny_linear, F32, 1, 256, 2048, True))
    # One token's own kernels, then each tile set; from 40, routed in chunks.
    for tokens in (1, 2, 40, 100, 300, 1100):
        out.append(case(fused_moe, BF16, tokens, tokens % 2 == 0))
    for tokens in (1, 2):  # Qwen3-MoE's routing, in either kernel that routes one chunk
        out.append(case(fused_moe, BF16, tokens, True, experts=128, top_k=8))
    out.append(case(fused_moe, BF16, 64, True, experts=128, top_k=8))
    out.append(case(fused_moe, F32, 1, True))
    out.append(case(fused_moe, F32, 300, False))
    return out


def run_case(name: str, fn, pdl: bool, failed: list[dict]) -> None:
    state["pdl"], state["kernel"], state["case"] = pdl, None, name
    try:
        fn()
    except Exception as e:
        case = f"{name}, sm_{state['target'][0]}, PDL {'on' if pdl else 'off'}"
        failed.append({"case": case, "kernel": state["kernel"], "error": error_tail(e)})


def main(argv: list[str]) -> int:
    """--shard i/n: the cases of index i modulo n only (the test runs n processes at once)."""
    shard, count = (0, 1)
    if "--shard" in argv:
        shard, count = map(int, argv[argv.index("--shard") + 1].split("/"))
    mine = [c for i, c in enumerate(cases()) if i % count == shard]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    driver.set_active(FakeDriver())
    JITFunction.__getitem__ = compile_only
    kernels, failed = zmqworker_kernels()
    defined = not_called(kernels)
    patch_launch_options()
    first_of_a_kernel = []
    for name, fn in mine:
        before = len(compiled)
        run_case(name, fn, True, failed)
        if len(compiled) > before:
            first_of_a_kernel.append((name, fn))
    # PDL off (ZMQWORKER_PDL=0, or a driver that refuses it in graphs): once per kernel,
    # the case that first took it; on older GPUs the attention kernels' first cases and
    # every tile set of the kernels whose tiles are sized by shared memory.
    from zmqworker import triton_device

    older = [c for c in first_of_a_kernel if c[0].startswith("attention")]
    older += [c for c in mine if c[0].startswith(("fused_moe", "gate_up_silu"))]
    for target in (SM90, *OLDER):
        state["target"] = target
        for k in kernels.values():
            k.device_caches.clear()  # compiled for the last target
        triton_device._properties.cache_clear()
        for name, fn in first_of_a_kernel if target == SM90 else older:
            run_case(name, fn, False, failed)
    for name in sorted(set(defined) - compiled) if count == 1 else ():
        failed.append({"kernel": name, "error": "no case compiled it"})
    reported = [s for s in spills if "float32" in s["case"] or "sm_90" not in s["case"]]
    for spill in spills:
        if spill not in reported:
            failed.append({**spill, "error": f"registers spilled: {spill['usage']}"})
    report = {"defined": defined, "compiled": sorted(compiled), "failed": failed}
    print(json.dumps({**report, "spills_reported": reported}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
