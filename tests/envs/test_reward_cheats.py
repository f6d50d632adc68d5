"""Reward cheats: what an RL policy would try instead of solving, against every reward function.

Code-v0 (real sandbox runs): shadowed builtins and modules, objects that claim equality, early
exits, BaseException, protocol forgery, signals, reading the tests. Each cheat must earn 0 and
each honest solution of the same real task 1.0. Then math, Search-R1 EM and the text games.
"""

import ast
import builtins
import sys
import threading

import pytest
import pytest_asyncio

from palaestra.envs import make
from palaestra.envs.code import CodeEnv, code_task, grade
from palaestra.envs.code.grader import parse_verdict
from palaestra.envs.code.tasks import solution_names
from palaestra.envs.code.validate import reference_solution
from palaestra.envs.games import action_parser, default_parse
from palaestra.envs.math import extract_final_answer, gsm8k_correct
from palaestra.envs.rewards import (
    exact_match,
    extract_boxed,
    extract_tag,
    last_code_block,
    math_equal,
)
from palaestra.envs.search.env import qa_metrics
from palaestra.envs.shipped import load_rows

sandbox_module = pytest.importorskip("palaestra.sandbox")
# one sandbox (and event loop) for the module's async tests: starting a sandbox takes a second
aio = pytest.mark.asyncio(loop_scope="module")

HUMANEVAL = {r["task_id"]: r for r in load_rows("humaneval", {"humaneval": "code/humaneval.jsonl.gz"})}
MBPP = {r["task_id"]: r for r in load_rows("mbpp", {"mbpp": "code/mbpp.jsonl.gz"})}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox():
    async with sandbox_module.LocalSandbox() as sb:
        yield sb


async def reward_of(sandbox, row, code, timeout_s=10.0):
    result = await grade(code, code_task(row), sandbox=sandbox, timeout_s=timeout_s)
    return (1.0 if result.all_passed else 0.0), result


# ----- Code-v0: shadowing the names the tests use ----------------------------------------------
# Each one earned 1.0 before the tests ran in a namespace of their own (issue 18).
SHADOW_CHEATS = {
    "HumanEval/4 def abs": (
        "HumanEval/4",
        "def abs(x):\n    return 0\n\ndef mean_absolute_deviation(numbers):\n    return 42.0\n",
    ),
    "HumanEval/2 def abs": (
        "HumanEval/2",
        "def abs(x):\n    return 0\n\ndef truncate_number(number):\n    return 0.5\n",
    ),
    "HumanEval/32 class math": (
        "HumanEval/32",
        "class math:\n    fabs = pow = staticmethod(lambda *a: 0.0)\n\n"
        "def find_zero(xs):\n    return 0.0\n",
    ),
    "HumanEval/151 def sum": (  # right on small lists, 0 on the long one whose gold uses sum()
        "HumanEval/151",
        "def sum(*args):\n    return 0\n\ndef double_the_difference(lst):\n"
        "    if len(lst) > 20:\n        return 0\n    total = 0\n"
        "    for i in lst:\n        if isinstance(i, int) and i > 0 and i % 2:\n"
        "            total += i * i\n    return total\n",
    ),
    "MBPP/596 class sys": (
        596,
        "class sys:\n    getsizeof = staticmethod(lambda x: 0)\n\ndef tuple_size(t):\n    return 0\n",
    ),
}


@pytest.mark.parametrize("name", sorted(SHADOW_CHEATS))
@aio
async def test_shadowing_builtins_and_modules_earns_nothing(sandbox, name):
    task_id, cheat = SHADOW_CHEATS[name]
    row = HUMANEVAL[task_id] if isinstance(task_id, str) else MBPP[task_id]
    reward, result = await reward_of(sandbox, row, cheat)
    assert reward == 0.0, (name, result)
    honest, result = await reward_of(sandbox, row, reference_solution(row))
    assert honest == 1.0, (name, result)


