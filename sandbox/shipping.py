"""How the in-sandbox runtime (``palaestra.sandbox.inner``) gets into a sandbox: no file is
copied in. The interpreter starts as ``python -I -B [-S] -c BOOTSTRAP '<json options>' NAME SRC
NAME SRC ...``: the bootstrap builds the ``palaestra_inner`` package from the module sources in
its argv (each module stays far below the kernel's 128 KiB limit per argument), drops them from
``sys.argv`` and calls ``main()``. The same command line serves bubblewrap, ``unshare`` and
Docker (where it is the container's command).
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from palaestra.sandbox.inner import MODULES

#: Package name of the runtime inside the sandbox (the host's ``palaestra`` is not visible there).
PACKAGE = "palaestra_inner"
BOOTSTRAP = f"""\
import sys
def _boot():
    import builtins
    pkg = type(sys)({PACKAGE!r})
    pkg.__path__, pkg.__package__ = [], {PACKAGE!r}
    sys.modules[{PACKAGE!r}] = pkg
    args = sys.argv[2:]
    del sys.argv[2:]
    for i in range(0, len(args), 2):
        name, src = args[i], args[i + 1]
        mod = type(sys)({PACKAGE!r} + "." + name)
        mod.__package__, mod.__builtins__ = {PACKAGE!r}, builtins
        mod.__file__ = "<" + {PACKAGE!r} + "/" + name + ".py>"
        sys.modules[mod.__name__] = mod
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        setattr(pkg, name, mod)
    return sys.modules[{PACKAGE!r} + ".main"]
_boot().main()
"""


@functools.lru_cache(maxsize=1)
def runtime_sources() -> tuple[tuple[str, str], ...]:
    """(module name, source) of every runtime module, in execution order."""
    pkg = resources.files("palaestra.sandbox.inner")
    return tuple((name, (pkg / f"{name}.py").read_text(encoding="utf-8")) for name in MODULES)


def runtime_argv(python: str, opts: dict[str, Any], *, no_site: bool = True) -> list[str]:
    """The command that starts the runtime under ``python`` with start-up ``opts``.

    ``no_site`` (-S): no site module, so no ``.pth`` file runs code in the sandbox; the runtime
    puts ``opts["sys_path"]`` on sys.path itself.
    """
    argv = [python, "-I", "-B", *(["-S"] if no_site else []), "-c", BOOTSTRAP, json.dumps(opts)]
    for name, source in runtime_sources():
        argv += [name, source]
    return argv
