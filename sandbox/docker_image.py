"""Build the Docker sandbox image locally, from this machine's own python (no registry).

``python -m palaestra.sandbox.docker_image build`` (what ``scripts/build_sandbox_image.sh``
runs) packs a minimal root filesystem: the system ``python3`` with its standard library (no
test suites), a POSIX shell and core utilities, and every shared library they load (found with
``ldd``), then ``docker import``s it as ``palaestra-sandbox:py3``. A content hash stored as an
image label makes a rebuild a no-op when nothing changed. Takes a few seconds, about 60 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable

from palaestra.errors import MissingExtraError, SandboxError
from palaestra.sandbox.config import DEFAULT_IMAGE

BUILDER_VERSION = "1"
HASH_LABEL = "palaestra.sandbox.hash"
#: Utilities copied into the image when present on the host.
TOOLS: tuple[str, ...] = (
    "sh", "dash", "bash", "cat", "ls", "echo", "head", "tail", "wc", "sort", "uniq", "cut", "tr",
    "sed", "grep", "mkdir", "rm", "rmdir", "cp", "mv", "ln", "env", "true", "false", "sleep",
    "kill", "timeout", "printf", "test", "[", "expr", "seq", "tee", "touch", "chmod", "stat",
    "id", "pwd", "basename", "dirname", "readlink", "realpath", "date", "find", "xargs", "diff",
    "cmp", "awk", "mawk", "nproc", "uname", "yes", "dd", "od", "base64", "md5sum", "sha256sum",
    "tac", "rev", "paste", "join", "comm", "fold", "nl", "split", "du", "df", "which", "ps",
)
#: Parts of the standard library a sandboxed program never needs (and that are large).
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
               "config-3.11-x86_64-linux-gnu", "site-packages", "dist-packages"}
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/workspace:/bin/sh\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"


def find_python() -> str:
    """The system interpreter to ship: a distribution python outside any virtualenv/pyenv."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand):
            return os.path.realpath(cand)
    raise SandboxError("no system python3 in /usr/bin to build the image from; install "
                       "python3 (apt-get install python3-minimal)")


def _canonical(path: str) -> str:
    """Resolve the directory part (merged /usr) but keep the last component as named."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _ldd(path: str) -> list[str]:
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    libs = []
    for line in out.splitlines():
        m = re.search(r"(/\S+)", line.split("=>")[-1])
        if m and os.path.exists(m.group(1)):
            libs.append(m.group(1))
    return libs


class RootfsBuilder:
    """Collects host paths (following symlinks and library dependencies) into a tar."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}  # path in image -> host path ("" for a directory)
        self.links: dict[str, str] = {}  # path in image -> symlink target
        self.extra: dict[str, tuple[bytes, int]] = {}  # path -> (content, mode)
        self._seen_elf: set[str] = set()

    def add(self, host_path: str, with_deps: bool = True) -> None:
        path = _canonical(host_path)
        if path in self.files or path in self.links:
            return
        if os.path.islink(path):
            target = os.readlink(path)
            self.links[path] = target
            self.add(os.path.join(os.path.dirname(path), target), with_deps)
            return
        if os.path.isdir(path):
            self.files[path] = ""
            return
        if not os.path.isfile(path):
            return
        self.files[path] = path
        if with_deps and path not in self._seen_elf and _is_elf(path):
            self._seen_elf.add(path)
            for lib in _ldd(path):
                self.add(lib)

    def add_tree(self, root: str, skip: Iterable[str] = ()) -> None:
        skip = set(skip)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
            self.files.setdefault(_canonical(dirpath), "")
            for name in filenames:
                full = os.path.join(dirpath, name)
                self.add(full, with_deps=name.endswith(".so"))

    def digest(self) -> str:
        h = hashlib.sha256(BUILDER_VERSION.encode())
        for path in sorted(self.files):
            src = self.files[path]
            st = os.stat(src) if src else None
            h.update(f"{path}:{st.st_size if st else 'd'}:{int(st.st_mtime) if st else 0}".encode())
        for path in sorted(self.links):
            h.update(f"{path}->{self.links[path]}".encode())
        for path in sorted(self.extra):
            h.update(path.encode() + self.extra[path][0])
        return h.hexdigest()[:16]

    def write_tar(self, out: str) -> None:
        with tarfile.open(out, "w") as tar:
            dirs = set()
            for path in list(self.files) + list(self.links) + list(self.extra):
                parent = os.path.dirname(path)
                while parent not in ("/", ""):
                    dirs.add(parent)
                    parent = os.path.dirname(parent)
            dirs |= {p for p, src in self.files.items() if not src}
            for d in sorted(dirs):
                info = tarfile.TarInfo(d.lstrip("/"))
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            for special, mode in (("tmp", 0o1777), ("workspace", 0o1777), ("proc", 0o555),
                                  ("dev", 0o755), ("sys", 0o555), ("root", 0o700),
                                  ("etc", 0o755)):
                if "/" + special not in dirs:
                    info = tarfile.TarInfo(special)
                    info.type = tarfile.DIRTYPE
                    info.mode = mode
                    tar.addfile(info)
            for path, target in sorted(self.links.items()):
                info = tarfile.TarInfo(path.lstrip("/"))
                info.type = tarfile.SYMTYPE
                info.linkname = target
                tar.addfile(info)
            for path, src in sorted(self.files.items()):
                if src:
                    tar.add(src, arcname=path.lstrip("/"), recursive=False)
            for path, (data, mode) in sorted(self.extra.items()):
                info = tarfile.TarInfo(path.lstrip("/"))
                info.size = len(data)
                info.mode = mode
                tar.addfile(info, io.BytesIO(data))


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