# A stand-in for every builtin and module the tests use: the real thing for the solution's own
# code, an opaque object for anyone else. If the tests saw the solution's names, every comparison
# through one of them would fail; they must not, so an honest solution keeps its full reward.
POISON = '''
import builtins as _builtins, importlib as _importlib, sys as _sys


def _outsider(depth):
    return _sys._getframe(depth).f_globals is not globals()


class _PoisonType(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, cls._real)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls._real)

    def __call__(cls, *args, **kwargs):
        return object() if _outsider(2) else cls._real(*args, **kwargs)

    def __getattr__(cls, name):
        return getattr(cls._real, name)


def _poison_function(real):
    def poisoned(*args, **kwargs):
        return object() if _outsider(2) else real(*args, **kwargs)
    return poisoned


class _PoisonModule:
    def __init__(self, name):
        object.__setattr__(self, "_real", _importlib.import_module(name))

    def __getattr__(self, name):
        real = getattr(object.__getattribute__(self, "_real"), name)
        if _outsider(2):
            return object()
        return real
'''


def poisoned_names(row):
    """Builtins and stdlib modules the task's tests use by name (not the task's own names)."""
    sources = [row["test"]] if "test" in row else [*row["test_list"], row.get("test_setup_code") or ""]
    used = set()
    for source in sources:
        used |= {n.id for n in ast.walk(ast.parse(source))
                 if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    known = set(dir(builtins)) | set(sys.stdlib_module_names)
    return sorted((used & known) - set(solution_names(row)) - {"True", "False", "None"})


def poison_program(row, names):
    lines = [POISON]
    for name in names:
        real = getattr(builtins, name, None)
        if isinstance(real, type):
            lines.append(f"{name} = _PoisonType({name!r}, (), {{'_real': _builtins.{name}}})")
        elif real is not None:
            lines.append(f"{name} = _poison_function(_builtins.{name})")
        else:
            lines.append(f"{name} = _PoisonModule({name!r})")
    return reference_solution(row) + "\n" + "\n".join(lines) + "\n"


POISONED_TASKS = sorted(
    [t for t, r in HUMANEVAL.items() if poisoned_names(r)]
    + [t for t, r in MBPP.items() if poisoned_names(r)],
    key=str,
)


def test_the_poisoned_task_list_covers_both_families():
    assert len([t for t in POISONED_TASKS if isinstance(t, str)]) == 17  # issue 18's count
    assert {533, 596, 912} <= set(POISONED_TASKS)


@pytest.mark.parametrize("task_id", POISONED_TASKS)
@aio
async def test_tests_never_see_the_solutions_names(sandbox, task_id):
    row = HUMANEVAL[task_id] if isinstance(task_id, str) else MBPP[task_id]
    program = poison_program(row, poisoned_names(row))
    reward, result = await reward_of(sandbox, row, program)
    assert reward == 1.0, (task_id, poisoned_names(row), result)


def test_only_the_task_names_come_from_the_solution():
    assert solution_names(HUMANEVAL["HumanEval/32"]) == ["find_zero"]  # not poly, not math
    assert solution_names(HUMANEVAL["HumanEval/38"]) == ["decode_cyclic"]  # not encode_cyclic
    assert solution_names(MBPP[601]) == ["Pair", "max_chain_length"]
    assert solution_names(MBPP[126]) == ["sum"]  # the task itself redefines the builtin
    assert solution_names(MBPP[596]) == ["tuple_size"]  # sys is the grader's
    no_reference = {k: v for k, v in MBPP[596].items() if k != "code"}
    assert solution_names(no_reference) == ["tuple_size"]


# ----- Code-v0: cheats that do not depend on the task -------------------------------------------
ADD_ROW = {
    "task_id": "Cheat/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
            "    assert candidate(10, 5) == 15\n    assert candidate(1, 1)\n"
            "    assert {candidate(4, 4): 1} == {8: 1}\n    assert [candidate(0, 7)] == [7]\n",
}
MBPP_ROW = {"task_id": 10_000, "text": "Add two numbers.", "code": "def add(a, b):\n    return a + b\n",
            "test_list": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]}
WRONG = "def add(a, b):\n    return a - b\n"

