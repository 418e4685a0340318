"""Adapter variants beyond plain LoRA: how an adapter starts (--lora-init), LoRA+'s learning rates, and the
form a base-moving init is saved in. DoRA's forward lives with LoRALinear (model/lora.py).

Inits, as PEFT's `tuners/lora/layer.py` computes them (W [out, in] in fp32, s the LoRA scale):

    default   A kaiming-uniform, B = 0                         (model/lora.py, `init_lora_`)
    gaussian  A ~ N(0, (1/r)²), B = 0
    pissa     W = U S Vᵀ (SVD), A = √(S_r/s) V_rᵀ, B = U_r √(S_r/s)      Meng et al. 2024 "PiSSA"
    olora     W = Q R (QR),     A = R[:r],         B = Q[:, :r]          Büyükakyüz 2024 "OLoRA"

PiSSA and OLoRA start B·A ≠ 0, so they move it out of the base: W_res = W - s·B·A takes W's place, and the
model's output before training is the original model's. A PiSSA/OLoRA adapter is only meaningful on W_res,
so it is saved in PEFT's converted form (what `save_pretrained(path_initial_model_for_weight_conversion=...)`
writes): the change from the initial A₀, B₀ as a plain LoRA of rank 2r on the original W,

    s·B·A - s·B₀·A₀ = s · [B | -B₀] · [A; A₀],    r' = 2r, alpha' = 2·alpha (alpha·√2 with rsLoRA), s' = s,

which PEFT, merge.py and export_gguf.py apply to the original base like any adapter.

LoRA+ (Hayes et al. 2024 "LoRA+"): B learns at lr × ratio, A at lr. The optimizer holds them in two groups
(masters.py, `param_groups`), each with its `lr_scale`; the loop sets every group's lr to the schedule's lr × its
lr_scale. As PEFT's `create_loraplus_optimizer` does, 1-D adapter weights (DoRA's magnitudes) go with B.
"""
import torch

from model.lora import BASE_MOVING_INITS, LoRALinear


@torch.no_grad()
def init_adapter_(linear: LoRALinear, generator=None):
    """Initialize `linear`'s adapter by its init, over the default one (`init_lora_`) already in A and B (fp32):
    gaussian draws A again, pissa and olora compute A, B from W and move W to W - s·B·A. Then DoRA's magnitude
    starts as ‖W + s·B·A‖ per output row. `generator`: a CPU generator, so that draws are alike on every device."""
    a, b, init = linear.lora_A, linear.lora_B, linear.init
    if init == "gaussian":
        a.copy_(torch.randn(a.shape, generator=generator) / linear.r)
        b.zero_()
    elif init in BASE_MOVING_INITS:
        if linear.nf4 is not None:
            raise ValueError(f"--lora-init {init} moves s·B·A out of the base weight, which must then be quantized "
                             "after it moved; an NF4 base is quantized as it loads. Train it on the full-precision "
                             "base (leave out --quantize), or use --lora-init default or gaussian with NF4")
        w = linear.weight.float()
        if linear.r > min(w.shape):
            raise ValueError(f"--lora-init {init} takes the adapter's r = {linear.r} components from {linear.name}'s "
                             f"weight of shape {tuple(w.shape)}, which has only {min(w.shape)}: lower --lora-r to at "
                             f"most {min(w.shape)}, or use --lora-init default or gaussian")
        a0, b0 = (pissa if init == "pissa" else olora)(w, linear.r, linear.scale)
        a.copy_(a0), b.copy_(b0)
        linear.weight.copy_(w - linear.scale * (b0 @ a0))  # W_res, in W's dtype
        linear.lora_A0, linear.lora_B0 = a0.clone(), b0.clone()
    if linear.dora:
        linear.lora_magnitude_vector.copy_(linear.weight_norm(linear.base_weight()))


def pissa(w, r, scale):
    """(A [r, in], B [out, r]) of PiSSA for W [out, in] (fp32): the top-r singular triplets, B·A = U_r S_r V_rᵀ / s."""
    u, sv, vh = torch.linalg.svd(w, full_matrices=False)
    root = (sv[:r] / scale).sqrt()
    return root[:, None] * vh[:r], u[:, :r] * root


def olora(w, r, scale):
    """(A [r, in], B [out, r]) of OLoRA for W [out, in] (fp32): the first r columns of Q and rows of R, W = Q R."""
    q, rr = torch.linalg.qr(w)
    return rr[:r].contiguous(), q[:, :r].contiguous()


def moves_base(model) -> bool:
    """Whether `model`'s adapters started from a base-moving init (its base weights are W - s·B₀·A₀)."""
    lora = getattr(model, "lora_config", None)
    return lora is not None and lora.init in BASE_MOVING_INITS


def converted_adapter(model):
    """{name: tensor} of `model`'s adapter as the rank-2r plain LoRA on the original base that it amounts to
    (see the module docstring): lora_A [A; A₀] and lora_B [B | -B₀], fp32 on the CPU."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear) and m.r:
            out[f"{name}.lora_A"] = torch.cat([m.lora_A.detach(), m.lora_A0]).to("cpu", torch.float32)
            out[f"{name}.lora_B"] = torch.cat([m.lora_B.detach(), -m.lora_B0], dim=1).to("cpu", torch.float32)
    return out
