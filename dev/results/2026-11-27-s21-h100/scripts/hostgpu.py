"""Is a rollout bound by the GPU or by the host? torch.profiler over one GroupSampler call (2 prompts x 8, 64
tokens), full and with the layers left out (as ablate.py): the wall time, the union of the GPU's kernel spans
(busy), the idle gaps longer than 5 µs, and when the host issued its last graph launch against when the GPU's
last kernel ended (a host far ahead: GPU-bound; close: the GPU waits on the host). Also the host's own time per
decoding step without the profiler: the sampler's loop timed up to its last launch (before the final copy)."""
import argparse, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler
from config import with_hardware_defaults
from rlconfig import RLConfig
import model.decode as md
import model.generate as mg

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="qwen2.5-0.5b,smollm2-135m")
a = p.parse_args()
dev = torch.device("cuda")
real_call = md.FusedDecode.__call__
real_stack = torch.stack
for shape in a.shapes.split(","):
    ns = argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir)
    folder = model_folder(ns)
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, mcfg = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    for variant in ("full", "no layers"):
        md.FusedDecode.__call__ = real_call if variant == "full" else (
            lambda self, model, x, tables, masks, cache: model.model.norm(x))
        s = GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0,
                         cuda_graph=True)
        g = torch.Generator(dev).manual_seed(0)
        for _ in range(3):
            s(prompts, 8, 1.0, generator=g)
        # the host's time to the end of its loop: torch.stack is first called after the loop's last launch
        marks = []
        def stack(*args, **kw):
            marks.append(time.perf_counter())
            return real_stack(*args, **kw)
        enq, walls = [], []
        for _ in range(5):
            marks.clear(); torch.stack = stack
            torch.cuda.synchronize(); t0 = time.perf_counter()
            s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize(); t1 = time.perf_counter()
            torch.stack = real_stack
            enq.append(marks[0] - t0); walls.append(t1 - t0)
        enq.sort(); walls.sort()
        print(f"{shape} {variant}: wall {walls[2] * 1e3:.1f} ms, host loop done at {enq[2] * 1e3:.1f} ms "
              f"({enq[2] / 64 * 1e6:.0f} us a step)", flush=True)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            torch.cuda.synchronize(); t0 = time.perf_counter()
            s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize(); wall = time.perf_counter() - t0
        ev = prof.events()
        gpu = sorted((e.time_range.start, e.time_range.end) for e in ev
                     if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, gaps, end = 0.0, [], gpu[0][0]
        cur_s, cur_e = gpu[0]
        for st, en in gpu[1:]:
            if st > cur_e:
                busy += cur_e - cur_s
                if st - cur_e > 5:
                    gaps.append(st - cur_e)
                cur_s, cur_e = st, en
            else:
                cur_e = max(cur_e, en)
        busy += cur_e - cur_s
        span = gpu[-1][1] - gpu[0][0]
        launches = [e.time_range.start for e in ev if e.name == "cudaGraphLaunch"]
        print(f"  profiled: wall {wall * 1e3:.1f} ms, GPU span {span / 1e3:.1f} ms, busy (union) {busy / 1e3:.1f} ms, "
              f"{len(gaps)} gaps > 5 us totalling {sum(gaps) / 1e3:.1f} ms (largest {sorted(gaps)[-5:]}); "
              f"last graph launch {(launches[-1] - gpu[0][0]) / 1e3:.1f} ms after the first kernel; "
              f"{len(launches)} graph launches", flush=True)
        del s
    md.FusedDecode.__call__ = real_call
