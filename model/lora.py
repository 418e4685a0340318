"""LoRA as a plain module, and fused autograd Functions for the projections that carry it.

    Y = X Wᵀ + b + s · (X̃ Aᵀ) Bᵀ,    X̃ = dropout(X) = X ⊙ M,  M ∈ {0, 1/(1-p)}
    W [out, in], b: frozen base (W may be 4-bit NF4, see model/qlora.py)
    A [r, in] kaiming-uniform, B [out, r] zeros: trained, fp32 master weights
    s = alpha / r, or alpha / sqrt(r) with rsLoRA

DoRA (`dora=True`) scales each output row of the adapted weight to a trained magnitude m [out]:

    Y = g ⊙ (X Wᵀ + s · (X Aᵀ) Bᵀ) + b,    g = m / ‖W + s·B·A‖ (the L2 norm of each output row)

with the norm a constant in backward (no gradient flows through it: the DoRA paper's §4.3) and the
bias outside the scaling, as PEFT's `tuners/lora/dora.py` computes it. m starts as ‖W + s·B·A‖, so
the adapter starts as a no-op. With dropout on, the base term of g reads X̃ too, as PEFT's does:
Y = X Wᵀ + b + (g - 1) ⊙ X̃ Wᵀ + g ⊙ s (X̃ Aᵀ) Bᵀ (the unfused path only: it costs a GEMM more).

The fused Functions carry DoRA without dropout: with P = X Wᵀ + s (X Aᵀ) Bᵀ (N, out) they return
Y = g ⊙ P + b and save P, and backward starts from dY with

    dm = Σ_n dY ⊙ P / ‖W + s·B·A‖      [out]     (the norm a constant)
    dP = g ⊙ dY                                    (then the LoRA backward below, with dP for dY)

both in one pass over dY and P (kernels/dora_backward.py). For the MLP's gate and up, P is saved in place of
[G | U], and the gated activation's kernels read P and compute G = g ⊙ P + b in registers, forward and
backward (kernels/glu.py), so that [G | U] is never written. g of a packed group (q|k|v, o, gate|up, down) is
computed once per step and layer (a checkpointed layer's recompute reads it: `_dora_scales`), with the kernels in
one launch (kernels/dora_norm.py), else from ‖W_r‖² and r-wide products in torch.

References: Hu et al. 2021 "LoRA"; Kalajdzievski 2023 "rsLoRA"; Liu et al. 2024 "DoRA"; torchtune
`modules/peft/lora.py` (LoRALinear owns the frozen weight, so checkpoint keys match);
PEFT `tuners/lora/layer.py` (init, dropout on the LoRA input only); Unsloth
`kernels/fast_lora.py` (one Function for the whole MLP, its backward written down).

Every q/k/v/o/gate/up/down projection is a LoRALinear; r = 0 means no adapter. One code
path thus serves base-only and adapted projections, full-precision and NF4 weights.

Two execution paths, chosen by `Transformer(fused_lora=...)`:
- unfused: `LoRALinear.forward` in plain autograd. The reference, and the path taken
  whenever a base weight requires grad (full fine-tuning): the fused Functions return no
  gradient for W or b.
- fused (the default): `lora_projections` runs q, k, v in one Function (X cast and saved
  once) and o in another; `lora_mlp` runs gate, up, the gated activation and down in one
  Function. For backward they save X, the dropped-out inputs X̃ (only when dropout is on),
  the gate and up pre-activations [G | U], the down-projection dropout mask (bool), the
  small products s·X̃Aᵀ [N, Σr] and the LoRA weights cast to the compute dtype (cast once
  per forward, stacked per group as below). They never save a dequantized or cast base
  weight (W is dequantized again in backward and freed after each matmul), nor the
  activation H = act(G) ⊙ U (the activation's backward writes it again as it reads G and U).
  Dropout > 0 and biases are supported on this path. Dropout masks are drawn with
  F.dropout, in the order PEFT draws them (q, k, v, o, gate, up, down), so the two paths
  agree mask for mask under one seed. The gated activation inside `lora_mlp` is the
  Triton kernels' forward/backward pair when the model uses kernels, else the torch
  reference and its autograd (so the fused path also runs, and is tested, on CPU).

Backward of one projection, given dY [N, out]:

    dB = s · dYᵀ (X̃ Aᵀ)                  [out, r]   (s X̃ Aᵀ saved from forward)
    dA = s · (dY B)ᵀ X̃                   [r, in]
    dX̃ = s · (dY B) A                    [N, in]
    dX = dY W + dX̃ ⊙ M                   [N, in]

The scale s is the alpha of the GEMMs that make s X̃ Aᵀ and s dY B, never a pass of its own.
With dropout off X̃ = X and dX̃ is added to dX in place. With it on, X̃ is a separate
input of the Function (drawn outside it) and autograd applies ⊙ M.

Projections that share X (q, k, v; gate and up) run as one: their base weights are stored as
consecutive rows of one tensor (`pack_weights_`, called by the loaders; each projection's
`weight` is a view of its rows), so Y = [Y_q | Y_k | Y_v] = X [W_q; W_k; W_v]ᵀ is one GEMM and
dX = dY [W_q; W_k; W_v] another. Their adapters, when they read X with one scale (dropout off),
are stacked: A = [A_q; A_k; A_v] (Σr, in), and the B matrices set on the diagonal of one block
matrix B (Σout, Σr), so that s X Aᵀ, its product with Bᵀ, s dY B = [s dY_q B_q | ...], dA =
(s dY B)ᵀ X and the input's gradient (s dY B) A are one GEMM each for the group (dB stays one
GEMM per adapter, so that each gradient is a tensor of its own). For a small model these GEMMs
cost their launch more than their arithmetic, so fewer, wider ones are faster. For the same reason
their fp32 masters are stored stacked too (`pack_adapters_`: A_q, A_k, A_v consecutive rows of one
tensor, B_q, B_k, B_v likewise): each forward casts the stacked A as one view, and builds the block B
in one multiply of the stacked B by a fixed 0/1 mask, written in the compute dtype.

On NF4 weights, which are dequantized into a new buffer at every use anyway, the product with Bᵀ (or with A)
joins the base GEMM along K instead of adding into its output in a pass of its own (`_folded`):

    Y  = [X | s X Aᵀ] [W | B]ᵀ         (N, Σout), K = in + Σr: W dequantized into the first columns, B beside it
    dX = [dY | s dY B] [W; A]          (N, in),   K = Σout + Σr: A stacked below W

one rounding of the sum, and the output is written once and never read and written again. The price is a copy of
X (or dY) beside the thin product, worth it where the output is wider than the input: forward for q|k|v, o and
gate|up, backward for down; gate|up's backward needs no copy, as its [dG | dU] buffer carries Σr spare rows from
the forward for s dY B. Dropout, DoRA, full-precision weights (W would be copied) and --fp8 keep the adds. With
--fp8, whose GEMM takes no addend, o's and down's add takes the layer's residual too: Y + R + s (X Aᵀ) Bᵀ in one
pass (`_late_residual`, kernels/residual_lowrank_add.py), where adding R after the GEMM would take one more.

The MLP, with act(g) = g·σ(g) (SwiGLU) or gelu(g) (GeGLU):

    G = X W_gᵀ + s_g (X̃_g A_gᵀ) B_gᵀ,   U likewise,   H = act(G) ⊙ U,   H̃ = H ⊙ M_d
    Y = H W_dᵀ + s_d (H̃ A_dᵀ) B_dᵀ        (biases added where the model has them)

    dH  = dY W_d + (s_d (dY B_d) A_d) ⊙ M_d       [N, I]
    dB_d = s_d dYᵀ (H̃ A_dᵀ),   dA_d = s_d (dY B_d)ᵀ H̃
    dU  = dH ⊙ act(G)
    dG  = dH ⊙ U ⊙ act'(G),    SwiGLU: act'(g) = σ(g) (1 + g (1 - σ(g)))
    then gate and up backward as one projection of X: [dG | dU] against [W_g; W_u].

With the kernels, gate's and up's s dY B and dB come from one read of [dG | dU] (`GLU.adapter_grads`,
kernels/adapter_grads.py) rather than from three GEMMs that each read it, where that pays (a large [dG | dU], r ≤ 32).
Where the adapters are not folded (bf16 and fp8 bases), the activation's kernels add gate's and up's s (X Aᵀ) Bᵀ to
X W_gᵀ and X W_uᵀ, and down's s (dY B_d) A_d to dY W_d, as they read them (`GLU.lowrank`, kernels/glu.py): the sums
never exist as tensors of their own, where adding them would read and write [G | U] and dH once more. Forward saves
[X W_gᵀ | X W_uᵀ], and backward's activation adds the same products again (without dropout on gate, up or down,
without DoRA on gate and up).

Backward runs in that order: dH and dB_d (neither reads H), then the activation's backward, which reads G
and U for dG and dU and writes H over dH as it goes (H is not saved, and no forward runs again), then dA_d
from that H (⊙ M_d with dropout).

M_d is drawn inside the Function (H only exists there) and saved as a bool mask. [G | U]
is computed transposed, as the contiguous (2I, N) product [W_g; W_u] Xᵀ, so that Gᵀ and Uᵀ
are each contiguous for the elementwise kernels; H and dH are handled transposed too (a
GEMM reads a transposed operand at no cost). With the Triton kernels, the activation
backward writes dG and dU over the saved G and U, so the MLP Function's backward can run
only once per forward (it raises if asked twice).

Dtypes. The compute dtype is autocast's dtype when autocast is on for X's device, else
X's dtype. Inside the Functions autocast is off and every operand is cast explicitly: X,
X̃, W (dequantized), b and the fp32 LoRA weights go to the compute dtype for the
matmuls; outputs are in the compute dtype; dX goes back in X's dtype and dA, dB in fp32,
to the masters. Saving fp32 LoRA weights and multiplying a bf16 gradient by them in
backward, where autocast no longer applies, is the classic "expected BFloat16 but got
Float" failure; tests/test_lora.py reproduces it. Every tensor entering and leaving the
Functions has its dtype asserted.
"""
import contextlib
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.references import dora_backward_reference, merged_weight_reference
from kernels.token_sum_layouts import stored_transposed, token_sum_operands
from model.fp8 import add_residual_and_adapter_, fp8_input_grad, fp8_linear

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: gradcheck only
MASTER_DTYPES = (torch.float32, torch.float64)
LORA_INITS = ("default", "gaussian", "pissa", "olora")
BASE_MOVING_INITS = ("pissa", "olora")  # inits that move s·B·A out of W: the base becomes W - s·B·A


