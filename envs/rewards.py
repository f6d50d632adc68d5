"""Reward functions shared by the built-in envs: QA exact match and F1, answer extraction, math.

- QA (Search-R1, NQ, HotpotQA): `normalize_answer` is the SQuAD normalisation (lower-case, drop
  punctuation and the articles a/an/the, collapse whitespace); `exact_match` and `f1_score` take
  the best score over all gold answers, as the Search-R1 and HotpotQA scorers do.
- Extraction: `extract_tag` (last ``<answer>...</answer>``), `extract_boxed` (last ``\\boxed{}``
  with nested braces), `extract_hash_answer` (GSM8K ``#### N``), `last_code_block`.
- Math: `numeric_value` reads numbers written with thousands separators, currency and units;
  `math_equal` compares two answers numerically, then symbolically with ``math-verify``, under a
  wall-clock limit (sympy can take forever on inputs such as ``2^{10^{10}}``; off the main thread
  the comparison runs in a helper process that is killed on timeout).

Every function here is pure and never trusts the model's text beyond reading it.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import concurrent.futures
import multiprocessing
import re
import string
import threading
from collections.abc import Iterable, Sequence
from fractions import Fraction

# ----- QA: SQuAD normalisation, EM, F1 ---------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, remove punctuation, articles and extra whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_list(golds: str | Iterable[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else [str(g) for g in golds]


def _same_answer(prediction: str, gold: str) -> bool:
    pred, target = normalize_answer(prediction), normalize_answer(gold)
    if pred and target:
        return pred == target
    # One side normalises to nothing (NQ-open golds "A+", "---", ")"; an answer "the" or ""):
    # the texts themselves must agree, case and spacing aside, so an empty answer never matches.
    light_pred, light_gold = " ".join(prediction.lower().split()), " ".join(gold.lower().split())
    return bool(light_pred) and light_pred == light_gold


def exact_match(prediction: str | None, golds: str | Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer.

    A gold answer that normalises to nothing ("A+" loses its article and its punctuation) is
    matched only by the same text, never by an empty answer or a lone article.
    """
    if prediction is None:
        return 0.0
    return float(any(_same_answer(prediction, g) for g in _as_list(golds)))


def sub_exact_match(prediction: str | None, golds: str | Iterable[str]) -> float:
    """1.0 when a normalised gold answer occurs inside the normalised prediction (Search-R1 sub-EM)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) and normalize_answer(g) in pred for g in _as_list(golds)))


def _f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred), normalize_answer(gold)
    # yes/no/noanswer must match exactly (the HotpotQA scorer's rule)
    if (p in ("yes", "no", "noanswer") or g in ("yes", "no", "noanswer")) and p != g:
        return 0.0
    p_tokens, g_tokens = p.split(), g.split()
    common = collections.Counter(p_tokens) & collections.Counter(g_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p_tokens), same / len(g_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golds: str | Iterable[str]) -> float:
    """Token-level F1 after normalisation, the best over the gold answers."""
    if prediction is None:
        return 0.0
    return max((_f1(prediction, g) for g in _as_list(golds)), default=0.0)


# ----- extraction -------------------------------------------------------------------------------
def extract_tag(text: str, tag: str = "answer", *, ignore_case: bool = False) -> str | None:
    """Stripped content of the last complete ``<tag>...</tag>`` in ``text``, or None.

    The last opening tag that a closing tag follows, up to the first closing tag after it; found
    in linear time (a regex ``<tag>(.*?)</tag>`` takes quadratic time on a reply of many opening
    tags, which a policy can write).
    """
    flags = re.IGNORECASE if ignore_case else 0
    opens = [m.end() for m in re.finditer(re.escape(f"<{tag}>"), text, flags)]
    closes = [m.start() for m in re.finditer(re.escape(f"</{tag}>"), text, flags)]
    if not opens or not closes:
        return None
    start_at = bisect.bisect_right(opens, closes[-1]) - 1  # the last open before the last close
    if start_at < 0:
        return None
    start = opens[start_at]
    end = closes[bisect.bisect_left(closes, start)]
    return text[start:end].strip()


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[start] == '{'`` and the index after it."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):  # an escaped brace \{ or \} does not nest
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


_MAX_UNWRAP = 8


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed N``), nested braces kept.

    A box inside the last box is unwrapped (``\\boxed{\\boxed{5}}`` gives ``5``); an unclosed box
    gives None.
    """
    found: str | None = None
    pattern = re.compile(r"\\(?:boxed|fbox)\s*(\{|\s+(?=[^\s{]))")
    pos = 0
    while (match := pattern.search(text, pos)) is not None:
        pos = match.end()
        if match.group(1) == "{":
            group = _braced(text, match.end() - 1)
            if group is None:  # unclosed: nothing after it can be a complete outer box
                break
            found, pos = group  # skip the boxes nested inside this one
        else:  # "\boxed 5": up to the next whitespace or $
            tail = re.match(r"[^\s$]+", text[match.end() :])
            if tail:
                found = tail.group(0)
    if found is None:
        return None
    found = found.strip()
    # \boxed{\boxed{5}}: unwrap a box that is the whole answer, a few levels deep at most (deeper
    # nesting is no answer worth the time; recursion here was a stack overflow for a policy)
    for _ in range(_MAX_UNWRAP):
        opening = re.match(r"\\(?:boxed|fbox)\s*\{", found)
        group = _braced(found, opening.end() - 1) if opening else None
        if group is None or group[1] != len(found):
            break
        found = group[0].strip()
    return found


