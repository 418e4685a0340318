"""Rewards (rewards.py): the built-in exact-answer, partial-answer and format rewards, the default set, loading a
user's reward function from a file with its errors, and `score`'s weighted total and its checks of what each
function returns."""
import math

import pytest
import torch

import rewards


def test_exact_answer_compares_the_last_number():
    """The completion's last number (the answer a reply ends on) against the reference's first, as numbers
    (separators, decimals, signs): "3 + 7 = 10" counts, "10, or 11" does not."""
    completions = ["The answer is 1,234.", "1234 apples, or 12", "-3", "3", "42.0", "about 7 or 8", "no idea", "8",
                   "3 + 7 = 10", "10, or 11"]
    references = ["1234", "1234", "-3", "-3", "42", "8", "5", "There are 8 of them.", "10", "10"]
    assert rewards.exact_answer([""] * 10, completions, references) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0,
                                                                         1.0, 0.0]


def test_a_typographic_minus_is_a_sign():
    """"−5" (U+2212, as typeset references and some models write it) is -5, not 5: a completion "5" does not
    answer it, "-5" and "−5" do, and "−5" answers "-5"; partial_answer and format_reward read it alike."""
    completions = ["5", "-5", "The answer is −5.", "−5", "−2.5"]
    references = ["−5", "−5", "−5", "-5", "-2.5"]
    assert rewards.exact_answer([""] * 5, completions, references) == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert rewards.partial_answer([""] * 2, ["5", "−5"], ["−5", "-5"]) == [rewards.PARTIAL_NUMBER, 1.0]
    assert rewards.format_reward([""], ["−5"], [None]) == [1.0]


def test_exact_answer_compares_whole_answers_without_a_number():
    """A reference without a number: the whole completion, trimmed of spaces and punctuation around it and
    case-folded, equals it; a longer completion does not."""
    completions = ["Paris.", "  needle\n", "the needle", "Coffee!", "coffee cup"]
    references = ["paris", "needle", "needle", "coffee", "coffee"]
    assert rewards.exact_answer([""] * 5, completions, references) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_exact_answer_needs_references():
    with pytest.raises(ValueError, match="prompt 1 has none"):
        rewards.exact_answer(["a", "b"], ["1", "2"], ["1", None])


def test_partial_answer_credits_the_answer_anywhere():
    """The reference's number anywhere in the completion (as numbers) is 1.0, another number PARTIAL_NUMBER, none
    0.0; a reference without a number counts as whole words, case-folded. "10, or 11", which exact_answer scores
    0, scores 1.0 here."""
    completions = ["10, or 11", "10", "The answer is 1,234.", "3 + 7 = 11", "eleven", "Paris is it", "in paris.",
                   "Parisian", ""]
    references = ["10", "10", "1234", "10", "11", "Paris", "Paris.", "Paris", "Paris"]
    p = rewards.PARTIAL_NUMBER
    assert rewards.partial_answer([""] * 9, completions, references) == [1.0, 1.0, 1.0, p, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert rewards.exact_answer([""] * 2, completions[:2], references[:2]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="partial_answer needs a reference answer"):
        rewards.partial_answer(["a"], ["1"], [None])


def test_the_default_rewards_tell_near_misses_apart():
    """Without --reward, exact_answer + 0.5 x partial_answer: the exact answer, the answer elsewhere, another
    number and no number all score differently, so a group without any exact answer still has a spread."""
    fns = [rewards.load_reward(s) for s in rewards.DEFAULT.split(",")]
    weights = [float(w) for w in rewards.DEFAULT_WEIGHTS.split(",")]
    total, per_fn = rewards.score(fns, weights, ["p"] * 4, ["3 + 7 = 10", "10, or 11", "3 + 7 = 11", "ten"], ["10"] * 4)
    assert list(per_fn) == ["exact_answer", "partial_answer"]
    assert total.tolist() == pytest.approx([1.5, 0.5, 0.5 * rewards.PARTIAL_NUMBER, 0.0])


def test_format_reward_is_the_answer_alone():
    """A bare number or a few words without sentence punctuation; not a sentence, a long answer or two lines."""
    completions = ["42", " -1,234.5 ", "3.5 kg", "Paris", "New York City", "It is 42.", "The answer is 42",
                   "42\n43", "", "yes!", "a: b"]
    assert rewards.format_reward(None, completions, None) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                                                              0.0]


def write(tmp_path, text, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_load_reward_runs_the_users_function(tmp_path):
    path = write(tmp_path, "def sevens(prompts, completions, references):\n"
                           "    return [float('7' in c) for c in completions]\n")
    fn = rewards.load_reward(f"{path}:sevens")
    assert fn(["p", "q"], ["7", "8"], [None, None]) == [1.0, 0.0]
    assert rewards.load_reward("exact_answer") is rewards.exact_answer


def test_load_reward_errors_name_the_problem(tmp_path):
    path = write(tmp_path, "LIMIT = 3\n\ndef short(prompts, completions, references):\n    return []\n")
    for spec, match in [("no_colon.py", "expected path/to/file.py:function"),
                        (f"{tmp_path}/missing.py:f", "no file"),
                        (f"{path}:long", "has no function 'long'; it has short"),
                        (f"{path}:LIMIT", "LIMIT in .* is of type int, not a function"),
                        (f"{write(tmp_path, 'import not_a_module_here', 'broken.py')}:f",
                         "importing .*broken.py failed: ModuleNotFoundError")]:
        with pytest.raises(ValueError, match=match):
            rewards.load_reward(spec)


def test_score_weighs_and_names_each_reward():
    def length(prompts, completions, references):
        return [len(c) for c in completions]

    total, per_fn = rewards.score([rewards.exact_answer, length], [2.0, 0.5], ["p"] * 3, ["7", "it is 8", "x"],
                                  ["7", "7", "x"])
    assert list(per_fn) == ["exact_answer", "length"]
    assert torch.equal(per_fn["exact_answer"], torch.tensor([1.0, 0.0, 1.0]))
    assert torch.equal(total, torch.tensor([2.5, 3.5, 2.5]))
    total, _ = rewards.score([length], None, ["p"], ["abc"], [None])
    assert total.tolist() == [3.0]


@pytest.mark.parametrize("returned,match", [([1.0], "returned 1 values for 2 completions"),
                                            ("1.0", "returned a str for 2 completions"),
                                            ([1.0, math.nan], "returned nan"), ([1.0, None], "returned None"),
                                            ([True, 1.0], "returned True"), ([1.0, "2"], "returned '2'")])
def test_score_rejects_what_is_not_one_float_per_completion(returned, match):
    def bad(prompts, completions, references):
        return returned

    with pytest.raises(ValueError, match=f"reward bad {match}"):
        rewards.score([bad], None, ["p", "q"], ["a", "b"], [None, None])


def test_score_checks_its_arguments():
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        rewards.score([rewards.format_reward], [1.0, 2.0], ["p"], ["a"], [None])
    with pytest.raises(ValueError, match="one prompt, completion and reference per completion"):
        rewards.score([rewards.format_reward], None, ["p", "q"], ["a"], [None])


def test_a_gsm8k_reference_is_read_from_its_final_answer():
    """GSM8K's answers are worked solutions ending "#### 72": the rewards compare with 72, not the first number."""
    reference = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    completions = ["She sold 72 clips.", "48", "72 or 24"]
    assert rewards.exact_answer([""] * 3, completions, [reference] * 3) == [1.0, 0.0, 0.0]
    assert rewards.partial_answer([""] * 3, completions, [reference] * 3) == [1.0, rewards.PARTIAL_NUMBER, 1.0]