def collect_rootfs(python: str | None = None) -> RootfsBuilder:
    """Everything the image holds."""
    python = python or find_python()
    b = RootfsBuilder()
    # The merged-/usr layout of the host, recreated as symlinks.
    for top in ("/bin", "/sbin", "/lib", "/lib64"):
        if os.path.islink(top):
            b.links[top] = os.readlink(top)
    b.add(python)
    version = re.search(r"python(\d+\.\d+)", python)
    ver = version.group(1) if version else f"{sys.version_info[0]}.{sys.version_info[1]}"
    for name in ("python3", "python"):
        b.links[f"/usr/bin/{name}"] = os.path.basename(python)
    stdlib = f"/usr/lib/python{ver}"
    if not os.path.isdir(stdlib):
        raise SandboxError(f"standard library of {python} not found at {stdlib}")
    b.add_tree(stdlib, skip=STDLIB_SKIP | {f"config-{ver}-x86_64-linux-gnu"})
    if os.path.isdir(f"/etc/python{ver}"):
        b.add_tree(f"/etc/python{ver}")
    for tool in TOOLS:
        for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
            if os.path.exists(os.path.join(d, tool)):
                b.add(os.path.join(d, tool))
                break
    if os.path.exists("/etc/ld.so.cache"):
        b.add("/etc/ld.so.cache", with_deps=False)
    b.extra["/etc/passwd"] = (PASSWD.encode(), 0o644)
    b.extra["/etc/group"] = (GROUP.encode(), 0o644)
    b.extra["/etc/hosts"] = (b"127.0.0.1 localhost\n", 0o644)
    return b


def build_image(tag: str = DEFAULT_IMAGE, force: bool = False, python: str | None = None,
                base_url: str | None = None, log: bool = True) -> str:
    """Build (or reuse) the image; returns its tag. Needs the docker SDK and a running engine."""
    try:
        import docker
    except ImportError as exc:
        raise MissingExtraError.for_module("docker", "docker") from exc
    client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
    rootfs = collect_rootfs(python)
    digest = rootfs.digest()
    if not force:
        try:
            image = client.images.get(tag)
            if (image.labels or {}).get(HASH_LABEL) == digest:
                if log:
                    print(f"{tag} is up to date ({digest})")
                return tag
        except docker.errors.ImageNotFound:
            pass
    repo, _, version = tag.partition(":")
    with tempfile.TemporaryDirectory(prefix="palaestra-rootfs-") as tmp:
        tar_path = os.path.join(tmp, "rootfs.tar")
        rootfs.write_tar(tar_path)
        size_mb = os.path.getsize(tar_path) / 2**20
        changes = ["ENV PATH=/usr/local/bin:/usr/bin:/bin", "ENV LANG=C.UTF-8",
                   "ENV PYTHONDONTWRITEBYTECODE=1", "WORKDIR /workspace",
                   "USER 65534:65534", f"LABEL {HASH_LABEL}={digest}",
                   'CMD ["python3"]']
        client.api.import_image(src=tar_path, repository=repo, tag=version or "latest",
                                changes=changes)
    if log:
        print(f"built {tag} ({digest}, {size_mb:.0f} MB rootfs, {len(rootfs.files)} files)")
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m palaestra.sandbox.docker_image",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("build", help="build or reuse the sandbox image")
    p.add_argument("--tag", default=DEFAULT_IMAGE)
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--python", default=None, help="interpreter to ship (default /usr/bin/python3)")
    args = parser.parse_args(argv)
    build_image(args.tag, force=args.force, python=args.python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
