"""Trainable embeddings (embed_tokens and lm_head) and new tokens, saved as PEFT's `modules_to_save`.

    tokenizer, new_ids = add_tokens(tokenizer, ["<tool>", "</tool>"])  the tokenizer gains them
    train_embeddings_(model, tokenizer.vocab_size, new_ids, all_rows)  grow, initialize, make trainable

The trained embeddings are fp32 parameters, whatever the model's dtype: the forward casts them to the
activations' dtype (`Transformer.hidden_states`, `Transformer.forward`), so AdamW updates one fp32 copy and
there is no second, low-precision copy to keep in step. Tied embeddings (Qwen2, Gemma) stay one tensor: the
lookup and the head both read it, and their gradients add up in it.

New tokens (Hewitt 2021, "Initializing New Word Embeddings for Pretrained Language Models"): a new row
starts at the mean of the rows of the tokens the tokenizer already had. A row of random values, or of the
zeros that some checkpoints hold in their unused rows, gives the new token a logit far from the others' and
a hidden state the layers never saw; at the mean its logit is the average one and the model's outputs on
other text barely move, so training starts from where the base model was. The vocabulary grows to exactly
the tokenizer's length (no padding rows), since that is what PEFT's AutoPeftModelForCausalLM resizes the
base to before it loads the adapter; a model whose embedding already has spare rows (Qwen2's) keeps its
row count, and the new tokens take the first spare rows, as in transformers.

Without --train-embeddings only the new rows train: a mask on the embedding's gradient zeroes the other
rows, which AdamW (without weight decay on embeddings: masters.py, `param_groups`) then leaves exactly as they were.
Either way the whole matrices are saved, so PEFT loads them as `modules_to_save` with nothing else to know.
"""
import dataclasses

import torch
import torch.nn as nn
from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")  # parameter names, which are also PEFT's keys


def parse_tokens(text: str | None) -> list[str]:
    """The tokens of --add-tokens (TOKEN,TOKEN,...); ValueError for an empty one or a repeated one."""
    if not text:
        return []
    tokens = text.split(",")
    if any(not t for t in tokens):
        raise ValueError(f"--add-tokens {text!r} has an empty token; give tokens separated by single commas, "
                         "e.g. --add-tokens '<tool>,</tool>'")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"--add-tokens names {repeated[0]!r} more than once; give each token once")
    return tokens


def add_tokens(tokenizer, tokens):
    """(a copy of `tokenizer` that knows `tokens`, their ids). Each is an added token of its own, never split
    and matched in data text and chat templates alike (not "special", so text from the data that spells it
    also becomes the token: a tool call in an answer). A token already in the vocabulary is a ValueError."""
    if not tokens:
        return tokenizer, []
    for t in tokens:
        if (i := tokenizer.token_to_id(t)) is not None:
            raise ValueError(f"--add-tokens: {t!r} is already in the tokenizer's vocabulary (id {i}); leave it out "
                             "(--train-embeddings trains the rows of tokens the model already has)")
    tok = _HFTokenizer.from_str(tokenizer.tok.to_str())
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])
    return dataclasses.replace(tokenizer, tok=tok), [tok.token_to_id(t) for t in tokens]


def grown(mcfg, vocab_size):
    """The ModelConfig of the model with an embedding row for each of `vocab_size` tokens."""
    return dataclasses.replace(mcfg, vocab_size=max(mcfg.vocab_size, vocab_size))


@torch.no_grad()
def resize_(model, rows):
    """Give the embedding (and an untied lm_head) `rows` rows: the first ones kept, the others zeros."""
    cfg = model.config
    emb = model.model.embed_tokens
    for module in (emb, model.lm_head) if not cfg.tie_embeddings else (emb,):
        old = module.weight
        if old.shape[0] == rows:
            continue
        w = old.new_zeros(rows, old.shape[1])
        w[:min(rows, old.shape[0])] = old[:rows]
        module.weight = nn.Parameter(w, requires_grad=old.requires_grad)
    emb.num_embeddings = model.lm_head.out_features = rows
    if cfg.tie_embeddings:
        model.lm_head.weight = emb.weight
    model.config = dataclasses.replace(cfg, vocab_size=rows)
    if getattr(model, "hf_config", None):  # config.json of a merged model
        model.hf_config = {**model.hf_config, "vocab_size": rows}


def embedding_parameters(model):
    """(name, parameter) of embed_tokens and of an untied lm_head."""
    names = EMBEDDINGS[:1] if model.config.tie_embeddings else EMBEDDINGS
    return [(n, model.get_parameter(n)) for n in names]


def train_embeddings_(model, vocab_size, new_ids, all_rows):
    """Make the model's embeddings trainable fp32 parameters, with a row for each of `vocab_size` tokens (at
    least), the rows of `new_ids` (the tokenizer's newest ids) at the mean of the rows before them. all_rows:
    every row trains (--train-embeddings); else only those of new_ids. Returns the model's new config."""
    resize_(model, grown(model.config, vocab_size).vocab_size)
    known = min(new_ids, default=None)
    for name, p in embedding_parameters(model):
        w = p.detach().float()  # (V, H)
        if new_ids:
            w[new_ids] = w[:known].mean(0)
        master = nn.Parameter(w, requires_grad=True)
        if not all_rows:
            mask = torch.zeros(w.shape[0], 1, device=w.device)
            mask[new_ids] = 1.0
            master.register_hook(lambda g, mask=mask: g * mask)  # only the new rows learn
        model.get_submodule(name.removesuffix(".weight")).weight = master
    if model.config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.config


@torch.no_grad()
def load_embeddings_(model, tensors, source):
    """Copy saved embeddings ({parameter name: tensor}, from an adapter's modules_to_save) into the model,
    grown first to their rows. A tied model takes embed_tokens (PEFT saves a tied lm_head as its copy)."""
    emb = tensors.get(EMBEDDINGS[0])
    rows = (emb if emb is not None else tensors[EMBEDDINGS[1]]).shape[0]
    if rows < model.config.vocab_size:
        raise ValueError(f"{source}: the saved embeddings have {rows} rows, the model has "
                         f"{model.config.vocab_size}. Was it trained on another base model?")
    resize_(model, rows)
    if model.config.tie_embeddings:
        if emb is None:
            raise ValueError(f"{source} holds lm_head but not embed_tokens, which this model ties to it")
        tensors = {EMBEDDINGS[0]: emb}
    for name, t in tensors.items():
        p = model.get_parameter(name)
        if t.shape != p.shape:
            raise ValueError(f"{source}: {name} has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}. "
                             "Was it trained on another base model?")
        p.copy_(t)
