"""Where the host's time goes in a rollout's decoding loop: cProfile over 5 GroupSampler calls (2 prompts x 8, 64
tokens), and the same loop's pieces timed on the host alone (no GPU wait) per decoding step."""
import argparse, cProfile, io, os, pstats, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler, sample_tokens
from config import with_hardware_defaults
from rlconfig import RLConfig

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="smollm2-135m")
a = p.parse_args()
dev = torch.device("cuda")
for shape in a.shapes.split(","):
    ns = argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir)
    folder = model_folder(ns)
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, mcfg = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0,
                     cuda_graph=True)
    g = torch.Generator(dev).manual_seed(0)
    for _ in range(3):
        s(prompts, 8, 1.0, generator=g)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        s(prompts, 8, 1.0, generator=g)
    torch.cuda.synchronize()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(22)
    print(f"== {shape}: cProfile, 5 rollouts (320 decoding steps), by own time")
    print("\n".join(out.getvalue().splitlines()[:50]))
    # the pieces alone, on the host: each repeated 200 times with no sync in between, then one sync
    logits = torch.randn(16, mcfg.vocab_size, device=dev, dtype=torch.bfloat16)
    tok = torch.zeros(16, dtype=torch.long, device=dev)
    done = torch.zeros(16, dtype=torch.bool, device=dev)
    stops = torch.tensor([], dtype=torch.long, device=dev)
    positions = torch.zeros(16, dtype=torch.long, device=dev)
    pieces = {
        "decode graph call (copies + replay)": lambda: s.decode(tok, 40, positions + 3),
        "graph replay alone": lambda: s.decode.replay(),
        "sample_tokens (empty, exponential_, 2 Triton launches)": lambda: sample_tokens(
            logits, 1.0, 1.0, 0, g, model.ops.sample_tokens),
        "exponential_ alone": lambda: torch.empty(logits.shape, dtype=torch.float32, device=dev).exponential_(
            generator=g),
        "Triton sampler alone": lambda: model.ops.sample_tokens(logits, 1.0, torch.ones(logits.shape, device=dev)),
        "where + isin + or": lambda: (torch.where(done, 0, tok), done | torch.isin(tok, stops)),
        "positions + t - 1": lambda: positions + 5 - 1,
    }
    for name, fn in pieces.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"  {name}: host {(t1 - t0) / 200 * 1e6:.1f} us a call (with the GPU's finish {(t2 - t0) / 200 * 1e6:.1f})")
