"""LoRA (Hu et al. 2021): y = x W^T + b + s * dropout(x) A^T B^T, with W frozen.

`LoRALinear` is a plain module built into the model when it is created. It owns the
frozen base `weight` (and `bias`), so base checkpoint keys still match, and adds
`lora_A` [r, in] (kaiming-uniform) and `lora_B` [out, r] (zeros), kept in fp32 as
master weights. The scale s is alpha / r, or alpha / sqrt(r) with rsLoRA.

The LoRA weights are cast to the activation dtype for the matmuls; autograd's cast
backward returns their gradients in fp32 to the master, so a bf16 forward never meets
an fp32 operand inside a matmul ("expected BFloat16 but got Float").
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    r: int = 16  # rank of the update
    alpha: float = 16.0  # the update is scaled by alpha / r (alpha / sqrt(r) with rslora)
    dropout: float = 0.0  # dropout on the LoRA branch's input
    targets: tuple = ALL_TARGETS  # which projections get an adapter
    rslora: bool = False  # rank-stabilized scale alpha / sqrt(r)

    def __post_init__(self):
        self.targets = tuple(self.targets)
        unknown = [t for t in self.targets if t not in ALL_TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target module(s) {unknown}; this model has {list(ALL_TARGETS)}")
        if self.r <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {self.r}")

    @property
    def scale(self):
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


class LoRALinear(nn.Module):
    def __init__(self, in_features, out_features, bias, cfg: LoRAConfig):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.r, self.scale = cfg.r, cfg.scale
        self.lora_A = nn.Parameter(torch.empty(cfg.r, in_features, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.empty(out_features, cfg.r, dtype=torch.float32))
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self):
        if self.lora_A.is_meta:
            return
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear (and PEFT) do
        nn.init.zeros_(self.lora_B)

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        return y + (self.dropout(x) @ a.t() @ b.t()) * self.scale

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, scale={self.scale:g}"


def make_linear(in_features, out_features, bias, name, lora: LoRAConfig | None):
    """A LoRALinear when `name` is a LoRA target, else a plain frozen-to-be nn.Linear."""
    if lora is not None and name in lora.targets:
        return LoRALinear(in_features, out_features, bias, lora)
    return nn.Linear(in_features, out_features, bias=bias)


def lora_parameters(model):
    """(name, parameter) of every LoRA weight in `model`."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_A" in n or ".lora_B" in n]


def mark_trainable(model, train_embeddings=False):
    """requires_grad on the LoRA weights only (plus embed/lm_head if asked)."""
    for n, p in model.named_parameters():
        is_lora = n.endswith(".lora_A") or n.endswith(".lora_B")
        is_embed = n in ("model.embed_tokens.weight", "lm_head.weight")
        p.requires_grad_(is_lora or (train_embeddings and is_embed))
