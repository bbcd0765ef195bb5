"""Compiles every kernel for a Hopper GPU (sm_90, as on an H100/H200) without one: Triton's front end, its
MLIR passes and the ptxas it ships all run on the CPU. Run by tests/engine/test_kernels_compile.py in a
process of its own (the test process imports Triton in interpreter mode, see tests/triton_interpret.py).

    python -m tests.compile_kernels [--all]   # prints each variant; exit status 2 when ptxas is missing

The suite compiles one variant of each kernel (bf16, head dim 128: about 20 s); ``--all`` adds the fp32,
single-split and other head-dim variants (about 45 s on 2 cores).
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import activation, attention_decode, attention_prefill, kv_store, norm, rotary
from engine.kernels.triton_support import LazyKernel

HOPPER = GPUTarget("cuda", 90, 32)
INT_POINTERS = {"block_tables_ptr", "context_lens_ptr", "query_start_ptr", "prefix_lens_ptr", "slot_ptr"}
LONG_POINTERS = {"seq_ids_ptr"}  # a mixed step's prefill sequences (engine.attention.MixedSplit: long)
FLOAT_ARGS = {"eps", "qk_scale"}
SHARED_MEMORY = 227 * 1024  # per block on an H100/H200 SM


def compile_for_hopper(
    kernel: LazyKernel,
    dtype: str,
    constexprs: dict[str, Any],
    fp32_pointers: tuple[str, ...] = (),
    **options: int,
) -> Any:
    """``kernel`` with every data pointer of ``dtype`` ("bf16", "fp32" ...) and the given constexprs."""
    signature: dict[str, str] = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in LONG_POINTERS:
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in fp32_pointers else f"*{dtype}"
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return triton.compile(ASTSource(triton.jit(kernel.fn), signature, constexprs=constexprs), HOPPER, options)


def variants(
    everything: bool,
) -> list[tuple[str, LazyKernel, str, dict[str, Any], tuple[str, ...], dict[str, int]]]:
    """Llama-3-8B sizes (hidden 4096, 32/8 heads of 128); ``everything`` adds fp32 and head dims 64, 256."""
    out: list[tuple[str, LazyKernel, str, dict[str, Any], tuple[str, ...], dict[str, int]]] = []
    for residual in (True, False) if everything else (True,):
        consts = {"HAS_RESIDUAL": residual, "BLOCK": 4096}
        out.append(
            (f"rms_norm residual={residual}", norm._rms_norm_kernel, "bf16", consts, (), {"num_warps": 16})
        )
    out.append(
        ("silu_and_mul", activation._silu_and_mul_kernel, "bf16", {"BLOCK": 4096}, (), {"num_warps": 4})
    )
    rotary_blocks = {"BLOCK_QH": 32, "BLOCK_KH": 8, "BLOCK_HALF": 64}
    out.append(("rotary", rotary._rotary_kernel, "bf16", rotary_blocks, (), {"num_warps": 4}))
    store_blocks = {"BLOCK_H": 8, "BLOCK_D": 128}
    out.append(("store_kv", kv_store._store_kv_kernel, "bf16", store_blocks, (), {"num_warps": 4}))
    partial = ("part_out_ptr", "part_lse_ptr")
    decode_cases = (("bf16", False, 128), ("bf16", True, 128), ("fp32", False, 64))
    for dtype, one_split, head_dim in decode_cases if everything else decode_cases[:1]:
        consts = {
            "BLOCK_G": 16,
            "BLOCK_N": 64,
            "BLOCK_D": head_dim,
            "ONE_SPLIT": one_split,
            "DOT_FP32": dtype == "fp32",
            "PRECISION": "ieee" if dtype == "fp32" else "tf32",
        }
        name = f"decode {dtype} d={head_dim} one_split={one_split}"
        out.append((name, attention_decode._decode_kernel, dtype, consts, partial, {"num_warps": 4}))
    merge = {"BLOCK_S": 16, "BLOCK_D": 128}
    out.append(
        ("merge splits", attention_decode._merge_splits_kernel, "bf16", merge, partial, {"num_warps": 4})
    )
    prefill_cases = (("bf16", 128), ("bf16", 256), ("fp32", 128))
    for dtype, head_dim in prefill_cases if everything else prefill_cases[:1]:
        block = (
            32 if head_dim > 128 or dtype == "fp32" else 64
        )  # as paged_prefill_attention_triton picks them
        options = {"num_warps": 4, "num_stages": 2}
        for some in (False, True):  # every sequence of the step, or a mixed step's prefill sequences only
            consts = {
                "BLOCK_M": block,
                "BLOCK_N": block,
                "BLOCK_D": head_dim,
                "DOT_FP32": dtype == "fp32",
                "PRECISION": "ieee" if dtype == "fp32" else "tf32",
                "HAS_SEQ_IDS": some,
            }
            name = f"prefill {dtype} d={head_dim}{' seq_ids' if some else ''}"
            out.append((name, attention_prefill._prefill_kernel, dtype, consts, (), options))
    return out


def main() -> int:
    failed = 0
    for name, kernel, dtype, consts, fp32_pointers, options in variants("--all" in sys.argv):
        started = time.perf_counter()
        try:
            compiled = compile_for_hopper(kernel, dtype, consts, fp32_pointers, **options)
        except Exception as exc:
            if "ptxas" in str(exc) and "not found" in str(exc).lower():
                print(f"no ptxas in this Triton: {exc}")
                return 2
            print(f"FAILED {name}: {type(exc).__name__}: {exc}")
            failed += 1
            continue
        shared = compiled.metadata.shared
        verdict = "ok" if shared <= SHARED_MEMORY else "FAILED: shared memory over the limit"
        failed += verdict != "ok"
        print(f"{verdict} {name}: {shared} B shared, {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
