"""Session 40: plain autograd's s (X Aᵀ) Bᵀ (bf16 casts of fp32 masters, as dora_forward computed it) against
_LowRank's, each against float64, at SmolLM2's q_proj (576 -> 576, r 16)."""
import sys, os
sys.path.insert(0, os.getcwd())
import torch
from tests.test_variants import _low_rank_case, _low_rank_grads
from model.lora import _LowRank
plain = lambda t, a, b: (t @ a.to(t.dtype).t() @ b.to(t.dtype).t()) * 0.5
fused = lambda t, a, b: _LowRank.apply(t, a, b, 0.5)
for tokens in (4096, 4097, 6145, 2817, 2753, 4161):
    x, a, b, dy = _low_rank_case(tokens, "cuda", torch.bfloat16, seed=tokens, sizes=(576, 16, 576))
    want = _low_rank_grads(lambda t, a_, b_: (t @ a_.t() @ b_.t()) * 0.5, x.double(), a.double(), b.double(), dy.double())
    row = []
    for name, fn in (("plain", plain), ("_LowRank", fused)):
        got = _low_rank_grads(fn, x, a, b, dy)
        errs = [(g.double() - w).abs().max().item() / w.abs().max().item() for g, w in zip(got[2:], want[2:])]
        row.append(f"{name} dA {errs[0]:.4f} dB {errs[1]:.4f}")
    print(tokens, " | ".join(row), flush=True)