@dataclass
class LoRAConfig:
    r: int = 16  # rank of the update
    alpha: float = 16.0  # the update is scaled by alpha / r (alpha / sqrt(r) with rslora)
    dropout: float = 0.0  # dropout on the LoRA branch's input
    targets: tuple = ALL_TARGETS  # which projections get an adapter
    rslora: bool = False  # rank-stabilized scale alpha / sqrt(r)
    dora: bool = False  # DoRA: a trained magnitude per output row (see the module docstring)
    init: str = "default"  # how the adapter starts: one of LORA_INITS (model/variants.py)

    def __post_init__(self):
        self.targets = tuple(self.targets)
        unknown = [t for t in self.targets if t not in ALL_TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target module(s) {unknown}; this model has {list(ALL_TARGETS)}")
        if self.r <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.init not in LORA_INITS:
            raise ValueError(f"LoRA init must be one of {', '.join(LORA_INITS)}, got {self.init!r}")
        if self.dora and self.init in BASE_MOVING_INITS:
            raise ValueError(f"DoRA with the {self.init} init is not supported: the {self.init} adapter is saved as "
                             "the plain LoRA it converts to, which has no magnitude; use one of them")

    @property
    def scale(self):
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


class LoRALinear(nn.Module):
    """A frozen linear projection with an optional LoRA adapter (lora=None: r = 0, none)."""

    def __init__(self, in_features, out_features, bias, lora: LoRAConfig | None = None, name="linear"):
        super().__init__()
        self.in_features, self.out_features, self.name = in_features, out_features, name
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.nf4 = None  # an NF4Weight that replaces `weight` once quantized (model/qlora.py)
        self.fp8 = None  # the FP8Weights of this projection's group, for --fp8 (model/fp8.py)
        self.merged = None  # W + s·B·A, which replaces W (with r read as 0) inside `MergedAdapters`
        self.r = lora.r if lora else 0
        self.scale = lora.scale if lora else 0.0
        self.dropout_p = lora.dropout if lora else 0.0
        self.dora = bool(self.r and lora.dora)
        self.init = lora.init if lora else "default"
        if self.r:
            self.lora_A = nn.Parameter(torch.empty(self.r, in_features, dtype=torch.float32))
            self.lora_B = nn.Parameter(torch.empty(out_features, self.r, dtype=torch.float32))
        else:
            self.lora_A = self.lora_B = None
        # DoRA's magnitude m [out], named as PEFT names it, so that the adapter's keys are PEFT's.
        self.lora_magnitude_vector = nn.Parameter(torch.empty(out_features)) if self.dora else None
        # A and B as a base-moving init (PiSSA, OLoRA) made them: the saved adapter is the change from them.
        self.register_buffer("lora_A0", None, persistent=False)
        self.register_buffer("lora_B0", None, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """nn.Linear's init for the base, `init_lora_` for the adapter. On the meta device there
        is nothing to fill: load_model loads W and initializes the adapter (model/weights.py)."""
        if self.weight.is_meta:
            return
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -self.in_features ** -0.5, self.in_features ** -0.5)
        if self.r:
            init_lora_(self.lora_A, self.lora_B)
        if self.dora:
            self.lora_magnitude_vector.copy_(self.weight_norm(self.weight))

    def read_as(self, r, merged):
        """Sets the rank the projection reads (0: its adapter is skipped) and the weight that replaces W (None: W
        itself), for `MergedAdapters` and `adapters_disabled`. Both are plain attributes, written straight into the
        instance's dict: nn.Module.__setattr__ checks each value's type first, a few µs a call, and a rollout sets
        them for every projection on entering and on leaving its block."""
        vars(self).update(r=r, merged=merged)

    def base_weight(self):
        """W [out, in] in its stored dtype. An NF4 weight is dequantized into a new tensor:
        drop it as soon as it has been used. A base stored only in fp8 is dequantized likewise. Inside
        `MergedAdapters`: the merged weight."""
        if self.merged is not None:
            return self.merged
        if self.nf4 is not None:
            return self.nf4.dequantize()
        return self.fp8.dequantize(self.name) if self.weight is None else self.weight

    def lora_input(self, x):
        """dropout(x) for the adapter, or None when there is no adapter or dropout is off
        (the adapter then reads x itself)."""
        if self.r and self.training and self.dropout_p > 0:
            return F.dropout(x, self.dropout_p, training=True)
        return None

    @torch.no_grad()
    def weight_norm(self, w):
        """‖W + s·B·A‖ of each output row (out,) in fp32, for the base weight `w` (dequantized if NF4): DoRA's
        denominator, computed without a graph, so that it is a constant in backward."""
        return torch.linalg.vector_norm(w.float() + self.scale * (self.lora_B.float() @ self.lora_A.float()), dim=1)

    def forward(self, x):
        """The unfused reference, in plain autograd (with DoRA, `dora_forward`)."""
        if self.dora and self.r:
            return self.dora_forward(x)
        y = F.linear(x, self.base_weight(), self.bias)
        if not self.r:
            return y
        x_lora = self.lora_input(x)
        x_lora = x if x_lora is None else x_lora
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)  # autograd returns their grads in fp32
        return y + (x_lora @ a.t() @ b.t()) * self.scale

    def dora_forward(self, x):
        """Y = X Wᵀ + (g - 1) ⊙ X̃ Wᵀ + g ⊙ s (X̃ Aᵀ) Bᵀ + b, g = m / ‖W + s·B·A‖ (see the module docstring);
        without dropout X̃ = X, and Y = g ⊙ (X Wᵀ + s (X Aᵀ) Bᵀ) + b. DoRA with dropout trains on this path, so the
        adapter term's token sums take `_LowRank`; the rest is plain autograd."""
        w = self.base_weight()
        x_lora = self.lora_input(x)
        y = F.linear(x, w)  # (..., out); the bias is added last, unscaled
        base = y if x_lora is None else F.linear(x_lora, w)
        x_lora = x if x_lora is None else x_lora
        g = (self.lora_magnitude_vector / self.weight_norm(w)).to(x.dtype)  # (out,); m's grad returns in fp32
        y = y + (g - 1) * base + g * _LowRank.apply(x_lora, self.lora_A, self.lora_B, self.scale)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        quant = (", nf4" if self.nf4 is not None else "") + (", fp8" if self.fp8 is not None else "")
        dora = ", dora" if self.dora else ""
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, scale={self.scale:g}{dora}{quant}"


class _LowRank(torch.autograd.Function):
    """s (X Aᵀ) Bᵀ for X (..., in) and the fp32 masters A (r, in), B (out, r): DoRA with dropout's adapter term
    (`dora_forward`, which runs in plain autograd otherwise), as the fused Functions compute an adapter (`_adapt`,
    `_adapt_backward`): s scales the thin products, s X Aᵀ and s dY B, and the token sums dA = (s dY B)ᵀ X and
    dB = dYᵀ (s X Aᵀ) run through `_mm_to`, since plain autograd's products of a transposed view and a stored tensor
    are the layout in which cuBLAS may drop a token (kernels/token_sum_layouts.py). The dtypes are the fused
    Functions' (the module docstring)."""

    @staticmethod
    def forward(ctx, x, a, b, scale):
        _check_inputs(ctx, ["x", "lora_A", "lora_B"], (x, a, b), x)
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc, ac, bc = x.reshape(-1, x.shape[-1]).to(dtype), a.to(dtype), b.to(dtype)
            xa = _scaled_mm(xc, ac.t(), scale)  # (N, r)
            y = (xa @ bc.t()).view(*x.shape[:-1], -1)
        _expect(y, dtype, "output of the adapter term")
        ctx.save_for_backward(xc, ac, bc, xa)
        ctx.scale, ctx.shape = scale, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, ac, bc, xa = ctx.saved_tensors
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.reshape(-1, dy.shape[-1]).to(xc.dtype)
            dyb = _scaled_mm(dy, bc, ctx.scale)  # (N, r)
            dx = (dyb @ ac).view(ctx.shape).to(ctx.dtypes[0])
            db = _mm_to(dy.t(), xa, ctx.dtypes[2])
            da = _mm_to(dyb.t(), xc, ctx.dtypes[1])
        return *_check_grads(ctx, (dx, da, db)), None


@contextlib.contextmanager
def adapters_disabled(model):
    """Inside the block, `model` computes with its base weights alone, as PEFT's `disable_adapter()` does: every
    adapter's rank reads 0, so the projections (plain and fused) skip their adapters and draw no dropout, and
    inside a `MergedAdapters` block they read W, not the merged weight. The weights stay where they are (no copy);
    the ranks and merged weights are put back on leaving. The reference model of DPO and IPO (preference.py) is
    the model inside this block, under torch.no_grad()."""
    adapted = [(m, m.r, m.merged) for m in model.modules()
               if isinstance(m, LoRALinear) and (m.r or m.merged is not None)]
    for m, _, _ in adapted:
        m.read_as(0, None)
    try:
        yield model
    finally:
        for m, r, merged in adapted:
            m.read_as(r, merged)


class NoDropout:
    """Inside the block no adapter of `model` draws dropout, whether the model is in train or eval mode: sampling
    (model/generate.py `GroupSampler`) takes the adapters as they are. Dropout is the one thing that the train/eval
    mode changes here (`LoRALinear.lora_input`, the fused MLP), so only the adapters with dropout have their
    `training` flag turned off, and back on leaving, written into their dicts as `LoRALinear.read_as` writes:
    model.eval() and model.train() visit every module through nn.Module.__setattr__, which costs the host as much
    as a few decoding steps of a small model, at every rollout.

        no_dropout = NoDropout(model)  # once: finds the adapters with dropout
        with no_dropout:
            ..."""

    def __init__(self, model):
        self.dropped = [m for m in model.modules() if isinstance(m, LoRALinear) and m.r and m.dropout_p > 0]
        self.modes = None

    def __enter__(self):
        assert self.modes is None, "NoDropout: the block is already open"
        self.modes = [m.training for m in self.dropped]
        for m in self.dropped:
            vars(m)["training"] = False
        return self

    def __exit__(self, *exc):
        for m, mode in zip(self.dropped, self.modes, strict=True):
            vars(m)["training"] = mode
        self.modes = None


_MERGED_PARAMETERS = ("weight", "lora_A", "lora_B", "lora_magnitude_vector")  # what a merge reads


