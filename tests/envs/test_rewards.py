"""Reward functions on crafted edge cases: QA normalisation/EM/F1, extraction, math equivalence."""

import threading

import pytest

from palaestra.envs.math import extract_final_answer, gsm8k_correct, gsm8k_gold, math_gold
from palaestra.envs.rewards import (
    exact_match,
    extract_boxed,
    extract_hash_answer,
    extract_tag,
    f1_score,
    last_code_block,
    math_equal,
    normalize_answer,
    numeric_value,
    sub_exact_match,
)

# ----- EM normalisation -----------------------------------------------------------------------
EM_CASES = [
    ("Paris", ["paris"], 1.0),  # case
    ("  The Paris ", ["Paris"], 1.0),  # article and whitespace
    ("an apple", ["apple"], 1.0),
    ("A", ["a"], 1.0),  # the article alone normalises to "" on both sides
    ("Chief of Protocol.", ["Chief of Protocol"], 1.0),  # punctuation
    ("U.S.", ["US"], 1.0),
    ("Theodore", ["the odore"], 0.0),  # "the" is removed only as a whole word
    ("the the", [""], 0.0),  # nothing matches an empty gold (it used to: both normalise to "")
    ("A+", ["A+"], 1.0),  # a gold that normalises to "" is matched by its own text
    ("a", ["A+"], 0.0),
    ("Barack Obama", ["Obama"], 0.0),  # EM is not containment
    ("yes", ["no", "Yes"], 1.0),  # any gold answer counts
    ("G.  Stanley   Hall", ["G. Stanley Hall", "Stanley Hall"], 1.0),
    ("Pieter Zeeman", ["Zeeman, Pieter"], 0.0),  # word order matters
    ("1,000", ["1000"], 1.0),  # punctuation inside numbers is stripped too
    ("Café", ["cafe"], 0.0),  # no accent folding in the standard normalisation
    (None, ["x"], 0.0),  # no answer at all
]


@pytest.mark.parametrize("prediction,golds,expected", EM_CASES)
def test_exact_match(prediction, golds, expected):
    assert exact_match(prediction, golds) == expected


def test_normalize_answer_matches_squad():
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("An\tapple\na day") == "apple day"


def test_exact_match_accepts_a_single_string_gold():
    assert exact_match("the Beatles", "Beatles") == 1.0


F1_CASES = [
    ("Eiffel Tower", ["Eiffel Tower"], 1.0),
    ("the Eiffel Tower in Paris", ["Eiffel Tower"], 2 * (2 / 4) * 1 / (2 / 4 + 1)),
    ("tower", ["Eiffel Tower", "tower"], 1.0),  # best over golds
    ("no", ["yes"], 0.0),  # yes/no must match exactly
    ("yes it is", ["yes"], 0.0),  # HotpotQA's rule: yes/no never get partial credit
    ("completely different", ["Eiffel Tower"], 0.0),
    (None, ["x"], 0.0),
]


@pytest.mark.parametrize("prediction,golds,expected", F1_CASES)
def test_f1(prediction, golds, expected):
    assert f1_score(prediction, golds) == pytest.approx(expected)


@pytest.mark.parametrize(
    "prediction,golds,expected",
    [("He was born in Paris, France", ["Paris"], 1.0), ("Lyon", ["Paris"], 0.0), ("x", [""], 0.0)],
)
def test_sub_exact_match(prediction, golds, expected):
    assert sub_exact_match(prediction, golds) == expected


# ----- tags and boxes ---------------------------------------------------------------------------
TAG_CASES = [
    ("<answer> Beijing </answer>", "Beijing"),
    ("<answer>first</answer> then <answer>second</answer>", "second"),  # the last one counts
    ("<answer>multi\nline</answer>", "multi\nline"),
    ("<answer>unclosed", None),
    ("no tags", None),
    ("<answer></answer>", ""),
]


@pytest.mark.parametrize("text,expected", TAG_CASES)
def test_extract_tag(text, expected):
    assert extract_tag(text, "answer") == expected


BOXED_CASES = [
    (r"so \boxed{42}", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\boxed{1} and finally \boxed{2}", "2"),  # the last box
    (r"\boxed{\boxed{10}}", "10"),  # a box in a box
    (r"\boxed{a \boxed{b} c}", r"a \boxed{b} c"),  # the outer box is the answer
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not nest
    (r"\boxed 5$.", "5"),  # brace-less form
    (r"\fbox{7}", "7"),
    (r"\boxed{2} then \boxed{3", "2"),  # unclosed last box: the last complete one
    (r"\boxed{", None),
    ("no box", None),
]


@pytest.mark.parametrize("text,expected", BOXED_CASES)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [("steps\n#### 72", "72"), ("#### 1,000\n", "1,000"), ("#### 5\n#### 6", "6"), ("####", None)],
)
def test_extract_hash_answer(text, expected):
    assert extract_hash_answer(text) == expected


