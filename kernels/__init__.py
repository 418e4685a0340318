"""Triton kernels for nanotune, one file per kernel: its math in the docstring, the @triton.jit
kernel, the launcher, the torch.autograd.Function and the public function. Import them from
their modules (`from kernels.rms_norm import rms_norm`).

    cross_entropy.py               cross-entropy over a large vocabulary, soft-capping, scaling
    fused_linear_cross_entropy.py  lm_head matmul + cross-entropy without the [N, V] logits
    rms_norm.py                    RMSNorm, Llama and Gemma rounding
    add_rms_norm.py                a residual add and the RMSNorm after it, and the sublayer's norm before it
                                   with sandwich norms (decoding)
    rope.py                        rotary position embedding of q and k
    swiglu.py, geglu.py            the gated MLP activations
    glu.py                         the launchers SwiGLU and GeGLU share (the amax of what they store, and the
                                   LoRA adapters' low-rank terms added as they read gate, up and dh)
    tanh.py                        tanh for kernels (softcapping, tanh-approximate gelu)
    dora_backward.py               DoRA's backward through its column scaling, in one pass
    dora_norm.py                   DoRA's column scales of a projection group, and merged weights W + s·B·A
    decode_attention.py            a decoding step's attention over a static KV cache
    rope_cache.py                  a decoding step's q/k head norms, RoPE and KV-cache write
    decode_qkv.py                  a decoding step's norm, q | k | v GEMM, bias, RoPE and cache write
    decode_swiglu.py               a decoding step's norm, gate | up GEMM and SwiGLU
    decode_linear.py               a decoding step's skinny GEMM with the residual add (o, down)
    sample.py                      a decoding step's token a row (the exponential race) and its log-prob
    softcap_attention.py           softcapped flash attention (Gemma 2), forward and backward
    nf4_dequantize.py              NF4 weights (double-quantized absmax) into a given buffer, as bitsandbytes
    nf4_to_fp8.py                  a group's NF4 weights straight to e4m3 with given scales, row-major or
                                   transposed, in one launch
    adamw_master.py                AdamW over flat fp32 masters, rounding the weights back, in one pass
    fp8_quantize.py                row-wise e4m3 quantization of activations (a scale per row)
    fp8_quantize_tensor.py         tensor-wise e4m3 quantization (one scale), of the MLP's transposed operands
    residual_lowrank_add.py        an fp8 projection's output plus the residual and its adapter's product, in
                                   one pass (o, down)
    token_sum_layouts.py           no kernel: the layouts of a GEMM over tokens (a weight's gradient) that
                                   cuBLAS sums whole, and which tensors are stored transposed
    references.py                  the pure-torch reference of every kernel (torch only, no Triton):
                                   what the tests compare against and the model runs with kernels off
"""
