"""Evaluation on the held-out batches, and greedy samples of held-out prompts.

    result = evaluate(model, eval_sets, device)   # {"eval_loss", "eval_accuracy", "eval_token_accuracy"}
    log_eval(step, result, run, log)              # a console line and a metrics.jsonl record
    samples = Samples(cfg, tokenizer, mcfg, eval_rows, log); samples.log(step, model, run, log)

The eval loss is the mean over every target token of the eval batches (the same normalization as training);
the answer accuracy counts an example right when every one of its answer tokens is the argmax (teacher-forced).
"""
import torch

import data
from config import UserError
from model.generate import generate, stop_ids


@torch.no_grad()
def evaluate(model, eval_sets, device):
    """Mean loss per target token, answer accuracy (every answer token right, teacher-forced) and
    token accuracy, over the held-out batches."""
    model.eval()
    loss_sum, n_tok, tok_right, correct, total = 0.0, 0, 0, 0, 0
    for batch in eval_sets:
        b = {k: v.to(device) for k, v in batch.items()}
        n = data.num_targets(batch)
        if n == 0:
            continue
        token_loss, hit = model.score(b["input_ids"], b["position_ids"], b["doc_ids"], b["targets"])  # (B, T) each
        loss_sum += float(token_loss.sum())
        n_tok += n
        tok_right += int(hit.sum())
        c, t = data.answer_accuracy(hit, b)
        correct, total = correct + c, total + t
    model.train()
    if n_tok == 0:  # data.load_datasets refuses such an eval set; a loss of 0 here would read as perfect
        raise UserError("the eval batches hold no target token, so there is no eval loss to report; raise "
                        "--eval-batches or --max-len, or check the eval data's answers")
    return {"eval_loss": loss_sum / n_tok, "eval_accuracy": correct / max(total, 1),
            "eval_token_accuracy": tok_right / n_tok}


def log_eval(step, result, run, log):
    if result is None:  # no eval set
        return
    if "eval_rewards/margins" in result:  # preference pairs (preference.py)
        log(f"eval step {step}: loss {result['eval_loss']:.4f}, reward accuracy "
            f"{result['eval_rewards/accuracies']:.1%}, reward margin {result['eval_rewards/margins']:.4f}")
    else:
        log(f"eval step {step}: loss {result['eval_loss']:.4f}, answer accuracy {result['eval_accuracy']:.1%}, "
            f"token accuracy {result['eval_token_accuracy']:.1%}")
    run.log({"step": step, **result})


SAMPLES, SAMPLE_TOKENS = 3, 48  # held-out prompts answered at each sampling; the longest answer in tokens


def sample_prompts(cfg, tokenizer, mcfg, rows, n=SAMPLES):
    """[(question, prompt ids, expected answer)] of the first n of the eval rows (data.load_datasets'
    with_rows) that have a prompt before their answer (data.held_out_prompt), rendered as in training
    (--chat-template, --system-prompt)."""
    tokenizer = data.use_chat_template(tokenizer, cfg.chat_template)
    cases = []
    for row in rows:
        case = data.held_out_prompt(row, tokenizer, cfg.system_prompt)
        if case is not None and len(case[1]) + SAMPLE_TOKENS <= mcfg.max_position_embeddings:
            cases.append(case)
            if len(cases) == n:
                break
    return cases


def one_line(text, width=80):
    """`text` on one line (whitespace runs as one space), cut to `width` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


class Samples:
    """--sample-every: the model's greedy answers (KV cache, at most SAMPLE_TOKENS tokens) to the first held-out
    prompts, on the console ("sample: prompt -> answer") and in metrics.jsonl as
    {"step": N, "samples": [{"prompt", "answer", "expected"}, ...]}. Rank 0 only: the others do not wait for it."""

    def __init__(self, cfg, tokenizer, mcfg, rows, log):
        self.every, self.tokenizer, self.stops = cfg.sample_every, tokenizer, stop_ids(tokenizer, mcfg)
        self.cases = sample_prompts(cfg, tokenizer, mcfg, rows)
        if not self.cases:
            log("samples: no held-out example has a prompt before its answer (plain text rows), so none are shown")

    def due(self, step):
        """Before training step step + 1: at step 0 (before any training), then every --sample-every steps."""
        return step == 0 if self.every == -1 else step % self.every == 0

    def log(self, step, model, run, log, final=False):
        if not self.cases:
            return
        model.eval()
        samples = [{"prompt": text, "answer": self.tokenizer.decode(generate(model, ids, SAMPLE_TOKENS,
                                                                           stop_ids=self.stops)).strip(),
                    "expected": expected} for text, ids, expected in self.cases]
        model.train()
        when = "after training" if final else "before training" if step == 0 else f"at step {step}"
        log(f"held-out samples {when} (greedy):")
        for sample in samples:
            log(f"sample: {one_line(sample['prompt'])} -> {one_line(sample['answer'])} (expected: "
                f"{one_line(sample['expected'], 40)})")
        run.log({"step": step, "samples": samples})