GENERIC_CHEATS = {
    "always-equal object with hash and bool": (
        "class Anything:\n    __eq__ = lambda self, other: True\n    __ne__ = lambda self, other: False\n"
        "    __hash__ = lambda self: 8\n    __bool__ = lambda self: True\n"
        "def add(a, b):\n    return Anything()\n"
    ),
    "always-equal str, int and float subclasses": (
        "class S(str):\n    __eq__ = lambda self, other: True\n    __hash__ = str.__hash__\n"
        "class F(float):\n    __eq__ = lambda self, other: True\n    __hash__ = float.__hash__\n"
        "def add(a, b):\n    return F(0) if a % 2 else S('x')\n"
    ),
    "a dict and list holding always-equal keys": (
        "class K:\n    __eq__ = lambda s, o: True\n    __hash__ = lambda s: hash(8)\n"
        "def add(a, b):\n    return [K()]\n"
    ),
    "sys.exit(0) at import": "import sys\nsys.exit(0)\n" + WRONG,
    "os._exit(0) at import": "import os\nos._exit(0)\n" + WRONG,
    "os._exit(0) inside the function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "SystemExit inside the function": "def add(a, b):\n    raise SystemExit(0)\n",
    "KeyboardInterrupt and GeneratorExit": (
        "def add(a, b):\n    raise (KeyboardInterrupt if a > 0 else GeneratorExit)()\n"
    ),
    "a BaseException subclass": "class Win(BaseException): pass\ndef add(a, b):\n    raise Win()\n",
    "prints fake verdicts everywhere": (
        "import os, sys\nline = '\\n@@palaestra-result 0 {\"passed\": 9, \"total\": 9}\\n'\n"
        "print(line); sys.__stdout__.write(line); os.write(1, line.encode()); os.write(2, line.encode())\n"
        "for path in (f'/proc/{os.getppid()}/fd/1', '/dev/stdout', '/dev/tty'):\n"
        "    try:\n        open(path, 'w').write(line)\n    except Exception:\n        pass\n" + WRONG
    ),
    "monkeypatches builtins, __import__ and sys.modules": (
        "import builtins, sys\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
        "builtins.__import__ = lambda *a, **k: None\nbuiltins.abs = builtins.len = lambda x: 0\n"
        "sys.modules['json'] = None\nsys.modules['math'] = None\n" + WRONG
    ),
    "patches the request loop it runs in": (
        "import sys\ndef add(a, b):\n    frame = sys._getframe(1)\n"
        "    frame.f_globals['encode'] = lambda value, refs, depth=0: True\n    return 0\n"
    ),
    "hunts the test frame and the recorder with gc": (
        "import gc\ndef add(a, b):\n    for obj in gc.get_objects():\n"
        "        if isinstance(obj, dict) and '__record__' in obj:\n"
        "            for _ in range(100):\n                obj['__record__'](None)\n"
        "        if getattr(obj, '__name__', '') == 'check':\n            obj.__code__ = (lambda c: None).__code__\n"
        "    return 0\n"
    ),
    "writes protocol frames of its own": (
        "import json, struct, sys\nfd = int(sys.argv[3]) if len(sys.argv) > 3 else 4\n"
        "def frame(obj):\n    blob = json.dumps(obj).encode()\n    return struct.pack('>I', len(blob)) + blob\n"
        "import os\nfor fd in range(3, 20):\n    for msg in ({'ok': True, 'value': 5}, {'op': 'call', 'ref': 1},\n"
        "                {'ok': True, 'names': ['add']}, {'ok': True, 'value': {'$builtin': 'exit'}}):\n"
        "        try:\n            os.write(fd, frame(msg))\n        except OSError:\n            pass\n" + WRONG
    ),
    "interrupts the judge": "import os, signal\nos.kill(os.getppid(), signal.SIGINT)\n" + WRONG,
    "terminates the judge": "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)\n" + WRONG,
    "stops the judge": (
        "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGSTOP)\n    return a + b\n"
    ),
    "kills its whole process group": "import os, signal\nos.killpg(0, signal.SIGKILL)\n",
    "signal handlers and alarms": (
        "import signal, os\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\nsignal.alarm(1)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + WRONG
    ),
    "loops forever at import": "while True:\n    pass\n",
    "loops forever in the function": "def add(a, b):\n    while True:\n        pass\n",
    "a huge and a deeply nested return value": (
        "def add(a, b):\n    if a > 0:\n        return list(range(10 ** 6))\n"
        "    v = []\n    for _ in range(10000):\n        v = [v]\n    return v\n"
    ),
    "a generator and a module instead of values": (
        "import math\ndef add(a, b):\n    return (x for x in [a + b]) if a > 0 else math\n"
    ),
}


