"""One training micro-step: forward and backward of one micro-batch, eager or replayed from a CUDA graph.

    step = EagerStep(model, device, loss_fn)  or  GraphStep(model, device, params, max_len, log, loss_fn=loss_fn)
    loss = step(batch, num_targets, loss_mult)   # adds d(loss * loss_mult)/dp into every p.grad
    step.zero_grad(optimizer)                    # after the optimizer step

`loss` is loss_fn(model, batch, num_targets), a 0-dim fp32 device tensor: train.py's is Σ token losses of
the micro-batch / num_targets, the target count of the whole optimizer step (a 0-dim fp32 device tensor here).
The gradients are those of loss * loss_mult (loss_mult: the fp16 loss scale times the world size).
Without a loss_fn the step takes the model's own: model(..., targets=..., num_targets=...), the same mean.

Why a graph: a step of a small model, or of a short batch, is bound by the CPU time it takes
Python and PyTorch to issue its ~1-3k kernels, not by the GPU. A CUDA graph records those
kernels once and replays them with one call (PyTorch's "whole-network capture"). The graph
reads fixed addresses, so everything that changes between steps lives in static device
buffers that are refilled before each replay: the batch tensors, the target-token count
(the loss denominator) and the loss multiplier. Nothing step-dependent is a Python number
inside the graph. Gradients accumulate into the trained weights' `.grad` tensors, which
therefore exist before the capture and are zeroed in place between optimizer steps
(`optimizer.zero_grad(set_to_none=False)`). The graph takes the gradients with
`torch.autograd.grad` and adds them into `.grad` with one multi-tensor add, where `backward()`
would launch one add per weight (420 for a 30-layer model with 7 adapters per layer); with
gradient checkpointing it calls `backward()` (see `_step`).
Dropout inside the graph draws fresh random numbers at every replay: PyTorch's CUDA generator
advances its offset per replay by what the captured kernels draw, exactly as the eager step advances
it. The capture's warm-up gives back what it drew (the generator state is restored after it), so a
replayed step draws the masks that the eager step would draw from the same state, and a run resumed
from a checkpoint, which captures anew, continues with the uninterrupted run's masks.

Shapes: a graph holds one batch shape. Packed rows always have [B, max_len]; a padded batch
is padded further to its length bucket (a multiple of BUCKET tokens, at most max_len; in a short
run at least SHORTEST: see `shortest_bucket`); the shapes of the batch's other tensors, which a loss_fn
reads (a preference batch's pair slots, preference.py), are part of the graph's key too. The extra
padding is one more stretch of the row's padding document: no target, no attention from
real tokens, so the loss and gradients are those of the unpadded batch (to rounding).
The documents of a batch (model.transformer.documents: where each starts, for flash attention's
variable-length kernels) are bucketed too: their count is padded with empty documents to a power
of two and their longest length rounded up to one, both part of the graph's key. A run thus
captures a few graphs, lazily, all in one memory pool.

What PyTorch initialises lazily (cuBLAS and cuDNN handles, the autograd engine's threads) must not
start inside a capture: a step must have run in the process before the first capture. Where none has,
the run's first step is issued eagerly, on a side stream, as a real step, and its shape is captured
at its next use. Later captures, of other shapes, go without: inside them the kernels for the new
shapes load, as the GPU tests of a bucket change check; the activation offload's pinned buffers for the
new shape are made just before (`reserve_offload`).

What a process does once, at its first step (Triton's start, each CUDA kernel's first load), runs
earlier, beside the model's loading: `WarmStart` steps a one-layer copy of the model in a thread.
After it, the first step is captured and replayed at once (`GraphStep(..., warmed=True)`). Where
that capture fails (something still starts inside it), a warm-up on a side stream runs the step
eagerly, its gradients are removed again, and the step is captured once more.
"""
import copy
import dataclasses
import sys
import threading

import torch

import data
from memory import warm_start_fits
from model.capture import capture, warm_up
from model.load import random_model
from model.transformer import Documents, documents
from model.weights import trainable_parameters