def test_final_answer_prefers_box_over_hash_over_tag():
    assert extract_final_answer(r"#### 3 and \boxed{4} <answer>5</answer>") == "4"
    assert extract_final_answer("#### 3 <answer>5</answer>") == "3"
    assert extract_final_answer("<answer>5</answer>") == "5"
    assert extract_final_answer("the answer is 5") is None  # no bare-number fallback


CODE_CASES = [
    ("```python\nprint(1)\n```", "print(1)\n"),
    ("```py\na\n```\ntext\n```python\nb\n```", "b\n"),  # the last python block
    ("```\nplain\n```", "plain\n"),  # untagged blocks count as python
    ("```bash\nls\n```", None),  # other languages do not
    ("```python\nunclosed", None),
    ("no code", None),
]


@pytest.mark.parametrize("text,expected", CODE_CASES)
def test_last_code_block(text, expected):
    assert last_code_block(text) == expected


# ----- numbers, units, fractions --------------------------------------------------------------
NUMBER_CASES = [
    ("1,234", 1234),
    ("$18.00", 18),
    (r"\$18", 18),
    ("18 dollars", 18),
    (r"5 \text{ cm}", 5),
    ("50%", 50),
    ("-3", -3),
    ("7/2", 3.5),
    (r"\frac{7}{2}", 3.5),
    (r"\dfrac{1}{4}", 0.25),
    ("0.50", 0.5),
    ("1,23", None),  # not a thousands separator
    ("x+1", None),
    ("1/0", None),
]


@pytest.mark.parametrize("text,expected", NUMBER_CASES)
def test_numeric_value(text, expected):
    value = numeric_value(text)
    assert (value is None) if expected is None else float(value) == pytest.approx(expected)


GSM8K_CASES = [
    ("72", "72", True),
    ("72.00", "72", True),
    ("$1,000", "1000", True),
    ("1000 dollars", "1000", True),
    (r"\$18", "18", True),
    (r"\frac{36}{2}", "18", True),  # a fraction of the right value
    ("18.5", "18", False),
    ("-18", "18", False),
    ("", "18", False),
    (None, "18", False),
]


@pytest.mark.parametrize("prediction,gold,expected", GSM8K_CASES)
def test_gsm8k_grading(prediction, gold, expected):
    assert gsm8k_correct(prediction, gold) is expected


def test_gsm8k_gold_reads_the_number_after_hashes():
    assert gsm8k_gold({"question": "q", "answer": "5 + 5 = <<5+5=10>>10\n#### 1,010"}) == "1010"
    assert math_gold({"problem": "p", "solution": r"so $\boxed{\frac{1}{2}}$."}) == r"\frac{1}{2}"


MATH_CASES = [
    (r"\frac{1}{2}", "0.5", True),
    ("1/2", r"\frac{1}{2}", True),
    (r"\dfrac12", r"\frac{1}{2}", True),
    (r"(3, \pi/2)", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"\frac{1}{\sqrt{3}}", r"\frac{\sqrt{3}}{3}", True),  # rationalised forms
    (r"\sqrt{18}", r"3\sqrt{2}", True),
    ("(x+1)^2", "x^2+2x+1", True),  # symbolic expansion
    ("2,1", "1,2", True),  # an unordered list of solutions
    (r"\text{(C)}", "C", True),
    (r"5^\circ", "5", True),  # degrees
    (r"18 \text{ dollars}", "18", True),  # units in \text
    ("[2,5)", "[2,5)", True),
    ("(2,5)", "[2,5)", False),  # open vs half-open interval
    ("3", "2", False),
    ("10.0001", "10", False),
    ("", "1", False),
]


@pytest.mark.parametrize("prediction,gold,expected", MATH_CASES)
def test_math_equal(prediction, gold, expected):
    assert math_equal(prediction, gold) is expected


def test_math_equal_refuses_essays_and_times_out_on_towers():
    assert math_equal("1" * 2000, "1" * 2000 + "0") is False
    # sympy would evaluate 2^(10^10) forever; the time limit makes it a wrong answer instead
    assert math_equal("3", r"2^{10^{10}}", timeout_s=1) is False


def test_math_equal_off_the_main_thread_uses_a_worker_process():
    results = {}

    def run():
        results["same"] = math_equal(r"\sqrt{18}", r"3\sqrt{2}")
        results["different"] = math_equal(r"\sqrt{17}", r"3\sqrt{2}")

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert results == {"same": True, "different": False}