@pytest.mark.parametrize("family", ["humaneval", "mbpp"])
@pytest.mark.parametrize("name", sorted(GENERIC_CHEATS))
@aio
async def test_generic_cheats_earn_nothing(sandbox, name, family):
    row = ADD_ROW if family == "humaneval" else MBPP_ROW
    reward, result = await reward_of(sandbox, row, GENERIC_CHEATS[name], timeout_s=2.0)
    assert reward == 0.0 and result.passed < result.total, (name, result)


@pytest.mark.parametrize("row", [ADD_ROW, MBPP_ROW], ids=["humaneval", "mbpp"])
@aio
async def test_the_honest_answer_to_the_cheat_rows_passes(sandbox, row):
    reward, result = await reward_of(sandbox, row, "def add(a, b):\n    return a + b\n")
    assert reward == 1.0 and result.passed == result.total, result


SECRET_ROW = {
    "task_id": "Cheat/1",
    "prompt": 'def secret() -> str:\n    """Return the secret."""\n',
    "entry_point": "secret",
    "test": "def check(candidate):\n    assert candidate() == 'TOPSECRET-' + 'c0ffee42'\n",
}
THIEF = r'''
import gc, glob, os, re, sys
def secret():
    # the hidden test reads  'TOPSECRET-' + '<8 hex digits>': find it anywhere, return the value
    pattern = re.compile(rb"TOPSECRET-' \+ '([0-9a-f]{8})")
    def scan(blob):
        found = pattern.search(blob if isinstance(blob, bytes) else str(blob).encode())
        if found:
            raise StopIteration("TOPSECRET-" + found.group(1).decode())
    try:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                fds = ["fd/" + fd for fd in os.listdir(f"/proc/{pid}/fd")]
            except OSError:
                fds = ["fd/0", "fd/1", "fd/2", "fd/3", "fd/4", "fd/5"]
            for leaf in ["cmdline", "environ", *fds]:
                try:
                    with open(f"/proc/{pid}/{leaf}", "rb") as f:
                        scan(f.read(1 << 20))
                except OSError: pass
            try:
                with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
                    for line in maps:
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        try:
                            mem.seek(lo)
                            scan(mem.read(min(hi - lo, 1 << 24)))
                        except (OSError, ValueError, OverflowError): pass
            except OSError: pass
        for path in glob.glob("*") + glob.glob(".*") + glob.glob("/tmp/*") + glob.glob("../*"):
            try:
                with open(path, "rb") as f:
                    scan(f.read(1 << 20))
            except OSError: pass
        for obj in gc.get_objects():
            scan(repr(obj)[:10000])
    except StopIteration as found:
        return str(found)
    return "nothing found"
'''


@aio
async def test_the_thief_finds_a_secret_it_can_reach(sandbox):
    """Control: the same scanner, given a readable copy of the test, does find the value."""
    leak = {"notes.txt": b"assert candidate() == 'TOPSECRET-' + 'c0ffee42'"}
    result = await sandbox.run(THIEF + "\nprint(secret())\n", timeout=10, files=leak)
    assert result.stdout.strip() == "TOPSECRET-c0ffee42", result


@aio
async def test_the_solution_cannot_read_the_tests_through_any_process(sandbox):
    reward, result = await reward_of(sandbox, SECRET_ROW, THIEF)
    assert reward == 0.0 and result.error is None and result.total == 2 and result.passed == 1
    reward, _ = await reward_of(sandbox, SECRET_ROW, "def secret():\n    return 'TOPSECRET-c0ffee42'\n")
    assert reward == 1.0


def test_a_second_verdict_line_voids_the_verdict():
    line = '@@palaestra-result abc {"passed": 3, "total": 3, "failures": []}'
    assert parse_verdict(line, "abc", 3).all_passed
    doubled = parse_verdict('@@palaestra-result abc {"passed": 0, "total": 3}\n' + line, "abc", 3)
    assert not doubled.all_passed and "2 verdicts" in doubled.error
    assert parse_verdict('@@palaestra-result abc [1]', "abc", 3).error  # not an object
    assert parse_verdict('@@palaestra-result abc {"passed": -5, "total": 0}', "abc", 3).passed == 0


