"""rl.py's options: train.py's (config.TrainConfig, the same names and checks) and the RL group (the names
as TRL's GRPOConfig spells them, with dashes). --help lists them in RL_GROUPS; train.py's options that an RL run
has no use for (--method and the preference losses' options, --num-epochs, --sample-every, --train-on-inputs,
--grad-accum) or does not train with (--full, --train-embeddings, --add-tokens) are not options of
rl.py."""
from dataclasses import dataclass, field

from config import OPTION_GROUPS, TrainConfig, UserError, flag
from grpo import IMPORTANCE, LOSS_TYPES, SCALES

USAGE = """nanotune RL: GRPO with verifiable rewards on the model's own samples (docs/rl.md).

    python rl.py --model smollm2-135m --max-steps 16              # builtin prompts, the answer rewards
    python rl.py --model ./my-model --data qa.jsonl --reward my_rewards.py:short_answer
"""

HIDDEN = ("method", "label_smoothing", "simpo_gamma", "orpo_lambda", "precompute_ref", "num_epochs", "sample_every",
          "train_on_inputs", "grad_accum", "full", "train_modules", "train_embeddings", "add_tokens")


@dataclass
class RLConfig(TrainConfig):
    beta: float | None = field(default=None, metadata={"help": "the weight of the KL to the reference (the base "
                               "model: the adapters off); left out: no KL, and no reference pass"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps before the cosine (RL runs are "
                              "short, and the first rollouts are the base model's anyway)"})
    num_generations: int = field(default=8, metadata={"help": "G: completions sampled per prompt; a step has "
                                 "--batch-size prompts x G completions"})
    max_new_tokens: int = field(default=64, metadata={"help": "the longest completion, in tokens"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (the log-probs of the loss use "
                               "the same)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling: keep the most likely tokens up to this "
                         "probability mass (1: all)"})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens (0: all)"})
    loss_type: str = field(default="dapo", metadata={"help": "dapo: token-level over the step; grpo: per-sequence "
                           "means; dr_grpo: a constant normalizer (docs/rl.md)", "choices": LOSS_TYPES})
    epsilon: float = field(default=0.2, metadata={"help": "the clip range's lower side, 1 - epsilon"})
    epsilon_high: float = field(default=0.28, metadata={"help": "the clip range's upper side, 1 + epsilon_high "
                                "(DAPO's clip-higher)"})
    importance_sampling_level: str = field(default="token", metadata={"help": "token: a ratio per token; sequence: "
                                           "GSPO's one per completion (use a clip range of about 3e-4 / 4e-4)",
                                           "choices": IMPORTANCE})
    scale_rewards: str = field(default="none", metadata={"help": "none: advantages are the rewards less the "
                               "group's mean (Dr. GRPO; a group of near-equal rewards moves the policy little); "
                               "group: over the group's std too (TRL's default)", "choices": SCALES})
    num_iterations: int = field(default=1, metadata={"help": "mu: optimizer updates per batch of rollouts"})
    reward: str | None = field(default=None, metadata={"help": "a reward function, path/to/file.py:function or a "
                               "built-in (exact_answer, partial_answer, format_reward); give it several times (or "
                               "comma-separated) for a weighted sum; default: exact_answer + 0.5 x partial_answer "
                               "(docs/rl.md)", "repeatable": True})
    reward_weights: str | None = field(default=None, metadata={"help": "one weight per --reward, comma-separated "
                                       "(default: 1 each)"})

    def __post_init__(self):
        super().__post_init__()
        checks = [
            (self.num_generations >= 2, f"--num-generations must be at least 2 (the advantages compare the completions "
                                        f"of a prompt), got {self.num_generations}"),
            (self.max_new_tokens > 0, f"--max-new-tokens must be > 0, got {self.max_new_tokens}"),
            (self.temperature > 0, f"--temperature must be > 0 (RL samples; the loss divides the logits by it), got "
                                   f"{self.temperature}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"--top-k must be >= 0 (0: all tokens), got {self.top_k}"),
            (self.num_iterations >= 1, f"--num-iterations must be >= 1, got {self.num_iterations}"),
            (0 <= self.epsilon < 1 and self.epsilon_high >= 0, f"--epsilon must be in [0, 1) and --epsilon-high >= 0, "
                                                              f"got {self.epsilon} and {self.epsilon_high}"),
        ]
        for name in ("loss_type", "importance_sampling_level", "scale_rewards"):
            f = self.__dataclass_fields__[name]
            value, choices = getattr(self, name), f.metadata["choices"]
            checks.append((value in choices, f"{flag(name)} must be one of {', '.join(choices)}, got {value!r}"))
        for holds, error in checks:
            if not holds:
                raise UserError(error)


RL_GROUPS = {title: tuple(n for n in names if n not in HIDDEN) for title, names in OPTION_GROUPS.items()}
RL_GROUPS["RL (GRPO)"] = ("beta",) + tuple(n for n in RLConfig.__dataclass_fields__
                                            if n not in TrainConfig.__dataclass_fields__)
RL_GROUPS["training"] = tuple(n for n in RL_GROUPS["training"] if n != "beta")
