"""Reward functions for RL with verifiable rewards: the built-in ones, a user's own, and their weighted total.

A reward function is a plain Python function, called positionally with three lists of equal length N (one entry
per completion: the prompt's question, the text the answer replies to (a chat's last user turn, an Alpaca row's
instruction and input, the prompt of a prompt/completion row; data/rollouts.py `Prompt.question`), the completion's
text, the reference answer or None where the row has none) and returning N floats, higher for better completions:

    def short_answer(prompts, completions, references):
        return [1.0 if len(c.split()) <= 3 else 0.0 for c in completions]

Built in:
    exact_answer   1.0 when the completion's last number equals the reference's first number (as numbers:
                   "42" == "42.0", "−5" == "-5", thousands separators ignored): the answer a reply ends on, so
                   "3 + 7 = 10" and "The answer is 10." both count, as GSM8K graders' last-number rule
                   (lm-evaluation-harness's flexible-extract) counts them; a reference ending "#### 72" (GSM8K's
                   worked solutions) is read from its "####" on; when the reference holds no number,
                   when the whole completion equals the whole reference, trimmed of spaces and of the punctuation
                   around them and case-folded ("Paris." == "paris"); else 0.0
    partial_answer 1.0 when the reference's answer is anywhere in the completion: one of its numbers equals the
                   reference's first number, or (a reference without a number) the reference is in it as whole
                   words, case-folded; else PARTIAL_NUMBER when the reference is a number and the completion
                   holds some number; else 0.0. Partial credit: exact_answer gives 0 to "10, or 11" and to
                   any reply that is not yet an answer, so a group of such completions would all score 0 and
                   teach nothing; this tells apart the ones closer to the answer
    format_reward  1.0 when the completion is the answer alone: a bare number, or a short answer of at most
                   FORMAT_MAX_WORDS words on one line with no sentence punctuation (. ! ? ; : inside it, a
                   number's decimal point aside); else 0.0
The default (no --reward) is DEFAULT with DEFAULT_WEIGHTS: exact_answer + 0.5 x partial_answer, so the exact
answer scores 1.5, the answer elsewhere in the completion 0.5, some other number 0.1, and a completion without
a number 0: a small model's first samples differ in reward long before one is exactly right.
`load_reward("path/to/file.py:function")` imports a user's file and returns its function. That runs the code in
the file, by the user's explicit choice on the command line (--reward), as `python file.py` would: it is the
user's own program, not data, and never a downloaded checkpoint. `score` calls each function and checks what it
returns (a list of N finite numbers), so that a broken reward fails on its first call with its name.
"""
import importlib.util
import math
import numbers
import os
import re

import torch

FORMAT_MAX_WORDS = 3
PARTIAL_NUMBER = 0.2  # partial_answer's credit for a number that is not the reference's: an answer of its kind
DEFAULT, DEFAULT_WEIGHTS = "exact_answer,partial_answer", "1,0.5"  # the rewards without --reward
# A number: a sign (the typographic minus "−", U+2212, too), digits with optional thousands separators, an optional
# decimal part ("-1,234.5", "−5", ".5").
NUMBER = re.compile(r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+\u2212]?\.\d+")
SENTENCE_PUNCTUATION = re.compile(r"[.!?;:]")
AROUND = " \t\n\r.,;:!?\"'`()[]"  # trimmed from both ends of a whole answer before comparing


def first_number(text):
    """The first number in text as a float, or None when it holds none."""
    m = NUMBER.search(text)
    return None if m is None else as_float(m.group())


def all_numbers(text):
    """Every number in text, in order, as floats."""
    return [as_float(m) for m in NUMBER.findall(text)]


def as_float(number):
    """The value of a match of NUMBER: without its thousands separators, a typographic minus read as "-"."""
    return float(number.replace(",", "").replace("\u2212", "-"))


def with_references(name, references):
    """The answers of `references` (`final_answer`), checked: a reward that compares with the answer needs one for
    every prompt."""
    for i, reference in enumerate(references):
        if reference is None:
            raise ValueError(f"{name} needs a reference answer for every prompt, and prompt {i} has none: use data "
                             "whose rows have a completion (or an assistant turn), or give --reward")
    return [final_answer(r) for r in references]


def final_answer(reference):
    """What follows the last "####" in a reference that has one (GSM8K's worked solutions end "#### 72"), else the
    whole reference."""
    head, marker, tail = reference.rpartition("####")
    return tail.strip() if marker else reference