@aio
async def test_code_env_reward_for_a_shadow_cheat_is_zero(sandbox):
    """The same cheat through the env's own episode (prompt, final message, reward)."""
    env = CodeEnv(dataset=[HUMANEVAL["HumanEval/4"]], sandbox=sandbox)
    await env.areset(seed=0)
    cheat = SHADOW_CHEATS["HumanEval/4 def abs"][1]
    _, reward, terminated, _, info = await env.astep(f"```python\n{cheat}```")
    assert reward == 0.0 and terminated and info["passed"] < info["total"], info


# ----- math --------------------------------------------------------------------------------------
HEDGES = [
    "1 or 2", r"1 \text{ or } 2", "1, 2", r"\{1, 2\}", "x=1 or x=2", r"1 \lor 2", "1 and 2",
    r"1 \\ 2", "1; 2", "[1, 2]", r"\pm 1", r"1 \approx 2", "1 | 2", r"1 \mid 2", r"1 \to 2",
    r"1 \Rightarrow 2", r"1 \hspace{1cm} 2", "1 \n 2", "1=2", "2=1", r"\boxed{1}\boxed{2}",
    r"\begin{cases}1\\2\end{cases}", "1 2",
]


@pytest.mark.parametrize("hedge", HEDGES)
def test_a_hedged_math_answer_never_matches_two_golds(hedge):
    assert not (math_equal(hedge, "1", timeout_s=2) and math_equal(hedge, "2", timeout_s=2))


@pytest.mark.parametrize("hedge", ["18 or twenty", "18 or 20", "18 and twenty", "18 dollars or twenty",
                                   "18 one", "18 not 20"])
def test_gsm8k_hedges_with_number_words_earn_nothing(hedge):
    # "18 or twenty" read as 18 of a unit "or twenty" before: a hedge covering 18 and 20
    assert not gsm8k_correct(hedge, "18") and not gsm8k_correct(hedge, "20")
    assert gsm8k_correct("18 dollars", "18") and gsm8k_correct("18 miles per hour", "18")


def test_boxed_spam_counts_only_the_last_box():
    spam = " ".join(rf"\boxed{{{i}}}" for i in range(100))
    assert extract_final_answer(spam) == "99"
    assert extract_boxed(r"\boxed{\boxed{1} + \boxed{2}}") == r"\boxed{1} + \boxed{2}"  # not "2"
    assert extract_boxed(r"\boxed{\boxed{\boxed{7}}}") == "7"
    assert extract_final_answer(r"\boxed{}") == "" and not math_equal("", "0")


def test_pathological_replies_are_graded_not_crashed():
    deep = r"\boxed{" * 5000 + "1" + "}" * 5000  # recursion depth 5000 raised RecursionError
    assert extract_boxed(deep) is not None
    assert not math_equal(extract_boxed(deep), "1")
    assert not math_equal("1" * 100_000, "1" * 100_000 + "1")


def linear_enough(fn, text):
    """fn(text) finishes within a minute (the regexes it replaces took quadratic time)."""
    done = []
    worker = threading.Thread(target=lambda: done.append(fn(text)), daemon=True)
    worker.start()
    worker.join(60)
    return bool(done)


@pytest.mark.parametrize("name,fn,text", [
    ("a line of backticks", last_code_block, "`" * 400_000),
    ("many opening answer tags", extract_tag, "<answer>" * 50_000),
    ("many opening action tags", action_parser(["left", "right"]), "<action>" * 50_000),
    ("many opening boxes", extract_boxed, r"\boxed{" * 50_000),
])
def test_huge_replies_are_read_in_linear_time(name, fn, text):
    assert linear_enough(fn, text), name


@pytest.mark.parametrize("bomb", [r"9^{9^{9}}", r"(10^{9})!"])
def test_sympy_bombs_are_wrong_answers_not_hangs(bomb):
    assert math_equal(bomb, "3", timeout_s=1) is False


