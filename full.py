"""Full fine-tuning: which base weights train (--full, --train-modules).

    train = train_filter(cfg.train_modules, mcfg)   # a predicate on parameter names; ValueError for bad input
    model, mcfg = load_model(path, ..., lora=None, train=train)

--train-modules is a comma-separated list of
  - projection names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), which select that
    projection's weight (and bias, where the model has one) in every chosen layer;
  - norm: every RMSNorm weight of the chosen layers, and the final norm;
  - embed_tokens, lm_head: the input embedding and the output head. Where the model ties them they are one
    weight, so naming either trains it, and it stays tied;
  - layers.N or layers.A-B (inclusive): the chosen layers. Without a name, every weight of those layers;
    without a range, every layer.
Left out, --full trains every weight.

A trained projection runs as model/stacked.py's autograd Function (model/transformer.py, `project`), which gives
dW and db; the fused LoRA Functions return no gradient for a base weight, so a projection group (q, k, v with o;
gate, up, down) takes them only while all of its weights are frozen (model/lora.py, `fusable`). Where q, k and v
all train, they run as one GEMM each way, their weights stored as one tensor. The norms' and the fused
head's kernels give their weight's gradient themselves.
"""
import re

import torch

from model.lora import ALL_TARGETS
from model.transformer import Transformer

NAMES = ALL_TARGETS + ("norm", "embed_tokens", "lm_head")
LAYERS = re.compile(r"layers\.(\d+)(?:-(\d+))?")


def parse_train_modules(spec):
    """(the names of `spec`, a set; the layer indices of its ranges, a set, or None where it gives none).
    ValueError names what is unknown and lists what is valid."""
    names, layers = set(), None
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError(f"--train-modules: nothing given; valid: {','.join(NAMES)}, layers.N or layers.A-B")
    for item in items:
        if item in NAMES:
            names.add(item)
        elif m := LAYERS.fullmatch(item):
            first, last = int(m[1]), int(m[2] or m[1])
            if last < first:
                raise ValueError(f"--train-modules: the range {item} is empty; write layers.A-B with A <= B")
            layers = (layers or set()) | set(range(first, last + 1))
        else:
            raise ValueError(f"--train-modules: unknown name {item!r}; valid: {','.join(NAMES)}, layers.N or "
                             "layers.A-B (e.g. q_proj,v_proj,layers.0-3)")
    return names, layers


def train_filter(spec, mcfg):
    """Whether the base weight of a parameter name trains: a predicate for `load_model(train=...)`, from
    --train-modules `spec` (None: every weight) on a model of ModelConfig `mcfg`. ValueError for a layer
    range beyond the model's layers."""
    if spec is None:
        return lambda name: True
    names, layers = parse_train_modules(spec)
    if layers is not None and max(layers) >= mcfg.n_layers:
        raise ValueError(f"--train-modules: layer {max(layers)} does not exist; this model has layers 0 to "
                         f"{mcfg.n_layers - 1}")
    if mcfg.tie_embeddings and "lm_head" in names:
        names.add("embed_tokens")  # the head is the embedding's weight

    def trains(name):
        if m := re.fullmatch(r"model\.layers\.(\d+)\.(?:\w+\.)*?(\w+)\.(?:weight|bias)", name):
            layer, module = int(m[1]), m[2]
            if layers is not None and layer not in layers:
                return False
            return not names or module in names or ("norm" in names and module.endswith("norm"))
        module = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head",
                  "model.norm.weight": "norm"}.get(name)
        return module in names
    return trains


def weight_counts(mcfg, train):
    """(every weight of a model of `mcfg`, those that `train` selects), counted on the meta device: no memory, no
    checkpoint read. A tied head counts once."""
    with torch.device("meta"):
        model = Transformer(mcfg)
    named = list(model.named_parameters())
    return sum(p.numel() for _, p in named), sum(p.numel() for n, p in named if train(n))
