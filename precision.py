"""fp16 dynamic loss scaling, and the one decision of every step: apply the optimizer's update, or skip it
because the loss or the gradient is NaN/inf.

    scaler = LossScaler(scale, growth_interval, enabled=dtype == torch.float16)
    loss = step(batch, ..., loss_mult=scaler.scale)      # gradients of loss * scale
    scaler.unscale_(params)                              # gradients / scale, before clipping
    applied = scaler.step(optimizer, loss_sum, grad_norm)

In fp16 small gradients underflow to 0, so the loss is multiplied by `scale` before the backward and the
gradients divided by it after: the fp32 update is the same, the fp16 gradients keep their small values.
A step whose loss or gradient norm is NaN/inf is skipped and halves the scale; `growth_interval` applied
steps in a row double it. In bf16 and fp32 the scale stays 1, and a NaN/inf step stops the run
(`nonfinite_step`).
"""
import torch

from config import UserError


class LossScaler:
    def __init__(self, scale, growth_interval, enabled):
        self.enabled, self.growth_interval = enabled, growth_interval
        self.scale = scale if enabled else 1.0
        self.good_steps, self.skipped_in_row = 0, 0

    def unscale_(self, params):
        """Divide the gradients by the scale, so that clipping sees the true gradient norm."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.scale != 1.0 and grads:
            torch._foreach_div_(grads, self.scale)

    def step(self, optimizer, loss, grad_norm):
        """optimizer.step() where `loss` and `grad_norm` (0-dim device tensors) are finite, else nothing; then
        the scale's update. Returns whether the update was applied.

        Fused Adam and AdamW (and masters.MasterAdamW) read `found_inf` on the device and leave the weights and
        their state as they were where it is 1, so for them the update is queued before the host reads the two
        numbers: the CPU issues it while the GPU still runs the backward. Any other optimizer steps only after the
        host has seen them."""
        finite = loss.isfinite() & grad_norm.isfinite()
        if getattr(optimizer, "reads_found_inf", False) or (  # masters.MasterAdamW, or torch's fused Adam(W)
                optimizer.defaults.get("fused") and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))):
            optimizer.found_inf = (~finite).float()
            optimizer.step()
            applied = bool(finite)
        else:
            applied = bool(finite)
            if applied:
                optimizer.step()
        self._update(applied)
        return applied

    def _update(self, applied):
        if not self.enabled:
            return
        if applied:
            self.good_steps, self.skipped_in_row = self.good_steps + 1, 0
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2
        else:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps, self.skipped_in_row = 0, self.skipped_in_row + 1

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_in_row": self.skipped_in_row}

    def load_state_dict(self, state):
        if self.enabled:  # a checkpoint of an fp16 run, resumed in bf16/fp32, keeps the scale at 1
            self.scale = state["scale"]
        self.good_steps, self.skipped_in_row = state["good_steps"], state["skipped_in_row"]


def updates_applied(optimizer):
    """How many updates the optimizer has applied (a skipped step does not count); 0 before the first."""
    return max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)


def nonfinite_step(scaler, optimizer, loss, norm, step, max_skipped, next_steps):
    """After a skipped step (NaN/inf loss or gradient): in fp16, the line that says the scale backed off,
    unless too many steps in a row were skipped; then, and in bf16 and fp32 at once, UserError stops the run.
    `next_steps(fix)` says how to go on from the last checkpoint."""
    if not scaler.enabled:
        # Without any update yet the adapter is as initialized, so the learning rate cannot be the cause.
        cause = ("This is before any update of the adapter, so the learning rate is not the cause: the input "
                 "holds a NaN/inf. Check the base model's weights, the data and the options (e.g. --lora-alpha), "
                 "then start again" if not updates_applied(optimizer)
                 else next_steps("lower --lr (or check the data)"))
        raise UserError(f"the loss or gradient is NaN/inf at step {step} (loss {loss:g}, grad norm {norm:g}). "
                          f"{cause}")
    if scaler.skipped_in_row > max_skipped:
        fix = "lower --lr, or use --dtype bf16 where the GPU has it (or fp32),"
        raise UserError(f"{scaler.skipped_in_row} fp16 steps in a row had inf/NaN gradients (up to step {step}; "
                          f"loss scale now {scaler.scale:g}), more than --max-skipped-steps {max_skipped}. "
                          f"{next_steps(fix)}")
    return f"step {step}: inf/NaN gradients in fp16, skipped; loss scale -> {scaler.scale:g}"
