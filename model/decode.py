"""A decoding step's layers in five kernel launches each (kernels/decode_*.py), where `Transformer.decode_layers`
launches nine and more: each weight is read by one skinny GEMM with the small ops around it fused into its prologue
and epilogue. For the residual stream x (M, H) of M rows of one token each:

    q = decode_qkv(xn, input_layernorm, W_qkv, b_qkv, cos, sin, cache)  norm, q | k | v, bias, (Qwen3's and Gemma
                                                                          3's q/k norms,) RoPE, cache write
    y = decode_attention(q, cache)                                        kernels/decode_attention.py
    x, xn = decode_linear(y, W_o, b_o, residual=x, next_norm=post)       o, the residual add, the norm's rows
    h = decode_swiglu(xn, post_attention_layernorm, W_gate_up, b_gate_up) norm, gate | up, silu(G) ⊙ U (or GeGLU)
    x, xn = decode_linear(h, W_down, b_down, residual=x, next_norm=next)  down, the residual add, the norm's rows

so each norm is split between the launch that writes its input (x ⊙ w and x's sums of squares, over that GEMM's
column tiles: `Scaled`) and the GEMM that reads it (which scales its sums by rstd); the first layer's q | k | v
normalizes x itself, and the final norm is one rms_norm launch after the last layer. In fp16 each normalizing GEMM
normalizes x itself: x ⊙ w can pass fp16's range where RMSNorm(x) ⊙ w does not. On Hopper each of these kernels
starts while the one before it runs and waits for it before its first load (programmatic dependent launch,
kernels/decode_linear.py).

With sandwich norms (Gemma 2/3: x + norm(sublayer(pre_norm(x)))), o and down write their output z without the add,
and its `Scaled` rows for the sublayer's post norm; the GEMM after (gate | up, the next layer's q | k | v) reads
x and those rows as a `Sandwich`: it adds x + RMSNorm(z), normalizes the sum with its own norm, and writes the sum
as the next x. The last layer's add and the final norm run after the loop, in one launch.

The values are the layers' own, within the rounding of the GEMMs' sums and of the norm's output, which is rounded
once (x ⊙ w) where the norm rounds it twice (tests/test_generate.py compares the logits with `decode_layers`' and,
in bf16, both with fp32 logits; Gemma's with the full forward's).

Taken (`FusedDecode.serves`) where every projection computes with a plain weight of the activations' dtype, packed
as `pack_weights_` packs q | k | v and gate | up (adapters merged, an NF4 base dequantized: `MergedAdapters`, whose
block a rollout's sampler opens), with at most 64 rows and norms of the activations' dtype, not for sandwich norms
in fp16 (z ⊙ w can pass its range), and for layers small enough that a step costs its launches more than its
bytes: up to MAX_LAYER_WEIGHTS weight elements a layer (a 1.5B model's; from 3B on, cuBLAS's GEMMs of the nine
launches stream the weights faster), MAX_SANDWICH_LAYER_WEIGHTS with sandwich norms (Gemma 3 270M's, not 1B's).
Elsewhere (fp8 bases, NF4 bases and adapters outside that block, larger layers) a step keeps `decode_layers`."""
import torch

from kernels.decode_linear import MAX_ROWS, Sandwich, Workspace, decode_linear
from kernels.decode_qkv import decode_qkv
from kernels.decode_swiglu import decode_swiglu
from model.lora import _rows_view


def packed(projs):
    """(W, b) of projections that read one input: [W_1; W_2; ...] (Σout, in) and their biases (or None), each one
    view of the rows `pack_weights_` (or `MergedAdapters`) stored one after the other, where every projection
    computes with a plain weight (merged inside `MergedAdapters`, an NF4 base's too; else no NF4 or fp8 base and no
    adapter); else None."""
    if any(p.r or (p.merged is None and (p.nf4 is not None or p.fp8 is not None or p.weight is None)) for p in projs):
        return None
    w = _rows_view([p.base_weight() for p in projs])
    biases = [p.bias for p in projs]
    if all(b is None for b in biases):
        return None if w is None else (w, None)
    b = None if any(b is None for b in biases) else _rows_view(biases)
    return None if w is None or b is None else (w, b)


MAX_LAYER_WEIGHTS = 1 << 26  # a layer's weight elements up to which its five launches beat the nine (cuBLAS's
# GEMMs): a small layer's step costs its launches, a larger one its GEMMs' bandwidth (dev/perf-notes.md)
MAX_SANDWICH_LAYER_WEIGHTS = 1 << 24  # the same with sandwich norms, whose normalizing GEMMs each add and normalize
# their input themselves


def layer_weights(cfg) -> int:
    """Elements of one decoder layer's projection weights (q | k | v, o, gate | up, down) of a model config."""
    H, D = cfg.hidden_size, cfg.head_dim
    return H * D * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * H * cfg.intermediate_size


