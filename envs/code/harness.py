"""Test harness for model-written code; runs INSIDE the sandbox as a standalone program.

Standard library only (the palaestra package is not visible in the sandbox). The Code env runs
``HARNESS_SOURCE = <this file's text>`` + `BOOTSTRAP_LINE` as the program, with the solution as
``solution.py`` and the test spec on stdin.

Trust split: a model could "pass" tests run in its own process in many ways (``sys.exit(0)``
before the tests, ``os._exit(0)`` from ``atexit``, patching builtins, returning an object whose
``__eq__`` is always true, printing a fake success line). So the solution never shares a process
with the tests:

1. The judge process makes itself non-dumpable (other processes of the same user cannot read its
   memory, file descriptors or stdin through /proc or ptrace), then forks and execs a fresh
   interpreter for the solution: a fresh address space, so nothing the sandbox put in this
   process's memory (the run request holds the tests) reaches the solution.
2. The solution process gets /dev/null as stdin/stdout/stderr, keeps only its request pipes,
   executes ``solution.py`` and then answers requests: get a name, call a function, get/set an
   attribute. Values cross the pipe as tagged JSON that decodes to plain built-in data only
   (exact types: no subclasses, no user objects); anything else comes back as an opaque handle
   that can be passed back or called, but has no truth value and no equality.
3. The judge reads the test spec (tests and a one-time nonce) from stdin and runs the tests
   (trusted code from the dataset) in a namespace of its own: the judge's builtins, the modules
   it imports itself, the prompt's helpers as the prompt wrote them, and proxies for the
   spec's ``solution_names`` only (the entry point, the names the task asks for). A solution
   that defines ``abs`` or ``class math`` changes nothing the tests see; its helpers run in its
   own process, called by its own functions.
4. The judge prints one result line ``@@palaestra-result <nonce> {"passed": p, "total": t, ...}``.
   A solution that exits early, crashes, hangs or kills the judge produces no valid line, which
   the host grades as a failure.
"""

import ast
import base64
import builtins
import collections
import ctypes
import json
import math
import os
import select
import signal
import struct
import sys
import time
import traceback

RESULT_MARKER = "@@palaestra-result"
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
MAX_FRAME = 64 * 1024 * 1024
_EXACT_SCALARS = (type(None), bool, int, str)
_DICT_TYPES = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)


