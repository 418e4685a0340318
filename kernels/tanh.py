"""tanh for Triton kernels, shared by cross-entropy (softcapping) and GeGLU (tanh-approximate gelu).

    tanh(x) = sign(x) * (1 - e) / (1 + e),  e = exp(-2|x|)

libdevice.tanh does not run in Triton's interpreter (the CPU tests). exp(-2|x|) <= 1 never
overflows, where 2 * sigmoid(2x) - 1 does, harmlessly but noisily, for |x| > 44.
The division is the approximate one (2 ulp: one reciprocal and a multiply): the IEEE
division's extra instructions make the soft-capped cross-entropy compute-bound.
Reference: torch.tanh.
"""
import triton
import triton.language as tl


@triton.jit
def tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = tl.fdiv(1.0 - e, 1.0 + e, ieee_rounding=False)
    return tl.where(x >= 0, t, -t)