def exact_answer(prompts, completions, references):
    """1.0 per completion whose answer equals the reference's (see the module docstring), else 0.0. A reference
    of None is an error: exact_answer needs data with answers."""
    out = []
    for completion, reference in zip(completions, with_references("exact_answer", references), strict=True):
        expected = first_number(reference)
        if expected is None:
            out.append(float(completion.strip(AROUND).casefold() == reference.strip(AROUND).casefold()))
        else:
            found = all_numbers(completion)
            out.append(float(bool(found) and found[-1] == expected))
    return out


def partial_answer(prompts, completions, references):
    """1.0 per completion that holds the reference's answer anywhere, PARTIAL_NUMBER per one that holds another
    number where the reference is a number, else 0.0 (see the module docstring). A reference of None is an error,
    as for exact_answer."""
    out = []
    for completion, reference in zip(completions, with_references("partial_answer", references), strict=True):
        expected = first_number(reference)
        if expected is None:
            words = re.escape(reference.strip(AROUND).casefold())
            out.append(float(bool(words) and re.search(rf"(?<!\w){words}(?!\w)", completion.casefold()) is not None))
        else:
            found = all_numbers(completion)
            out.append(1.0 if expected in found else PARTIAL_NUMBER if found else 0.0)
    return out


def format_reward(prompts, completions, references):
    """1.0 per completion that is the answer alone (see the module docstring), else 0.0."""
    return [float(is_answer_alone(c)) for c in completions]


def is_answer_alone(completion):
    """A bare number, or at most FORMAT_MAX_WORDS words on one line without sentence punctuation."""
    text = completion.strip()
    if not text:
        return False
    if NUMBER.fullmatch(text):
        return True
    return ("\n" not in text and len(text.split()) <= FORMAT_MAX_WORDS
            and not SENTENCE_PUNCTUATION.search(NUMBER.sub("0", text)))


BUILTIN = {"exact_answer": exact_answer, "partial_answer": partial_answer, "format_reward": format_reward}


def load_reward(spec):
    """The function named by "path/to/file.py:function" (imports the file: it runs the user's code, by the user's
    choice), or a built-in reward by its name alone. A ValueError of one line when the form is wrong, the file is
    missing, the function is not in it or is not callable."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"--reward {spec!r}: expected path/to/file.py:function, or a built-in reward "
                         f"({', '.join(BUILTIN)})")
    if not os.path.isfile(path):
        raise ValueError(f"--reward {spec!r}: no file {path!r}; give the path of a Python file, then :function")
    module_name = "nanotune_reward_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None:
        raise ValueError(f"--reward {spec!r}: {path!r} cannot be imported as Python; give a .py file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error it raises is reported as the reward's
        raise ValueError(f"--reward {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"--reward {spec!r}: {path} has no function {name!r}; it has "
                         f"{', '.join(found) or 'no public function'}")
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: {name} in {path} is of type {type(fn).__name__}, not a function")
    return fn


def reward_name(fn):
    """The name a reward's metrics use: rewards/<name>/mean."""
    return getattr(fn, "__name__", type(fn).__name__)


def score(reward_fns, weights, prompts, completions, references):
    """(total, {name: rewards}): each function's rewards (lists of N floats) and their weighted sum (N floats).
    weights: one per function, or None for 1.0 each. A function that returns something other than N finite
    numbers is an error naming it."""
    n = len(completions)
    if not (len(prompts) == len(references) == n):
        raise ValueError(f"score needs one prompt, completion and reference per completion; got {len(prompts)}, "
                         f"{n} and {len(references)}")
    weights = [1.0] * len(reward_fns) if weights is None else list(weights)
    if len(weights) != len(reward_fns):
        raise ValueError(f"--reward-weights has {len(weights)} weights for {len(reward_fns)} reward functions; "
                         "give one weight per --reward")
    per_fn, total = {}, torch.zeros(n, dtype=torch.float32)
    for fn, w in zip(reward_fns, weights):
        name = reward_name(fn)
        values = fn(list(prompts), list(completions), list(references))
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise ValueError(f"reward {name} returned {got} for {n} completions; it must return a list of "
                             f"{n} floats, one per completion")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"reward {name} returned {v!r} among its values; it must return finite floats "
                                 "(not NaN, inf, None or bool)")
        t = torch.tensor([float(v) for v in values], dtype=torch.float32)
        key = name if name not in per_fn else f"{name}_{len(per_fn)}"
        per_fn[key] = t
        total += w * t
    return total, per_fn
