"""``palaestra engines add|remove|list``: engines join and leave a running training run.

Talks to the admin endpoint the run serves on loopback (`palaestra.run.fleet.elastic`): its
address is in ``RUN/admin.json`` and its token in ``RUN/admin.token``, so the command runs on
the run's machine by someone who can read the run directory. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from palaestra.errors import ConfigError, EngineError, PalaestraError

ADMIN_FILE = "admin.json"  # the names `palaestra.run.fleet.elastic` writes
TOKEN_FILE = "admin.token"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (("add", ("add an engine (SGLang-protocol server) to the run: it gets "
                                "the current weights at the next step boundary, then serves")),
                       ("remove", ("drain an engine out of the run (in-flight requests finish "
                                   "or move to another engine after --timeout)")),
                       ("list", "the run's engines, their requests and weight versions")):
        p = sub.add_parser(name, help=text, description=text)
        if name == "add":
            p.add_argument("url", nargs="?", default=None,
                           help="the engine's base URL, http://HOST:PORT (or --gpus)")
            p.add_argument("--gpus", type=int, default=None, metavar="N",
                           help="start the engine instead: a Ray actor on N GPUs of the run's "
                                "Ray cluster (0: a CPU engine, palaestra serve), then add it")
        elif name == "remove":
            p.add_argument("url", help="the engine's base URL, http://HOST:PORT")
        p.add_argument("--run", required=True, metavar="DIR",
                       help="the run directory (the run's `out`)")
        if name == "remove":
            p.add_argument("--timeout", type=float, default=None, metavar="S",
                           help="seconds the in-flight requests may take to finish there "
                                "(default: the run's, 60)")
        p.add_argument("--json", action="store_true", help="print the answer as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        answer = call(args.run, args.action, getattr(args, "url", None),
                      timeout_s=getattr(args, "timeout", None), gpus=getattr(args, "gpus", None))
    except PalaestraError as exc:
        print(f"palaestra engines {args.action}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer, indent=2))
    elif args.action == "add":
        actor = answer.get("actor")
        started = (f" (engine actor pid {actor['actor_pid']} on {actor['node']}, "
                   f"{actor['gpus']} GPU)" if actor else "")
        print(f"{answer['url']}{started} joined at weight version {answer['version']} "
              f"(before step {answer['step']}; weights pushed in {answer['push_s']} s)")
    elif args.action == "remove":
        print(f"{answer['name']} removed: {answer['finished']} in-flight requests finished on "
              f"it, {answer['retried']} retried elsewhere ({answer['seconds']:.1f} s)")
    else:
        print(f"weight version {answer['version']} (step {answer['step']})")
        for e in answer["engines"]:
            print(f"  {e['name']}  {'healthy' if e['healthy'] else 'DOWN'}  version "
                  f"{e['weight_version']}  served {e['served']}  in flight {e['outstanding']}")
        for url in answer["joining"]:
            print(f"  {url}  joining at the next step")
        for a in answer.get("actors", []):
            print(f"  {a['url']}  engine actor pid {a['actor_pid']} (server pid "
                  f"{a['server_pid']}) on {a['node']}, {a['gpus']} GPU")
    return 0


def call(run_dir: str | Path, action: str, url: str | None = None, *,
         timeout_s: float | None = None, wait_s: float = 3600.0,
         gpus: int | None = None) -> dict[str, Any]:
    """The run's answer to ``action`` (``add``/``remove``/``list``); `PalaestraError` with the
    reason when there is no run, the URL is bad, or the run refuses. ``add`` takes a ``url``
    or ``gpus`` (start an engine actor on that many GPUs, 0: CPU)."""
    if action == "add" and (url is None) == (gpus is None):
        raise ConfigError("engines add takes an engine URL or --gpus N (one of them)")
    if gpus is not None and gpus < 0:
        raise ConfigError(f"--gpus must be >= 0 (got {gpus})")
    if url is not None:
        from palaestra.run.fleet.elastic import normalize_url  # light: no torch, no aiohttp

        url = normalize_url(url)
    admin, token = _admin_of(Path(run_dir))
    body: dict[str, Any] | None
    if action == "list":
        method, path, body = "GET", "/engines", None
    elif action == "add":
        method, path, body = "POST", "/engines", {"url": url} if gpus is None else {"gpus": gpus}
    elif action == "remove":
        method, path, body = "POST", "/engines/remove", {"url": url, "timeout_s": timeout_s}
    else:
        raise ConfigError(f"unknown action {action!r}: add, remove or list")
    request = urllib.request.Request(
        admin + path, method=method, data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=wait_s) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read()).get("error", "")
        except ValueError:
            reason = ""
        raise EngineError(f"the run refused: {reason or f'HTTP {exc.code}'}") from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise EngineError(f"the run at {run_dir} does not answer on {admin} ({exc}); it has "
                          f"ended or was killed (a stale {ADMIN_FILE})") from exc


def _admin_of(run_dir: Path) -> tuple[str, str]:
    if not run_dir.is_dir():
        raise ConfigError(f"no run directory {run_dir}: pass --run the `out` of a running "
                          "`palaestra train`")
    try:
        admin = json.loads((run_dir / ADMIN_FILE).read_text())["url"]
        token = (run_dir / TOKEN_FILE).read_text().strip()
    except FileNotFoundError as exc:
        raise ConfigError(
            f"no running run in {run_dir}: {exc.filename} is missing (a run writes "
            f"{ADMIN_FILE} while its RL steps run, when its engines are servers: "
            "engine.kind = 'sglang' or [placement] engine actors)") from exc
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{run_dir / ADMIN_FILE} is not a run's admin file: {exc}") from exc
    return str(admin), token


__all__ = ["call", "configure", "run"]
