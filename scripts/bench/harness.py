"""The measuring harness of the benchmark scripts: build nanotune's LoRA training step, make
batches, time steps (warm-up, then synchronized steps), measure peak memory and GPU kernel time.

    step = nanotune_step(folder, "cuda", ckpt="off")
    batches = repeat(fixed_batch(step.vocab_size, 4, 2048, "cuda"))  # or padded_batches(...): a new shape each step
    result = time_steps(step, batches, warmup=3, steps=10, device="cuda")

`nanotune_step` is the one place that builds nanotune's step for every benchmark, so a new way
to run the step (another training option) is switched on there and reaches them all.

The scripts of scripts/bench/ run from the repository root (`python scripts/bench/bench.py`):
each first puts the root on sys.path, so that `model`, `kernels`, `data` and `scripts.bench`
import as they do for train.py.
"""
import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import data
from model import LoRAConfig, load_model
from model.config import ModelConfig
from model.load import random_model
from model.lora import lora_parameters
from step import EagerStep, GraphStep

REPO = Path(__file__).resolve().parents[2]
LORA_R, LORA_ALPHA, LR = 16, 16, 2e-4  # LoRA and learning rate as train.py's defaults
DTYPE = torch.bfloat16
CKPT_MODES = ("on", "off", "on+offload")  # activation checkpointing; on+offload: layer inputs in pinned CPU memory


# ----------------------------------------------------------------------------- batches

@dataclass
class Batch:
    """One step's input, on the device: what `Transformer.forward` takes, and the padding mask peers need."""
    input_ids: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T): the next token, or -100 where nothing is predicted
    tokens: int  # real (unpadded) tokens
    position_ids: torch.Tensor | None = None  # (B, T); None: 0..T-1 in every row
    doc_ids: torch.Tensor | None = None  # (B, T); None: each row is one causal sequence
    mask: torch.Tensor | None = None  # (B, T): 1 for real tokens, 0 for padding; None: no padding


def fixed_batch(vocab_size, batch, seqlen, device, seed=0) -> Batch:
    """Random token ids [batch, seqlen], every position real; the same ids for every seed-0 caller."""
    ids = torch.randint(0, vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(seed))
    targets = torch.full_like(ids, data.IGNORE_INDEX)
    targets[:, :-1] = ids[:, 1:]
    return Batch(ids.to(device), targets.to(device), tokens=ids.numel())


