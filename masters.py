"""fp32 master weights for the weights a run trains in bf16 or fp16 (full fine-tuning), and their optimizer.

    masters = Masters(trainable_parameters(model))   # the model's trained weights, by name
    optimizer = masters.optimizer(param_groups(masters.named(), ...), lr, use_kernels)
    ...forward and backward: gradients in the model's weights' .grad...
    grad_norm = masters.unscale_and_clip_(scaler, max_norm)
    scaler.step(optimizer, ...)                      # updates the masters and rounds them into the weights
    masters.zero_grad(set_to_none)

Why masters: AdamW's update lr·m/(√v+ε) is often below half a bf16 ulp of the weight (bf16 keeps 8 bits of
mantissa: a weight of 1.0 moves only by steps of 2⁻⁷), so updates applied to bf16 weights round away and
training stalls. The optimizer therefore steps fp32 copies, and the model computes with their rounding.

Two layouts:
- every trained weight fp32 (every LoRA weight and trained embedding, every weight of an fp32 run): each weight
  is its own master, nothing is copied, and torch's fused AdamW steps them.
- trained weights in bf16 or fp16 (--full): the weights, their gradients, the masters and AdamW's two moments are
  each one flat buffer, of which every tensor is a view (the model's weights are re-pointed into theirs, the
  gradients accumulate into theirs; a projection group stored as one tensor stays one, `flat_order`).
  `MasterAdamW` then steps a whole buffer in one pass (kernels/adamw_master.py): it reads the low-precision
  gradient, unscales and clips it with a device factor, updates master and moments, and writes the rounded
  weight. The gradient norm is taken from the low-precision
  gradients, accumulated in fp32. Memory per trained bf16 weight: 2 bytes of weight, 2 of gradient, 4 of
  master, 8 of AdamW moments (`memory.training_bytes`).

The masters are what the optimizer and a checkpoint hold (`named`): a resume restores them, and rounds them into
the model's weights again, so it continues exactly as the uninterrupted run. MasterAdamW's state_dict is
torch.optim.AdamW's, so that a checkpoint loads in either.

The optimizer's parameter groups (`param_groups`) are made of the masters, with their names (`param_names`, which
checkpoints read) and a learning-rate multiplier each (`lr_scale`; the loop sets every group's lr to the schedule's
lr × lr_scale).
"""
import torch

from kernels.references import adamw_master_reference
from model.lora import is_lora_param

BETAS = (0.9, 0.999)


def bias_corrections(step, lr, betas):
    """[lr / c₁, √c₂] (fp32, on the device) for the step count `step` (a 0-dim device tensor): c₁ = 1 − β₁ᵗ,
    c₂ = 1 − β₂ᵗ, computed in fp64 as aten's fused AdamW does (in fp32, 1 − β₂ᵗ keeps few digits for small t)."""
    t = step.double()
    return torch.stack([lr / (1 - betas[0] ** t), (1 - betas[1] ** t).sqrt()]).float()


def flat_order(weights):
    """The order of `weights` in the flat buffers: their own, but for weights that share one storage (a projection
    group that `pack_weights_` stacked, model/lora.py), which go together, in their storage order, at the place of
    the first of them. Their views of the flat weight buffer then lie one after the other as they did in their
    storage, so that the group is still one strided view (`_rows_view`) and one GEMM (model/stacked.py)."""
    shared = {}
    for i, w in enumerate(weights):
        shared.setdefault(w.untyped_storage().data_ptr(), []).append(i)
    return [i for group in shared.values() for i in sorted(group, key=lambda i: weights[i].storage_offset())]