BUCKET = 64  # padded batches are padded to a multiple of this many tokens (one graph per multiple)
SHORTEST = 2 * BUCKET  # ... and to at least this many in a run of at most SHORT_RUN micro-steps
SHORT_RUN = 100  # (see shortest_bucket)


class EagerStep:
    """The reference: forward and backward issued from Python every time. `batch` may be on the CPU;
    its position_ids and doc_ids may be None (one causal sequence per row). It may hold "docs", the
    Documents of its doc_ids (GraphStep's buffers); otherwise the model computes them where it needs them."""

    def __init__(self, forward, device, loss_fn=None):
        self.forward, self.device, self.loss_fn = forward, device, loss_fn or model_loss

    def __call__(self, batch, num_targets, loss_mult):
        loss = self.loss(batch, torch.as_tensor(num_targets, dtype=torch.float32, device=self.device))
        (loss * loss_mult).backward()
        return loss.detach()

    def loss(self, batch, num_targets):
        """The micro-batch's loss (forward only); num_targets: a 0-dim fp32 tensor on the device."""
        batch = {k: None if v is None else v.to(self.device) if k == "docs" else v.to(self.device, non_blocking=True)
                 for k, v in batch.items()}
        loss = self.loss_fn(self.forward, batch, num_targets)
        assert loss.dtype == torch.float32 and loss.dim() == 0, f"loss must be a float32 scalar, got {loss.dtype}"
        return loss

    def zero_grad(self, optimizer):
        optimizer.zero_grad(set_to_none=True)


def model_loss(model, batch, num_targets):
    """The model's own loss: Σ token losses / num_targets (what train.py's loss_fn spells out)."""
    return model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], targets=batch["targets"],
                 num_targets=num_targets, docs=batch.get("docs"))


class _Graph:
    """One captured micro-step for one batch shape, with its static input and output buffers."""

    def __init__(self, batch, dev):
        self.batch = {k: None if v is None else torch.empty_like(v, device=dev)
                      for k, v in batch.items() if k != "docs"}
        docs = batch["docs"]  # its max_len is a number inside the graph: part of the graph's key
        self.batch["docs"] = None if docs is None else Documents(torch.empty_like(docs.cu_seqlens, device=dev),
                                                                 docs.max_len)
        self.num_targets = torch.zeros((), dtype=torch.float32, device=dev)
        self.loss_mult = torch.ones((), dtype=torch.float32, device=dev)
        self.graph = torch.cuda.CUDAGraph()
        self.loss = None  # the static output, written by every replay

    def load(self, batch, num_targets, loss_mult):
        for k, v in batch.items():
            if k == "docs" and v is not None:
                self.batch[k].cu_seqlens.copy_(v.cu_seqlens, non_blocking=True)
            elif v is not None:
                self.batch[k].copy_(v, non_blocking=True)
        self.num_targets.fill_(num_targets)
        self.loss_mult.fill_(loss_mult)