class MergedAdapters:
    """Inside the block, every adapted projection of `model` computes with its merged weight W' = W + s·B·A (DoRA:
    `merged_weight`'s row-scaled one) as a plain linear layer: one GEMM, where the adapter path adds two GEMMs, a
    scale and an add. For sampling, where the adapters do not change; gradients would not reach them.

        merged = MergedAdapters(model)  # once: allocates the buffers
        with merged:                    # each rollout: W' written into them in place, the projections read them
            ...

    The buffers are allocated once, one per group of projections that share an input and hold an adapter (q|k|v,
    o, gate|up, down), in W's dtype, with the members' rows one after the other as `pack_weights_` stores W, so a
    group stays one GEMM; the groups' buffers lie one after the other in one allocation. Entering the block
    refreshes them in place, so their addresses never change and a CUDA graph captured inside one block reads the
    current adapters in every later one: with the kernels (`Ops.merge_table`), every projection's W' in one launch
    (two where DoRA's and plain ones mix; kernels/dora_norm.py `MergeTable`, whose table is built again only when a
    tensor it reads has moved); without, `merged_weight` and copy_ a projection. A projection without an adapter in
    such a group gets its W copied. The projections' ranks read 0 inside the block (as in `adapters_disabled`), so
    both the fused and the unfused paths take W' as a base weight.

    An NF4 (QLoRA) base is dequantized into the buffers first (one launch a projection), in its original dtype, and
    the merge then adds s·B·A in place: a rollout dequantizes each weight once, where the adapter path would at every
    decoding step, and decodes from plain weights (model/decode.py's five launches a layer where the layers are
    small, the nine elsewhere), at the memory of an unquantized copy of the adapted projections. Not taken
    (`groups` empty, the block changes nothing) for --fp8 bases, or where that copy takes more than a quarter of
    the free memory."""

    def __init__(self, model):
        groups = [g for g in model.projection_groups() if any(p.r for p in g)]
        projs = [p for g in groups for p in g]
        dtype, device = _stored(projs[0]) if projs else (torch.float32, None)
        size = sum(p.out_features * p.in_features for p in projs) * dtype.itemsize
        if any(p.fp8 is not None for p in projs) or size > free_memory(device) / 4:
            groups = []
        self.groups, self.views, self.ranks = groups, [], None
        self.make_table, self.table, self.key = model.ops.merge_table, None, None
        shapes = [(sum(p.out_features for p in g), g[0].in_features) for g in groups]
        self.buffer = torch.empty(sum(o * i for o, i in shapes), dtype=dtype, device=device) if groups else None
        start = 0
        for g, (rows, cols) in zip(groups, shapes):
            buffer = self.buffer[start:start + rows * cols].view(rows, cols)
            self.views += [(p, buffer[span]) for p, span in zip(g, _spans(g))]
            start += rows * cols

    @torch.no_grad()
    def __enter__(self):
        assert self.ranks is None, "MergedAdapters: the block is already open"
        if self.make_table is None:
            for p, view in self.views:
                view.copy_(merged_weight(p))
        elif self.views:
            for p, view in self.views:
                if p.nf4 is not None:
                    p.nf4.dequantize(out=view)  # W, which the merge then reads and overwrites in place
            self.current_table()()
        self.ranks = [p.r for p, _ in self.views]
        for p, view in self.views:
            p.read_as(0, view)
        return self

    def __exit__(self, *exc):
        for (p, _), r in zip(self.views, self.ranks):
            p.read_as(r, None)
        self.ranks = None

    def current_table(self):
        """The `MergeTable` of every projection's W, A, B, m and scale (W alone where the rank reads 0): the last one,
        while none of them has moved. The key reads the parameters from each module's own dict: the host checks it
        at every rollout, before the merge's launch, and nn.Module's attribute lookup costs several times as much."""
        key = [(*(0 if t is None else t.data_ptr() for t in map(vars(p)["_parameters"].get, _MERGED_PARAMETERS)),
                p.r, p.scale) for p, _ in self.views]
        if key != self.key:
            members = [(view if p.nf4 is not None else p.weight,
                        *((p.lora_A, p.lora_B, p.lora_magnitude_vector if p.dora else None) if p.r else (None,) * 3),
                        view, p.scale) for p, view in self.views]
            self.table, self.key = self.make_table(self.buffer, members), key
        return self.table


def _stored(p):
    """(dtype, device) of a projection's full-precision weight: its own, or what its NF4 weight dequantizes to."""
    return (p.weight.dtype, p.weight.device) if p.nf4 is None else (p.nf4.weight_dtype, p.nf4.packed.device)


def free_memory(device):
    """Bytes free on `device` (None: the host): the GPU's free memory, or the host's available memory."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def make_linear(in_features, out_features, bias, name, lora: LoRAConfig | None):
    """The LoRALinear for projection `name`, with an adapter when `name` is a LoRA target."""
    adapted = lora is not None and name in lora.targets
    return LoRALinear(in_features, out_features, bias, lora if adapted else None, name=name)


def is_lora_param(name: str) -> bool:
    """Whether parameter `name` (as model.named_parameters() spells it) is a LoRA weight."""
    return name.endswith((".lora_A", ".lora_B", ".lora_magnitude_vector"))


def lora_parameters(model):
    """(name, parameter) of every LoRA weight in `model`."""
    return [(n, p) for n, p in model.named_parameters() if is_lora_param(n)]


@torch.no_grad()
def init_lora_(a, b, generator=None):
    """PEFT's adapter init, in place: A [r, in] kaiming-uniform with a = sqrt(5) as nn.Linear
    draws it, i.e. U(-1/sqrt(in), 1/sqrt(in)); B [out, r] zeros, so the adapter starts as a no-op."""
    bound = 1.0 / a.shape[1] ** 0.5
    a.uniform_(-bound, bound, generator=generator)
    b.zero_()


def merged_weight(linear: LoRALinear, dtype=None):
    """W + s·B·A, summed in fp32 (an NF4 W is dequantized first), returned in `dtype` (default: W's). With DoRA,
    each row of it scaled to its magnitude: (m / ‖W + s·B·A‖) ⊙ (W + s·B·A)."""
    w = linear.base_weight()
    dtype = dtype or w.dtype
    if not linear.r:
        return w.to(dtype)
    m = linear.lora_magnitude_vector if linear.dora else None
    return merged_weight_reference(w.float(), linear.lora_A, linear.lora_B, m, linear.scale, dtype)  # in fp32


def quantization(model) -> str | None:
    """How the model's projection weights are stored: "nf4" (QLoRA) or None (the model dtype)."""
    return "nf4" if any(isinstance(m, LoRALinear) and m.nf4 is not None for m in model.modules()) else None


def fusable(projs):
    """The fused Functions return no gradient for W and b: use them only while those are frozen. They carry DoRA
    without dropout; DoRA with dropout runs on the unfused path."""
    return not any(t is not None and t.requires_grad for p in projs for t in (p.weight, p.bias)) and \
        not any(p.dora and p.r and p.dropout_p > 0 for p in projs)


# ----------------------------------------------------------------------------- gated activation

class GLU(NamedTuple):
    """The MLP activation H = act(G) ⊙ U, built by `model.transformer.Ops.glu`: a differentiable
    function for the unfused path, and a forward/backward pair for `lora_mlp`. The pair takes keywords
    scale and bias: G and U are then the per-row affine of gate and up (`scale_rows`; DoRA's g ⊙ P + b),
    and backward returns dG, dU in new tensors."""
    function: Callable  # (gate, up) -> h, with its own autograd
    forward: Callable  # (gate, up, scale=None, bias=None, amax=None) -> h, no graph; amax (0-d) gets max |h|
    backward: Callable  # (dh, gate, up, scale=None, bias=None, amax=None) -> (dgate, dup, h), h the forward's, bit
    # for bit; amax (0-d) gets the largest |dgate| or |dup|
    inplace: bool  # backward without scale writes dgate, dup over gate, up (saves two [N, I] buffers), h over dh
    adapter_grads: Callable | None = None  # gate's and up's s dY B and dB from one read of [dG | dU]
    # (kernels/adapter_grads.py; None where that does not pay), or None: a GEMM each
    lowrank: Callable | None = None  # (gate) -> whether forward and backward take, for gate and up like `gate`, the
    # keywords terms = ((L_gate, R_gate), (L_up, R_up)) and (backward) dh_term = (L_h, R_h): G = gate + L_gate R_gateᵀ,
    # U likewise, dH = dh + L_h R_hᵀ inside the kernels (kernels/glu.py `terms_pay`); None: never


def scale_rows(gate, up, scale=None, bias=None):
    """(gate ⊙ scale[:rows] + bias[:rows], up ⊙ scale[rows:] + bias[rows:]) per row, for gate and up (rows, n) and
    scale, bias (2 · rows,): the torch reference of the GLU kernels' affine (kernels/glu.py). No scale: gate, up."""
    if scale is None:
        return gate, up
    both = _rows_view([gate, up])  # the MLP's halves of one (2 · rows, n) buffer: one op for both
    if both is not None:
        return (both * scale[:, None] if bias is None else torch.addcmul(bias[:, None], both, scale[:, None])).chunk(2)
    s_gate, s_up = scale[:, None].chunk(2)
    if bias is None:
        return gate * s_gate, up * s_up
    b_gate, b_up = bias[:, None].chunk(2)
    return torch.addcmul(b_gate, gate, s_gate), torch.addcmul(b_up, up, s_up)


def affine_forward(fn, gate, up, scale=None, bias=None, amax=None):
    """fn(G, U) of the per-row affine G, U of gate, up (`scale_rows`): a torch reference as a GLU forward. amax: a
    0-d tensor filled with max |H|."""
    h = fn(*scale_rows(gate, up, scale, bias))
    if amax is not None:
        amax.copy_(h.abs().amax() if h.numel() else 0)
    return h


def autograd_backward(fn, dh, gate, up, scale=None, bias=None, amax=None):
    """(dG, dU, H) of H = fn(G, U) by autograd, G, U the per-row affine of gate, up (`scale_rows`): a torch
    reference's own gradient, and the H it differentiates, as a GLU backward. amax: a 0-d tensor filled with the
    largest |dG| or |dU|."""
    gate, up = scale_rows(gate, up, scale, bias)
    with torch.enable_grad():
        gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
        h = fn(gate, up)
        dg, du = torch.autograd.grad(h, (gate, up), dh)
    if amax is not None:
        amax.copy_(torch.maximum(dg.abs().amax(), du.abs().amax()) if dg.numel() else 0)
    return dg, du, h.detach()


# ----------------------------------------------------------------------------- fused Functions

def compute_dtype(x):
    """The dtype the matmuls run in: autocast's when it is on for x's device, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _expect(t, dtype, name):
    assert t.dtype == dtype, f"fused LoRA: {name} must be {dtype}, got {t.dtype}"


def _check_inputs(ctx, names, tensors, x):
    """Assert the input dtypes and remember them, so backward can assert its gradients'."""
    assert x.dtype in COMPUTE_DTYPES, f"fused LoRA: x must be one of {COMPUTE_DTYPES}, got {x.dtype}"
    for name, t in zip(names, tensors):
        if t is None:
            continue
        if name.startswith("lora_"):
            assert t.dtype in MASTER_DTYPES, (
                f"fused LoRA: {name} must be an fp32 master weight, got {t.dtype}. Do not cast the model "
                f"with .to(dtype): load_model(dtype=...) sets the base dtype and keeps LoRA weights in fp32")
        else:
            _expect(t, x.dtype, name)
    ctx.names, ctx.dtypes = names, [None if t is None else t.dtype for t in tensors]


def _to(t, dtype):
    return None if t is None else t.to(dtype)


def _check_grads(ctx, grads):
    for name, dtype, g in zip(ctx.names, ctx.dtypes, grads):
        if g is not None:
            _expect(g, dtype, f"gradient of {name}")
    return grads


def _scaled_mm(a, b, scale):
    """scale · (a @ b) as one GEMM (scale in its alpha; beta = 0 never reads the output's old values)."""
    return torch.addmm(a.new_empty(a.shape[0], b.shape[1]), a, b, beta=0, alpha=scale)


def _mm_to(a, b, dtype):
    """a @ b in `dtype`: on CUDA a half-precision product is written in fp32 by the GEMM itself (no
    rounding to half precision, no cast kernel); elsewhere the product is cast. Its products sum over the tokens,
    in layouts that cuBLAS sums whole (kernels/token_sum_layouts.py)."""
    if a.is_cuda:
        a, b = token_sum_operands(a, b)
        if a.dtype != dtype:
            return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a, b).to(dtype)


