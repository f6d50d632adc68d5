"""``LocalSandbox``: the default backend, no daemon needed, ~2 ms per run.

A warm zygote (``palaestra.sandbox.inner``) runs inside bubblewrap (or ``unshare``) with the
filesystem read-only and no network. Every run gets its own pid namespace (the run is pid 2 under
a pid 1 that reaps and reports), a /proc showing only itself, its own uid when the host runs as
root, rlimits, Landlock and seccomp. Stateless runs get a fresh tmpfs of ``workspace_mb`` in their
own mount namespace; each session gets its own tmpfs of that size, so no run or session can fill
another's workspace (a session's forks, ``session.fork()``, share the sandbox's root tmpfs).
Where these layers cannot be had the sandbox refuses to start and says how
to fix it (``palaestra sandbox doctor`` shows what is in force).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
from typing import Any

from palaestra.errors import ConfigError, SandboxError
from palaestra.sandbox.base import Sandbox
from palaestra.sandbox.spec import RunSpec, make_spec
from palaestra.sandbox.cgroups import PidsCgroup
from palaestra.sandbox.errors import IsolationUnavailableError
from palaestra.sandbox.isolation import (
    DEV_FILES,
    ZYGOTE_CAPS_PIDNS,
    ZYGOTE_CAPS_UID,
    PythonLayout,
    bwrap_argv,
    clean_env,
    landlock_paths,
    python_layout,
    unshare_argv,
)
from palaestra.sandbox.local_session import (
    LOST_FILES_NOTE,
    _Family,
    _LocalSession,
    _remove_tree,
    _with_note,
)
from palaestra.sandbox.outcome import result_from_frame
from palaestra.sandbox.probe import IsolationReport, probe_isolation
from palaestra.sandbox.requests import ZygoteRequests, file_reply
from palaestra.sandbox.result import ExecResult
from palaestra.sandbox.uids import UidRange
from palaestra.sandbox.zygote import LocalZygote, ZygoteDied

MIB = 1024 * 1024
#: Extra seconds the host waits beyond a run's timeout before declaring the worker hung.
HOST_GRACE_S = 10.0
#: Where working directories live inside bubblewrap (a private tmpfs).
BWRAP_ROOT = "/sandbox"
#: Working directory of every stateless run, below the root: each run mounts its own tmpfs
#: there in its own mount namespace, so runs never share (or fill) one directory.
RUN_DIR = "run"

log = logging.getLogger(__name__)


class LocalSandbox(Sandbox):
    """Runs code on this machine under the strongest isolation available (see ``doctor``)."""

    backend_name = "local"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._workers: list[LocalZygote | None] = []
        self._restart_locks: list[asyncio.Lock] = []
        self._uids: UidRange | None = None
        self._root = ""
        self._host_root = ""
        self._ids = itertools.count(1)
        self._init_opts: dict[str, Any] = {}
        self._seccomp = b""
        self._launcher: list[str] = []
        self._layout: PythonLayout | None = None
        self.report: IsolationReport | None = None
        self._cgroup: PidsCgroup | None = None
        self._sessions: dict[str, _LocalSession] = {}
        self._quotas = False
        self._requests = ZygoteRequests(self.config, count_processes=False)
        self._workdirs_in_worker = False
        self.mode: dict[str, Any] = {}

    # -- lifecycle
    async def _start(self) -> None:
        cfg = self.config
        report = self.report = await asyncio.to_thread(probe_isolation)
        layout = self._layout = await asyncio.to_thread(python_layout, cfg.python)
        launcher = self._choose_launcher(report)
        per_run_uid = report.root if cfg.per_run_uid is None else cfg.per_run_uid
        if per_run_uid and not report.root:
            raise IsolationUnavailableError("per_run_uid=True needs root; leave it unset")
        if not report.root and cfg.per_run_uid is None:
            log.warning("palaestra sandbox: not running as root, so runs share your (unprivileged) "
                        "uid instead of getting one each; run as root for per-run uids")
        # Every run in its own pid namespace with its own /proc and workspace tmpfs, unless the
        # caller explicitly accepts less (per_run_pid_namespace=False).
        pidns = cfg.per_run_pid_namespace is not False
        from palaestra.sandbox.seccomp import build_filter_bpf

        self._seccomp = await asyncio.to_thread(build_filter_bpf)
        self._set_launcher(launcher, report, layout, per_run_uid=per_run_uid, pidns=pidns)
        if report.root:
            # Whole-sandbox process cap (the per-uid RLIMIT_NPROC bounds each run already).
            limit = cfg.max_processes * (cfg.max_concurrency + 4) + 64
            self._cgroup = await asyncio.to_thread(PidsCgroup.create, limit)
        exe_dir = os.path.dirname(layout.executable)
        child_env = clean_env({"PATH": f"{exe_dir}:/usr/local/bin:/usr/bin:/bin"})
        child_env.update(cfg.env)
        # Under bubblewrap only curated paths exist, so one read-only rule on "/" is enough
        # (and cheaper per child); otherwise Landlock alone hides the rest of the host.
        ro_paths = ["/"] if launcher == "bwrap" else landlock_paths(layout, cfg.ro_paths)
        # bubblewrap's /dev holds only null, zero, full, random, urandom, tty and friends: one
        # rule for it; on the host /dev, only the listed files (never block devices).
        dev_files = ["/dev"] if launcher == "bwrap" else list(DEV_FILES)
        own_mounts = launcher == "unshare" or (launcher == "none" and report.root)
        expose = [] if launcher == "bwrap" or not per_run_uid else \
            [*layout.dirs, *(os.path.realpath(p) for p in cfg.ro_paths if os.path.exists(p))]
        self._init_opts = {
            "ro_paths": ro_paths, "dev_files": dev_files,
            "env": child_env, "max_output": cfg.max_output_bytes, "pidns": pidns,
            "private_mounts": pidns, "run_dir": f"{self._root}/{RUN_DIR}",
            "quota_mb": cfg.workspace_mb, "own_mountns": launcher == "none" and report.root,
            "root_tmpfs": {"path": self._root, "mb": cfg.workspace_mb} if own_mounts else None,
            "expose": expose, "drop_caps": not per_run_uid, "landlock": True,
        }
        self._workdirs_in_worker = launcher == "bwrap" or own_mounts
        self._uids = UidRange() if per_run_uid else None
        self._requests = ZygoteRequests(cfg, count_processes=per_run_uid)
        self.mode = {"launcher": launcher, "per_run_uid": per_run_uid, "per_run_pidns": pidns,
                     "landlock_abi": report.landlock_abi, "seccomp": bool(self._seccomp),
                     "pids_cgroup": self._cgroup.path if self._cgroup else None}
        n_workers = cfg.workers or max(1, min(2, os.cpu_count() or 1))
        self._workers = [None] * n_workers
        self._restart_locks = [asyncio.Lock() for _ in range(n_workers)]
        try:
            await asyncio.gather(*(self._worker(i) for i in range(n_workers)))
            feats = self._workers[0].features if self._workers[0] else {}
            self._check_features(feats, pidns)
        except BaseException:
            await self._close()
            raise
        self._quotas = bool(feats.get("private_mounts"))
        self.mode.update(private_proc=self._quotas, workspace_quota_mb=cfg.workspace_mb
                         if self._quotas else None, exposed=feats.get("exposed", []),
                         per_run_pidns=bool(feats.get("pidns")),
                         landlock_abi=feats.get("landlock_abi", 0))
        vm_mb = feats.get("vmsize_kb", 0) / 1024
        if vm_mb + 32 > cfg.memory_mb:
            await self._close()
            raise ConfigError(f"memory_mb={cfg.memory_mb} leaves no room: the warm interpreter "
                              f"already maps {vm_mb:.0f} MiB (preloaded modules); raise memory_mb "
                              "or preload fewer modules")

    def _set_launcher(self, launcher: str, report: IsolationReport, layout: PythonLayout, *,
                      per_run_uid: bool, pidns: bool) -> None:
        """The zygote's argv and the runs' root directory for ``launcher``."""
        cfg = self.config
        if launcher == "bwrap":
            self._root, self._host_root = BWRAP_ROOT, ""
            caps: tuple[str, ...] = ZYGOTE_CAPS_UID if per_run_uid else ()
            if pidns:
                caps += ZYGOTE_CAPS_PIDNS
            assert report.bwrap is not None
            self._launcher = bwrap_argv(report.bwrap, layout, self._root, cfg.ro_paths, caps,
                                        cfg.workspace_mb)
        else:
            # The directory exists on the host; the zygote covers it with a tmpfs in its own
            # mount namespace (unshare; none as root), so nothing lands on the host's disk.
            self._root = self._host_root = tempfile.mkdtemp(prefix="palaestra-sbx-",
                                                            dir=cfg.workdir_root)
            os.chmod(self._root, 0o711)  # runs may enter their own directory, not list others
            assert launcher == "none" or report.unshare is not None
            self._launcher = unshare_argv(report.unshare, report.root) \
                if launcher == "unshare" and report.unshare else []

    def _check_features(self, feats: dict[str, Any], pidns: bool) -> None:
        """Refuse to run weaker than asked: every problem with the fix in one message."""
        why = feats.get("setup_error") or feats.get("problem") or "unknown reason"
        if pidns and not (feats.get("pidns") and feats.get("private_mounts")):
            raise IsolationUnavailableError(
                f"runs cannot get their own pid and mount namespaces here ({why}), so the "
                "sandbox refuses to start. Install bubblewrap (apt-get install bubblewrap, or "
                "bash scripts/setup.sh as root) and run as root with CAP_SYS_ADMIN (not in a "
                "locked-down container) or with unprivileged user namespaces enabled; "
                "per_run_pid_namespace=False accepts the weaker isolation explicitly.")
        if feats.get("setup_error"):
            raise IsolationUnavailableError(
                f"the sandbox worker could not prepare its mounts ({why}); install bubblewrap "
                "(apt-get install bubblewrap) or run as root")

    def _choose_launcher(self, report: IsolationReport) -> str:
        cfg = self.config
        if cfg.use_bwrap:
            if not report.bwrap:
                raise IsolationUnavailableError(
                    "use_bwrap=True but bubblewrap does not work here "
                    f"({'; '.join(report.notes) or 'not installed'}); apt-get install bubblewrap")
            return "bwrap"
        if cfg.use_bwrap is None and report.bwrap:
            return "bwrap"
        if report.unshare:
            return "unshare"
        if cfg.allow_network_isolation_fallback:
            return "none"
        raise IsolationUnavailableError(
            "no network namespace can be created here (bubblewrap and `unshare --net` both "
            "failed), so the sandbox refuses to start. Install bubblewrap, run with user "
            "namespaces enabled, or pass allow_network_isolation_fallback=True to rely on "
            "seccomp+Landlock alone.")

    async def _worker(self, index: int) -> LocalZygote:
        """The live zygote at ``index``, (re)started if needed."""
        zyg = self._workers[index]
        if zyg is not None and not zyg.closed:
            return zyg
        async with self._restart_locks[index]:
            zyg = self._workers[index]
            if zyg is not None and not zyg.closed:
                return zyg
            assert self._layout is not None
            launcher = self._cgroup.wrap(self._launcher) if self._cgroup else self._launcher
            sys_path = self._layout.site_dirs if self.config.python_site else ()
            zyg = LocalZygote(f"worker{index}", launcher, self._layout.executable, sys_path,
                              self.config.preload, clean_env())
            await zyg.start(self._init_opts, self._seccomp)
            self._workers[index] = zyg
            if self._workdirs_in_worker:  # working directories lived in the dead worker
                for sess in self._sessions.values():
                    if sess.worker == index:
                        await zyg.request(self._mkdir_request(sess.workdir, sess.uid),
                                          timeout=60)
                        sess.note = LOST_FILES_NOTE
            return zyg

    async def _rebind(self) -> None:
        for zyg in self._workers:
            if zyg is not None:
                zyg.abandon()
        self._workers = [None] * len(self._workers)
        self._restart_locks = [asyncio.Lock() for _ in self._workers]

    def _is_live(self, index: int) -> bool:
        zyg = self._workers[index]
        return zyg is not None and not zyg.closed

    async def _pick(self) -> tuple[int, LocalZygote]:
        """The least loaded live worker; dead ones are restarted in the background."""
        for i in range(len(self._workers)):
            if not self._is_live(i) and not self._restart_locks[i].locked():
                task = asyncio.get_running_loop().create_task(self._worker(i))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        live = [i for i in range(len(self._workers)) if self._is_live(i)]
        if not live:
            return 0, await self._worker(0)
        best = min(live, key=lambda i: self._workers[i].load)  # type: ignore[union-attr]
        return best, await self._worker(best)

    async def _close(self) -> None:
        for zyg in self._workers:
            if zyg is not None:
                await zyg.aclose()
        self._workers = []
        if self._host_root:
            await asyncio.to_thread(_remove_tree, self._host_root)
        if self._uids is not None:
            self._uids.release_range()
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.remove)
            self._cgroup = None

    # -- runs
    async def _execute(self, spec: RunSpec, handle: _LocalSession | None) -> ExecResult:
        if handle is None:
            _, zyg = await self._pick()
            uid = self._uids.acquire() if self._uids is not None else None
            if self._quotas:  # the run's own tmpfs, in its own mount namespace
                workdir, create = f"{self._root}/{RUN_DIR}", False
            else:
                workdir, create = f"{self._root}/r{next(self._ids)}", True
        else:
            zyg = await self._worker(handle.worker)
            uid, workdir, create = handle.uid, handle.workdir, False
        header, blobs = self._requests.run(spec, workdir=workdir, uid=uid, create_workdir=create,
                                           private_workdir=self._quotas and handle is None,
                                           shared_uid=bool(handle and handle.family))
        try:  # the zygote deletes a run's directory itself once the run is over
            reply, out = await zyg.request(header, blobs, timeout=spec.timeout + HOST_GRACE_S)
        except ZygoteDied as exc:
            return ExecResult.failure(str(exc))
        finally:
            if handle is None and uid is not None and self._uids is not None:
                self._uids.release(uid)
        return _with_note(result_from_frame(reply, out), handle)

    # -- sessions
    async def _open_session(self, persistent_python: bool) -> _LocalSession:
        index, zyg = await self._pick()
        uid = self._uids.acquire() if self._uids is not None else None
        sid = f"s{next(self._ids)}"
        workdir = f"{self._root}/{sid}"
        reply, _ = await zyg.request(self._mkdir_request(workdir, uid), timeout=60)
        if reply.get("op") != "ok":
            if uid is not None and self._uids is not None:
                self._uids.release(uid)
            raise SandboxError(f"cannot create the session directory: {reply.get('error')}")
        sess = self._sessions[sid] = _LocalSession(sid, workdir, uid, index, persistent_python)
        if persistent_python and self._fork_refusal() is None:
            sess.nursery = f"{workdir}.forks"
        return sess

    def _fork_refusal(self) -> str | None:
        """Why sessions cannot fork here (None: they can)."""
        feats = self._workers[0].features if self._workers and self._workers[0] else {}
        if self._uids is None:
            return ("session fork needs per-run uids (the host must run as root): a fork's "
                    "workspace and nursery are protected by the uid")
        if not (self._quotas and feats.get("pidns")):
            return "session fork needs a pid and mount namespace per run (see sandbox doctor)"
        if not feats.get("fork"):
            return (f"session fork needs Landlock ABI >= 6 (Linux 6.12) for signal scoping "
                    f"between a fork and its parent; this kernel has ABI "
                    f"{feats.get('landlock_abi', 0)}")
        return None

    async def _fork_session(self, parent: _LocalSession) -> _LocalSession:
        why = self._fork_refusal()
        if why is not None:
            raise IsolationUnavailableError(why)
        if not parent.persistent or parent.nursery is None:
            raise SandboxError("only a persistent_python session opened here can fork")
        if not parent.had_kernel:  # start the interpreter: there is nothing to fork before
            started = await self._run_cell(parent, make_spec("python", "", (), 30.0, None, None))
            if not started.ok:
                raise SandboxError(f"cannot start the session's interpreter: {started.summary()}")
        zyg = await self._worker(parent.worker)
        k = next(self._ids)
        sid, base = f"s{k}", parent.nursery
        workdir, nursery, parent_nursery = f"{base}/f{k}", f"{base}/f{k}.forks", f"{base}/p{k}"
        header = self._requests.fork(parent.sid, sid, workdir=workdir, nursery=nursery,
                                     parent_nursery=parent_nursery)
        try:
            reply, _ = await zyg.request(header, timeout=60)
        except ZygoteDied as exc:
            raise SandboxError(f"cannot fork the session: {exc}") from exc
        if reply.get("op") != "ok":
            raise SandboxError(f"cannot fork the session: {reply.get('error')}")
        family = parent.family
        if family is None:
            family = parent.family = _Family(base, {parent.sid})
        family.members.add(sid)
        parent.nursery = parent_nursery
        child = self._sessions[sid] = _LocalSession(sid, workdir, parent.uid, parent.worker,
                                                    True, had_kernel=True, nursery=nursery,
                                                    family=family)
        return child

    def _mkdir_request(self, path: str, uid: int | None) -> dict[str, Any]:
        """A session's directory: its own tmpfs of ``workspace_mb`` where quotas are on."""
        return self._requests.mkdir(path, uid, quota=self._quotas)

    async def _close_session(self, handle: _LocalSession) -> None:
        self._sessions.pop(handle.sid, None)
        family = handle.family
        if family is not None:
            family.members.discard(handle.sid)
        last = family is None or not family.members  # no other session has this uid
        zyg = self._workers[handle.worker] if handle.worker < len(self._workers) else None
        if zyg is not None and not zyg.closed:
            try:
                if handle.persistent:
                    await zyg.request({"op": "kernel_stop", "session": handle.sid}, timeout=30)
                if handle.uid is not None and last:
                    await zyg.request({"op": "sweep", "uid": handle.uid}, timeout=30)
                await zyg.request({"op": "rmtree", "path": handle.workdir}, timeout=60)
                nursery = family.root_nursery if family is not None else handle.nursery
                if last and nursery:
                    await zyg.request({"op": "rmtree", "path": nursery}, timeout=60)
            except ZygoteDied:
                pass
        if self._host_root:
            await asyncio.to_thread(_remove_tree, handle.workdir)
        if handle.uid is not None and self._uids is not None and last:
            self._uids.release(handle.uid)

    async def _run_cell(self, handle: _LocalSession, spec: RunSpec) -> ExecResult:
        zyg = await self._worker(handle.worker)
        header, blobs = self._requests.cell(spec, session=handle.sid, had_kernel=handle.had_kernel,
                                            workdir=handle.workdir, uid=handle.uid,
                                            nursery=handle.nursery,
                                            shared_uid=handle.family is not None)
        handle.had_kernel = True
        try:
            reply, out = await zyg.request(header, blobs, timeout=spec.timeout + HOST_GRACE_S)
        except ZygoteDied as exc:
            return ExecResult.failure(str(exc))
        return _with_note(result_from_frame(reply, out), handle)

    async def _read_file(self, handle: _LocalSession, path: str) -> bytes:
        zyg = await self._worker(handle.worker)
        reply, blobs = await zyg.request(self._requests.read_file(handle.workdir, path),
                                         timeout=60)
        file_reply(reply, "read", path)
        return blobs[0]

    async def _write_file(self, handle: _LocalSession, path: str, data: bytes) -> None:
        zyg = await self._worker(handle.worker)
        reply, _ = await zyg.request(self._requests.write_file(handle.workdir, path, handle.uid),
                                     [data], timeout=60)
        file_reply(reply, "write", path)

    def _session_workdir(self, handle: _LocalSession) -> str:
        return handle.workdir
