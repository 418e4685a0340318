"""Does the micro-step capture as a CUDA graph, does the replay match the eager step, how fast is each.

    python scripts/bench/probe_graphs.py     # H100: forward + backward only, no optimizer, random init

Random-init models of real shapes built directly (no checkpoint on disk), LoRA r=16 on all 7
projections, bf16, kernels on; each case: eager vs replayed loss and LoRA gradients, then the median
of 12 steps of each (after 3). Results: docs/perf-notes.md, "CUDA graphs".
"""
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
import step as S  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.lora import LoRAConfig, lora_parameters  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from model.weights import finish_model  # noqa: E402

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9, n_kv_heads=3,
            head_dim=64, tie_embeddings=True, rms_eps=1e-5)
TINY = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, n_layers=22, n_heads=32, n_kv_heads=4,
            head_dim=64, tie_embeddings=False, rms_eps=1e-5)


def build(shape, ckpt, dropout, dtype=torch.bfloat16):
    cfg = ModelConfig(**shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Transformer(cfg, lora=LoRAConfig(r=16, alpha=16, dropout=dropout), use_kernels=True)
    for n, p in m.named_parameters():
        if "norm" in n:
            torch.nn.init.ones_(p)
        elif "embed" in n:
            torch.nn.init.normal_(p, std=0.02)
    m.to(dtype)
    finish_model(m, cfg, torch.device("cuda"), 0)
    with torch.no_grad():
        for n, p in lora_parameters(m):
            if n.endswith("lora_B"):
                p.normal_(std=0.02)
    m.gradient_checkpointing = ckpt
    m.train()
    return m


def batch(B, T, V, docs=True, gen=None):
    ids = torch.randint(0, V, (B, T), generator=gen)
    if docs:
        doc = torch.zeros(B, T, dtype=torch.long)
        pos = torch.zeros(B, T, dtype=torch.long)
        for b in range(B):
            cuts = sorted(torch.randint(1, T, (4,), generator=gen).tolist())
            d, start = 0, 0
            for c in cuts + [T]:
                doc[b, start:c] = d
                pos[b, start:c] = torch.arange(c - start)
                d, start = d + 1, c
    else:
        doc = torch.zeros(B, T, dtype=torch.long)
        pos = torch.arange(T).expand(B, T).clone()
    tgt = torch.roll(ids, -1, 1)
    tgt[:, -1] = -100
    tgt[doc != torch.roll(doc, -1, 1)] = -100
    return {"input_ids": ids, "targets": tgt, "position_ids": pos, "doc_ids": doc}


def run(step, params, b, mult=1.0):
    for p in params:
        if p.grad is not None:
            p.grad.zero_()
    n = int((b["targets"] != -100).sum())
    loss = step(b, n, mult)
    torch.cuda.synchronize()
    return float(loss), [p.grad.clone() for p in params]


def timeit(step, params, batches, n=15):
    times = []
    for i in range(n):
        b = batches[i % len(batches)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        loss = step(b, int((b["targets"] != -100).sum()), 1.0)
        float(loss)
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1e3


def case(name, shape, B, T, ckpt=False, dropout=0.0, docs=True, padded=False):
    print(f"=== {name}: B={B} T={T} ckpt={ckpt} dropout={dropout} docs={docs} padded={padded}", flush=True)
    try:
        m = build(shape, ckpt, dropout)
        params = [p for _, p in lora_parameters(m)]
        gen = torch.Generator().manual_seed(1)
        if padded:
            batches = []
            for _ in range(6):
                L = int(torch.randint(100, 601, (1,), generator=gen))
                bb = batch(B, L, shape["vocab_size"], docs=False, gen=gen)
                bb["doc_ids"][:, L - 7:] = 1  # a padding tail
                bb["targets"][:, L - 8:] = -100
                batches.append(bb)
        else:
            batches = [batch(B, T, shape["vocab_size"], docs=docs, gen=gen) for _ in range(4)]
        eager = S.EagerStep(m, torch.device("cuda"))
        graph = S.GraphStep(m, torch.device("cuda"), params, max_len=T if not padded else 640)
        if dropout == 0:
            le, ge = run(eager, params, batches[0])
            lg, gg = run(graph, params, batches[0])
            lg2, gg2 = run(graph, params, batches[0])
            err = max(float((a - b).norm() / b.norm().clamp(min=1e-12)) for a, b in zip(gg, ge))
            err2 = max(float((a - b).norm() / b.norm().clamp(min=1e-12)) for a, b in zip(gg2, ge))
            print(f"loss eager {le:.6f} graph {lg:.6f} replay {lg2:.6f}; max rel grad err {err:.2e} / {err2:.2e}")
        else:
            lg, gg = run(graph, params, batches[0])
            lg2, gg2 = run(graph, params, batches[0])
            print(f"dropout: replay losses {lg:.6f} {lg2:.6f} differ={lg != lg2}")
        te = timeit(eager, params, batches)
        tg = timeit(graph, params, batches)
        ntok = sum(int((b['doc_ids'] >= 0).sum()) for b in batches) / len(batches)
        print(f"RESULT {name}: eager {te:.1f} ms, graph {tg:.1f} ms ({te / tg:.1f}x), graphs={len(graph.graphs)}, "
              f"{ntok / tg:.0f}k tok/s graph, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
        del m, graph, eager
    except Exception:
        traceback.print_exc()
        print(f"RESULT {name}: FAILED", flush=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    case("smol packed flex", SMOL, 8, 512)
    case("smol causal", SMOL, 8, 512, docs=False)
    case("smol packed ckpt", SMOL, 8, 512, ckpt=True)
    case("smol dropout", SMOL, 8, 512, dropout=0.1)
    case("smol padded", SMOL, 8, 0, padded=True)
    case("tiny 1x64", TINY, 1, 64, docs=False)
    case("tiny 1x64 ckpt", TINY, 1, 64, docs=False, ckpt=True)
    case("tiny 4x2048 causal", TINY, 4, 2048, docs=False)