def _rows_view(tensors):
    """Tensors [n_i, ...] of one dtype and trailing shape as one [Σ n_i, ...] view when they lie one after the
    other in one storage (as `pack_weights_` and `pack_adapters_` store those of q, k, v and of gate, up), else None."""
    first = tensors[0]
    end = first.data_ptr()
    for t in tensors:
        if not (t.is_contiguous() and t.data_ptr() == end and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
                and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            return None
        end += t.numel() * t.element_size()
    return first.as_strided((sum(len(t) for t in tensors), *first.shape[1:]), first.stride())


def _packed(tensors):
    """Tensors [n_i, ...] of one trailing shape as one [Σ n_i, ...]: their `_rows_view`, else their concatenation."""
    view = _rows_view(tensors)
    return torch.cat(tensors) if view is None else view


@torch.no_grad()
def _stack_rows_(projs, attr):
    """Store tensor `attr` [n_i, ...] of the projections as consecutive rows of one tensor: each projection's becomes
    a Parameter that views its rows (requires_grad as before), so names, shapes, state_dict and checkpoints stay as
    they are. Left alone where one is missing or on the meta device, or where dtypes or devices differ."""
    ts = [getattr(p, attr) for p in projs]
    if any(t is None or t.is_meta for t in ts) or len({(t.dtype, t.device) for t in ts}) > 1:
        return
    packed, start = torch.cat(ts), 0
    for p, t in zip(projs, ts):
        setattr(p, attr, nn.Parameter(packed[start:start + len(t)], requires_grad=t.requires_grad))
        start += len(t)


def pack_weights_(projs):
    """Store the base weights (and biases) of projections that read one input as consecutive rows of one tensor
    (`_stack_rows_`), where all of them are frozen or all of them train, so that the projections run as one GEMM
    without concatenating their weights at every step: frozen, in the fused Functions (`_packed`); trained (full
    fine-tuning), in model/stacked.py. NF4 weights, groups where some train and some not, and meta tensors are left
    alone."""
    for attr in ("weight", "bias"):
        if len({getattr(p, attr).requires_grad for p in projs if getattr(p, attr) is not None}) <= 1:
            _stack_rows_(projs, attr)


def pack_adapters_(projs):
    """Store the fp32 LoRA masters of projections that read one input as consecutive rows of one tensor each
    (`_stack_rows_`), A as (Σr, in), B as (Σout, r) and DoRA's magnitudes as (Σout,), and keep on the first
    projection the 0/1 mask (Σout, members, 1) that sets the stacked B on the diagonal of the group's block B
    (`_block_b`). A forward then casts the group's A as one view, reads the magnitudes as one, and builds its block
    B in one multiply, instead of concatenating, filling and copying. Left alone unless every projection has an
    adapter of one rank, and on the meta device (the loaders pack again once the weights are in)."""
    if len(projs) < 2 or not all(p.r for p in projs) or len({p.r for p in projs}) > 1 or projs[0].lora_B.is_meta:
        return
    for attr in ("lora_A", "lora_B", "lora_magnitude_vector"):
        _stack_rows_(projs, attr)
    member = torch.repeat_interleave(torch.arange(len(projs)), torch.tensor([p.out_features for p in projs]))
    mask = (member[:, None] == torch.arange(len(projs)))[:, :, None]
    projs[0].block_mask = mask.to(projs[0].lora_B.device, torch.float32)


def _spans(projs):
    """Each projection's columns in the projections' (N, Σout) output."""
    ends = list(itertools.accumulate(p.out_features for p in projs))
    return [slice(e - p.out_features, e) for p, e in zip(projs, ends)]


def _base_weights(projs, dtype, columns=None, rows=None):
    """[W_1; W_2; ...] (Σout, in) in `dtype`. NF4 weights are dequantized straight into the rows of one new buffer
    (no concatenation after); full-precision ones are their packed view (`pack_weights_`) or concatenation.
    columns (Σout, c) or rows (c, in): set beside or below the NF4 weights in that buffer, [W | columns] or
    [W; rows], so that one GEMM multiplies both (`_folded`); the weights are then written into its first columns
    or rows."""
    nf4 = [p.nf4 for p in projs]
    if None in nf4 or any(p.merged is not None for p in projs):  # inside `MergedAdapters`: the merged weights
        assert columns is None and rows is None, "fused LoRA: adapters join the GEMM of NF4 weights only"
        return _packed([p.base_weight() for p in projs]).to(dtype)
    n_out, n_in = sum(p.out_features for p in projs), projs[0].in_features
    extra_rows = 0 if rows is None else rows.shape[0]
    extra_cols = 0 if columns is None else columns.shape[1]
    w = nf4[0].packed.new_empty(n_out + extra_rows, n_in + extra_cols, dtype=nf4[0].weight_dtype)
    for q, span in zip(nf4, _spans(projs)):
        q.dequantize(out=w[span, :n_in])
    w = w.to(dtype)
    if columns is not None:
        w[:n_out, n_in:] = columns
    if rows is not None:
        w[n_out:] = rows
    return w


def _base(projs, x, dtype, transposed=False, bias=True, residual=None, adapter_b=None, out=None, amax=None):
    """X [W_1; W_2; ...]ᵀ + [b_1 | b_2 | ...], the projections' outputs side by side (N, Σout) in `dtype`, as one
    GEMM. residual: R (N, Σout) added too, as the GEMM's C (R + X Wᵀ in its epilogue, no add of its own: the
    layer's residual add of o and down). transposed: computed as the contiguous (Σout, N) product [W_1; W_2; ...] Xᵀ
    (into `out` when given: rows of a larger buffer) and returned transposed, so that each projection's output,
    transposed back, is contiguous (the MLP's G and U, for the elementwise kernels). One row (a decoding step) is
    computed plainly, unless `out` is given: its plain product already has that layout, and its transposed one
    would carry the row stride 1, which cuBLAS takes as the leading dimension of the column slices that the
    adapters add into, and refuses. A dequantized, concatenated or cast weight is freed on return. bias=False:
    without the biases (DoRA adds them after its scaling, `_dora_output`). adapter_b: x is [X | s X Aᵀ] and the
    weight [W | B] (`_folded`). With --fp8 the GEMM runs in fp8 (model/fp8.py) and the biases and the residual are
    added after it (the residual with the adapters' product, where the caller passes it to `_adapt` instead:
    `_late_residual`); amax: max |x| where the caller has it (`fp8_linear`)."""
    assert len({p.bias is None for p in projs}) == 1, "fused LoRA: projections of one input all have a bias or none"
    assert residual is None or not transposed, "fused LoRA: a residual is added to a row-major output only"
    b = _bias(projs, dtype) if bias else None
    if projs[0].fp8 is not None:
        y = fp8_linear(projs, x, dtype, transposed, amax)
        y = y if b is None else y.add_(b)
        return y if residual is None else y.add_(residual)
    w = _base_weights(projs, dtype, columns=adapter_b)
    if residual is not None:
        y = torch.addmm(residual, x, w.t())
        return y if b is None else y.add_(b)
    if not transposed or (len(x) == 1 and out is None):
        return F.linear(x, w, b)
    return (torch.mm(w, x.t(), out=out) if b is None else torch.addmm(b[:, None], w, x.t(), out=out)).t()


def _bias(projs, dtype):
    """[b_1 | b_2 | ...] (Σout,) in `dtype`, or None when the projections have no bias."""
    return None if projs[0].bias is None else _packed([p.bias for p in projs]).to(dtype)


def base_sq_norms(projs):
    """‖W_r‖² of the projections' frozen base rows side by side (Σout,), in fp32 (fp64 for an fp64 base; an NF4 or
    fp8 base from its dequantized values), kept on the first projection while the base weights are the same
    tensors at the same version: computed once, not at every step (`Transformer.pack_weights_` computes them
    before any step, so that none is computed inside a CUDA graph's capture). Read only: callers write into
    copies."""
    key = [(id(t), t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else id(t)
           for p in projs for t in (p.weight, p.nf4, p.fp8)]
    cached = getattr(projs[0], "dora_base_sq_norms", None)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            w = _base_weights(projs, torch.promote_types(projs[0].base_weight().dtype, torch.float32))
            cached = projs[0].dora_base_sq_norms = key, w.square().sum(1)
    return cached[1]


class DoRAOps(NamedTuple):
    """DoRA's kernels, or their torch references (model/transformer.py `Ops`). backward: the one-pass dm and dP
    (`_dora_backward`). norms: g and 1 / ‖W + s·B·A‖ of a packed group in one launch (kernels/dora_norm.py), or
    None: `_dora_scales` computes them from ‖W_r‖² and r-wide products, in torch. norms_table: those of many groups
    in one launch (kernels/dora_norm.py `NormsTable`, model/dora_scales.py), or None."""
    backward: Callable = dora_backward_reference
    norms: Callable | None = None
    norms_table: Callable | None = None


DORA_REFERENCES = DoRAOps()


def _dora_norms_args(projs, groups, mags, masters):
    """(A, B, m, ends, s) for `DoRAOps.norms` when the projections' adapters form one group whose fp32 masters and
    magnitudes are stored stacked (`pack_adapters_`, or a lone projection), else None."""
    if len(groups) != 1 or len(groups[0]) != len(projs) or None in mags or len(projs) > 3 or \
            len({p.r for p in projs}) > 1:
        return None
    n = len(projs)
    stacked = [_rows_view(ts) for ts in (masters[0][:n], masters[1][:n], [m.detach() for m in mags])]
    if any(t is None or t.dtype != torch.float32 for t in stacked):
        return None
    return *stacked, list(itertools.accumulate(p.out_features for p in projs)), projs[0].scale


def _dora_scales(projs, groups, saved, mags, masters, dtype, store=None, norms=None):
    """DoRA's g = m / ‖W + s·B·A‖ (Σout,) in `dtype`, and 1 / ‖W + s·B·A‖ (Σout,) in fp32, of the projections side by
    side (both 1 in the columns of a projection without DoRA): constants in backward. `saved`: what `_adapt_groups`
    returned for `groups` (the stacked A and the block B of each group, in `dtype`); masters: (A_i, B_i) per
    projection, fp32.

    Per row r of a group's block B (its members' B on the diagonal, zeros elsewhere) and stacked A:

        ‖W_r + s B_r A‖² = ‖W_r‖² + Σ_c B_rc (2s · W Aᵀ + s² · B (A Aᵀ))_rc

    with ‖W_r‖² of the frozen base computed once (`base_sq_norms`), W Aᵀ (Σout, Σr) and A Aᵀ (Σr, Σr) GEMMs and the
    row sums one batched product: no (out, in) temporary, and a few kernels for the whole group. The sum is in fp32
    (fp64 for an fp64 base): B and A from the fp32 masters, W Aᵀ from the GEMM of W and A in `dtype`.

    store: a dict that keeps the result under the first projection, for the recompute of a checkpointed layer (the
    checkpoint's first run fills it, its recompute reads it: the weights are the same in both). norms: the kernel
    that computes both for a packed group in one launch (`DoRAOps.norms`), used where it applies."""
    if store is not None and projs[0] in store:
        return store[projs[0]]
    args = None if norms is None else _dora_norms_args(projs, groups, mags, masters)
    out = _dora_scales_torch(projs, groups, saved, mags, masters, dtype) if args is None else \
        norms(_base_weights(projs, dtype), *args, dtype)
    if store is not None:
        store[projs[0]] = out
    return out


def _dora_scales_torch(projs, groups, saved, mags, masters, dtype):
    """`_dora_scales` in torch ops, from ‖W_r‖² and r-wide products (see there)."""
    base = base_sq_norms(projs)
    acc = base.dtype
    sq = None if len(groups) == 1 and _blocks(projs, groups[0])[0] == slice(0, len(base)) else base.clone()
    w = _base_weights(projs, dtype)
    for n, group in enumerate(groups):
        _, a, b = saved[3 * n:3 * n + 3]
        cols, _ = _blocks(projs, group)
        s = projs[group[0]].scale
        a_acc = a if a.dtype == acc else _packed([masters[0][i] for i in group]).to(acc)  # (Σr, in)
        b_acc = b if b.dtype == acc else _block_b(projs, group, masters[1], acc)  # (Σout_g, Σr)
        c = torch.addmm(_mm_to(w[cols], a.t(), acc), b_acc, a_acc @ a_acc.t(), beta=2 * s, alpha=s * s)
        rows = torch.baddbmm(base[cols, None, None], b_acc[:, None, :], c[:, :, None]).view(-1)  # ‖W_r + s B_r A‖²
        if sq is None:
            sq = rows
        else:
            sq[cols] = rows
    inv = sq.rsqrt()
    if None in mags:  # a projection without DoRA: g = 1 and no norm in its columns
        for m, cols in zip(mags, _spans(projs)):
            if m is None:
                inv[cols] = 1
    m = _packed([inv.new_ones(p.out_features) if m is None else m.detach() for p, m in zip(projs, mags)])
    return torch.mul(m, inv, out=inv.new_empty(len(inv), dtype=dtype)), inv  # g written in `dtype`


def _dora_output(pre, g, b, residual=None):
    """Y = g ⊙ P + b (columns scaled), a new tensor, from DoRA's P = X Wᵀ + s (X Aᵀ) Bᵀ (N, Σout), in one op; with a
    residual R (N, Σout), R + g ⊙ P + b, also one op where there is no bias (o and down: the layer's residual add,
    so that g ⊙ P is not written and read again). (The MLP's gate and up are scaled inside the activation instead:
    `GLU`.)"""
    if residual is not None:
        y = torch.addcmul(residual, pre, g)
        return y if b is None else y.add_(b)
    return pre * g if b is None else torch.addcmul(b, pre, g)


def _dora_backward(fn, projs, m_dtypes, dy, pre, g, inv, need_m, dms, inplace=False):
    """DoRA's part of backward, from dY (N, Σout) of Y = g ⊙ P + b: each magnitude's gradient Σ_n dY ⊙ P / ‖W + s·B·A‖
    (in its master's dtype, m_dtypes[i], into dms[i] where need_m[i]; inv = 1 / ‖W + s·B·A‖), and dP = g ⊙ dY,
    returned (written over dY when inplace): what the base and the adapters backpropagate. fn: the one-pass kernel
    or its torch reference (`Ops.dora_backward`, kernels/dora_backward.py)."""
    dp, dm = fn(dy, pre, g, inv, out=dy if inplace else None)  # (N, Σout), (Σout,)
    for i, (dtype, cols) in enumerate(zip(m_dtypes, _spans(projs))):
        if dtype is not None and need_m[i]:
            dms[i] = dm[cols].to(dtype)
    return dp


def _base_backward(projs, dy, transposed=False, rows=None, amax=None, quantized=None):
    """dY [W_1; W_2; ...] (N, in), the gradient of the projections' shared input through their base weights, from
    dY (N, Σout), as one GEMM; each W is dequantized again, and freed after it. transposed: computed as the
    contiguous (in, N) product and returned transposed (the MLP's dH, which meets Gᵀ and Uᵀ in the kernels).
    rows: dY is [dY | s dY B] and the weight [W; A] (`_folded`). With --fp8 the GEMM runs in fp8 with the weights'
    transposed copy (model/fp8.py); amax: max |dY| where the caller has it, quantized: dY's e4m3 copy where the
    caller made it (`fp8_input_grad`)."""
    if projs[0].fp8 is not None:
        return fp8_input_grad(projs, dy, transposed, amax, quantized)
    w = _base_weights(projs, dy.dtype, rows=rows)
    return torch.mm(w.t(), dy.t()).t() if transposed else torch.mm(dy, w)


def _folded(projs, groups, x_loras, dora):
    """Whether the adapters' second GEMM joins the base GEMM along K rather than adding its product to the base's
    output in a pass of its own: forward X Wᵀ + s (X Aᵀ) Bᵀ = [X | s X Aᵀ] [W | B]ᵀ, backward dY W + s (dY B) A =
    [dY | s dY B] [W; A], with A stacked and B the block B of one group that reads X (no dropout) and spans every
    projection's columns, without DoRA. For NF4 weights only: they are dequantized into a new buffer anyway, so that
    setting B or A beside them costs no copy of W. The products are then rounded once, and the copy of X or dY into
    [X | s X Aᵀ] or [dY | s dY B] is cheaper than a read and a write of the output, where the output is wider than
    the input (forward) or narrower (backward): the callers decide."""
    return _one_group(projs, groups, x_loras, dora) and all(p.nf4 is not None and p.fp8 is None for p in projs)


def _one_group(projs, groups, x_loras, dora):
    """Whether the projections' adapters form one group that spans every projection and reads X (no dropout),
    without DoRA: what folding them into the base GEMM (`_folded`) or into the activation (`_in_activation`) needs."""
    return len(groups) == 1 and groups[0][0] == 0 and groups[0][-1] == len(projs) - 1 and x_loras[0] is None \
        and not dora


def _base_folded(projs, group, x, a_masters, b_masters, dtype, bias=True, residual=None, out=None):
    """`_base` and `_adapt` of a `_folded` group as one GEMM, [X | s X Aᵀ] [W | B]ᵀ (K = in + Σr), for x (N, in):
    X is copied beside s X Aᵀ into one (N, in + Σr) buffer, freed on return. Returns (Y, what backward needs as
    `_adapt` returns it)."""
    saved = _adapt(None, projs, group, x, a_masters, b_masters, dtype)
    y = _base(projs, torch.cat([x, saved[0]], dim=1), dtype, transposed=out is not None, bias=bias,
              residual=residual, adapter_b=saved[2], out=out)
    return y, saved


def _adapter_groups(projs, x_loras):
    """The adapted projections (indices into projs), grouped by the input their adapters read: those
    without dropout read X (one group per scale); one with dropout reads its own X̃ (a group of its own).
    A group's adapters run as one: see `_adapt`."""
    shared, groups = {}, []
    for i, (p, x_lora) in enumerate(zip(projs, x_loras)):
        if not p.r:
            continue
        if x_lora is not None:
            groups.append([i])
        elif p.scale in shared:
            shared[p.scale].append(i)
        else:
            shared[p.scale] = [i]
            groups.append(shared[p.scale])
    return groups


def _read(group, x_loras, x):
    """The input the group's adapters read: its X̃ when it is a dropout group, else X."""
    return x if x_loras[group[0]] is None else x_loras[group[0]]


def _columns(projs, group):
    """Each member's columns in the group's (N, Σr) products."""
    ends = list(itertools.accumulate(projs[i].r for i in group))
    return [slice(e - projs[i].r, e) for i, e in zip(group, ends)]


def _blocks(projs, group):
    """The group's output columns (from its first member's first to its last member's last), and each member's
    block of the group's block-diagonal B: (its rows among those columns, its columns of Σr)."""
    spans = _spans(projs)
    first = spans[group[0]].start
    rows = [slice(spans[i].start - first, spans[i].stop - first) for i in group]
    return slice(first, spans[group[-1]].stop), list(zip(rows, _columns(projs, group)))


def _adapt(y, projs, group, x, a_masters, b_masters, dtype, residual=None):
    """Add s (X A_iᵀ) B_iᵀ into projection i's columns of y (N, Σout) for the group's members i, whose adapters read
    x, in two GEMMs for the group: s X Aᵀ with the A stacked, [A_1; A_2; ...] (Σr, in), then its product with the
    members' B set on the diagonal of one matrix (the group's output columns by Σr, zeros elsewhere). Returns what
    backward needs, in `dtype` (so that it casts nothing again): s X Aᵀ (N, Σr), the stacked A and the block B.
    y None: no output is wanted, only what backward needs (the second GEMM is skipped). residual: added to y
    with the product, in one pass over y (`_late_residual`)."""
    a = _packed([a_masters[i] for i in group]).to(dtype)  # one cast of a view when `pack_adapters_` stacked them
    xa = _scaled_mm(x, a.t(), projs[group[0]].scale)
    b = _block_b(projs, group, b_masters, dtype)
    if y is not None and residual is not None:
        add_residual_and_adapter_(y, residual, xa, b)
    elif y is not None:
        cols, _ = _blocks(projs, group)
        y[:, cols].addmm_(xa, b.t())
    return [xa, a, b]


def _late_residual(projs, groups, dora, residual):
    """The residual where the fp8 path adds it to the output together with the adapters' product (`_adapt`): one
    pass over the output, where adding it after the GEMM takes a pass of its own (torch._scaled_mm takes no addend;
    the bf16 path's GEMM takes the residual as its C). For one adapter group that spans every projection, without
    DoRA (which adds it after its scaling), and a residual of unit column stride. Else None: `_base` adds it."""
    if residual is None or dora or projs[0].fp8 is None or len(groups) != 1 or residual.stride(-1) != 1:
        return None
    cols, _ = _blocks(projs, groups[0])
    return residual if cols == slice(0, sum(p.out_features for p in projs)) else None


def _block_b(projs, group, b_masters, dtype):
    """The group's B in `dtype`: a lone member's own, else the members' B on the diagonal of one matrix (the group's
    output columns by Σr, zeros elsewhere). When `pack_adapters_` stacked the whole group's B, that is one multiply
    of the stacked (Σout, r) B by the group's 0/1 mask, written in `dtype`; otherwise a zero matrix and a copy per
    member."""
    if len(group) == 1:
        return b_masters[group[0]].to(dtype)
    bs = [b_masters[i] for i in group]
    mask = getattr(projs[group[0]], "block_mask", None)
    stacked = _rows_view(bs) if mask is not None and len(group) == len(projs) else None  # (Σout, r)
    if stacked is not None and mask.device == stacked.device:
        block = stacked.new_empty(len(stacked), len(bs), stacked.shape[1], dtype=dtype)
        return torch.mul(stacked[:, None, :], mask, out=block).view(len(stacked), -1)
    cols, blocks = _blocks(projs, group)
    b = bs[0].new_zeros(cols.stop - cols.start, sum(t.shape[1] for t in bs), dtype=dtype)
    for t, (rows, c) in zip(bs, blocks):
        b[rows, c] = t  # cast as it is copied
    return b


def _adapt_backward(projs, group, dy, x, xa, b, need_a, need_b, masters, da, db):
    """The group's LoRA gradients from dY (N, Σout): dA_i and dB_i, in the masters' dtypes, go into da[i] and db[i]
    where need_a[i], need_b[i] ask for them. Returns s dY B = s [dY_1 B_1 | dY_2 B_2 | ...] (N, Σr), one GEMM with
    the block B: times the stacked A it is the gradient of the adapters' input, in one more."""
    cols, blocks = _blocks(projs, group)
    dy = dy[:, cols]  # the group's columns: a member's block rows are its columns here
    dyb = _scaled_mm(dy, b, projs[group[0]].scale)
    for i, (rows, c) in zip(group, blocks):
        if need_b[i]:  # one GEMM per member, so that each dB_i is a whole tensor (one multi-tensor add in step.py)
            db[i] = _mm_to(dy[:, rows].t(), xa[:, c], masters[i])  # xa holds s X̃ Aᵀ
    _stacked_da(projs, group, dyb.t(), x, need_a, masters, da)
    return dyb


def _stacked_da(projs, group, dybt, x, need_a, masters, da):
    """dA_i = (s dY B)ᵀ_i X for the group's members, as rows of one GEMM's (Σr, in) product, into da[i] where need_a[i]
    asks for it; dybt: (s dY B)ᵀ (Σr, N)."""
    if any(need_a[i] for i in group):
        da_stacked = _mm_to(dybt, x, masters[group[0]])  # (Σr, in)
        for i, c in zip(group, _columns(projs, group)):
            da[i] = da_stacked[c] if need_a[i] else None  # rows of the stack: contiguous


def _adapt_backward_one_read(fn, projs, group, dyt, x, xa, b, need_a, need_b, masters, da, db, q_out=None,
                             amax=None, fp8=None):
    """`_adapt_backward` of a group whose dY is stored transposed, dyt = dYᵀ (Σout, N) with unit stride along N (the
    MLP's [dG | dU]). fn (`GLU.adapter_grads`) takes s dY B and the members' dB from one read of dY, where the
    members share one width and one rank and some dB is wanted. Returns (s dY B)ᵀ (Σr, N), written into q_out when
    given, or None where the one read does not run (nothing written: the caller's GEMMs then do the work). amax:
    max |dY| (--fp8), where the read also makes dY's e4m3 copy for the base's GEMM; it goes into the list `fp8`."""
    r = projs[group[0]].r
    if fn is None or len({projs[i].r for i in group}) > 1 or len({projs[i].out_features for i in group}) > 1 or \
            not any(need_b[i] for i in group):
        return None
    result = fn(dyt, xa, b, projs[group[0]].scale, r, q_out, amax)
    if result is None:  # where one read does not pay
        return None
    db_stacked, dybt, quantized = result
    if amax is not None:
        fp8.append(quantized)
    for i, (features, _) in zip(group, _blocks(projs, group)[1]):
        db[i] = db_stacked[features].to(masters[i]) if need_b[i] else None
    _stacked_da(projs, group, dybt, x, need_a, masters, da)
    return dybt


def _adapt_groups(y, projs, groups, x_loras, x, a_masters, b_masters, dtype, residual=None):
    """`_adapt` for every group, each reading its own input (`_read`); what backward needs, three tensors a group.
    residual: `_late_residual`'s, of the one group."""
    return [t for g in groups
            for t in _adapt(y, projs, g, _read(g, x_loras, x), a_masters, b_masters, dtype, residual)]


def _saved_group(saved, n, dtype, first):
    """(s X Aᵀ, A, B) that `_adapt_groups` saved for its n-th group, whose first member is `first`; A and B checked to
    be in the compute dtype."""
    xa, a, b = saved[3 * n:3 * n + 3]
    _expect(a, dtype, f"saved lora_A of {first.name}")
    _expect(b, dtype, f"saved lora_B of {first.name}")
    return xa, a, b


def _adapt_groups_backward(projs, groups, saved, dy, x_loras, x, dx, need_x, need_a, need_b, masters, da, db,
                           one_read=None):
    """`_adapt_backward` for every group; saved starts with what `_adapt_groups` returned. A group that reads
    X adds its (s dY B) A into dx (unless dx is None: X needs no gradient); a dropout group's is its dX̃_i,
    returned where need_x[i] asks for it (in a list indexed like x_loras). one_read: `GLU.adapter_grads` (or None),
    tried where dY is stored transposed (the MLP's [dG | dU]; `_adapt_backward_one_read`)."""
    dx_loras = [None] * len(x_loras)
    for n, g in enumerate(groups):
        xa, a, b = _saved_group(saved, n, x.dtype, projs[g[0]])
        xr = _read(g, x_loras, x)
        dybt = None
        if one_read is not None and stored_transposed(dy):
            cols, _ = _blocks(projs, g)
            dybt = _adapt_backward_one_read(one_read, projs, g, dy[:, cols].t(), xr, xa, b, need_a, need_b, masters,
                                            da, db)
        dyb = _adapt_backward(projs, g, dy, xr, xa, b, need_a, need_b, masters, da, db) if dybt is None else dybt.t()
        if x_loras[g[0]] is None:
            if dx is not None:
                dx.addmm_(dyb, a)
        elif need_x[g[0]]:
            dx_loras[g[0]] = torch.mm(dyb, a)  # in the compute dtype, like dx
    return dx_loras


class _LoRAProjections(torch.autograd.Function):
    """[Y_1 | Y_2 | ...] (N, Σout), Y_i = X W_iᵀ + b_i + s_i (X̃_i A_iᵀ) B_iᵀ, for projections i that share the
    input X [N, in].

    Inputs after X: (X̃_i, A_i, B_i) per projection, then m_i per projection, then optionally a residual R (N, Σout).
    A_i, B_i are None without an adapter; X̃_i is None unless that adapter's dropout is on (the adapter then reads X);
    m_i, DoRA's magnitude, is None without DoRA. R (o's: the layer's residual stream) is added to the output by the
    base GEMM (`_base`), or with DoRA in the op that scales the output (`_dora_output`); its gradient is dY. With
    DoRA (no dropout), Y_i = g_i ⊙ P_i + b_i, P_i = X W_iᵀ + s_i (X A_iᵀ) B_iᵀ, and backward starts with
    dm_i = Σ_n dY_i ⊙ P_i / ‖W_i + s_i B_i A_i‖ and dP_i = g_i ⊙ dY_i (`_dora_backward`).
    given: the output, known already (a checkpointed layer's recompute whose first run kept it, model/offload.py):
    forward then runs only what backward needs (the adapters' X Aᵀ) and returns `given`; backward is unchanged, and
    so are the gradients where `given` is what this forward would compute. Not with DoRA (its backward reads P).
    """

    @staticmethod
    def forward(ctx, projs, store, dora_ops, given, x, *inputs):
        dtype, n = compute_dtype(x), len(projs)
        lora, mags, residual = inputs[:3 * n], inputs[3 * n:4 * n], (inputs[4 * n:] or [None])[0]
        names = ["x"] + [f"{n} of {p.name}" for p in projs for n in ("dropout(x)", "lora_A", "lora_B")] + [
            f"lora_magnitude_vector of {p.name}" for p in projs] + ["residual"]
        _check_inputs(ctx, names, (x, *inputs), x)
        a_masters, b_masters = lora[1::3], lora[2::3]
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(dtype)
            x_loras = [_to(t, dtype) for t in lora[0::3]]
            dora = any(m is not None for m in mags)
            groups = _adapter_groups(projs, x_loras)
            assert given is None or not dora, "a given output: not with DoRA, whose backward reads P"
            if given is not None:
                y, saved = given, _adapt_groups(None, projs, groups, x_loras, xc, a_masters, b_masters, dtype)
            elif _folded(projs, groups, x_loras, dora) and sum(p.out_features for p in projs) >= xc.shape[1]:
                y, saved = _base_folded(projs, groups[0], xc, a_masters, b_masters, dtype, residual=residual)
            else:
                late = _late_residual(projs, groups, dora, residual)
                y = _base(projs, xc, dtype, bias=not dora, residual=None if dora or late is not None else residual)
                saved = _adapt_groups(y, projs, groups, x_loras, xc, a_masters, b_masters, dtype, late)
            if dora:
                scales = _dora_scales(projs, groups, saved, mags, (a_masters, b_masters), dtype, store, dora_ops.norms)
                saved += [y, *scales]  # P, g, 1 / ‖W + s·B·A‖
                y = _dora_output(y, scales[0], _bias(projs, dtype), residual)
        _expect(y, dtype, "output of " + "/".join(p.name for p in projs))
        ctx.save_for_backward(xc, *x_loras, *saved)
        ctx.projs, ctx.groups, ctx.dora, ctx.dora_ops = projs, groups, dora, dora_ops
        ctx.residual = residual is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        projs, n = ctx.projs, len(ctx.projs)
        xc, *saved = ctx.saved_tensors
        x_loras, saved = saved[:n], saved[n:]
        need = ctx.needs_input_grad[4:]  # x, then (X̃_i, A_i, B_i) per projection, then m_i per projection
        need_lora, need_m = need[:3 * n + 1], need[3 * n + 1:]
        masters = ctx.dtypes[2:3 * n:3]  # lora_A's dtype per projection (lora_B's is asserted equal by _check_grads)
        da, db, dm = [None] * n, [None] * n, [None] * n
        _expect(dy, xc.dtype, "gradient of the " + "/".join(p.name for p in projs) + " output")
        d_residual = [dy] if ctx.residual else []
        with torch.autocast(xc.device.type, enabled=False):
            if ctx.dora:
                *saved, pre, g, inv = saved
                dy = _dora_backward(ctx.dora_ops.backward, projs, ctx.dtypes[3 * n + 1:], dy, pre, g, inv, need_m, dm)
            dx = _base_backward(projs, dy) if need[0] else None
            dx_loras = _adapt_groups_backward(projs, ctx.groups, saved, dy, x_loras, xc, dx, need_lora[1::3],
                                              need_lora[2::3], need_lora[3::3], masters, da, db)
        x_dtype = ctx.dtypes[0]  # X's, and every X̃_i's (asserted in forward)
        grads = [t for i in range(n) for t in (_to(dx_loras[i], x_dtype), da[i], db[i])]
        return (None, None, None, None, *_check_grads(ctx, [_to(dx, x_dtype)] + grads + dm + d_residual))


def _halves(gu):
    """Gᵀ and Uᵀ, (I, N) each and contiguous, from [G | U] (N, 2I) stored as the contiguous (2I, N)."""
    return gu.t().chunk(2)


class _LoRAMLP(torch.autograd.Function):
    """Y = down(act(gate(X)) ⊙ up(X)), each projection with its LoRA adapter (see the module docstring).

    Inputs: X [N, H]; X̃_gate, X̃_up (None unless that dropout is on); then A, B of gate,
    up and down (None where there is no adapter). The down-projection's dropout mask is
    drawn here, since H only exists here. output=False: Y is not computed (zeros are returned
    in its place) but everything backward needs is saved, as for the recompute of a checkpointed
    layer, whose output nothing reads. Gate and up run as one projection (`_base`) whose
    output [G | U] is stored transposed, so that Gᵀ and Uᵀ are contiguous for the elementwise
    kernels; H and dH are handled transposed likewise, which the GEMMs take at no cost.

    Last inputs: m of gate, up and down (None without DoRA), then optionally a residual R (N, H), added to the output
    by down's base GEMM, or with DoRA on down in the op that scales it (as in `_LoRAProjections`; output=False: zeros
    still).
    With DoRA on gate/up, what is saved is their P = [G | U] before DoRA's scaling, and backward scales it again;
    with DoRA on down, its P (N, H) is saved, and computed also when output=False (see `_LoRAProjections` for DoRA's
    backward).
    """

    @staticmethod
    def forward(ctx, projs, glu, output, store, dora_ops, x, x_gate, x_up, *inputs):
        gate, up, down = projs
        dtype = compute_dtype(x)
        ab, mags, residual = inputs[:6], inputs[6:9], (inputs[9:] or [None])[0]
        names = ["x", "dropout(x) of gate_proj", "dropout(x) of up_proj"] + [
            f"{n} of {p.name}" for p in projs for n in ("lora_A", "lora_B")] + [
            f"lora_magnitude_vector of {p.name}" for p in projs] + ["residual"]
        _check_inputs(ctx, names, (x, x_gate, x_up, *inputs), x)
        a_masters, b_masters = ab[0::2], ab[1::2]  # of gate, up, down
        p_drop = down.dropout_p if down.r and down.training else 0.0
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(dtype)
            x_loras = [_to(x_gate, dtype), _to(x_up, dtype)]
            dora_gu, dora_d = (any(m is not None for m in ms) for ms in (mags[:2], mags[2:]))
            groups, n_gu = _adapter_groups(projs[:2], x_loras), gate.out_features + up.out_features
            in_glu = False  # gate's and up's adapters added inside the activation (`_in_activation`)
            if _folded(projs[:2], groups, x_loras, dora_gu):
                # [G | U] in the first rows of a buffer whose last Σr rows take backward's s dY B, when the
                # activation's backward writes [dG | dU] over [G | U] (its other rows)
                spare = sum(projs[i].r for i in groups[0]) if glu.inplace else 0
                gu_rows = xc.new_empty(n_gu + spare, len(xc))
                gu, saved = _base_folded(projs[:2], groups[0], xc, a_masters, b_masters, dtype, out=gu_rows[:n_gu])
            else:
                gu = _base(projs[:2], xc, dtype, transposed=True, bias=not dora_gu)  # [G | U] (N, 2I)
                in_glu = _in_activation(glu, projs[:2], gu, groups, x_loras, dora_gu)
                saved = _adapt_groups(None if in_glu else gu, projs[:2], groups, x_loras, xc, a_masters, b_masters,
                                      dtype)
                gu_rows = gu.t()
            # what is saved: [G | U] (2I rows, and any spare ones), or DoRA's P before its scaling, or with the adapters
            # inside the activation X [W_g; W_u]ᵀ alone (backward's activation adds them again)
            pre_gu = gu_rows
            dora = []  # g, 1 / ‖W + s·B·A‖ of gate/up; then P, g, 1 / ‖W + s·B·A‖ of down
            affine = {}  # DoRA's [G | U] = g ⊙ P + b, which the activation computes as it reads P
            if dora_gu:
                dora += _dora_scales(projs[:2], groups, saved, mags[:2], (a_masters, b_masters), dtype, store,
                                     dora_ops.norms)
                affine = dict(scale=dora[0], bias=_bias(projs[:2], dtype))
            # max |H|, for its one fp8 scale, where down's base GEMM runs (not in a recompute that skips it)
            amax = xc.new_empty(()) if down.fp8 is not None and (output or dora_d) else None
            terms = _gate_up_terms(projs[:2], groups[0], saved) if in_glu else {}
            h = glu.forward(*_halves(gu), **affine, amax=amax, **terms).t()  # (N, I)
            keep, h_lora = None, None
            if p_drop > 0:
                mask = F.dropout(h.new_ones(h.shape), p_drop)  # 0 or 1/(1-p), drawn as F.dropout(h) draws
                keep, h_lora = mask != 0, h * mask
                del mask
            late = _late_residual((down,), [[0]] if down.r else [], dora_d, residual)
            y = _base((down,), h, dtype, bias=not dora_d, residual=None if dora_d or late is not None else residual,
                      amax=amax) if output or dora_d else None
            if down.r:
                saved += _adapt(y, (down,), [0], h if h_lora is None else h_lora, a_masters[2:], b_masters[2:], dtype,
                                late)
            if dora_d:
                scales = _dora_scales((down,), [[0]], saved[-3:], mags[2:], (a_masters[2:], b_masters[2:]), dtype,
                                      store, dora_ops.norms)
                dora += [y, *scales]
                y = _dora_output(y, scales[0], _bias((down,), dtype), residual) if output else None
            if y is None:
                y = xc.new_zeros(xc.shape[0], down.out_features)
            del h, h_lora, gu
        for t, name in ((pre_gu, "gate/up"), (y, "output")):
            _expect(t, dtype, f"MLP {name}")
        ctx.save_for_backward(xc, *x_loras, pre_gu, keep, *dora, *saved)
        ctx.projs, ctx.glu, ctx.p_drop, ctx.groups, ctx.in_glu = projs, glu, p_drop, groups, in_glu
        ctx.dora_gu, ctx.dora_d, ctx.dora_ops = dora_gu, dora_d, dora_ops
        ctx.residual = residual is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.glu.inplace:
            # Triton's writes do not bump tensor versions, so autograd could not tell that a
            # second backward would read gradients where G and U were.
            if getattr(ctx, "consumed", False):
                raise RuntimeError("fused LoRA MLP: backward ran twice through one forward (retain_graph=True?), "
                                   "but the first overwrote the saved gate/up activations with their gradients. "
                                   "Build the model with fused_lora=False to backpropagate twice")
            ctx.consumed = True
        xc, x_gate, x_up, gu_rows, keep, *saved = ctx.saved_tensors
        dora_gu, saved = (saved[:2], saved[2:]) if ctx.dora_gu else (None, saved)  # g, 1 / ‖W + s·B·A‖
        dora_d, saved = (saved[:3], saved[3:]) if ctx.dora_d else (None, saved)  # P, g, 1 / ‖W + s·B·A‖
        x_loras, projs, down = [x_gate, x_up], ctx.projs, ctx.projs[2]
        n_gu = projs[0].out_features + projs[1].out_features
        gu = gu_rows[:n_gu].t()  # [G | U] (N, 2I)
        need = ctx.needs_input_grad[5:]  # x, X̃_gate, X̃_up, A_g, B_g, A_u, B_u, A_d, B_d, m_g, m_u, m_d
        need_a, need_b, need_m = need[3:9:2], need[4:9:2], need[9:]  # of gate, up, down
        masters, m_dtypes = ctx.dtypes[3:9:2], ctx.dtypes[9:]  # lora_A's and m's dtypes of gate, up, down
        da, db, dm = [None] * 3, [None] * 3, [None] * 3
        _expect(dy, xc.dtype, "gradient of the MLP output")
        d_residual = [dy] if ctx.residual else []
        with torch.autocast(xc.device.type, enabled=False):
            # DoRA: gu holds P, which the activation scales as it reads it (its backward then writes new tensors)
            affine = {} if dora_gu is None else dict(scale=dora_gu[0], bias=_bias(projs[:2], xc.dtype))
            terms = _gate_up_terms(projs[:2], ctx.groups[0], saved) if ctx.in_glu else {}  # as forward read them
            if dora_d is not None:
                dm_d = [None]
                dy = _dora_backward(ctx.dora_ops.backward, (down,), m_dtypes[2:], dy, *dora_d, need_m[2:], dm_d)
                dm[2] = dm_d[0]
            g, u = _halves(gu)
            mask = None if keep is None else keep.to(dy.dtype).div_(1 - ctx.p_drop)  # M_d, as F.dropout scales
            if down.r:  # dH gets s (dY B_d) A_d (⊙ M_d), and dB_d reads the saved s H̃ A_dᵀ: neither needs H
                xa, a_d, b_d = saved[-3:]
                _expect(a_d, xc.dtype, f"saved lora_A of {down.name}")
                _expect(b_d, xc.dtype, f"saved lora_B of {down.name}")
                db_d = [None]
                dyb = _adapt_backward((down,), [0], dy, None, xa, b_d, [False], need_b[2:], masters[2:], None, db_d)
                db[2] = db_d[0]
            # down's input (H) is wider than its output: dH = [dY | s dY B_d] [W_d; A_d] without dropout (whose
            # mask M_d applies to the adapter's term alone), rather than a pass that adds s (dY B_d) A_d into dH
            fold_down = down.r and mask is None and down.in_features > down.out_features
            if fold_down and _folded((down,), [[0]], [None], ctx.dora_d):
                dh = _base_backward((down,), torch.cat([dy, dyb], dim=1), transposed=True, rows=a_d)
            else:
                dh = _base_backward((down,), dy, transposed=True)  # (N, I), stored as (I, N) like Gᵀ and Uᵀ
                if down.r and mask is None and _takes_terms(ctx.glu, dh):  # added as the activation's backward reads dH
                    terms["dh_term"] = (a_d.t(), dyb)
                elif down.r and mask is None:
                    dh.addmm_(dyb, a_d)
                elif down.r:
                    dh.addcmul_(torch.mm(dyb, a_d), mask)
            # kernels, no DoRA: dG, dU written over Gᵀ and Uᵀ (into gu); H over dH
            # max |[dG | dU]|, for its one fp8 scale, where the base's input gradient reads [dG | dU] itself
            amax = xc.new_empty(()) if projs[0].fp8 is not None and dora_gu is None else None
            dg, du, h = ctx.glu.backward(dh.t(), g, u, **affine, amax=amax, **terms)
            del dh
            if down.r and need_a[2]:  # dA_d = s (dY B_d)ᵀ H̃
                da[2] = _mm_to(dyb.t(), h.t() if mask is None else h.t() * mask, masters[2])
            del h, mask
            if dora_gu is not None:  # dP = g ⊙ [dG | dU], written over [dG | dU] (new tensors)
                dgu = _dora_backward(ctx.dora_ops.backward, projs[:2], m_dtypes[:2], _packed([dg, du]).t(), gu,
                                     *dora_gu, need_m[:2], dm, inplace=True)
            else:
                dgu = gu if ctx.glu.inplace else torch.cat([dg, du]).t()  # [dG | dU] (N, 2I)
            del gu, dg, du
            if len(gu_rows) > n_gu:  # folded: [dG | dU | s dY B] [W_gate; W_up; A], s dY B in the spare rows
                xa, a, b = _saved_group(saved, 0, xc.dtype, projs[0])
                if _adapt_backward_one_read(ctx.glu.adapter_grads, projs[:2], ctx.groups[0], gu_rows[:n_gu], xc, xa, b,
                                            need_a, need_b, masters, da, db, q_out=gu_rows[n_gu:]) is None:
                    dyb = _adapt_backward(projs[:2], ctx.groups[0], dgu, xc, xa, b, need_a, need_b, masters, da, db)
                    gu_rows[n_gu:] = dyb.t()
                dx = _base_backward(projs[:2], gu_rows.t(), rows=a) if need[0] else None
                dx_loras = [None, None]
            else:
                # --fp8, one group: the adapters' one read of [dG | dU] also makes its e4m3 copy for the base's GEMM
                fp8, dybt = [], None
                if amax is not None and need[0] and stored_transposed(dgu) and \
                        _one_group(projs[:2], ctx.groups, x_loras, False):
                    xa, a, b = _saved_group(saved, 0, xc.dtype, projs[0])
                    dybt = _adapt_backward_one_read(ctx.glu.adapter_grads, projs[:2], ctx.groups[0], dgu.t(), xc, xa,
                                                    b, need_a, need_b, masters, da, db, amax=amax, fp8=fp8)
                if dybt is not None:
                    dx = _base_backward(projs[:2], dgu, quantized=fp8[0]).addmm_(dybt.t(), a)
                    dx_loras = [None, None]
                else:
                    dx = _base_backward(projs[:2], dgu, amax=amax) if need[0] else None
                    dx_loras = _adapt_groups_backward(projs[:2], ctx.groups, saved, dgu, x_loras, xc, dx, need[1:3],
                                                      need_a, need_b, masters, da, db, one_read=ctx.glu.adapter_grads)
        x_dtype = ctx.dtypes[0]  # X's, and X̃_gate's and X̃_up's (asserted in forward)
        dxs = [_to(t, x_dtype) for t in (dx, *dx_loras)]
        return (None, None, None, None, None,
                *_check_grads(ctx, dxs + [da[0], db[0], da[1], db[1], da[2], db[2]] + dm + d_residual))


def _in_activation(glu, projs, gu, groups, x_loras, dora):
    """Whether gate's and up's adapter products s (X Aᵀ) Bᵀ are added to G and U by the activation's kernels as they
    read [G | U] (gu, (N, 2I)), rather than into [G | U] in a pass of its own: where the kernels take them for that
    size (`_takes_terms`), for one group of both that reads X, without DoRA (whose scaling comes after the sum)."""
    return _takes_terms(glu, _halves(gu)[0]) and _one_group(projs, groups, x_loras, dora)


def _takes_terms(glu, like):
    """Whether the activation's kernels take low-rank terms for operands like `like` (`GLU.lowrank`)."""
    return glu.lowrank is not None and glu.lowrank(like)


def _gate_up_terms(projs, group, saved):
    """The activation's keyword `terms` for gate's and up's adapters (`_in_activation`): per member, its rows and
    columns of the group's block B (2I, Σr), and its columns of R = s X Aᵀ (N, Σr), from what `_adapt` saved."""
    xa, _, b = saved[:3]
    _, blocks = _blocks(projs, group)
    return {"terms": tuple((b[rows, cols], xa[:, cols]) for rows, cols in blocks)}


def _magnitudes(projs):
    """Each projection's DoRA magnitude, None where it has no DoRA adapter (or its adapters are off)."""
    return [p.lora_magnitude_vector if p.dora and p.r else None for p in projs]


def lora_projections(x, projs, store=None, dora_ops=DORA_REFERENCES, residual=None, given=None):
    """tuple(p(x) for p in projs) as one autograd Function: one GEMM for the base of all of them (`_base`),
    X cast and saved once, and dX in one GEMM too. x (..., in); the outputs are column slices of one
    (..., Σout) tensor (`projected`). store: a dict that keeps DoRA's scales for a checkpointed layer's recompute
    (`_dora_scales`). dora_ops: DoRA's kernels or their references (`DoRAOps`). residual: (..., Σout) added to
    the output (residual + y), inside the Function (`_residual_input`). given: that output (with the residual), known
    already, where `givable` holds: no GEMM of the base runs (`_LoRAProjections`)."""
    return output_slices(projected(x, projs, store, dora_ops, residual, given), projs)


def output_slices(y, projs):
    """Each projection's output: the column slices of `projected`'s y (..., Σout)."""
    return (y,) if len(projs) == 1 else y.split([p.out_features for p in projs], dim=-1)


def projected(x, projs, store=None, dora_ops=DORA_REFERENCES, residual=None, given=None):
    """`lora_projections`' outputs as the one (..., Σout) tensor they are column slices of."""
    x2 = x.reshape(-1, x.shape[-1])  # (N, in)
    lora = [t for p in projs for t in (p.lora_input(x2), p.lora_A, p.lora_B)]
    mags = _magnitudes(projs)
    inside = _residual_input(residual, x2)
    if given is not None:
        assert givable(projs, x, residual), "a given output: only where `givable` holds"
        given = given.reshape(-1, given.shape[-1])
    y = _LoRAProjections.apply(projs, store, dora_ops, given, x2, *lora, *mags, *inside)
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if residual is None or inside else residual + y


def givable(projs, x, residual=None):
    """Whether `lora_projections` can take its output as given: without DoRA, whose backward reads the output
    before its scaling, and with the residual (if any) added inside the Function, so that the given output is
    the Function's own."""
    return not any(m is not None for m in _magnitudes(projs)) and (
        residual is None or bool(_residual_input(residual, x.reshape(-1, x.shape[-1]))))


def _residual_input(residual, x):
    """[the residual as (N, Σout)] when the fused Function adds it (the residual, X and the output share X's dtype: no
    autocast), else [] (the caller adds it)."""
    if residual is None or not residual.dtype == x.dtype == compute_dtype(x):
        return []
    return [residual.reshape(-1, residual.shape[-1])]


def lora_mlp(x, projs, glu: GLU, output=True, store=None, dora_ops=DORA_REFERENCES, residual=None):
    """down(act(gate(x)) ⊙ up(x)) for projs = (gate, up, down), as one autograd Function. x (..., H).
    output=False: zeros in place of the output, the graph and what backward needs as with True (`_LoRAMLP`).
    store, dora_ops, residual: as for `lora_projections`."""
    gate, up, down = projs
    x2 = x.reshape(-1, x.shape[-1])  # (N, H)
    mags = _magnitudes(projs)
    inside = _residual_input(residual, x2)
    y = _LoRAMLP.apply(projs, glu, output, store, dora_ops, x2, gate.lora_input(x2), up.lora_input(x2),
                       gate.lora_A, gate.lora_B, up.lora_A, up.lora_B, down.lora_A, down.lora_B, *mags, *inside)
    y = y.view(*x.shape[:-1], y.shape[-1])
    return residual + y if residual is not None and not inside else y
