"""rl.rewards: GSM8K's `####` and MATH's `\\boxed{}` answers graded against gold after normalisation (commas in
numbers, decimals, fractions, `\\frac`, `\\text`, units of degrees and percent, a missing answer), and
`gold_reward` grading each completion against its own prompt's gold."""
import pytest

from mfsdp_kit.rl import rewards
from mfsdp_kit.rl.core import Reward

GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("completion,gold,score", [
    ("so the total is 72.\n#### 72", GSM8K_GOLD, 1.0),
    ("#### 72.00", GSM8K_GOLD, 1.0),                      # a decimal of the same number
    ("#### $72", GSM8K_GOLD, 1.0),                        # a currency sign
    ("#### 1,234,567", "#### 1234567", 1.0),              # thousands commas
    ("#### 1234567", "#### 1,234,567", 1.0),
    ("#### 0.5", "#### 1/2", 1.0),                        # one number, two spellings
    ("#### 73", GSM8K_GOLD, 0.0),
    ("the answer is 72", GSM8K_GOLD, 0.0),                # no #### line: not an answer
    ("#### ", GSM8K_GOLD, 0.0),                           # an empty answer
    ("#### 7\n#### 72", GSM8K_GOLD, 1.0),                 # the last one counts
    ("#### -3", "#### -3", 1.0),
    ("#### 1,2", "#### 12", 0.0),                         # not a thousands comma
])
def test_gsm8k(completion, gold, score):
    assert rewards.gsm8k(completion, gold) == score


@pytest.mark.parametrize("completion,gold,score", [
    (r"so \boxed{\frac{1}{2}}", r"\boxed{\frac12}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{0.75}", r"\boxed{\tfrac{3}{4}}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\boxed{\frac{\sqrt{3}}{2}}", 1.0),   # not a number: compared as LaTeX
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\boxed{\frac{\sqrt{2}}{2}}", 0.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{25\%}", r"\boxed{25}", 1.0),
    (r"\boxed{\text{(B)}}", "(B)", 1.0),
    (r"\boxed{ x + 1 }", r"\boxed{x+1}", 1.0),
    (r"\boxed{\left( 3, 4 \right)}", r"\boxed{(3,4)}", 1.0),
    (r"\boxed{2}", r"\boxed{3}", 0.0),
    ("no box here: 2", "2", 0.0),                        # a missing answer
    (r"\boxed{2", "2", 0.0),                              # an unclosed box
    (r"first \boxed{1}, then \boxed{{2}}", "2", 1.0),     # the last box counts; outer braces do not
    (r"\boxed{2}, then \boxed{1}", "2", 0.0),
    (r"\boxed{{1}+{2}}", "{1}+{2}", 1.0),                  # braces that are not around the whole answer stay
])
def test_math(completion, gold, score):
    assert rewards.math(completion, gold) == score


def test_extractors_and_numbers():
    assert rewards.extract_boxed(r"\boxed{\frac{a}{b}} and \fbox{x^{2}}") == "x^{2}"
    assert rewards.extract_boxed("none") is None and rewards.extract_gsm8k("none") is None
    assert rewards.as_number("1,000.50") == rewards.as_number("2001/2")
    assert rewards.as_number("x") is None and rewards.as_number("1/0") is None


def test_gold_reward_grades_each_completion_against_its_prompts_gold():
    problems = [("How many clips?", GSM8K_GOLD), ("What is 2+2?", "#### 4")]
    reward = rewards.gold_reward(problems, grade=rewards.gsm8k)
    assert isinstance(reward, Reward)
    assert reward("What is 2+2?", "#### 4") == 1.0 and reward("How many clips?", "#### 4") == 0.0
    with pytest.raises(KeyError, match="a prompt not in its problems"):
        reward("another prompt", "#### 4")
