"""QLoRA (Dettmers et al. 2023): frozen projection weights stored in 4-bit NormalFloat.

Each weight is cut into blocks of 64 values; a block stores one 4-bit NF4 code per value
(the 16 levels are quantiles of a standard normal) and its absmax scale. With double
quantization (compress_statistics=True) the absmax scales are themselves quantized to 8
bits in blocks of 256, around their mean. Bits per weight value:

    4 (code) + 8/64 (absmax) + 32/(64·256) (fp32 scale of the absmax) ≈ 4.127,

0.258 of bf16's 16. bitsandbytes' `quantize_4bit` quantizes, on GPU and CPU. On CUDA,
nanotune's Triton kernel dequantizes (kernels/nf4_dequantize.py: bit-equal to
bitsandbytes' `dequantize_4bit`, and straight into a given buffer); elsewhere
`dequantize_4bit` does.

`NF4Weight` holds those tensors as buffers (so `.to(device)` moves them and byte counts
see them) and replaces a LoRALinear's `weight`. `LoRALinear.base_weight()` dequantizes
it; the fused LoRA Functions (model/lora.py) dequantize the weights of projections that
share an input (q, k, v; gate, up) into the rows of one [Σout, in] buffer, in forward and
again in backward (with the adapters' B set beside it or A below it, so that one GEMM computes both terms), and
free it right after each matmul, so a dequantized weight is never kept. (The
unfused reference path, fused_lora=False, lets autograd save each dequantized weight for
backward: correct, but with full-precision weight memory.)

`load_model(..., quantize="nf4")` quantizes each projection weight as it is read from
the checkpoint (`quantize_linear_`), so the full-precision model is never on the device
at once. Embeddings, lm_head and norms stay in the model dtype, as in the QLoRA paper.
"""
import logging
from functools import lru_cache

import torch
import torch.nn as nn

from kernels.references import NF4_ABSMAX_BLOCK, NF4_BLOCK, NF4Data
from model.lora import LoRALinear


