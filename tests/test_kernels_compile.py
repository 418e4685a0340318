"""Compile every kernel ahead of time for sm_80 and sm_90, for every dtype and every
constexpr flag, without a GPU: `triton.compile(ASTSource(...), target=GPUTarget(...))`
runs the whole pipeline (TTIR, TTGIR, LLVM IR, PTX, ptxas to cubin).

Why: Triton's interpreter runs kernels as Python, so it accepts code the compiler
rejects, e.g. a variable that is bf16 before an `if` and fp32 inside it (the Unsloth
bug). The CPU tests alone would miss it.

Under TRITON_INTERPRET=1 (set by conftest.py without a GPU) `@triton.jit` builds
interpreter objects that cannot be compiled, so the compilation runs once, in a
subprocess without that variable: this file run as a script, which prints a JSON map
from case id to error ("" when it compiled). The tests read that map.
"""
import importlib
import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import pytest
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]
# Under pytest-xdist every test here runs in one worker (`--dist loadgroup`, the README's test command), so the
# compilation below runs once, not once a worker.
pytestmark = pytest.mark.xdist_group("compile")
ARCHS = (80, 90)
SHARED_MEMORY = {80: 166912, 90: 232448}  # bytes a block may use: 163 KiB on sm_80 (A100), 227 KiB on sm_90 (H100)
DTYPES = ("fp32", "bf16", "fp16")
# The kernels that dequantize NF4 as bitsandbytes does, which must not fuse a multiply and an add.
NF4_KERNELS = {"nf4_fma": "_nf4_dequantize_kernel", "nf4_to_fp8_fma": "_nf4_to_fp8_kernel"}
E4M3_KERNELS = ("_fp8_quantize_rows_kernel", "_fp8_quantize_tensor_kernel", "_nf4_to_fp8_kernel")  # store e4m3


@dataclass(frozen=True)
class Case:
    id: str
    module: str
    kernel: str
    signature: dict  # argument name -> Triton type string ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict
    num_warps: int
    arch: int
    num_stages: int = 3  # Triton's default on NVIDIA GPUs
    aligned: tuple = ()  # pointers known 16-byte aligned and integers multiples of 16, as the launcher specializes
    # them at run time (for the model shapes): the loads then vectorize and pipeline through shared memory


def flags(*names):
    """Every True/False combination of the named constexpr flags, as dicts."""
    return [dict(zip(names, values)) for values in product((False, True), repeat=len(names))]


def flag_id(d):
    return "-".join(f"{k}={int(v)}" for k, v in d.items() if isinstance(v, bool)) or "base"


def torch_dtype(name):
    """The torch dtype of a case's dtype name (DTYPES)."""
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def dot_case(name):
    """DTYPE, OPERAND and PRECISION of kernels/softcap_attention.py's `_dot` as a GPU launch of a case's dtype name
    sets them (kernels/decode_linear.py's `dot_constexprs`)."""
    operand = getattr(tl, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[name])
    return dict(DTYPE=operand, OPERAND=operand, PRECISION="ieee" if name == "fp32" else "tf32")


