"""Where a GroupSampler call's time goes (2 prompts x 8, 64 tokens, T 1.0): the call's body copied with a sync and a
clock read between its phases (the merge, the prefill, the 63 decoding steps, the host's lists), median of 9 after 3
warm-ups, per shape; and the whole call unchanged for comparison."""
import argparse, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
from scripts.bench.bench_grpo import make_prompts, model_folder
from model import load_model, load_tokenizer
from model.generate import GroupSampler, Prefill, sample_tokens
from config import with_hardware_defaults
from rlconfig import RLConfig


class Timed(GroupSampler):
    @torch.no_grad()
    def phases(self, prompts, G, temperature, generator):
        M, P = self.max_prompt_len, len(prompts)
        n = P * G
        if P not in self.prefills:
            self.prefills[P] = Prefill(self.model, self.cache, P, M, self.graphed)
        sync = torch.cuda.synchronize
        sync(); marks = [time.perf_counter()]
        with self.merged:
            sync(); marks.append(time.perf_counter())
            ids = torch.full((P, M), self.pad_id, dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, M - len(p):] = torch.tensor(p, dtype=torch.long)
            lengths = torch.tensor([len(p) for p in prompts], device=self.device)
            prompt_of = torch.arange(self.rows, device=self.device).clamp(max=n - 1) // G
            logits = self.prefills[P](ids, lengths, prompt_of)
            positions = lengths[prompt_of]
            self.first.copy_(M - positions)
            stops = torch.tensor([], dtype=torch.long, device=self.device)
            done = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
            tokens, logps = [], []
            token, logp = sample_tokens(logits, temperature, 1.0, 0, generator, self.model.ops.sample_tokens)
            tokens.append(token); logps.append(logp)
            sync(); marks.append(time.perf_counter())
            for t in range(1, self.max_new_tokens):
                if t % self.SYNC_EVERY == 0 and bool(done.all()):
                    break
                logits = self.decode(tokens[-1], M + t - 1, positions + t - 1)
                token, logp = sample_tokens(logits, temperature, 1.0, 0, generator, self.model.ops.sample_tokens)
                tokens.append(torch.where(done, self.pad_id, token)); logps.append(logp)
                done = done | torch.isin(token, stops)
            sync(); marks.append(time.perf_counter())
        tokens, logps = torch.stack(tokens, 1)[:n].tolist(), torch.stack(logps, 1)[:n].tolist()
        marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])]


p = argparse.ArgumentParser()
p.add_argument("--tokenizer"); p.add_argument("--cache-dir", default="/tmp/bc")
p.add_argument("--shapes", default="qwen2.5-0.5b,smollm2-135m")
a = p.parse_args()
dev = torch.device("cuda")
for shape in a.shapes.split(","):
    folder = model_folder(argparse.Namespace(model=None, shape=shape, smoke=False, cache_dir=a.cache_dir))
    cfg, _ = with_hardware_defaults(RLConfig(model=folder, batch_size=2, num_generations=8, max_new_tokens=64,
                                             beta=None, loss_type="dapo", num_iterations=1), "cuda")
    model, _ = load_model(folder, dtype=torch.bfloat16, device=dev, lora=cfg.lora(), use_kernels=True)
    prompts = [q.ids for q in make_prompts(load_tokenizer(a.tokenizer), 2)]
    s = Timed(model, rows=16, max_prompt_len=max(map(len, prompts)), max_new_tokens=64, pad_id=0, cuda_graph=True)
    g = torch.Generator(dev).manual_seed(0)
    for _ in range(3):
        s(prompts, 8, 1.0, generator=g)
    whole = []
    for _ in range(9):
        torch.cuda.synchronize(); t0 = time.perf_counter(); s(prompts, 8, 1.0, generator=g); torch.cuda.synchronize()
        whole.append(time.perf_counter() - t0)
    ph = [s.phases(prompts, 8, 1.0, g) for _ in range(12)][3:]
    med = [statistics.median(x[i] for x in ph) * 1e3 for i in range(4)]
    print(f"{shape}: call {statistics.median(whole) * 1e3:.1f} ms; phased: merge {med[0]:.2f}, prefill + first token "
          f"{med[1]:.2f}, 63 steps {med[2]:.2f} ({med[2] / 63 * 1e3:.0f} us a step), lists {med[3]:.2f} ms; "
          f"prompt lengths {[len(q) for q in prompts]}", flush=True)