def import_bitsandbytes():
    """Import bitsandbytes (once; a failure raises as the import does) without the warning of its CPU backend.

    On a CPU with AVX512-BF16, importing bitsandbytes runs `from kernels import get_kernel`, to fetch a CPU
    matmul from Hugging Face's optional `kernels` package, and logs "Failed to load CPU gemm_4bit_forward from
    kernels-community ..." through the logger `bitsandbytes.backends.cpu.ops` when that fails. Run from
    nanotune's root, the import finds nanotune's own `kernels/` folder, which has no get_kernel, so the warning
    appears on every QLoRA run although nothing is wrong: bitsandbytes then uses its own kernel, and nanotune
    never calls that matmul (it dequantizes, model/qlora.py). That one logger is silenced during the import.
    It can go when bitsandbytes no longer probes for `kernels` at import (tests/test_ux.py shows the warning
    without this function: that check fails then)."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    disabled, logger.disabled = logger.disabled, True
    try:
        import bitsandbytes
        import bitsandbytes.functional  # noqa: F401
    finally:
        logger.disabled = disabled
    return bitsandbytes


import_bitsandbytes()
from bitsandbytes.functional import QuantState, create_dynamic_map, dequantize_4bit, quantize_4bit  # noqa: E402


@lru_cache
def absmax_code(device):
    """The 256 levels of the absmax scales' 8-bit quantization: bitsandbytes' signed dynamic
    map, the same for every weight, so it is kept once per device rather than per weight."""
    return create_dynamic_map(signed=True).to(device)


class NF4Weight(nn.Module):
    """One weight [out, in] in NF4 with double-quantized absmax scales."""

    def __init__(self, weight):
        super().__init__()
        assert weight.dtype in (torch.float32, torch.bfloat16, torch.float16), (
            f"NF4 quantizes fp32/bf16/fp16 weights, got {weight.dtype}")
        packed, state = quantize_4bit(weight.contiguous(), blocksize=NF4_BLOCK, compress_statistics=True,
                                      quant_type="nf4")  # always name nf4: bitsandbytes defaults to fp4
        assert state.state2.blocksize == NF4_ABSMAX_BLOCK and torch.equal(state.state2.code, absmax_code(weight.device))
        self.shape, self.weight_dtype = weight.shape, weight.dtype  # what dequantize() gives back
        # Not in state_dict(): the checkpoint's full-precision weight is the source of truth.
        self.register_buffer("packed", packed, persistent=False)  # (numel/2, 1) uint8: two codes a byte
        self.register_buffer("absmax", state.absmax, persistent=False)  # (numel/64,) uint8
        self.register_buffer("absmax_offset", state.offset, persistent=False)  # () fp32, their mean
        self.register_buffer("absmax_scale", state.state2.absmax, persistent=False)  # (numel/64/256,) fp32

    def data(self):
        """The tensors of the NF4 format, for the Triton kernel (kernels/nf4_dequantize.py)."""
        return NF4Data(self.packed, self.absmax, self.absmax_scale, self.absmax_offset, absmax_code(self.packed.device))

    def dequantize(self, out=None, kernel=None):
        """The weight [out, in] in its original dtype, written into `out` when given (a tensor of that shape and
        dtype whose rows are contiguous: e.g. rows of a larger buffer, or its first columns), else into a new
        tensor. kernel: dequantize with nanotune's Triton kernel rather than bitsandbytes' (the same values, bit for
        bit); by default on CUDA only, where Triton compiles (elsewhere it runs only in its interpreter, far slower
        than bitsandbytes' CPU code). Where neither writes `out` in place, the weight is copied into it."""
        assert out is None or (out.shape == self.shape and out.dtype == self.weight_dtype and out.stride(-1) == 1), (
            f"NF4 dequantize: out must be {tuple(self.shape)} {self.weight_dtype} with contiguous rows, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
        if self.packed.is_cuda if kernel is None else kernel:
            from kernels.nf4_dequantize import nf4_dequantize, row_strided  # Triton is imported only where it runs
            if out is None or not (out.is_contiguous() or row_strided(out)):
                w = torch.empty(self.shape, dtype=self.weight_dtype, device=self.packed.device)
                w = nf4_dequantize(self.data(), w)
                return w if out is None else out.copy_(w)
            return nf4_dequantize(self.data(), out)
        absmax_state = QuantState(absmax=self.absmax_scale, code=absmax_code(self.packed.device),
                                  blocksize=NF4_ABSMAX_BLOCK, dtype=torch.float32)
        state = QuantState(absmax=self.absmax, shape=self.shape, blocksize=NF4_BLOCK, quant_type="nf4",
                           dtype=self.weight_dtype, offset=self.absmax_offset, state2=absmax_state)
        if out is not None and out.is_cuda and out.is_contiguous():
            return dequantize_4bit(self.packed, state, out=out)
        w = dequantize_4bit(self.packed, state)
        return w if out is None else out.copy_(w)  # bitsandbytes' CPU backend takes no out=, nor a strided one

    def extra_repr(self):
        return f"shape={tuple(self.shape)}, dtype={self.weight_dtype}"


def quantize_linear_(linear: LoRALinear, weight):
    """Store `weight` [out, in] in `linear` as NF4; its full-precision `weight` is dropped."""
    if tuple(weight.shape) != (linear.out_features, linear.in_features):
        raise ValueError(f"{linear.name}: weight of shape {tuple(weight.shape)}, expected "
                         f"{(linear.out_features, linear.in_features)}")
    linear.weight = None
    linear.nf4 = NF4Weight(weight.detach())


def nf4_bytes(model):
    """The bytes of the model's NF4 weights: codes, absmax scales and their quantization state."""
    return sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, NF4Weight) for b in m.buffers())


def quantize_model(model):
    """Quantize every projection weight of a model already in memory to NF4, in place."""
    for m in model.modules():
        if isinstance(m, LoRALinear) and m.weight is not None:
            quantize_linear_(m, m.weight)
    return model
