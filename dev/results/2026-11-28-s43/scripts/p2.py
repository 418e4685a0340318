"""Where a Llama-3.1-8B NF4 step's time goes with checkpointing on + offload, against off (2 x 2048, graphed as
bench_qlora): wall time a step (median of 5), then torch.profiler over 2 steps: the GPU's busy time (union of
kernel and copy spans), per stream, the copies, and the top kernels."""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench import harness
from scripts.bench.bench_qlora import model_config

dev = torch.device("cuda")
for case in sys.argv[1].split(","):
    prec, ckpt = case.split(":")
    step = harness.nanotune_step(model_config(os.environ.get("SHAPE", "llama-3.1-8b"), False), dev, ckpt, quantize="nf4", fp8=prec == "fp8",
                                 cuda_graphs=sys.argv[2] if len(sys.argv) > 2 else "on")
    b = harness.fixed_batch(step.vocab_size, 2, 2048, dev)
    for _ in range(3):
        step(b)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter(); step(b); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    print(f"== {prec} {ckpt}: {statistics.median(times) * 1e3:.1f} ms a step (min {min(times) * 1e3:.1f}), peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(2):
            step(b)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 2
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and e.get("cat") in
          ("kernel", "gpu_memcpy", "gpu_memset")]
    def union(spans):
        spans = sorted(spans); busy = 0.0; s0, e0 = spans[0]
        for s, e in spans[1:]:
            if s > e0:
                busy += e0 - s0; s0, e0 = s, e
            else:
                e0 = max(e0, e)
        return busy + e0 - s0
    span = max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)
    print(f"  profiled wall {wall * 1e3:.1f} ms a step; GPU span {span / 2e3:.1f} ms a step, busy "
          f"{union([(e['ts'], e['ts'] + e['dur']) for e in ev]) / 2e3:.1f} ms a step")
    streams = {}
    for e in ev:
        streams.setdefault((e["cat"] == "kernel", e.get("tid")), []).append(e)
    kspans = [(e['ts'], e['ts'] + e['dur']) for e in ev if e["cat"] == "kernel"]
    print(f"  kernels' union {union(kspans) / 2e3:.1f} ms a step, their sum {sum(b - a for a, b in kspans) / 2e3:.1f}")
    for (kern, tid), es in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1]))[:8]:
        names = {}
        for e in es:
            names[e["name"][:60]] = names.get(e["name"][:60], 0) + e["dur"]
        top = sorted(names.items(), key=lambda kv: -kv[1])[:4]
        print(f"  stream {tid} {'kernels' if kern else 'copies'}: {len(es) / 2:.0f} a step, sum "
              f"{sum(e['dur'] for e in es) / 2e3:.2f} ms, busy {union([(e['ts'], e['ts'] + e['dur']) for e in es]) / 2e3:.2f} ms; "
              + "; ".join(f"{n} {d / 2e3:.2f}" for n, d in top))
    byname = {}
    for e in ev:
        k = e["name"][:100]
        n, d = byname.get(k, (0, 0.0)); byname[k] = (n + 1, d + e["dur"])
    for k, (n, d) in sorted(byname.items(), key=lambda kv: -kv[1][1])[:int(os.environ.get("TOP", 40))]:
        print(f"  {d / 2e3:8.2f} ms {n / 2:5.0f}x  {k}")
    del step, b
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
