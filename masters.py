"""fp32 master weights for the weights a run trains in bf16 or fp16 (full fine-tuning).

    masters = Masters(trainable_parameters(model))   # the model's trained weights, by name
    optimizer = torch.optim.AdamW(masters.params, fused=True)
    ...forward and backward: gradients in the model's weights' .grad...
    masters.take_grads()                             # upcast into the masters' .grad
    scaler.unscale_(masters.params); clip; scaler.step(optimizer, ...)
    masters.copy_back()                              # the updated masters, rounded into the model's weights
    masters.zero_grad(set_to_none)                   # both sets of gradients

Why masters: AdamW's update lr·m/(√v+ε) is often below half a bf16 ulp of the weight (bf16 keeps 8 bits of
mantissa: a weight of 1.0 moves only by steps of 2⁻⁷), so updates applied to bf16 weights round away and
training stalls. The optimizer therefore steps fp32 copies, and the model computes with their rounding. An
fp32 weight (every LoRA weight, and every weight of an fp32 run) is its own master: nothing is copied, and
take_grads and copy_back do nothing for it. Memory per trained bf16 weight: 2 bytes of weight, 2 of gradient,
4 of master, 4 of its gradient, 8 of AdamW moments (`memory.training_bytes`).

The masters are what the optimizer and a checkpoint hold (`named`): a resume restores them, and rounds them into
the model's weights again, so it continues exactly as the uninterrupted run.

The optimizer's parameter groups (`param_groups`) are made of the masters, with their names (`param_names`, which
checkpoints read) and a learning-rate multiplier each (`lr_scale`; the loop sets every group's lr to the schedule's
lr × lr_scale).
"""
import torch

from model.lora import is_lora_param


class Masters:
    def __init__(self, named):
        """named: (name, parameter) of the model's trained weights."""
        self.names = [n for n, _ in named]
        self.weights = [p for _, p in named]  # the model's: they get the gradients
        self.params = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in self.weights]
        self._low = [(w, m) for w, m in zip(self.weights, self.params) if w is not m]  # the pairs that differ

    def named(self):
        """(name, fp32 tensor) of every trained weight, as the optimizer holds it."""
        return list(zip(self.names, self.params))

    def take_grads(self):
        """Each master's .grad = its weight's gradient in fp32 (None where the weight got none)."""
        for w, m in self._low:
            m.grad = None if w.grad is None else w.grad.float()

    @torch.no_grad()
    def copy_back(self):
        """The model's weights = their masters, rounded to the model's dtype. After a skipped step (NaN/inf) the
        masters are unchanged, so this copies the weights' own values."""
        if self._low:
            torch._foreach_copy_([w for w, _ in self._low], [m for _, m in self._low])

    @torch.no_grad()
    def load(self, tensors):
        """Copy {name: tensor} (a checkpoint's) into the masters and, rounded, into the model's weights."""
        for name, w, m in zip(self.names, self.weights, self.params):
            m.copy_(tensors[name])
            if w is not m:
                w.copy_(m)

    def zero_grad(self, set_to_none=True):
        """Clear the weights' gradients: set to None, or zeroed in place where a CUDA graph adds into fixed .grad
        buffers (step.GraphStep.zero_grad). The masters' fp32 gradients go: take_grads makes them anew."""
        for w in self.weights:
            if w.grad is not None and set_to_none:
                w.grad = None
            elif w.grad is not None:
                w.grad.zero_()
        for _, m in self._low:
            m.grad = None


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