def kernel_cases():
    """The launch configurations of the largest realistic shapes, from the launchers themselves."""
    import kernels.adamw_master as adam
    import kernels.add_rms_norm as arn
    import kernels.cross_entropy as ce
    import kernels.decode_attention as da
    import kernels.dora_backward as db
    import kernels.dora_norm as dn
    import kernels.fp8_quantize as fq
    import kernels.fp8_quantize_tensor as fqt
    import kernels.nf4_dequantize as nf4
    import kernels.nf4_to_fp8 as nf8
    import kernels.rms_norm as rn
    import kernels.rope as rp
    import kernels.rope_cache as rc
    import kernels.sample as smp
    import kernels.softcap_attention as sa
    from kernels.references import NF4_ABSMAX_BLOCK, NF4_BLOCK
    specs = []  # (module, kernel, signature(dtype), base constexprs, flag combos, num_warps[, label])

    block, warps = ce.launch_config(262144, ce.FORWARD_MAX_BLOCK)
    specs.append(("kernels.cross_entropy", "_cross_entropy_forward_kernel", lambda t: {
        "logits_ptr": f"*{t}", "logits_row_stride": "i32", "dlogits_ptr": f"*{t}", "dlogits_row_stride": "i32",
        "targets_ptr": "*i64", "losses_ptr": "*fp32", "lse_ptr": "*fp32", "V": "i32", "ignore_index": "i32",
        "scale": "fp32", "inv_softcap": "fp32", "softcap": "fp32"}, {"BLOCK": block},
        flags("HAS_SCALE", "HAS_SOFTCAP", "COMPUTE_GRAD"), warps))
    block, warps = ce.launch_config(262144, ce.BACKWARD_MAX_BLOCK)
    specs.append(("kernels.cross_entropy", "_cross_entropy_backward_kernel", lambda t: {
        "logits_ptr": f"*{t}", "logits_row_stride": "i32", "dlogits_ptr": f"*{t}", "targets_ptr": "*i64",
        "lse_ptr": "*fp32", "g_ptr": "*fp32", "g_stride": "i32", "V": "i32", "ignore_index": "i32",
        "scale": "fp32", "inv_softcap": "fp32", "softcap": "fp32"}, {"BLOCK": block},
        flags("HAS_SCALE", "HAS_SOFTCAP"), warps))

    block, warps = rn.launch_config(8192)
    specs.append(("kernels.rms_norm", "_rms_norm_forward_kernel", lambda t: {
        "x_ptr": f"*{t}", "x_row_stride": "i32", "w_ptr": f"*{t}", "y_ptr": f"*{t}", "rstd_ptr": "*fp32",
        "H": "i32", "eps": "fp32", "offset": "fp32"}, {"BLOCK": block}, flags("GEMMA_CAST"), warps))
    specs.append((arn.__name__, "_add_rms_norm_kernel", lambda t: {
        "x_ptr": f"*{t}", "r_ptr": f"*{t}", "w_ptr": f"*{t}", "rw_ptr": f"*{t}", "s_ptr": f"*{t}", "y_ptr": f"*{t}",
        "x_row_stride": "i32", "r_row_stride": "i32", "H": "i32", "eps": "fp32", "offset": "fp32"},
        {"BLOCK": block, "PDL": None}, flags("NORM_R", "GEMMA_CAST"), warps))
    specs.append(("kernels.rms_norm", "_rms_norm_backward_kernel", lambda t: {
        "dy_ptr": f"*{t}", "dy_row_stride": "i32", "x_ptr": f"*{t}", "x_row_stride": "i32", "w_ptr": f"*{t}",
        "rstd_ptr": "*fp32", "dres_ptr": f"*{t}", "dres_row_stride": "i32", "dx_ptr": f"*{t}",
        "dw_partial_ptr": "*fp32", "N": "i32", "H": "i32", "offset": "fp32", "rows_per_program": "i32"},
        {"BLOCK": block}, flags("GEMMA_CAST", "COMPUTE_DW", "HAS_DRES"), warps))

    block_hq, block_hk, block_half, warps = rp.launch_config(32, 8, 256)
    specs.append(("kernels.rope", "_rope_kernel", lambda t: {
        "q_ptr": f"*{t}", "k_ptr": f"*{t}", "q_token_stride": "i32", "k_token_stride": "i32",
        "q_out_ptr": f"*{t}", "k_out_ptr": f"*{t}", "q_out_token_stride": "i32", "k_out_token_stride": "i32",
        "cos_ptr": f"*{t}", "sin_ptr": f"*{t}", "cs_batch_stride": "i32", "cs_token_stride": "i32",
        "v_ptr": f"*{t}", "v_token_stride": "i32", "v_out_ptr": f"*{t}", "v_out_token_stride": "i32",
        "T": "i32", "HQ": "i32", "HK": "i32", "HALF": "i32"},
        {"BLOCK_HQ": block_hq, "BLOCK_HK": block_hk, "BLOCK_HALF": block_half},
        flags("BACKWARD", "COPY_V"), warps))
    specs.append((rc.__name__, "_rope_into_cache_kernel", lambda t: {
        "q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "q_row_stride": "i32", "k_row_stride": "i32",
        "v_row_stride": "i32", "q_out_ptr": f"*{t}", "k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}", "at_ptr": "*i64",
        "cos_ptr": f"*{t}", "sin_ptr": f"*{t}", "cs_row_stride": "i32", "qn_ptr": f"*{t}", "kn_ptr": f"*{t}",
        "eps": "fp32", "offset": "fp32", "S": "i32", "HQ": "i32", "HK": "i32", "HALF": "i32"},
        {"BLOCK_HQ": block_hq, "BLOCK_HK": block_hk, "BLOCK_HALF": block_half, "PDL": None},
        flags("QK_NORM", "GEMMA_CAST"), warps))
    block, _, _ = smp.launch_config(16, 151936, 2 * 132)  # a rollout's rows of Qwen2.5's vocabulary on an H100
    specs.append((smp.__name__, "_sample_chunks_kernel", lambda t: {
        "logits_ptr": f"*{t}", "logits_row_stride": "i32", "noise_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32",
        "score_ptr": "*fp32", "index_ptr": "*i32", "V": "i32", "chunk": "i32", "inv_temperature": "fp32"},
        {"BLOCK": block}, flags("SAMPLE"), smp.NUM_WARPS))
    specs.append((smp.__name__, "_sample_rows_kernel", lambda t: {
        "logits_ptr": f"*{t}", "logits_row_stride": "i32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "score_ptr": "*fp32",
        "index_ptr": "*i32", "tokens_ptr": "*i64", "logps_ptr": "*fp32", "V": "i32", "chunks": "i32",
        "inv_temperature": "fp32"}, {"BLOCK_C": 16}, [{}], smp.ROWS_NUM_WARPS))

    for transposed in (False, True):  # the row-major and the transposed (MLP gate/up) tiles
        block_n, block_c, sum_rows = db.launch_config(transposed)
        unit = "stride_n" if transposed else "stride_c"  # the contiguous dimension's stride, 1: the JIT specializes it
        specs.append(("kernels.dora_backward", "_dora_backward_kernel", lambda t: {
            "dy_ptr": f"*{t}", "p_ptr": f"*{t}", "g_ptr": f"*{t}", "inv_ptr": "*fp32", "dp_ptr": f"*{t}",
            "partial_ptr": "*fp32", "count_ptr": "*i32", "dm_ptr": "*fp32", "N": "i32", "C": "i32", "stride_n": "i32",
            "stride_c": "i32"}, {"BLOCK_N": block_n, "BLOCK_C": block_c, "SUM_ROWS": sum_rows,
                                 "TRANSPOSED": transposed, unit: 1}, [{}], db.NUM_WARPS,
            "transposed" if transposed else "rows"))

    for rank in (16, 64, 128, 256):  # SmolLM2's step (64 rows, K 16), Qwen's r 64, and the fewer-row tiles
        config = dn.launch_config(rank)
        specs.append(("kernels.dora_norm", "_dora_norm_kernel", lambda t: {
            "w_ptr": f"*{t}", "a_ptr": "*fp32", "b_ptr": "*fp32", "m_ptr": "*fp32", "g_ptr": f"*{t}",
            "inv_ptr": "*fp32", "OUT": "i32", "IN": "i32", "R": "i32", "end0": "i32", "end1": "i32", "scale": "fp32"},
            config, [{}], dn.NUM_WARPS, f"rank{rank}"))
        specs.append(("kernels.dora_norm", "_dora_norms_table_kernel", lambda t: {
            "groups_ptr": "*i64", "blocks_ptr": "*i32", "scales_ptr": "*fp32", "g_ptr": f"*{t}", "inv_ptr": "*fp32"},
            config, [{}], dn.NUM_WARPS, f"rank{rank}"))
        specs.append(("kernels.dora_norm", "_merge_table_kernel", lambda t: {
            "groups_ptr": "*i64", "blocks_ptr": "*i32", "scales_ptr": "*fp32", "out_ptr": f"*{t}"},
            config, flags("DORA"), dn.NUM_WARPS, f"rank{rank}"))

    specs.append(("kernels.nf4_dequantize", "_nf4_dequantize_kernel", lambda t: {
        "packed_ptr": "*u8", "absmax_ptr": "*u8", "absmax_scale_ptr": "*fp32", "absmax_offset_ptr": "*fp32",
        "absmax_code_ptr": "*fp32", "levels_ptr": "*fp32", "out_ptr": f"*{t}", "n": "i32", "K": "i32",
        "row_stride": "i32"}, {"BLOCKS": nf4.BLOCKS, "BLOCK": NF4_BLOCK, "ABSMAX_BLOCK": NF4_ABSMAX_BLOCK},
        flags("STRIDED", "HARDWARE_BF16"), nf4.OPTIONS["num_warps"]))

    # e4m3 from the GPU's conversion (HARDWARE_E4M3) or from the fp32 bits, stored as uint8. Every launch
    # configuration: a row held in registers (the widest), a wide row read twice, a transposed x in tiles.
    fp8_sig = lambda t: {  # noqa: E731
        "x_ptr": f"*{t}", "x_row_stride": "i32", "x_col_stride": "i32", "q_ptr": "*u8", "s_ptr": "*fp32",
        "M": "i32", "K": "i32"}
    for label, K, transposed in (("one_pass", fq.MAX_ONE_PASS, False), ("wide", 28672, False),
                                 ("transposed", 28672, True)):
        block_m, block_k, one_pass, warps = fq.launch_config(4096, K, transposed)
        specs.append(("kernels.fp8_quantize", "_fp8_quantize_rows_kernel", fp8_sig,
                      {"BLOCK_M": block_m, "BLOCK_K": block_k, "ONE_PASS": one_pass, "MIN_SCALE": fq.MIN_SCALE},
                      flags("HARDWARE_E4M3"), warps, label))
    specs.append(("kernels.fp8_quantize_tensor", "_fp8_quantize_tensor_kernel", lambda t: {
        "x_ptr": f"*{t}", "x_row_stride": "i32", "x_col_stride": "i32", "amax_ptr": f"*{t}", "q_ptr": "*u8",
        "s_ptr": "*fp32", "M": "i32", "K": "i32"},
        {"BLOCK_M": fqt.BLOCK[0], "BLOCK_K": fqt.BLOCK[1], "MIN_SCALE": fq.MIN_SCALE}, flags("HARDWARE_E4M3"),
        fqt.NUM_WARPS))
    group = 3  # projections in one launch (q, k, v), each with its NF4 tensors
    specs.append(("kernels.nf4_to_fp8", "_nf4_to_fp8_kernel", lambda t: {
        "weights": (("*u8", "*u8", "*fp32", "*fp32", "*fp32"),) * group, "rows": ("i32",) * group,
        "first_rows": ("i32",) * group, "first_tiles": ("i32",) * (group + 1), "levels_ptr": "*fp32",
        "rcp_ptr": "*fp32", "out_ptr": "*u8", "out_row_stride": "i32", "K": "i32"},
        {"N": group, "BLOCK_R": nf8.BLOCK_R, "BLOCK_K": nf8.BLOCK_K, "BLOCK": NF4_BLOCK,
         "ABSMAX_BLOCK": NF4_ABSMAX_BLOCK},
        flags("TRANSPOSED", "WHOLE_BLOCKS", "HARDWARE_E4M3"), nf8.OPTIONS["num_warps"]))
    specs.append(("kernels.adamw_master", "_adamw_master_kernel", lambda t: {  # t: the gradient's and weight's
        "master_ptr": "*fp32", "exp_avg_ptr": "*fp32", "exp_avg_sq_ptr": "*fp32", "grad_ptr": f"*{t}",
        "weight_ptr": f"*{t}", "factor_ptr": "*fp32", "found_inf_ptr": "*fp32", "coefs_ptr": "*fp32", "n": "i64",
        "lr_decay": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32"}, {"BLOCK": adam.BLOCK}, [{}],
        adam.NUM_WARPS))

    cases = []
    for module, kernel, signature, base, combos, warps, *label in specs:  # label: one of a kernel's configurations
        for dtype, combo, arch in product(DTYPES, combos, ARCHS):
            if combo.get("HARDWARE_E4M3") and arch < 89:
                continue  # sm_80 has no e4m3 conversion (nor fp8 GEMMs): the kernels use the bits there
            constexprs = {**base, **combo}
            if "PDL" in constexprs:  # a decoding kernel's dependent launch: on from sm_90, as `pdl_constexprs` sets it
                constexprs["PDL"] = arch >= 90
            sig = {**signature(dtype), **{k: "constexpr" for k in constexprs}}
            cases.append(Case("-".join([kernel, *label, dtype, flag_id(combo), f"sm{arch}"]), module, kernel, sig,
                              constexprs, warps, arch))
    return cases + glu_cases() + decode_attention_cases(da) + softcap_attention_cases(sa) + decode_gemm_cases() + \
        adapter_grads_cases() + residual_lowrank_add_cases()


def glu_cases():
    """SwiGLU's and GeGLU's kernels (kernels/glu.py): every flag combination of the elementwise blocks, and the tiles
    with low-rank terms where the LoRA MLP runs them: gate's and up's terms, dH's, or both (no affine; h written
    over dH, with and without amax), and dH's beside DoRA's affine of gate and up, at rank 16, and in half precision
    at the largest pipelined rank and at a rank of two chunks, whose shared memory is what could exceed a GPU's.
    fp32 terms run unpipelined (`tile_stages`) and their products as FMAs, whose code at k 64 and 128 took 10-100 s
    a case to compile on one core of a 2-core CPU machine: their rank-16 cases compile every fp32 flag."""
    import kernels.geglu as gg
    import kernels.glu as glu
    import kernels.swiglu as sw
    cases = []
    for (mod, name, approx), dtype, arch in product(((sw, "swiglu", ()), (gg, "geglu", ("APPROX_TANH",))), DTYPES,
                                                    ARCHS):
        term = (f"*{dtype}", "i32", "i32", f"*{dtype}", "i32", "i32", "i32")  # (L, its strides, R, its strides, k)
        base = dict(BLOCK=glu.BLOCK, BLOCK_R=glu.BLOCK_R, BLOCK_C=glu.BLOCK_C, BLOCK_K=16, K_CHUNKS=1, STEPS=1,
                    STAGES=1, **dot_case(dtype))
        elementwise = dict(TERMS=False, terms=None)
        tiles = dict(TERMS=True, STEPS=glu.STEPS, STAGES=glu.tile_stages(torch_dtype(dtype), 16))  # rank 16
        forward = [{**f, **elementwise} for f in flags(*approx, "AFFINE", "HAS_BIAS", "AMAX")] + [
            {**f, "AFFINE": False, "HAS_BIAS": False, **tiles} for f in flags(*approx, "AMAX")]
        no_terms = dict(GATE_UP_TERMS=False, DH_TERM=False, dh_term=None, **elementwise)
        backward = [{**f, **no_terms} for f in flags(*approx, "AFFINE", "HAS_BIAS", "AMAX", "WRITE_H")]
        for gate_up, dh in ((True, True), (True, False), (False, True)):
            backward += [{**f, "AFFINE": False, "HAS_BIAS": False, "WRITE_H": True, **tiles,
                          "GATE_UP_TERMS": gate_up, "DH_TERM": dh, **({} if gate_up else {"terms": None}),
                          **({} if dh else {"dh_term": None})} for f in flags(*approx, "AMAX")]
        backward += [{**f, "AFFINE": True, "AMAX": False, "WRITE_H": True, **tiles, "GATE_UP_TERMS": False,
                      "DH_TERM": True, "terms": None} for f in flags(*approx, "HAS_BIAS")]
        for k in (64, 128) if dtype != "fp32" else ():  # the largest pipelined rank, and one of two chunks
            rank = dict(BLOCK_K=glu.MAX_BLOCK_K, K_CHUNKS=k // glu.MAX_BLOCK_K, AMAX=True,
                        STAGES=glu.tile_stages(torch_dtype(dtype), k))
            forward.append({**forward[-1], **rank})
            backward.append({**next(f for f in backward if f["GATE_UP_TERMS"] and f["DH_TERM"]), **rank})
        pointers = ("gate", "up", "scale", "bias", "h", "amax")
        signatures = (
            ("forward", forward, {**{f"{a}_ptr": f"*{dtype}" for a in pointers}, "n": "i32", "n_cols": "i32",
                                  "terms": (term, term)}),
            ("backward", backward, {**{f"{a}_ptr": f"*{dtype}" for a in ("dh", *pointers[:4], "dgate", "dup", "amax")},
                                    "n": "i32", "n_cols": "i32", "terms": (term, term), "dh_term": term}))
        for direction, combos, signature in signatures:
            for combo in combos:
                constexprs = {**base, **combo}
                sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
                kernel = f"_{name}_{direction}_kernel"
                rank = [f"k{constexprs['BLOCK_K'] * constexprs['K_CHUNKS']}"] if constexprs["BLOCK_K"] > 16 else []
                cases.append(Case("-".join([kernel, dtype, flag_id(combo), *rank, f"sm{arch}"]), mod.__name__, kernel,
                                  sig, constexprs, glu.TILE_WARPS if combo["TERMS"] else glu.NUM_WARPS, arch))
    return cases


def adapter_grads_cases():
    """The LoRA dY products from one read (kernels/adapter_grads.py) at its launcher's configurations, every dtype,
    ranks padded to 16 and 64, with the pointers 16-byte aligned as torch's tensors make them: the tiles of dY then
    pipeline through shared memory, which is what needs the most of it."""

    import kernels.adapter_grads as ag
    cases = []
    for dtype, R, arch in product(DTYPES, (16, 64), ARCHS):
        for quantize in (False, True):
            block_f, block_t, warps, stages = ag.launch_config(torch_dtype(dtype), quantize)
            constexprs = dict(RANK=R, R=R, BLOCK_F=block_f, BLOCK_T=block_t, **dot_case(dtype), QUANTIZE=quantize,
                              HARDWARE_E4M3=arch >= 89, MIN_SCALE=2.0**-126)
            sig = {"dyt_ptr": f"*{dtype}", "p_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "db_ptr": "*fp32",
                   "q_ptr": "*fp32", "amax_ptr": f"*{dtype}", "q8_ptr": "*u8", "s8_ptr": "*fp32",
                   **dict.fromkeys(("N", "M", "OUT", "stride_dyt", "stride_p", "stride_b"), "i32"), "scale": "fp32",
                   "runs": "i32", "tiles_per_run": "i32", **dict.fromkeys(constexprs, "constexpr")}
            cases.append(Case(f"_adapter_grads_kernel-R{R}-{dtype}-QUANTIZE={int(quantize)}-sm{arch}", ag.__name__,
                              "_adapter_grads_kernel", sig, constexprs, warps, arch, stages,
                              aligned=("dyt_ptr", "p_ptr", "b_ptr", "db_ptr", "q_ptr", "q8_ptr", "N", "stride_dyt",
                                       "stride_p", "stride_b")))
    return cases


def residual_lowrank_add_cases():
    """An fp8 output's residual and adapter product (kernels/residual_lowrank_add.py), every dtype at rank 16 (one
    chunk) and half precision at 128 (two chunks of 64; fp32's products are FMAs, whose code there takes ~20 s a case
    to compile, and --fp8 runs beside bf16), the pointers 16-byte aligned as torch's tensors make them."""
    import kernels.residual_lowrank_add as rla
    from kernels.glu import rank_blocks
    cases = []
    for dtype, k, arch in product(DTYPES, (16, 128), ARCHS):
        if dtype == "fp32" and k > 16:
            continue
        block_k, chunks = rank_blocks(k)
        constexprs = dict(BLOCK_R=rla.BLOCK_R, BLOCK_C=rla.BLOCK_C, BLOCK_K=block_k, K_CHUNKS=chunks, **dot_case(dtype))
        term = (f"*{dtype}", "i32", "i32", f"*{dtype}", "i32", "i32", "i32")  # (P, its strides, B, its strides, k)
        sig = {"y_ptr": f"*{dtype}", "y_row_stride": "i32", "r_ptr": f"*{dtype}", "r_row_stride": "i32", "term": term,
               "n_rows": "i32", "n_cols": "i32", **dict.fromkeys(constexprs, "constexpr")}
        cases.append(Case(f"_residual_lowrank_add_kernel-k{k}-{dtype}-sm{arch}", rla.__name__,
                          "_residual_lowrank_add_kernel", sig, constexprs, rla.NUM_WARPS, arch,
                          aligned=("y_ptr", "r_ptr", "y_row_stride", "r_row_stride", "n_cols")))
    return cases


def decode_attention_cases(da):
    """The decoding attention at its launcher's configurations: Qwen2.5-0.5B's heads (rep 7, D 64; SmolLM2's rep 3
    pads to the same tiles) and Gemma's widest (rep 8, D 256), in every dtype and every flag combination, with the
    pointers 16-byte aligned as Triton's launcher specializes them for torch's tensors: the loads then vectorize
    and pipeline through shared memory, which is what runs on a GPU and what needs the most shared memory."""
    cases = []
    for (label, (rep, D)), dtype, combo, arch in product(
            (("qwen", (7, 64)), ("large", (8, 256))), DTYPES,
            flags("HAS_FIRST", "HAS_WINDOW", "HAS_SOFTCAP"), ARCHS):
        block_rep, block_s, block_d = da.launch_config(rep, D, torch_dtype(dtype))
        constexprs = dict(D=D, REP=rep, BLOCK_REP=block_rep, BLOCK_S=block_s, BLOCK_D=block_d, **dot_case(dtype),
                          PDL=arch >= 90, **combo)
        sig = {**{f"{a}_ptr": f"*{dtype}" for a in ("q", "k", "v", "y")}, "first_ptr": "*i64", "at_ptr": "*i64",
               "S": "i32", "HK": "i32", "window": "i32", "scale": "fp32", "softcap": "fp32",
               **dict.fromkeys(constexprs, "constexpr")}
        cases.append(Case(f"_decode_attention_kernel-{label}-{dtype}-{flag_id(combo)}-sm{arch}", da.__name__,
                          "_decode_attention_kernel", sig, constexprs, da.NUM_WARPS, arch, da.NUM_STAGES,
                          aligned=("q_ptr", "k_ptr", "v_ptr", "y_ptr")))
    return cases


def softcap_attention_cases(sa):
    """The softcapped flash attention's three kernels at the launchers' fixed configurations, on GPUs (tensor-core
    operands): Gemma 2's head of 256 (2B, 9B) in every dtype on sm_80, whose shared memory is the smaller, and in
    bf16 on sm_90; the 128 (27B) and 64 configurations once each. Each compile of these takes seconds: the cases
    are the ones that differ in configuration, dtype or architecture, not every product of them."""
    pointers = {"_forward_kernel": ("q", "k", "v", "y", "lse", "lo"),
                "_backward_dkdv_kernel": ("q", "k", "v", "dy", "lse", "delta", "lo", "hi", "dk", "dv"),
                "_backward_dq_kernel": ("q", "k", "v", "dy", "lse", "delta", "lo", "dq")}
    types = {"lse": "fp32", "delta": "fp32", "lo": "i32", "hi": "i32"}
    cases = []
    for kernel, args in pointers.items():
        for D, dtype, arch in ((256, "bf16", 80), (256, "fp16", 80), (256, "fp32", 80), (256, "bf16", 90),
                               (128, "bf16", 80), (64, "fp16", 90)):
            block_m, block_n, warps, stages = sa.launch_config(D, torch_dtype(dtype), kernel != "_forward_kernel")
            constexprs = dict(REP=2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=D, **dot_case(dtype))
            sig = {**{f"{a}_ptr": f"*{types.get(a, dtype)}" for a in args},
                   **dict.fromkeys(("T", "HQ", "HK", "D"), "i32"), "scale": "fp32", "softcap": "fp32",
                   **dict.fromkeys(constexprs, "constexpr")}
            cases.append(Case(f"softcap_attention{kernel}-D{D}-{dtype}-sm{arch}", sa.__name__, kernel, sig, constexprs,
                              warps, arch, stages))
    return cases


def decode_gemm_cases():
    """A decoding step's three GEMM kernels at their largest tiles (64 rows; a head of 256 for q | k | v), with the
    bias, whole (SPLIT 1) and with K split (the workspace's sums and arrival counts): bf16 on both architectures,
    and q | k | v's split in fp32 on sm_80 too (twice the bytes an element), whose shared memory is the smaller;
    in bf16 each also as it runs between two GEMMs (o and down writing the next norm's `Scaled` rows, gate | up and
    q | k | v reading them, from 128 blocks of sums as at a hidden size of 4096; q | k | v with Qwen3's norms of
    its q and k heads there and in fp32, without them in the other cases) and as it runs in Gemma 2/3's layers (o
    and down without the add, gate | up with GeGLU and q | k | v with the head norms reading a `Sandwich`, Gemma's
    norm rounding); o, down and gate | up in bf16 also at 64 columns a program, as for a wide weight. Aligned as at
    the model shapes (the loads pipeline), and on sm_90 with programmatic dependent launch (PDL), as their
    launchers compile them there."""
    import torch

    import kernels.decode_linear as dl
    gemm = {"_decode_linear_kernel": ("kernels.decode_linear", ("x", "w", "b", "r", "y", "nw", "xs"),
                                      ("M", "N", "K", "K_CHUNK"), {"BLOCK_N": 32}),
            "_decode_swiglu_kernel": ("kernels.decode_swiglu", ("x", "nw", "w", "b", "h", "zs", "xo"),
                                      ("M", "N", "K", "K_CHUNK", "T", "TZ"),
                                      {"BLOCK_N": 32, "GEMMA_CAST": False, "ACT": "silu"}),
            "_decode_qkv_kernel": ("kernels.decode_qkv",
                                   ("x", "nw", "w", "b", "cos", "sin", "q", "k_cache", "v_cache", "qn", "kn", "zs",
                                    "xo"),
                                   ("M", "K", "K_CHUNK", "S", "HQ", "HK", "HALF", "T", "TZ"),
                                   {"BLOCK_HALF": 128, "GEMMA_CAST": False})}
    floats = {"_decode_linear_kernel": ("offset",), "_decode_swiglu_kernel": ("eps", "offset"),
              "_decode_qkv_kernel": ("eps", "offset")}
    plain = {"NORMALIZE": True, "T_STEPS": 1, "SANDWICH": False, "TZ_STEPS": 1}
    # as it runs between two GEMMs: after o or down, with or without the add; reading the rows before it wrote
    chained = {"_decode_linear_kernel": ({"SCALE_NEXT": False, "HAS_RESIDUAL": True},
                                         {"SCALE_NEXT": True, "HAS_RESIDUAL": True},
                                         {"SCALE_NEXT": True, "HAS_RESIDUAL": False})}
    sandwich = {**plain, "SANDWICH": True, "TZ_STEPS": 4}
    cases = []
    for kernel, (module, pointers, ints, base_shape) in gemm.items():
        shapes = (base_shape,) + (({**base_shape, "BLOCK_N": 64},) if "BLOCK_N" in base_shape else ())  # and wide
        runs = list(product(("bf16",), (80, 90), (1, 4), shapes))
        if kernel == "_decode_qkv_kernel":
            runs.append(("fp32", 80, 4, base_shape))
        for dtype, arch, split, shape in runs:
            modes = chained.get(kernel, (plain, {**plain, "NORMALIZE": False, "T_STEPS": 4}, sandwich))
            for mode in modes[:1] if dtype == "fp32" else modes[:2] if shape.get("BLOCK_N") == 64 else modes:
                extra = {}
                if "qn" in pointers:  # the head norms (Qwen3's, Gemma 3's)
                    extra["QK_NORM"] = dtype == "fp32" or not mode["NORMALIZE"] or mode["SANDWICH"]
                if mode is sandwich:  # Gemma's norm rounding, and its GeGLU
                    extra.update(GEMMA_CAST=True, **({"ACT": "gelu_tanh"} if "ACT" in shape else {}))
                constexprs = {**dict(HAS_BIAS=True, SPLIT=split, **dot_case(dtype), BLOCK_M=dl.MAX_ROWS,
                                     BLOCK_K=32 if dtype == "fp32" else 128, PDL=arch >= 90),
                              **shape, **mode, **extra}
                sig = {**{f"{a}_ptr": f"*{dtype}" for a in pointers},
                       **({"at_ptr": "*i64"} if "q" in pointers else {}), "ss_ptr": "*fp32",
                       **({"zss_ptr": "*fp32"} if "zs" in pointers else {}),
                       "ws_ptr": "*fp32", "count_ptr": "*i32", **dict.fromkeys(ints, "i32"),
                       **dict.fromkeys(floats[kernel], "fp32"), **dict.fromkeys(constexprs, "constexpr")}
                width = {"_decode_linear_kernel": shape.get("BLOCK_N", 0)}.get(kernel, 2 * shape.get("BLOCK_N", 0)
                                                                                   + 2 * shape.get("BLOCK_HALF", 0))
                stages = dl.num_stages((dl.MAX_ROWS + width) * constexprs["BLOCK_K"],
                                       torch.empty(0, dtype=torch_dtype(dtype)))
                chain = ("-sandwich" if mode is sandwich else "-noadd" if mode is modes[2] else
                         "-chained" if mode is modes[1] else "")
                name = f"{kernel}-{dtype}-split{split}{chain}{'-n64' if shape.get('BLOCK_N') == 64 else ''}-sm{arch}"
                cases.append(Case(name, module, kernel, sig, constexprs, dl.NUM_WARPS, arch, stages,
                                  aligned=tuple(f"{a}_ptr" for a in pointers) + ("K", "K_CHUNK")))
    return cases


# --------------------------------------------------------------------------- the Unsloth bug

@triton.jit
def _branch_dtype_bug_kernel(x_ptr, y_ptr, n):
    x = tl.load(x_ptr)  # bf16
    if n > 0:  # a runtime branch: both sides must leave x with one type
        x = x.to(tl.float32) * 2.0  # fp32 on this side only
    tl.store(y_ptr, x)


def bug_cases():
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32"}
    return [Case(f"branch_dtype_bug-sm{arch}", __name__, "_branch_dtype_bug_kernel", sig, {}, 4, arch)
            for arch in ARCHS]


# --------------------------------------------------------------------------- compiling (in the subprocess)

def compile_case(case: Case) -> str:
    """'' if the case compiles to a cubin whose shared memory fits the architecture, else the error's first lines."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(case.module), case.kernel)
    try:
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in case.aligned}
        compiled = triton.compile(ASTSource(fn=fn, signature=case.signature, constexprs=case.constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", case.arch, 32),
                                  options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    except Exception as e:  # report every failure, not just the first
        return f"{type(e).__name__}: {e}"[:2000] or type(e).__name__
    shared = compiled.metadata.shared
    return "" if shared <= SHARED_MEMORY[case.arch] else f"{shared} bytes of shared memory, over sm_{case.arch}'s limit"


def nf4_fma(arch, kernel) -> str:
    """'' if the NF4 kernel `kernel`, compiled with its launcher's options, has no FMA in its PTX, else what it
    has: a fused D[c] · s + o would round once where bitsandbytes rounds twice (kernels/nf4_dequantize.py)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    case = next(c for c in kernel_cases() if c.kernel == kernel and c.arch == arch)
    fn = getattr(importlib.import_module(case.module), case.kernel)
    options = importlib.import_module(case.module).OPTIONS
    ptx = triton.compile(ASTSource(fn=fn, signature=case.signature, constexprs=case.constexprs),
                         target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
    return ", ".join(sorted(set(re.findall(r"\bfma\.\S+", ptx))))


def e4m3_conversions(kernel) -> str:
    """The fp32-to-e4m3 conversions in the sm_90 PTX of `kernel` with HARDWARE_E4M3 on: the kernels rely on them
    rounding to nearest even and saturating (cvt.rn.satfinite), as references.to_e4m3 does."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    case = next(c for c in kernel_cases() if c.kernel == kernel and c.arch == 90 and c.constexprs["HARDWARE_E4M3"])
    fn = getattr(importlib.import_module(case.module), case.kernel)
    ptx = triton.compile(ASTSource(fn=fn, signature=case.signature, constexprs=case.constexprs),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": case.num_warps}).asm["ptx"]
    return ", ".join(sorted(set(re.findall(r"\bcvt\.\S*e4m3\S*", ptx))))


def loads_before_wait(case_id) -> str:
    """'' if the PTX of a case compiled with PDL reads or writes global memory only after its `griddepcontrol.wait`
    (before it: L2 prefetches of weights and the kernel's parameters), else the first such instruction: a load
    there could read what the previous kernel has not written yet, and a store overwrite what it still reads."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    case = next(c for c in kernel_cases() if c.id == case_id)
    fn = getattr(importlib.import_module(case.module), case.kernel)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in case.aligned}
    ptx = triton.compile(ASTSource(fn=fn, signature=case.signature, constexprs=case.constexprs, attrs=attrs),
                         target=GPUTarget("cuda", case.arch, 32),
                         options={"num_warps": case.num_warps, "num_stages": case.num_stages}).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "no griddepcontrol.wait"
    early = re.search(r"\b((ld|st|atom|red)\.global|cp\.async)\S*", ptx[:wait])
    return "" if early is None else early.group(0)


PDL_CASES = ("_decode_linear_kernel-bf16-split4-sm90", "_decode_swiglu_kernel-bf16-split4-sm90",
             "_decode_qkv_kernel-bf16-split4-sm90", "_decode_linear_kernel-bf16-split4-chained-sm90",
             "_decode_swiglu_kernel-bf16-split4-chained-sm90", "_decode_qkv_kernel-bf16-split4-chained-sm90",
             "_decode_linear_kernel-bf16-split4-noadd-sm90", "_decode_swiglu_kernel-bf16-split4-sandwich-sm90",
             "_decode_qkv_kernel-bf16-split4-sandwich-sm90",
             "_decode_attention_kernel-qwen-bf16-HAS_FIRST=1-HAS_WINDOW=1-"
             "HAS_SOFTCAP=1-sm90", "_add_rms_norm_kernel-bf16-NORM_R=1-GEMMA_CAST=1-sm90",
             "_rope_into_cache_kernel-bf16-QK_NORM=1-GEMMA_CAST=0-sm90")


def compile_all() -> dict:
    cases = kernel_cases() + bug_cases()
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        compiled = dict(zip((c.id for c in cases), pool.map(compile_case, cases)))
        fma = {f"{name}-sm{arch}": pool.submit(nf4_fma, arch, kernel).result() for arch in ARCHS
               for name, kernel in NF4_KERNELS.items()}
        cvt = {f"e4m3_cvt-{kernel}": pool.submit(e4m3_conversions, kernel).result() for kernel in E4M3_KERNELS}
        pdl = {f"pdl-{case}": pool.submit(loads_before_wait, case).result() for case in PDL_CASES}
        return {**compiled, **fma, **cvt, **pdl}


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(compile_all()))
    sys.exit(0)


# --------------------------------------------------------------------------- tests (in pytest)

@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)  # minutes with an empty Triton cache, seconds with a full one
    if proc.returncode != 0:
        pytest.fail(f"the compile subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case_id", [c.id for c in kernel_cases()])