def padded_batches(vocab_size, row_lengths: Callable[[random.Random], list[int]], device, seed=0) -> Iterator[Batch]:
    """Endless batches of random token ids, a new shape every step: one row per length that
    row_lengths(rng) gives, right-padded to the longest as `train.py --no-packing` pads them
    (data.pad_batch: the padding is a document of its own, without targets). The same seed
    gives the same batches."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    while True:
        lengths = row_lengths(rng)
        rows = [(torch.randint(0, vocab_size, (n,), generator=gen).tolist(), [True] * n) for n in lengths]
        b = data.pad_batch(rows, pad_id=0)
        yield Batch(b["input_ids"].to(device), b["targets"].to(device), tokens=sum(lengths),
                    position_ids=b["position_ids"].to(device), doc_ids=b["doc_ids"].to(device),
                    mask=(b["doc_ids"] == 0).long().to(device))


# ----------------------------------------------------------------------------- the step

class Step:
    """One LoRA training step: loss(batch) and its backward (`loss`: a function that does both and returns
    the loss), AdamW on the trainable weights (fused on CUDA, as the peers' harnesses use), zero the grads
    (in place where a CUDA graph adds into them)."""

    def __init__(self, model, loss: Callable[[Batch], torch.Tensor], params, vocab_size, keep_grads=False):
        self.model, self.loss, self.params, self.vocab_size = model, loss, params, vocab_size
        fused = {"fused": True} if params[0].is_cuda else {}
        self.optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, **fused)
        self.keep_grads = keep_grads
        self.checked = False

    def __call__(self, batch: Batch) -> torch.Tensor:
        loss = self.loss(batch)
        if not self.checked:  # once (a warm-up step): a loss function without its backward times a forward only
            missing = sum(p.grad is None for p in self.params)
            if missing:
                raise RuntimeError(f"the step's loss function left {missing} of {len(self.params)} trainable weights "
                                   "without a gradient: it must run the backward")
            self.checked = True
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        return loss

    def init_optimizer_state(self):
        """Allocate AdamW's moments now (a step of lr 0 on zero gradients), so that a single timed
        step already shows the steady-state peak memory."""
        for p in self.params:
            p.grad = torch.zeros_like(p)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.param_groups[0]["lr"] = 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.param_groups[0]["lr"] = lr


def nanotune_step(source, device, ckpt="off", *, fused_lora=True, use_kernels=None, cuda_graphs="off",
                  quantize=None, dora=False, fp8=False) -> Step:
    """nanotune's step on `source`, the folder of a checkpoint, or a ModelConfig for a model built in memory
    with stand-in weights (model.load.random_model: nothing on disk, so 7-12B shapes cost no files): bf16,
    LoRA r=16 alpha=16 on all 7 projections, activation checkpointing per `ckpt` (one of CKPT_MODES), the
    Triton kernels on CUDA unless use_kernels says otherwise, fused_lora=False for LoRA in plain autograd,
    cuda_graphs="on" for the micro-step replayed from a CUDA graph per batch shape (step.py, as train.py's
    --cuda-graphs), quantize="nf4" for QLoRA, dora=True for DoRA adapters (train.py's --dora), fp8=True for the
    base GEMMs in fp8 (train.py's --fp8)."""
    device = torch.device(device)
    if ckpt not in CKPT_MODES:
        raise ValueError(f"ckpt={ckpt!r}; expected one of {CKPT_MODES}")
    options = dict(dtype=DTYPE, device=device, lora=LoRAConfig(r=LORA_R, alpha=LORA_ALPHA, dora=dora),
                   quantize=quantize, use_kernels=device.type == "cuda" if use_kernels is None else use_kernels,
                   fused_lora=fused_lora, gradient_checkpointing=ckpt != "off",
                   offload_activations=ckpt == "on+offload", fp8=fp8)
    if isinstance(source, ModelConfig):
        model, cfg = random_model(source, **options), source
    else:
        model, cfg = load_model(str(source), **options)
    model.train()
    if cuda_graphs not in ("on", "off"):
        raise ValueError(f"cuda_graphs={cuda_graphs!r}; expected on or off")
    params = [p for _, p in lora_parameters(model)]
    graphed = cuda_graphs == "on"
    micro = GraphStep(model, device, params, max_len=1 << 20) if graphed else EagerStep(model, device)

    def loss(b: Batch):
        batch = {"input_ids": b.input_ids, "targets": b.targets, "position_ids": b.position_ids, "doc_ids": b.doc_ids}
        return micro(batch, (b.targets != data.IGNORE_INDEX).sum(), 1.0)

    return Step(model, loss, params, cfg.vocab_size, keep_grads=graphed)


# ----------------------------------------------------------------------------- measuring

def gpu_folders(doc, script):
    """The checkpoint folders named on the command line of a GPU-only bench script (its --help is `doc`);
    without a CUDA GPU, the script exits with one error line."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+")
    folders = p.parse_args().folders
    if not torch.cuda.is_available():
        sys.exit(f"error: {script} needs a CUDA GPU")
    return folders


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, batches: Iterator[Batch], *, warmup, steps, device) -> dict:
    """Run warmup + steps steps on next(batches), timing each of the last `steps` between two
    synchronizes (the batch is on the device before the clock starts).

    Returns step_times_s and step_tokens (the real, unpadded tokens) of the timed steps,
    median_step_s, tokens_per_s, loss_first and loss_final (of all steps), and on CUDA
    peak_mem_bytes / peak_reserved_bytes: the allocator's maxima over every step, reset before
    the first. tokens_per_s is tokens / median step time when every timed step has the same
    tokens, else their sum / the summed step times."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times, tokens = [], [], []
    for i in range(warmup + steps):
        batch = next(batches)
        synchronize(device)
        t0 = time.perf_counter()
        loss = step(batch)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(batch.tokens)
        losses.append(loss.item())
    median = statistics.median(times)
    tokens_per_s = tokens[0] / median if len(set(tokens)) == 1 else sum(tokens) / sum(times)
    res = {"step_times_s": times, "step_tokens": tokens, "median_step_s": median, "tokens_per_s": tokens_per_s,
           "loss_first": losses[0], "loss_final": losses[-1]}
    if cuda:
        res.update(peak_mem_bytes=torch.cuda.max_memory_allocated(),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved())
    return res


def median_ms(fn, device, *, grad_to_none=(), warmup_ms=25, rep_ms=100, cpu_reps=5) -> float:
    """Median time of fn() in ms: triton.testing.do_bench on CUDA (warm-up and measuring times in
    ms); on CPU one warm-up call, then the wall-clock median of cpu_reps calls. The .grad of
    every tensor in grad_to_none is cleared before each call."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none), return_mode="median")
    fn()
    times = []
    for _ in range(cpu_reps):
        for t in grad_to_none:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_bytes_above(fn, device) -> int | None:
    """The most memory allocated during one call of fn() above what was allocated before it (the
    activations it keeps plus its temporaries); None off CUDA, where fn is not called."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def cuda_kernel_ms(fn) -> float:
    """The summed time of the CUDA kernels of one call of fn(), in ms (torch.profiler). Well below
    the call's wall time, the call is bound by the CPU that launches its kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