def test_tag_extraction_keeps_its_meaning():
    assert extract_tag("<answer>first</answer> then <answer>second</answer>") == "second"
    assert extract_tag("<answer>x</answer> junk </answer>") == "x"
    assert extract_tag("</answer><answer>y") is None
    assert last_code_block("```python\na\n```\n```bash\nls\n```\n````\nb\n```") == "b\n"


# ----- Search-R1 EM ------------------------------------------------------------------------------
NQ = load_rows("nq_open", {"nq_open": "search/nq_open_dev.jsonl.gz"})


def test_empty_answers_do_not_match_golds_that_normalise_to_nothing():
    """NQ-open golds "A+", "---", ")" and "*" normalise to "": an empty answer matched them."""
    from palaestra.envs.search.env import golden_answers

    rows = [r for r in NQ if any(g in ("A+", "---", ")", "*") for g in golden_answers(r))]
    assert len(rows) == 4
    for row in rows:
        golds = golden_answers(row)
        for empty in ("", "the", "a", "!!!", " . "):
            assert qa_metrics(empty, golds)["em"] == 0.0, (golds, empty)
        assert qa_metrics(golds[0], golds)["em"] == 1.0


def test_listing_many_candidates_in_one_answer_earns_nothing():
    golds = ["Paris"]
    for listing in ("Paris, London, Rome", "Paris or London", "London; Paris", "paris paris",
                    "Paris\nLondon", "Paris (or maybe Lyon)"):
        assert exact_match(listing, golds) == 0.0, listing
    text = "<answer>London</answer><answer>Rome</answer><answer>Paris London</answer>"
    assert qa_metrics(extract_tag(text), golds)["em"] == 0.0
    for near in ("Par\u200bis", "P a r i s", "Pariss"):
        assert exact_match(near, golds) == 0.0, near
    assert exact_match("the Paris.", golds) == 1.0  # the normalisation itself is SQuAD's


# ----- text games ----------------------------------------------------------------------------------
GAMES = ["palaestra/FrozenLake-v0", "palaestra/Taxi-v0", "palaestra/CliffWalking-v0",
         "palaestra/Blackjack-v0"]


def play(env_id, seed, moves):
    env = make(env_id)
    env.reset(seed=seed)
    total, terminated, truncated = 0.0, False, False
    for move in moves:
        _, reward, terminated, truncated, _ = env.step(move)
        total += reward
        if terminated or truncated:
            break
    return total, env


@pytest.mark.parametrize("env_id", GAMES)
def test_giving_up_with_invalid_moves_never_beats_playing(env_id):
    """Before: 3 invalid moves ended CliffWalking at 0 (the best honest return is -13) and
    Blackjack at 0 (an honest hand is worth less than 0 on average)."""
    for seed in range(3):
        forfeit, env = play(env_id, seed, ["no idea"] * 100)
        n_moves = int(env.game.action_space.n)
        for move in range(n_moves):  # every fixed legal move, played until the episode ends
            honest, _ = play(env_id, seed, [f"<action>{move}</action>"] * 100)
            assert forfeit <= honest, (env_id, seed, move, forfeit, honest)


@pytest.mark.parametrize("env_id", GAMES[:3])
def test_an_invalid_move_costs_at_least_the_worst_legal_move(env_id):
    env = make(env_id)
    env.reset(seed=0)
    table = env.game.unwrapped.P
    worst = min(r for s in table for a in table[s] for _, _, r, _ in table[s][a])
    _, reward, *_ = env.step("<action>fly</action>")
    assert reward <= worst


def test_malformed_actions_are_invalid_moves_not_crashes():
    parse = action_parser(["left", "right"])
    assert parse("<action>" + "9" * 5000 + "</action>") is None  # int() raised ValueError
    assert default_parse("<action>" + "1" * 5000 + "</action>") is None
    assert parse("<action>-1</action>") is None and parse("<ACTION>Right</ACTION>") == 1
    env = make("palaestra/FrozenLake-v0")
    env.reset(seed=0)
    for text in ("<action>" + "9" * 5000 + "</action>", "<action>-1</action>", "<action>4</action>",
                 "<action></action>", "\x00", "<action>left right</action>"):
        _, reward, _, _, info = env.step(text)
        assert info.get("invalid_action") and reward == 0.0, text
        env.reset(seed=0)