def extract_hash_answer(text: str) -> str | None:
    """The answer after the last ``####`` (GSM8K format): its number, else the rest of the line."""
    found = re.findall(r"####[ \t]*([^\n]*)", text)
    if not found or not found[-1].strip():
        return None
    rest = found[-1].strip()
    number = re.match(r"(?:\\?\$\s*)?-?(?:\d[\d,]*)?\.?\d+(?:\s*/\s*\d+)?", rest)
    return number.group(0) if number else rest


_FENCE_LANGUAGE = re.compile(r"[ \t]*([\w+-]*)")


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced block, in linear time.

    A fence opens with three backticks and an info string up to the end of the line, and closes
    at the next three backticks. (The regex this replaces backtracked quadratically on a long
    line of backticks.)
    """
    blocks, pos = [], 0
    while (start := text.find("```", pos)) != -1:
        newline = text.find("\n", start + 3)
        if newline == -1:
            break
        end = text.find("```", newline + 1)
        if end == -1:
            break
        language = _FENCE_LANGUAGE.match(text, start + 3, newline)
        blocks.append((language.group(1) if language else "", text[newline + 1 : end]))
        pos = end + 3
    return blocks


def last_code_block(text: str, languages: Sequence[str] = ("python", "py", "python3", "")) -> str | None:
    """The body of the last fenced code block whose language tag is one of ``languages``."""
    blocks = [body for lang, body in _code_blocks(text) if lang.lower() in languages]
    return blocks[-1] if blocks else None


# ----- math -------------------------------------------------------------------------------------
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")
_UNIT_SUFFIX = re.compile(r"^(.*?\d)\s*(?:\\text\{[^}]*\}|\\mbox\{[^}]*\}|[a-zA-Z][a-zA-Z .]*|%|\\%)$")
#: Words a unit never contains: "18 or twenty" is two answers, not 18 of a unit called "or twenty".
_NOT_UNIT_WORDS = frozenset(
    "or and nor not no to than versus vs plus minus times over either maybe perhaps else "
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty "
    "ninety hundred thousand million billion trillion half halves third thirds quarter quarters "
    "dozen".split()
)


def _is_unit(suffix: str) -> bool:
    words = re.findall(r"[a-zA-Z]+", suffix.lower())
    return not _NOT_UNIT_WORDS.intersection(words)


def numeric_value(text: str | None, *, allow_units: bool = True) -> Fraction | None:
    """The number written in ``text``, exactly, or None when it is not a plain number.

    Accepts ``1,234``, ``$18.00``, ``\\$18``, ``-3``, ``7/2``, ``\\frac{7}{2}``, ``50%`` (as 50) and,
    with ``allow_units``, a trailing unit word (``18 dollars``, ``5 \\text{ cm}``).
    """
    if text is None:
        return None
    s = text.strip().rstrip(".").strip()
    s = s.replace("\\$", "").replace("$", "").replace("\\!", "").replace("{,}", ",")
    s = s.replace("\\left", "").replace("\\right", "").strip()
    if allow_units:
        match = _UNIT_SUFFIX.match(s)
        if match:
            if not _is_unit(s[match.end(1):]):
                return None  # a hedge ("18 or twenty") or a number word, not a unit
            s = match.group(1)
    s = s.strip()
    frac = re.fullmatch(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if frac:
        num, den = numeric_value(frac.group(1), allow_units=False), numeric_value(
            frac.group(2), allow_units=False
        )
        return num / den if num is not None and den else None
    if re.fullmatch(r"[-+]?\d+\s*/\s*\d+", s):
        num_s, den_s = s.split("/")
        return Fraction(int(num_s), int(den_s)) if int(den_s) else None
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if _NUMBER.match(s):
        return Fraction(s)
    return None


def numbers_equal(a: Fraction, b: Fraction, rel_tol: float = 1e-6) -> bool:
    """Exact for rationals; a relative tolerance covers rounded decimals of the same value."""
    if a == b:
        return True
    return abs(float(a) - float(b)) <= rel_tol * max(1.0, abs(float(b)))


def _verify_in_process(pred: str, gold: str, timeout_s: int) -> bool:
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout_s)
    pred_parsed = parse(f"${pred}$", parsing_timeout=timeout_s)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


# Process-wide on purpose: math-verify's workers hold no state of a run (each call is a pure
# function of its two strings), cost a spawn (~1 s) each, and are killed at exit; a second run in
# the process reuses them and cannot see anything of the first.
_POOL: concurrent.futures.ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ProcessPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            # spawn: forking a process that runs threads (asyncio, torch) can deadlock
            ctx = multiprocessing.get_context("spawn")
            _POOL = concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx)
            atexit.register(_shutdown_pool)
        return _POOL


def _shutdown_pool() -> None:
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()  # a worker stuck in sympy would otherwise block shutdown
        pool.shutdown(wait=False, cancel_futures=True)


def symbolic_equal(pred: str, gold: str, timeout_s: float = 5.0) -> bool:
    """``math-verify`` equivalence of two LaTeX answers; False on timeout or parse failure."""
    seconds = max(1, round(timeout_s))
    if threading.current_thread() is threading.main_thread():
        try:
            return _verify_in_process(pred, gold, seconds)
        except Exception:  # noqa: BLE001 - math-verify raises on odd input: not equal
            return False
    future = _pool().submit(_verify_in_process, pred, gold, seconds)
    try:
        # the worker's own signal alarm fires first; the margin covers start-up of a fresh worker
        return bool(future.result(timeout=3 * seconds + 30))
    except concurrent.futures.TimeoutError:
        _shutdown_pool()
        return False
    except Exception:  # noqa: BLE001 - a crashed worker means "not shown equal"
        return False


def math_equal(pred: str | None, gold: str, *, timeout_s: float = 5.0, max_chars: int = 1000) -> bool:
    """Whether ``pred`` is the same answer as ``gold``: numerically, else symbolically."""
    if pred is None or not pred.strip():
        return False
    if len(pred) > max_chars:  # a pasted essay is not an answer, and would only slow sympy
        return False
    if pred.strip() == gold.strip():
        return True
    a, b = numeric_value(pred, allow_units=False), numeric_value(gold, allow_units=False)
    if a is not None and b is not None:
        return numbers_equal(a, b)
    return symbolic_equal(pred, gold, timeout_s=timeout_s)


__all__ = [
    "exact_match",
    "extract_boxed",
    "extract_hash_answer",
    "extract_tag",
    "f1_score",
    "last_code_block",
    "math_equal",
    "normalize_answer",
    "numbers_equal",
    "numeric_value",
    "sub_exact_match",
    "symbolic_equal",
]
