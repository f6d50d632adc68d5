"""The in-sandbox runtime: a zygote that forks one fresh, isolated child per run, plus persistent
kernels for sessions. It runs *inside* the isolation boundary (bubblewrap, an ``unshare``
network namespace, or a Docker container); the host never runs it, it only ships its source
(``palaestra.sandbox.shipping``) and imports ``framing`` to speak its wire format.

Standard library only (the palaestra package is not visible in the sandbox); modules import each
other relatively, so they work as ``palaestra.sandbox.inner.*`` on the host and as the
``palaestra_inner`` package that the bootstrap builds from their sources in the sandbox.
It trusts nothing its children send back.

Why a zygote: starting an interpreter costs ~8-35 ms here; forking an already started one with
its modules imported costs ~1-3 ms (a spare child is forked ahead of demand while the zygote is
idle). Each run gets a fresh pid namespace whose pid 1 (``child.pidns_init``) gives it its own
mount namespace (a /proc showing only the run, a size-limited tmpfs workspace) and forks the run
as pid 2, which applies, in this order: new process group, fresh stdio (memfds owned by the
zygote, so output survives a kill and is capped by RLIMIT_FSIZE), rlimits, its own uid (root
hosts), the working directory, Landlock (filesystem, TCP, signal and abstract-socket scoping)
and a seccomp filter compiled once on the host. Children are never reused. When the run ends
its pid 1 exits and the kernel kills whatever the run left behind; without pid namespaces
(Docker) the zygote, a child subreaper, kills the leftovers before it reports.

The blobs of a request (a run's code, argv, files and stdin; a cell; a written file) are
payload: the zygote reads only the header and has the kernel move the blobs into a memfd that
it hands to the run unread; outputs and read files go back from memfds the same way. Every run
is a fork of the zygote, so a payload byte in its memory, even freed, would be readable by every
later run.

Modules, in the order the bootstrap executes them (each imports only earlier ones):
``linux`` (libc: Landlock, seccomp, capabilities, mounts), ``framing`` (wire format),
``payload`` (host channel, memfd moves), ``procs`` (finding, killing, reaping processes),
``files`` (workspace file I/O that follows no planted link), ``child`` (a run from fork to
exec), ``kernel`` (the persistent interpreter and its forks), ``jobs`` (what the zygote
tracks), ``sessions`` (the zygote's session and kernel handling), ``forking`` (how the zygote
forks runs and spares), ``zygote`` (the request loop),
``main`` (start-up).
"""

#: Module names in execution order (see the docstring); ``palaestra.sandbox.shipping`` ships these.
MODULES = ("linux", "framing", "payload", "procs", "files", "child", "kernel", "jobs",
           "sessions", "forking", "zygote", "main")
