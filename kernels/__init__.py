"""Triton kernels for nanotune, one file per kernel. Each file holds the @triton.jit
kernel, its launcher, a torch.autograd.Function, the public function, and a pure-torch
`*_reference` that the tests compare against and the model uses when kernels are off."""
from kernels.cross_entropy import cross_entropy, cross_entropy_reference
from kernels.fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
from kernels.geglu import geglu, geglu_backward, geglu_forward, geglu_reference
from kernels.rms_norm import rms_norm, rms_norm_reference
from kernels.rope import apply_rope, rope_cos_sin, rope_reference
from kernels.swiglu import swiglu, swiglu_backward, swiglu_forward, swiglu_reference

__all__ = [
    "cross_entropy", "cross_entropy_reference",
    "fused_linear_cross_entropy", "fused_linear_cross_entropy_reference",
    "geglu", "geglu_forward", "geglu_backward", "geglu_reference",
    "rms_norm", "rms_norm_reference",
    "apply_rope", "rope_cos_sin", "rope_reference",
    "swiglu", "swiglu_forward", "swiglu_backward", "swiglu_reference",
]
