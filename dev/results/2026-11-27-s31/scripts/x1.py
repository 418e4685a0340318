"""Session 31: where a Qwen2.5-0.5B GroupSampler call's time goes (2 prompts x 8, 64 tokens, T 1.0): the whole call
timed (median of 9), then one call under torch.profiler with its phases marked (record_function around the merge,
the host's prompt tensors, the prefill, each decoding step, each draw), the trace written to $OUT/SHAPE.json.gz."""
import argparse, gzip, os, shutil, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import record_function
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
import importlib
gen = importlib.import_module("model.generate")
from model.lora import MergedAdapters
from config import with_hardware_defaults
from rlconfig import RLConfig

def marked(cls, name, label):
    f = getattr(cls, name)
    def g(*a, **k):
        with record_function(label):
            return f(*a, **k)
    setattr(cls, name, g)

p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="qwen2.5-0.5b"); p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
a = p.parse_args()
dev = torch.device("cuda")
for shape in a.shapes.split(","):
    folder = model_folder(argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir))
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    s = gen.GroupSampler(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0,
                         cuda_graph=True)
    g = torch.Generator(dev).manual_seed(0)
    for _ in range(3):
        s(prompts, 8, 1.0, generator=g)
    whole = []
    for _ in range(9):
        torch.cuda.synchronize(); t0 = time.perf_counter(); s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
        whole.append(time.perf_counter() - t0)
    print(f"{shape}: call {statistics.median(whole) * 1e3:.2f} ms (min {min(whole) * 1e3:.2f}); prompt lengths "
          f"{[len(q) for q in prompts]}", flush=True)
    marked(MergedAdapters, "__enter__", "merge_enter")
    marked(MergedAdapters, "__exit__", "merge_exit")
    marked(gen.Prefill, "__call__", "prefill")
    marked(gen.DecodeGraph, "__call__", "decode")
    draw = gen.sample_tokens
    def marked_draw(*x, **k):
        with record_function("draw"):
            return draw(*x, **k)
    gen.sample_tokens = marked_draw
    for i in range(2):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            with record_function("call"):
                s(prompts, 8, 1.0, generator=g)
            torch.cuda.synchronize()
    path = f"/tmp/{shape}.json"
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(os.path.join(a.out, f"{shape}.json.gz"), "wb") as o:
        shutil.copyfileobj(f, o)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
