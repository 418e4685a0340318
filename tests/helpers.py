"""Shared test helpers."""
import json
import os
import zlib

import torch


def assert_close(actual, expected, atol, rtol, name="tensor"):
    """torch.testing.assert_close on fp32 copies, with the max and mean |difference| in the message."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    a, e = actual.detach().float(), expected.detach().float()
    diff = (a - e).abs()
    stats = (f"{name}: max |diff| {diff.max().item():.3g}, mean |diff| {diff.mean().item():.3g}"
             if diff.numel() else f"{name}: empty")
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False, msg=lambda m: f"{stats}\n{m}")


def rel_err(actual, expected):
    """‖a − b‖ / ‖b‖ in float64 (the absolute norm of the difference when b is zero)."""
    a, b = actual.detach().double(), expected.detach().double()
    den = b.norm()
    return ((a - b).norm() / den).item() if den > 0 else (a - b).norm().item()


def read_metrics(out_dir):
    """The records of a run's metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def randomize_lora_b(model, std=0.05):
    """Random non-zero lora_B (initialized to 0, it would hide every gradient that flows
    through B), the same values for the same parameter name on any device."""
    from model.lora import lora_parameters
    with torch.no_grad():
        for n, p in lora_parameters(model):
            if n.endswith("lora_B"):
                gen = torch.Generator().manual_seed(zlib.crc32(n.encode()))
                p.copy_(torch.randn(p.shape, generator=gen) * std)
