"""GPU memory: estimates of what a step needs, the gradient-checkpointing choice, and the warnings.

    on, why = choose_checkpointing(cfg, mcfg, dtype, use_kernels, device, world)
    if warning := memory_warning(cfg, mcfg, dtype, use_kernels, device, on): log(warning)

The estimates are rough on purpose (within tens of percent): they decide defaults and warnings, never
correctness. Where one is wrong, the step runs out of memory and says what to lower (`memory_fixes`).
"""
import torch

from config import UserError
from distributed import any_rank
from model.offload import host_available

# The fused cross-entropy (kernels/fused_linear_cross_entropy.py) keeps at most this much of the logits at once.
LOSS_CHUNK_BYTES = 256 << 20


def logits_bytes(tokens, mcfg, dtype, use_kernels):
    """The memory of a micro-batch's logits in its loss, in bytes: the fused cross-entropy kernel keeps a chunk
    of at most LOSS_CHUNK_BYTES and the fp32 gradient of its input; the torch reference keeps them in the
    compute dtype and in fp32, with their fp32 gradient."""
    if use_kernels:
        return LOSS_CHUNK_BYTES + tokens * mcfg.hidden_size * 4
    return tokens * mcfg.vocab_size * (torch.finfo(dtype).bits // 8 + 8)


def weights(mcfg):
    """The count of base weights of a model of `mcfg` (the embedding and the head counted apart)."""
    h = mcfg.hidden_size
    width = (2 * mcfg.n_heads + 2 * mcfg.n_kv_heads) * mcfg.head_dim
    return 2 * mcfg.vocab_size * h + mcfg.n_layers * (h * width + 3 * h * mcfg.intermediate_size)


def activation_bytes(cfg, mcfg, dtype, use_kernels, checkpointing):
    """A rough estimate of one micro-batch's activation memory on the GPU: the layer inputs kept for backward
    (every layer's with checkpointing, none with offload), one layer's activations with their gradients
    (every layer's without checkpointing), and the logits (`logits_bytes`)."""
    n, size = cfg.batch_size * cfg.max_len, torch.finfo(dtype).bits // 8  # tokens, bytes per activation
    h, q, kv = mcfg.hidden_size, mcfg.n_heads * mcfg.head_dim, mcfg.n_kv_heads * mcfg.head_dim
    layer = n * size * (4 * h + 2 * q + 2 * kv + 3 * mcfg.intermediate_size)  # norms, residuals, q k v o, MLP
    if mcfg.attn_softcap:  # explicit attention: fp32 scores and probabilities, (B, heads, T, T) each
        layer += 2 * 4 * cfg.batch_size * mcfg.n_heads * cfg.max_len ** 2
    if checkpointing:
        kept = 0 if cfg.offload_activations else mcfg.n_layers * n * h * size
        total = kept + 2 * layer
    else:
        total = (mcfg.n_layers + 1) * layer
    return total + logits_bytes(n, mcfg, dtype, use_kernels)


def choose_checkpointing(cfg, mcfg, dtype, use_kernels, device, world):
    """(on, reason) for gradient checkpointing. Left unset, it is off on a CUDA GPU where the activations of
    every layer (`activation_bytes` without checkpointing) fit in half of the memory free after loading the
    model: the other half stays for the estimate's error, the CUDA graphs' pool and the allocator's slack.
    Off saves recomputing each layer's forward in backward. Every rank takes the same choice."""
    if cfg.gradient_checkpointing is not None:
        return cfg.gradient_checkpointing, "as requested"
    if device.type != "cuda":
        return True, "the default without a CUDA GPU, where free memory is not measured"
    need = activation_bytes(cfg, mcfg, dtype, use_kernels, checkpointing=False)
    free = torch.cuda.mem_get_info(device)[0]
    if any_rank(need > free / 2, world, device):
        return True, (f"without it the activations (about {need / 2**30:.1f} GiB) would take more than half of the "
                      f"{free / 2**30:.1f} GiB of free GPU memory")
    return False, (f"the activations of every layer (about {need / 2**30:.1f} GiB) fit in half of the "
                   f"{free / 2**30:.1f} GiB of free GPU memory; --gradient-checkpointing uses less memory, more time")


def memory_warning(cfg, mcfg, dtype, use_kernels, device, checkpointing):
    """A warning line when a micro-batch's activations (estimated) exceed the free GPU memory, or the layer inputs
    that activation offload keeps exceed the host's available memory; else None."""
    if device.type != "cuda":
        return None
    need = activation_bytes(cfg, mcfg, dtype, use_kernels, checkpointing)
    free = torch.cuda.mem_get_info(device)[0]
    if need > free:
        return (f"warning: a micro-batch of {cfg.batch_size} x {cfg.max_len} tokens needs about {need / 2**30:.1f} "
                f"GiB of activations, but {free / 2**30:.1f} GiB of GPU memory is free: expect out-of-memory. "
                f"To fit: {memory_fixes(cfg, checkpointing)}")
    if not (checkpointing and cfg.offload_activations):
        return None
    need, free = offload_bytes(cfg, mcfg, dtype), host_available()
    if free is None or need <= 0.9 * free:
        return None
    return (f"warning: activation offload keeps every layer's input of a {cfg.batch_size} x {cfg.max_len} micro-batch "
            f"in page-locked host memory, about {need / 2**30:.1f} GiB, but {free / 2**30:.1f} GiB of host memory is "
            "available: expect the host to run out of memory. To fit: lower --batch-size or --max-len, or "
            "--no-offload-activations (the inputs then stay on the GPU)")


def offload_bytes(cfg, mcfg, dtype):
    """The page-locked host memory of activation offload (model/offload.py): every layer's input of a micro-batch.
    (What travels with them where the host has room, `Transformer.kept_tensors`, is counted by `offload_line`.)"""
    return mcfg.n_layers * cfg.batch_size * cfg.max_len * mcfg.hidden_size * (torch.finfo(dtype).bits // 8)


def offload_line(model, cfg, dtype, device):
    """The header line of activation offload on a CUDA GPU (with checkpointing): what a micro-batch of cfg's size
    keeps in page-locked host memory, its layer inputs and, where the host has room for them, its attention outputs
    (and o's, q | k | v's), which backward then does not recompute (`Transformer.kept_tensors`); None without
    offload or a CUDA GPU."""
    if not cfg.offload_activations or device.type != "cuda":
        return None
    layers = model.config.n_layers
    inputs = offload_bytes(cfg, model.config, dtype)
    tensors = model.kept_tensors(cfg.batch_size, cfg.max_len, dtype)
    kept = layers * sum(n * d.itemsize for n, d in tensors)
    what, then = {0: ("layer inputs", "backward recomputes attention"),
                  2: ("layer inputs and attention outputs", "backward does not recompute attention"),
                  3: ("layer inputs, attention outputs and o's outputs",
                      "backward recomputes neither attention nor o"),
                  4: ("layer inputs, attention outputs and o's and q | k | v's outputs",
                      "backward recomputes neither attention nor o nor q | k | v")}[len(tensors)]
    return (f"activation offload: a micro-batch's {what} wait in page-locked host memory, about "
            f"{(inputs + kept) / 2**30:.2f} GiB; {then}")


def memory_fixes(cfg, checkpointing):
    """What lowers the activation memory, among what this run does not do yet."""
    fixes = "lower --batch-size (a larger --grad-accum keeps the step's size) or --max-len"
    if not checkpointing:
        return fixes + ", or turn on --gradient-checkpointing (and --offload-activations)"
    return fixes + ("" if cfg.offload_activations else ", or add --offload-activations")


def warm_start_fits(mcfg, small, batch, dtype, use_kernels, free):
    """Whether the model's weights and WarmStart's copy of it (`small`, one layer per type) fit in half of `free`
    bytes together: the copy runs while the model loads, so the process's peak holds both; where memory is
    tight, the run goes without. A generous estimate: the weights at `dtype` (NF4 ones take less), the copy's
    step at 24 values a token for each layer's hidden and intermediate width, and the logits (`logits_bytes`)."""
    size = torch.finfo(dtype).bits // 8
    h, i, n = small.hidden_size, small.intermediate_size, batch["input_ids"].numel()
    copy = (weights(small) + 24 * n * small.n_layers * (h + i)) * size + logits_bytes(n, small, dtype, use_kernels)
    return weights(mcfg) * size + copy <= free / 2


def training_bytes(total, trained, dtype):
    """The memory of a run's weights and optimizer, in bytes: `total` weights at `dtype`; for each of the `trained`
    ones its gradient at `dtype`, AdamW's two fp32 moments and, below fp32, its fp32 master (masters.py: the
    optimizer reads the low-precision gradient itself). Activations come on top (`activation_bytes`)."""
    size = torch.finfo(dtype).bits // 8
    return total * size + trained * (size + 8 + (4 if dtype != torch.float32 else 0))


def full_finetuning_fit(mcfg, counts, dtype, device, world):
    """The header line of a full fine-tuning run's memory (weights, gradients, masters, AdamW state), from
    counts = (every weight, the trained ones); estimated before the model loads. On a CUDA GPU whose free memory
    cannot hold it, UserError instead, with what would fit."""
    total, trained = counts
    need = training_bytes(total, trained, dtype)
    masters = ", fp32 masters" if dtype != torch.float32 else ""
    line = (f"full fine-tuning: {trained / 1e6:.2f}M of {total / 1e6:.2f}M weights train; weights, gradients{masters} "
            f"and AdamW state take about {need / 2**30:.2f} GiB, activations apart")
    if device.type != "cuda":
        return line
    free = torch.cuda.mem_get_info(device)[0]
    if not any_rank(need > free, world, device):
        return line + f" ({free / 2**30:.1f} GiB free)"
    size = torch.finfo(dtype).bits // 8
    projections = weights(mcfg) - 2 * mcfg.vocab_size * mcfg.hidden_size
    lora, qlora = total * size, (total - projections) * size + projections * 0.53  # NF4: 4 bits + block scales
    raise UserError(f"full fine-tuning needs about {need / 2**30:.1f} GiB for weights, gradients, fp32 masters and "
                    f"AdamW state, before activations, and {device} has {free / 2**30:.1f} GiB free. What fits: "
                    f"LoRA (drop --full: about {lora / 2**30:.1f} GiB of weights), QLoRA (--quantize nf4 without "
                    f"--full: about {qlora / 2**30:.1f} GiB), or a GPU with more memory (with torchrun each GPU "
                    "holds all of it: data parallelism splits the batches, not the weights)")