def test_kernel_compiles(compiled, case_id):
    assert compiled[case_id] == "", f"{case_id} does not compile:\n{compiled[case_id]}"


@pytest.mark.parametrize("name", NF4_KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_nf4_kernels_compile_without_fma(compiled, arch, name):
    assert compiled[f"{name}-sm{arch}"] == "", f"the NF4 kernel's PTX fuses: {compiled[f'{name}-sm{arch}']}"


@pytest.mark.parametrize("kernel", E4M3_KERNELS)
def test_e4m3_kernels_use_the_saturating_conversion_on_sm90(compiled, kernel):
    assert compiled[f"e4m3_cvt-{kernel}"] == "cvt.rn.satfinite.e4m3x2.f32", compiled[f"e4m3_cvt-{kernel}"]


@pytest.mark.parametrize("case_id", PDL_CASES)
def test_dependent_launches_touch_memory_only_after_their_wait(compiled, case_id):
    assert compiled[f"pdl-{case_id}"] == "", f"{case_id} before griddepcontrol.wait: {compiled[f'pdl-{case_id}']}"


@pytest.mark.parametrize("arch", ARCHS)
def test_compiler_rejects_dtype_changed_in_branch(compiled, arch):
    error = compiled[f"branch_dtype_bug-sm{arch}"]
    assert "CompilationError" in error and "bf16" in error and "fp32" in error, error


@pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="shows what the interpreter (CPU tests) accepts")
def test_interpreter_accepts_dtype_changed_in_branch():
    import torch
    x = torch.tensor([1.5], dtype=torch.bfloat16)
    y = torch.empty_like(x)
    _branch_dtype_bug_kernel[(1,)](x, y, 1)
    assert y.item() == 3.0