class Masters:
    def __init__(self, named):
        """named: (name, parameter) of the model's trained weights."""
        self.names = [n for n, _ in named]
        self.weights = [p for _, p in named]  # the model's: they get the gradients
        dtypes = {p.dtype for p in self.weights}
        self.flat = dtypes != {torch.float32} and bool(self.weights)
        if not self.flat:
            self.params = self.weights
            return
        if len(dtypes) > 1:
            raise ValueError(f"the trained weights mix dtypes ({sorted(map(str, dtypes))}): fp32 masters need them "
                             "all in one of bf16 or fp16")
        (dtype,), device = dtypes, self.weights[0].device
        self.spans, n = [None] * len(self.weights), 0  # each weight's [start, end) in the flat buffers
        for i in flat_order(self.weights):
            self.spans[i], n = (n, n + self.weights[i].numel()), n + self.weights[i].numel()
        self.weight_buffer = torch.empty(n, dtype=dtype, device=device)
        self.master_buffer = torch.empty(n, dtype=torch.float32, device=device)
        self.grad_buffer = torch.zeros(n, dtype=dtype, device=device)
        self.params = []
        with torch.no_grad():
            for w, view, master, grad in zip(self.weights, self.views(self.weight_buffer),
                                             self.views(self.master_buffer), self.views(self.grad_buffer)):
                view.copy_(w)
                master.copy_(w)
                w.data = view  # the weight now lives in the flat buffer, which the optimizer writes in one pass
                w.grad = grad  # backward accumulates into a .grad that exists, in place
                self.params.append(master)

    def views(self, buffer):
        """Each trained weight's view of a flat buffer, in its shape."""
        return [buffer[a:b].view(w.shape) for w, (a, b) in zip(self.weights, self.spans)]

    def named(self):
        """(name, fp32 tensor) of every trained weight, as the optimizer holds it."""
        return list(zip(self.names, self.params))

    def optimizer(self, groups, lr, use_kernels):
        """AdamW over `groups` (param_groups of `named`): torch's fused one where the weights are their own
        masters, else MasterAdamW over the flat buffers."""
        if not self.flat:
            return torch.optim.AdamW(groups, lr=lr, betas=BETAS, fused=True)  # one kernel for all weights
        return MasterAdamW(groups, self, lr, use_kernels)

    def unscale_and_clip_(self, scaler, max_norm):
        """The gradient norm (a 0-dim fp32 device tensor) after the loss scale's unscaling, clipped to max_norm
        (None or 0: not clipped) as torch.nn.utils.clip_grad_norm_ clips. With flat buffers nothing is written:
        the factor clip_coef / scale goes to the optimizer's pass (`grad_factor`)."""
        max_norm = max_norm or float("inf")
        if not self.flat:
            scaler.unscale_(self.params)
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        norms = torch._foreach_norm(self.views(self.grad_buffer), 2, dtype=torch.float32)  # fp32 sums of squares
        norm = torch.linalg.vector_norm(torch.stack(norms)) / scaler.scale  # a power of two: exact
        self.grad_factor = (max_norm / (norm + 1e-6)).clamp(max=1.0) / scaler.scale
        return norm

    def zero_grad(self, set_to_none=True):
        """Clear the weights' gradients: set to None, or zeroed in place where a CUDA graph adds into fixed .grad
        buffers (step.GraphStep.zero_grad). The flat gradient buffer is always zeroed in place: one memset."""
        if self.flat:
            self.grad_buffer.zero_()
            return
        for w in self.weights:
            if w.grad is not None and set_to_none:
                w.grad = None
            elif w.grad is not None:
                w.grad.zero_()


class MasterAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW over the flat buffers of `Masters`, in one pass per parameter group
    (kernels/adamw_master.py; its pure-torch reference with use_kernels False). The gradients are the weights'
    (low precision) times `masters.grad_factor`; every weight steps every step (a weight without gradient, with
    a zero one, as under CUDA graphs). As the fused torch.optim.AdamW, it reads `found_inf` (a 0-dim device
    tensor set by precision.LossScaler.step) and then changes nothing, the step counts included."""
    reads_found_inf = True

    def __init__(self, groups, masters, lr, use_kernels):
        # torch.optim.AdamW's group keys, so that a checkpoint of either loads in the other.
        defaults = dict(lr=lr, betas=BETAS, eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False, foreach=None,
                        capturable=False, differentiable=False, fused=True, decoupled_weight_decay=True)
        super().__init__(groups, defaults)
        self.masters, self.use_kernels = masters, use_kernels
        self.exp_avg = self.exp_avg_sq = None  # made at the first step or load (`_moments`)
        self.index = {id(m): i for i, m in enumerate(masters.params)}
        self.runs = []  # per group: its step count, and the [start, end) runs of the flat buffers it covers
        for group in self.param_groups:
            step = torch.zeros((), dtype=torch.float32, device=masters.master_buffer.device)
            runs = []
            for a, b in sorted(masters.spans[self.index[id(p)]] for p in group["params"]):
                if runs and runs[-1][1] == a:
                    runs[-1][1] = b
                else:
                    runs.append([a, b])
            self.runs.append((step, runs))

    def _moments(self):
        """The two moments' flat buffers and each weight's state (views of them), made once. As torch's AdamW
        makes its state at the first step, so that the moments (8 bytes a weight) do not add to the peak of the
        first forward and backward, the run's largest when its step is then captured into a CUDA graph."""
        if self.exp_avg is not None:
            return
        m = self.masters
        self.exp_avg = torch.zeros_like(m.master_buffer)
        self.exp_avg_sq = torch.zeros_like(m.master_buffer)
        avgs, avg_sqs = m.views(self.exp_avg), m.views(self.exp_avg_sq)
        for group, (step, _) in zip(self.param_groups, self.runs):
            for p in group["params"]:
                i = self.index[id(p)]
                self.state[p] = {"step": step, "exp_avg": avgs[i], "exp_avg_sq": avg_sqs[i]}

    @torch.no_grad()
    def step(self):
        self._moments()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            found_inf = torch.zeros((), device=self.exp_avg.device)
        update = adamw_master_reference
        if self.use_kernels:
            from kernels.adamw_master import adamw_master_  # imports Triton: only with kernels on
            update = adamw_master_
        m = self.masters
        for group, (step, runs) in zip(self.param_groups, self.runs):
            step.add_(1).sub_(found_inf)  # as torch's fused AdamW: a skipped step does not count
            coefs = bias_corrections(step, group["lr"], group["betas"])
            for a, b in runs:
                update(m.master_buffer[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b], m.grad_buffer[a:b],
                       m.weight_buffer[a:b], m.grad_factor, found_inf, coefs, lr=group["lr"],
                       weight_decay=group["weight_decay"], betas=group["betas"], eps=group["eps"])

    def state_dict(self):
        """torch.optim.AdamW's state_dict, each tensor a copy: the state's tensors are views of the flat buffers,
        and a group's weights share one step count, which a safetensors file cannot hold twice."""
        sd = super().state_dict()
        sd["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Copy a torch.optim.AdamW or MasterAdamW state_dict (a checkpoint's) into the buffers. A group's step
        count is the largest of its weights' (they differ only where a weight once had no gradient)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the optimizer state does not fit these parameter groups")
        self._moments()
        for group, g, (step, _) in zip(self.param_groups, saved, self.runs):
            group.update({k: v for k, v in g.items() if k != "params"})
            group["betas"] = tuple(group["betas"])
            steps = [0.0]
            for p, i in zip(group["params"], g["params"]):
                st = state_dict["state"].get(i)
                if st is None:  # never stepped
                    self.state[p]["exp_avg"].zero_()
                    self.state[p]["exp_avg_sq"].zero_()
                    continue
                self.state[p]["exp_avg"].copy_(st["exp_avg"])
                self.state[p]["exp_avg_sq"].copy_(st["exp_avg_sq"])
                steps.append(float(st["step"]))
            step.fill_(max(steps))


def param_groups(named, weight_decay, lora_plus_ratio=1.0):
    """AdamW's parameter groups of the trained weights `named` ((name, fp32 tensor), `Masters.named`):
    - LoRA+ (Hayes et al. 2024): B and DoRA's magnitudes learn at lr × lora_plus_ratio, A at lr (as PEFT's
      create_loraplus_optimizer; model/variants.py);
    - weight decay on the LoRA weights and on --full's weights, none on embeddings trained beside LoRA: decay would
      pull every embedding row, also the rows a mask keeps from learning (model/embeddings.py), towards zero.
    Each group holds (name, tensor) pairs, so that it carries the names (`param_names`) in its state."""
    beside_lora = any(is_lora_param(n) for n, _ in named)
    groups = {}
    for n, p in named:
        fast = is_lora_param(n) and not n.endswith(".lora_A")
        key = (lora_plus_ratio if fast else 1.0, weight_decay if not beside_lora or is_lora_param(n) else 0.0)
        groups.setdefault(key, []).append((n, p))
    return [{"params": ps, "lr_scale": float(scale), "weight_decay": decay} for (scale, decay), ps in groups.items()]