class GraphStep:
    """The micro-step replayed from a CUDA graph per batch shape (captured on first use)."""

    def __init__(self, forward, device, params, max_len, log=print, warmed=False, shortest=SHORTEST, loss_fn=None):
        self.eager = EagerStep(forward, device, loss_fn)
        self.device = device
        self.params = list(params)
        self.max_len = max_len
        self.shortest = shortest  # the shortest length bucket (`shortest_bucket`)
        self.warmed = warmed  # a training step has run in this process (a WarmStart's): see _record_first
        self.log = log  # says once why the run goes on eagerly, if a capture fails
        self.graphs = {}  # (each tensor's name and shape[, documents + 1, their max_len]) -> _Graph
        self.pool = None  # one memory pool for every graph: they never run at the same time
        self.failed = False

    def __call__(self, batch, num_targets, loss_mult):
        if self.failed:
            return self.eager(batch, num_targets, loss_mult)
        batch = pad_to_bucket(batch, self.max_len, self.shortest)
        docs = None if batch["doc_ids"] is None else documents(batch["doc_ids"], bucket=True)
        batch = {**batch, "docs": docs}
        shape = (*((k, *v.shape) for k, v in batch.items() if k != "docs" and v is not None),
                 *(() if docs is None else (len(docs.cu_seqlens), docs.max_len)))
        g = self.graphs.get(shape)
        if g is None and not self.warmed:
            return self._first_step(batch, num_targets, loss_mult)
        if g is None:
            try:
                g = self.graphs[shape] = self._capture(batch, num_targets, loss_mult)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # an op that cannot be captured: the same step, issued eagerly from now on
                self.failed = True
                self.log(f"warning: CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}); training on "
                         "without graphs (same results, more CPU time per step). --cuda-graphs off skips the try")
                return self.eager(batch, num_targets, loss_mult)
        g.load(batch, num_targets, loss_mult)
        g.graph.replay()
        return g.loss

    def zero_grad(self, optimizer):
        """The graphs add into fixed .grad buffers: zeroed in place, never freed."""
        optimizer.zero_grad(set_to_none=False)

    def _first_step(self, batch, num_targets, loss_mult):
        """The process's first step, where no WarmStart has run: issued eagerly on a side stream (`warm_up`), as a
        real step whose gradients and dropout draws are kept. It starts what PyTorch initialises lazily, which must
        not start inside a capture, at the cost of one step, where a warm-up thrown away and then a replay would
        cost two: the first step of a long-context run, seconds to minutes, takes as long as the others. The
        shape's graph is captured at its next use."""
        self.warmed = True
        return warm_up(lambda: self.eager(batch, num_targets, loss_mult))

    def _capture(self, batch, num_targets, loss_mult):
        reserve = getattr(self.eager.forward, "reserve_offload", None)
        if reserve is not None:  # host memory is page-locked at its own size only outside a capture
            reserve(*batch["input_ids"].shape)
        g = _Graph(batch, self.device)
        g.load(batch, num_targets, loss_mult)
        for p in self.params:  # accumulate into fixed buffers: .grad must exist before the capture
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.pool is None:  # the run's first capture
            if not self._record_first(g):  # a step has run in this process (see __call__)
                self._warm_up_and_record(g)
            return g
        try:
            self._record(g)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            # Something this shape starts lazily started inside the capture (a kernel's first launch at new sizes,
            # a library's handle on a new stream). The failed capture ran nothing and released its pool: the step
            # is warmed up as before a run's first capture and captured once more. A second failure goes to the
            # caller, which goes on eagerly.
            self.log(f"note: CUDA graph capture of a new batch shape failed ({type(e).__name__}: {str(e)[:120]}); "
                     "warmed up and captured again")
            self._warm_up_and_record(g)
        return g

    def _record(self, g):
        g.loss = capture(g.graph, lambda: self._step(g), self.pool)

    def _warm_up_and_record(self, g):
        """g's step warmed up (`_warm_up`), then captured into a new graph and a new pool: after a failed capture,
        which left its graph unusable and released its pool."""
        g.graph = torch.cuda.CUDAGraph()
        self._warm_up(g)
        self.pool = torch.cuda.graph_pool_handle()
        self._record(g)

    def _record_first(self, g):
        """The first capture without the warm-up, after a WarmStart's step or the run's first (eager) step: that
        step has started the autograd engine's backward thread and made its handles, and this thread's cuBLAS
        handle is made here. Whether it worked:
        where something else still starts inside the capture, the capture fails, and the caller warms up and
        captures again (the failed capture ran nothing: the gradients and the generator's state are as they were)."""
        with torch.cuda.device(self.device):
            torch.cuda.current_blas_handle()
        self.pool = torch.cuda.graph_pool_handle()
        try:
            self._record(g)
            return True
        except torch.OutOfMemoryError:
            raise
        except Exception:
            self.pool = None  # the failed capture released it
            return False

    def _warm_up(self, g):
        """g's step run once eagerly on a side stream, before the run's first capture: what PyTorch initialises
        lazily (cuBLAS and cuDNN handles, the autograd engine's threads) must not start inside a capture. That
        is done once per process, so later captures go without. The warm-up's gradients and dropout draws are not
        a step's: both are put back, and the replay draws the masks again from where the generator stood."""
        saved = [p.grad.clone() for p in self.params]
        rng = torch.cuda.get_rng_state(self.device)
        # A loss_fn's own state (a preference loss's metric sums) is not a step's either: the warm-up's loss
        # adds into a copy's.
        eager = EagerStep(self.eager.forward, self.device, copy.copy(self.eager.loss_fn))
        try:
            warm_up(lambda: self._step(g, eager))
        finally:
            torch.cuda.set_rng_state(rng, self.device)
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.grad.copy_(s)

    def _step(self, g, eager=None):
        """What the graph holds: the loss of g's batch, and its gradients added into every p.grad at once.
        With gradient checkpointing, backward() instead: the reentrant checkpoints compute their layers'
        gradients in a backward of their own, which adds into .grad and is hidden from autograd.grad.
        eager: the EagerStep whose loss it takes (default: the step's own)."""
        loss = (eager or self.eager).loss(g.batch, g.num_targets)
        if getattr(self.eager.forward, "gradient_checkpointing", False):
            (loss * g.loss_mult).backward()
            return loss.detach()
        grads = torch.autograd.grad(loss * g.loss_mult, self.params, allow_unused=True)
        used = [(p.grad, d) for p, d in zip(self.params, grads) if d is not None]
        torch._foreach_add_([acc for acc, _ in used], [d for _, d in used])
        return loss.detach()