class FusedDecode:
    """The five-launch decoding layers, with the split-K workspace its GEMMs share (kernels/decode_linear.py)."""

    def __init__(self):
        self.workspace = Workspace()

    def weights(self, model, dtype):
        """Each layer's ((W_qkv, b), (W_o, b), (W_gate_up, b), (W_down, b)), or None where one is not a packed plain
        weight of `dtype`."""
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            groups = [packed(g) for g in ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,),
                                          (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,))]
            if any(g is None or g[0].dtype != dtype for g in groups):
                return None
            layers.append(groups)
        return layers

    def serves(self, model, x) -> bool:
        """Whether this path takes a decoding step of x (B, 1, H) (the module docstring says which)."""
        cfg = model.config
        norms = [n.weight for layer in model.model.layers
                 for n in (layer.input_layernorm, layer.post_attention_layernorm)
                 + ((layer.self_attn.q_norm, layer.self_attn.k_norm) if cfg.qk_norm else ())
                 + ((layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if cfg.sandwich_norm else ())]
        most = MAX_SANDWICH_LAYER_WEIGHTS if cfg.sandwich_norm else MAX_LAYER_WEIGHTS
        # fp16 with sandwich norms: a sublayer's output times its norm's weight (`Scaled`) can pass fp16's range
        return (x.shape[0] <= MAX_ROWS and layer_weights(cfg) <= most
                and not (cfg.sandwich_norm and x.dtype == torch.float16) and all(w.dtype == x.dtype for w in norms))

    def __call__(self, model, x, tables, masks, cache):
        """Final-norm hidden states (B, 1, H) after the layers, from the embeddings x (B, 1, H) of a decoding step
        (`Transformer.decode_layers`' arguments), or None where this path does not serve the step."""
        layers = self.weights(model, x.dtype) if self.serves(model, x) else None
        if layers is None:
            return None
        B, _, H = x.shape
        x = x.view(B, H)
        ws = self.workspace
        blocks = model.model.layers
        sandwich, act = model.config.sandwich_norm, model.config.act
        # fp16's range: x ⊙ w can overflow where RMSNorm(x) ⊙ w does not, so there each GEMM normalizes x itself
        ahead = x.dtype != torch.float16
        xn = x  # the next GEMM's input: the first layer's q | k | v normalizes its x itself
        for i, (layer, ((w_qkv, b_qkv), (w_o, b_o), (w_gu, b_gu), (w_down, b_down))) in enumerate(
                zip(blocks, layers)):
            attn, c, mask = layer.self_attn, cache.layers[i], masks[layer.layer_type]
            cos, sin = tables[layer.layer_type]  # (B, 1, D)
            norm = layer.input_layernorm
            heads = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else None  # their eps, cast: norm's
            q = decode_qkv(xn, norm.weight, w_qkv, b_qkv, cos[:, 0], sin[:, 0], c.k, c.v, mask.at, attn.nh, ws,
                           eps=norm.eps, offset=norm.offset, cast=norm.cast, qk_norm=heads)  # (B, nh, D)
            y = model.ops.decode_attention(q[:, None], c.k, c.v, mask.first, mask.at, attn.scale, mask.window,
                                           attn.softcap).view(B, -1)  # (B, nh · D)
            if sandwich:
                norm = layer.pre_feedforward_layernorm
                xn, _ = sandwich_add(y, w_o, b_o, x, ws, layer.post_attention_layernorm)
                x = xn.out  # written by gate | up's launch
            else:
                norm = layer.post_attention_layernorm
                x, xn = residual_add(y, w_o, b_o, x, ws, norm if ahead else None)
            h = decode_swiglu(xn, norm.weight, w_gu, b_gu, ws, eps=norm.eps, offset=norm.offset, cast=norm.cast,
                              act=act)
            if sandwich:
                residual = x
                xn, z = sandwich_add(h, w_down, b_down, x, ws, layer.post_feedforward_layernorm)
                x = xn.out  # written by the next layer's q | k | v launch
            else:
                after = blocks[i + 1].input_layernorm if ahead and i + 1 < len(blocks) else None
                x, xn = residual_add(h, w_down, b_down, x, ws, after)
        if sandwich:  # the last layer's add, which no GEMM reads, with the final norm
            return model.model.norm.after_add(residual, z, before=layer.post_feedforward_layernorm)[1].view(B, 1, H)
        return model.model.norm(x).view(B, 1, H)


def residual_add(y, w, b, x, workspace, norm):
    """(x + y Wᵀ + b, the next GEMM's input): with `norm`, the RMSNorm that reads the sum next, its `Scaled` rows
    (written by the same launch); without, the sum itself."""
    if norm is None:
        x = decode_linear(y, w, b, x, workspace)
        return x, x
    return decode_linear(y, w, b, x, workspace, next_norm=(norm.weight, norm.offset))


def sandwich_add(y, w, b, x, workspace, norm):
    """(x + norm(z) as the `Sandwich` that the next normalizing GEMM reads, z): Gemma 2/3's residual add after a
    sublayer whose output z = y Wᵀ + b its own norm normalizes first. The launch writes z and its `Scaled` rows
    for that norm; the next GEMM adds, normalizes and writes the sum to the `Sandwich`'s out."""
    z, scaled = decode_linear(y, w, b, None, workspace, next_norm=(norm.weight, norm.offset))
    return Sandwich(x, scaled, torch.empty_like(x)), z