# ------------------------------------------------------------------------- value encoding
def encode(value, refs, depth=0):
    """Tagged JSON of built-in data; other objects become handles registered in ``refs``."""
    kind = type(value)
    if depth > 200:
        raise ValueError("value nested too deeply")
    if kind in _EXACT_SCALARS:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$f": repr(value)}
    if kind is list:
        return [encode(v, refs, depth + 1) for v in value]
    if kind is tuple:
        return {"$t": [encode(v, refs, depth + 1) for v in value]}
    if kind in _DICT_TYPES:  # the stdlib dicts compare as plain dicts
        return {"$d": [[encode(k, refs, depth + 1), encode(v, refs, depth + 1)]
                       for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"$fs" if kind is frozenset else "$s": [encode(v, refs, depth + 1) for v in value]}
    if kind is bytes:
        return {"$b": base64.b64encode(value).decode()}
    if kind is complex:
        return {"$c": [encode(value.real, refs), encode(value.imag, refs)]}
    if refs is None:
        raise TypeError(f"cannot send a {kind.__name__} to the solution")
    handle = refs.handle(value)
    return {"$ref": handle, "type": kind.__name__, "callable": callable(value)}


def decode(data, make_ref, builtin=None):
    """Plain data back from tagged JSON; ``builtin`` resolves ``$builtin`` (the solution side only)."""
    if isinstance(data, list):
        return [decode(v, make_ref, builtin) for v in data]
    if not isinstance(data, dict):
        return data
    if "$f" in data:
        return float(data["$f"])
    if "$t" in data:
        return tuple(decode(v, make_ref, builtin) for v in data["$t"])
    if "$d" in data:
        return {decode(k, make_ref, builtin): decode(v, make_ref, builtin) for k, v in data["$d"]}
    if "$s" in data:
        return {decode(v, make_ref, builtin) for v in data["$s"]}
    if "$fs" in data:
        return frozenset(decode(v, make_ref, builtin) for v in data["$fs"])
    if "$b" in data:
        return base64.b64decode(data["$b"])
    if "$c" in data:
        return complex(data["$c"][0], data["$c"][1])
    if "$ref" in data:
        return make_ref(data)
    if "$builtin" in data and builtin is not None:
        return builtin(data["$builtin"])
    raise ValueError("unknown tag")


class Refs:
    """Objects of the solution process handed out as numbered handles (kept alive here)."""

    def __init__(self):
        self.objects = {}
        self.ids = {}

    def handle(self, value):
        if id(value) not in self.ids:
            self.ids[id(value)] = len(self.objects) + 1
            self.objects[self.ids[id(value)]] = value
        return self.ids[id(value)]

    def __getitem__(self, handle):
        return self.objects[handle]


# ------------------------------------------------------------------------- framing
def send(fd, obj):
    blob = json.dumps(obj, separators=(",", ":")).encode()
    data = struct.pack(">I", len(blob)) + blob
    while data:
        data = data[os.write(fd, data):]


def recv(fd, deadline=None):
    def read_exact(n):
        chunks = []
        while n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError("the solution did not answer in time")
            chunk = os.read(fd, min(n, 1 << 20))
            if not chunk:
                raise EOFError("the solution process ended")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    (size,) = struct.unpack(">I", read_exact(4))
    if size > MAX_FRAME:
        raise ValueError("the solution sent an oversized message")
    return json.loads(read_exact(size))


# ------------------------------------------------------------------------- solution process
def start_solution_process(requests, replies):
    """Fork, then exec a FRESH interpreter for the solution (see the module docstring).

    A plain fork would hand the solution a copy of this process's memory, which holds the
    sandbox's copy of the run request (tests and nonce included); exec replaces it all.
    """
    pid = os.fork()
    if pid:
        return pid
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for fd in (requests, replies):
            os.set_inheritable(fd, True)
        keep = {0, 1, 2, requests, replies}
        for fd in range(3, 4096):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        argv = [sys.executable, "-I", "-c", BOOTSTRAP, "solution", str(requests), str(replies)]
        os.execve(sys.executable, argv, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    finally:
        os._exit(127)


def solution_process(requests, replies):
    with open("solution.py", encoding="utf-8", errors="replace") as f:
        source = f.read()
    refs = Refs()
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102 - running code is the point
        names = [k for k in namespace if not k.startswith("__")]
        send(replies, {"ok": True, "names": names})
    except BaseException as exc:  # noqa: BLE001 - report anything, including SystemExit
        send(replies, {"ok": False, "error": _describe(exc)})
        os._exit(0)
    while True:
        request = recv(requests)
        try:
            send(replies, {"ok": True, "value": _serve(request, namespace, refs)})
        except BaseException as exc:  # noqa: BLE001
            send(replies, {"ok": False, "error": _describe(exc), "type": type(exc).__name__})


def _serve(request, namespace, refs):
    def resolve(data):
        return decode(data, lambda d: refs[d["$ref"]], _builtin)

    op = request["op"]
    if op == "get":
        return encode(namespace[request["name"]], refs)
    target = refs[request["ref"]]
    if op == "call":
        args = [resolve(a) for a in request["args"]]
        kwargs = {k: resolve(v) for k, v in request["kwargs"].items()}
        return encode(target(*args, **kwargs), refs)
    if op == "getattr":
        return encode(getattr(target, request["name"]), refs)
    if op == "setattr":
        setattr(target, request["name"], resolve(request["value"]))
        return None
    raise ValueError(f"unknown op {op!r}")


def _builtin(name):
    """A builtin the tests passed (MBPP 533 passes ``int``): the solution process's own."""
    return getattr(builtins, str(name))


def _describe(exc):
    text = f"{type(exc).__name__}: {exc}"
    return text[:500]


# ------------------------------------------------------------------------- judge process
class SolutionError(Exception):
    """The solution process failed to answer (crashed, hung, or sent garbage)."""


class Connection:
    def __init__(self, requests, replies, deadline):
        self.requests, self.replies, self.deadline = requests, replies, deadline

    def ask(self, request):
        try:
            send(self.requests, request)
            reply = recv(self.replies, self.deadline)
        except (OSError, EOFError, TimeoutError, ValueError) as exc:
            raise SolutionError(str(exc)) from None
        if not isinstance(reply, dict) or "ok" not in reply:
            raise SolutionError("malformed reply from the solution")
        if not reply["ok"]:
            raise _exception(reply.get("type"), reply.get("error", "error"))
        return self.decode(reply.get("value"))

    def decode(self, data):
        try:
            return decode(data, self.remote)
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise SolutionError(f"undecodable value from the solution: {exc}") from None

    def remote(self, data):
        # never resolved to a module or object of this process: a solution's "math" stays its own
        return Remote(self, int(data["$ref"]), str(data.get("type"))[:100])

    def encode(self, value):
        return encode(value, None) if not isinstance(value, Remote) else {"$ref": value._ref}


def _exception(type_name, message):
    cls = getattr(builtins, str(type_name), None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        try:
            return cls(message)
        except Exception:  # noqa: BLE001, S110 - exotic constructors fall back below
            pass
    return RuntimeError(message)


def _encode_arg(conn, value, depth=0):
    if isinstance(value, Remote):
        return {"$ref": object.__getattribute__(value, "_ref")}
    kind = type(value)
    name = getattr(value, "__name__", None)
    if (kind is type or kind is type(len)) and isinstance(name, str) \
            and getattr(builtins, name, None) is value:
        return {"$builtin": name}  # a builtin type or function is sent by name
    if kind is list:
        return [_encode_arg(conn, v, depth + 1) for v in value]
    if kind is tuple:
        return {"$t": [_encode_arg(conn, v, depth + 1) for v in value]}
    if kind is dict:
        return {"$d": [[_encode_arg(conn, k, depth + 1), _encode_arg(conn, v, depth + 1)]
                       for k, v in value.items()]}
    return encode(value, None, depth)


class Remote:
    """A handle on an object of the solution process: callable and attribute access only."""

    __slots__ = ("_conn", "_ref", "_type")

    def __init__(self, conn, ref, type_name):
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)

    def __call__(self, *args, **kwargs):
        conn = object.__getattribute__(self, "_conn")
        return conn.ask({
            "op": "call", "ref": object.__getattribute__(self, "_ref"),
            "args": [_encode_arg(conn, a) for a in args],
            "kwargs": {k: _encode_arg(conn, v) for k, v in kwargs.items()},
        })

    def __getattr__(self, name):
        conn = object.__getattribute__(self, "_conn")
        return conn.ask({"op": "getattr", "ref": object.__getattribute__(self, "_ref"),
                         "name": name})

    def __setattr__(self, name, value):
        conn = object.__getattribute__(self, "_conn")
        conn.ask({"op": "setattr", "ref": object.__getattribute__(self, "_ref"), "name": name,
                  "value": _encode_arg(conn, value)})

    def _no(self, *args):
        raise TypeError(f"a {object.__getattribute__(self, '_type')} object returned by the "
                        "solution cannot be compared or tested; return plain data")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __len__ = __iter__ = _no
    __hash__ = object.__hash__

    def __repr__(self):
        return f"<solution {object.__getattribute__(self, '_type')} object>"


class Recorder:
    def __init__(self):
        self.passed = 0
        self.total = 0
        self.failures = []

    def __call__(self, error):
        self.total += 1
        if error is None:
            self.passed += 1
        elif len(self.failures) < 3:
            self.failures.append(_describe(error))


def _instrument_check(tree, recorder_name):
    """Wrap each top-level assert of ``def check`` so every one is counted."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            body = []
            for stmt in node.body:
                if isinstance(stmt, ast.Assert):
                    wrapped = ast.parse(
                        f"try:\n    pass\nexcept Exception as _e:\n    {recorder_name}(_e)\n"
                        f"else:\n    {recorder_name}(None)\n"
                    ).body[0]
                    wrapped.body = [stmt]
                    body.append(wrapped)
                else:
                    body.append(stmt)
            node.body = body
    return ast.fix_missing_locations(tree)


def _module_bases(sources):
    """Names the tests use as ``name.attr`` and never assign: modules the grader imports."""
    bases, assigned = set(), set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                bases.add(node.value.id)
            elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                assigned.add(node.id)
    return bases - assigned


def _grader_namespace(sources, taken):
    """A fresh namespace for the tests: the judge's own builtins and stdlib modules only.

    The tests of a dataset sometimes use a module the reference solution imported (MBPP 596
    reads ``sys.maxsize``); the judge imports such modules itself, never taking the solution's.
    """
    namespace = {"__name__": "tests", "__builtins__": builtins}
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    for name in sorted(_module_bases(sources) - set(taken)):
        if name in stdlib and not hasattr(builtins, name):
            try:
                namespace[name] = __import__(name)
            except ImportError:
                pass
    return namespace


def _take(conn, names, wanted, namespace):
    """Bind ``wanted`` (the names the task requires) to the solution's objects, nothing else."""
    for name in wanted:
        if name in names:
            namespace[name] = conn.ask({"op": "get", "name": name})


def run_tests(conn, names, spec, recorder):
    """Run the spec's tests in a namespace the solution cannot shadow.

    Builtins and modules are the judge's; the prompt's helpers are the trusted prompt's; only
    ``spec["solution_names"]`` (the entry point, the names the task asks for) come from the
    solution, as handles on its objects: its other names, ``def abs``, ``class math`` or a
    patched helper included, never reach the tests.
    """
    wanted = [str(n) for n in spec.get("solution_names") or [spec.get("entry_point")] if n]
    if spec["kind"] == "humaneval":
        prompt, test = spec.get("prompt", ""), spec["test"]
        namespace = _grader_namespace([test], wanted)
        namespace["__record__"] = recorder
        exec(compile(prompt, "prompt.py", "exec"), namespace)  # noqa: S102 - trusted dataset code
        _take(conn, names, wanted, namespace)
        exec(compile(_instrument_check(ast.parse(test), "__record__"), "test.py", "exec"), namespace)  # noqa: S102 - trusted dataset code
        entry = spec["entry_point"]
        if entry not in names:
            recorder(NameError(f"the solution does not define {entry!r}"))
            return
        candidate = conn.ask({"op": "get", "name": entry})
        try:
            namespace["check"](candidate)
        except Exception as exc:  # noqa: BLE001 - a failing test is data
            recorder(exc)
        else:
            recorder(None)
        return
    setup = spec.get("setup", "")
    namespace = _grader_namespace([setup, *spec["asserts"]], wanted)
    _take(conn, names, wanted, namespace)
    if setup:
        exec(compile(setup, "setup.py", "exec"), namespace)  # noqa: S102 - trusted dataset code
    for source in spec["asserts"]:
        try:
            exec(compile(source, "test.py", "exec"), namespace)  # noqa: S102 - trusted dataset code
        except Exception as exc:  # noqa: BLE001
            recorder(exc)
        else:
            recorder(None)


def judge():
    sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
    libc = ctypes.CDLL(None)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        print("cannot make the judge non-dumpable", file=sys.stderr)
        return 3
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = start_solution_process(req_r, rep_w)
    os.close(req_r)
    os.close(rep_w)
    spec = json.loads(sys.stdin.buffer.read().decode())  # read only after the fork
    nonce = spec.pop("nonce")
    recorder = Recorder()
    expected = max(1, int(spec.get("n_tests", 1)))
    conn = Connection(req_w, rep_r, time.monotonic() + float(spec.get("budget_s", 10.0)))
    try:
        try:
            ready = recv(rep_r, conn.deadline)
        except (OSError, EOFError, TimeoutError, ValueError) as exc:
            raise SolutionError(str(exc)) from None
        if not ready.get("ok"):
            raise SolutionError(f"the solution failed to load: {ready.get('error')}")
        run_tests(conn, set(ready.get("names", [])), spec, recorder)
    except SolutionError as exc:
        recorder.failures.append(str(exc)[:500])
    except Exception:  # noqa: BLE001 - a broken test spec is reported, not raised
        recorder.failures.append(traceback.format_exc(limit=3)[-500:])
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
    total = max(recorder.total, expected)
    result = {"passed": recorder.passed, "total": total, "failures": recorder.failures}
    sys.stdout.write(f"\n{RESULT_MARKER} {nonce} {json.dumps(result)}\n")
    sys.stdout.flush()
    return 0


#: How to start this program again: the host sends ``HARNESS_SOURCE = '...'`` + this line.
BOOTSTRAP_LINE = "exec(compile(HARNESS_SOURCE, 'harness.py', 'exec'))"
BOOTSTRAP = f"HARNESS_SOURCE = {globals().get('HARNESS_SOURCE', '')!r}\n{BOOTSTRAP_LINE}"

if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "solution":
        solution_process(int(sys.argv[2]), int(sys.argv[3]))
        os._exit(0)
    sys.exit(judge())