def graphs_off_reason(mode, device, world):
    """Why this run issues its steps eagerly, or None when it replays CUDA graphs (see --cuda-graphs).
    Raises ValueError when --cuda-graphs on asks for a combination that cannot be captured."""
    reason = (("there is no CUDA GPU" if device.type != "cuda" else None)
              or ("of data parallelism (DDP's all-reduce hooks)" if world > 1 else None))
    if mode == "on" and reason:
        raise ValueError(f"--cuda-graphs on: not possible because {reason}; use --cuda-graphs auto or off")
    if mode == "off":
        return "--cuda-graphs off"
    return reason


def shortest_bucket(micro_steps):
    """The shortest length bucket of a run of `micro_steps` micro-steps: SHORTEST for a short run, BUCKET for a
    longer one. A capture costs as much time as many replays: a short run saves the capture of a graph for
    batches of at most SHORTEST - BUCKET tokens by padding them to SHORTEST, which a long run would pay for at
    every such step (dev/benchmarks-history.md, section 21). The choice depends on the run's length alone, so a
    resumed run pads every batch as the uninterrupted run did: the same shapes, the same kernels, the same results."""
    return SHORTEST if micro_steps <= SHORT_RUN else BUCKET


def pad_to_bucket(batch, max_len, shortest=SHORTEST):
    """`batch` with T raised to the next multiple of BUCKET, at least `shortest` (at most max_len): the new columns
    continue each row's last document, which is padding whenever the row is shorter than T
    (a padded batch's rows end in a padding document of their own; see data.py). Other tensors of the batch,
    which a loss_fn reads, stay as they are, but for those of shape (B, T), which get 0 in the new columns (a
    preference batch's seq_ids: its padding reads 0, and has no target)."""
    B, T = batch["input_ids"].shape
    T_new = min(max(-(-T // BUCKET) * BUCKET, shortest), max(max_len, T))
    if T_new == T:
        return batch
    extra = T_new - T
    if batch["doc_ids"] is None:  # one causal sequence per row: one document, which the padding continues
        batch = {**batch, "doc_ids": torch.zeros_like(batch["input_ids"]),
                 "position_ids": torch.arange(T, device=batch["input_ids"].device).expand(B, T)}
    last_pos = batch["position_ids"][:, -1:]
    return {
        **{k: v if v is None or v.shape != (B, T) else torch.cat([v, v.new_zeros(B, extra)], 1)
           for k, v in batch.items()},  # what else the loss reads; (B, T) ones (seq_ids) padded with 0
        "input_ids": torch.cat([batch["input_ids"], batch["input_ids"][:, -1:].expand(B, extra)], 1),
        "targets": torch.cat([batch["targets"], batch["targets"].new_full((B, extra), data.IGNORE_INDEX)], 1),
        "position_ids": torch.cat([batch["position_ids"],
                                   last_pos + torch.arange(1, extra + 1, device=last_pos.device)], 1),
        "doc_ids": torch.cat([batch["doc_ids"], batch["doc_ids"][:, -1:].expand(B, extra)], 1),
    }


class WarmStart:
    """A background thread that pays the first training step's one-time costs while the model loads.

        warm = WarmStart.start(model_cfg, first_batch, device, dtype, lora=..., ...)  # None: not needed here
        ...load the model...
        warm.join()   # before training: no launch of the thread overlaps the loop's

    What is slow once per process: Triton hashes its sources, and compiles or loads each kernel; CUDA loads
    each kernel on its first launch (cuBLAS's for every GEMM shape, every elementwise kernel); the autograd
    engine starts its threads. The thread runs one micro-step (forward, backward) and the gradient clipping of
    a copy of the model with one layer per layer type and random weights (model/load.py, `random_model`), on
    the run's first batch: the same kernels at the same shapes as the run's first step. The copy has no dropout
    and draws from generators of its own, so the run's random state is untouched. It leaves out the optimizer:
    the first optimizer of a process imports torch._dynamo, seconds of Python that the loop's own AdamW
    meanwhile imports (an import runs in one thread; another that needs it waits)."""

    def __init__(self, run, log):
        self.failed = None
        self.log = log
        # Not a daemon: a run that stops during the loading (bad weights, Ctrl-C) lets the step finish before the
        # interpreter exits, rather than tearing down CUDA under it.
        self.thread = threading.Thread(target=self._guard, args=(run,), name="warm-start", daemon=False)
        self.thread.start()

    @classmethod
    def start(cls, mcfg, batch, device, dtype, *, lora, train=None, quantize=None, use_kernels=True, max_len=None,
              shortest=SHORTEST, log=print, loss_fn=None):
        """The running warm start, or None where it does not apply: not CUDA, or memory that is not plentiful
        (`memory.warm_start_fits`). max_len: pad the batch to its CUDA-graph bucket first, as GraphStep does
        (`pad_to_bucket` with `shortest`); None for eager steps. loss_fn: the run's (see EagerStep). lora, train:
        the run's adapters (None with --full) and base weights that train (None without --full)."""
        if device.type != "cuda":
            return None
        types = list(dict.fromkeys(mcfg.layer_types))  # one layer of each type, in order of appearance
        small = dataclasses.replace(mcfg, n_layers=len(types), layer_types=types)
        if max_len is not None:
            batch = pad_to_bucket(batch, max_len, shortest)
        if not warm_start_fits(mcfg, small, batch, dtype, use_kernels, torch.cuda.mem_get_info(device)[0]):
            return None

        def run():
            with torch.cuda.device(device):  # the thread's current device is not the caller's
                model = random_model(small, dtype, device, quantize, train=train, use_kernels=use_kernels,
                                     lora=lora and dataclasses.replace(lora, dropout=0.0))
                model.train()
                params = [p for _, p in trainable_parameters(model)]
                EagerStep(model, device, loss_fn)(batch, max(1, data.num_targets(batch)), 1.0)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                torch.cuda.current_stream().synchronize()

        return cls(run, log)

    def _guard(self, run):
        """run() in the thread. Meanwhile Python switches threads every 0.1 ms instead of every 5: the loading
        holds the GIL for long stretches (imports), and the copy's step, some 500 operations that each take the
        GIL back after the GPU call, would otherwise wait for it at every one."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        try:
            run()
        except Exception as e:  # the run's own first step meets the same problem, and reports it
            self.failed = e
        finally:
            sys.setswitchinterval(interval)

    def join(self):
        """Wait for the thread; returns whether its step ran (GraphStep's `warmed`)."""
        self.thread.join()
        if self.failed is not None:
            self.log(f"note: the warm-up beside the loading stopped ({type(self.failed).__name__}: "
                     f"{str(self.failed)[:200]}); the first step pays its one-time costs")
        return self.failed is None
