"""What scoutbench keeps on disk between runs (`$SCOUTBENCH_CACHE`, default `~/.cache/scoutbench`): the compiled
CPU kernel library and the converted GGUF models. Each is a folder published whole and verified before use.

Why verified: a cached file is mapped into the process (ctypes loads the kernel with dlopen; safetensors maps the
weights), and a truncated shared object kills the process with SIGBUS the moment a missing page is touched, with no
message and on every later run. A file's name says only what it should hold, so every artefact carries a manifest
(`MANIFEST`: each file's size and the sha256 of its first `DIGEST_PREFIX_BYTES`) that is checked before anything in
the folder is opened. Small files (the kernel library, configs, tokenizers) are digested whole; of a model's weights
the size and the first 16 MiB (the safetensors header and the first tensors): the size catches the faults a killed
copy or a full disk make, and a whole digest of a 3 GB file would add seconds to every load.

How published: built in a private staging folder beside the artefact, sealed with its manifest, renamed into place,
all under a per-artefact OS lock (released by the kernel when a builder is killed), so concurrent first uses build
once. A staging folder is removed on any exit, Ctrl-C and SIGTERM included; one left by a killed (SIGKILL) builder
is removed by the next build of the same artefact, which holds the lock that the dead builder held.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from scoutbench.errors import ScoutbenchError

MANIFEST = "scoutbench-manifest.json"
DIGEST_PREFIX_BYTES = 16 << 20
_READ_CHUNK_BYTES = 1 << 20


def cache_root() -> Path:
    """`$SCOUTBENCH_CACHE`, or `~/.cache/scoutbench`."""
    from scoutbench.environment import value

    root = value("SCOUTBENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "scoutbench")
    return Path(root)


def _prefix_digest(path: Path) -> str:
    digest = hashlib.sha256()
    left = DIGEST_PREFIX_BYTES
    with open(path, "rb") as handle:
        while left > 0 and (chunk := handle.read(min(_READ_CHUNK_BYTES, left))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def seal(folder: Path) -> None:
    """Write the manifest of every file under `folder` (the last step of a build, before it is published)."""
    entries = {p.relative_to(folder).as_posix(): {"size_bytes": p.stat().st_size, "sha256_prefix": _prefix_digest(p)}
               for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps({"digest_prefix_bytes": DIGEST_PREFIX_BYTES, "files": entries},
                                              indent=1, sort_keys=True), encoding="utf-8")


def verify(folder: Path) -> str | None:
    """Why the cached artefact in `folder` cannot be used (missing, unsealed, a file of the wrong size or digest),
    or None when every file of its manifest is there as it was written."""
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        return "not built yet" if not folder.exists() else f"{folder} is not a folder"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest["digest_prefix_bytes"] != DIGEST_PREFIX_BYTES or not isinstance(files, dict) or not files:
            raise ValueError("another digest")
    except FileNotFoundError:
        return "no manifest (an interrupted or older build)"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        return f"an unreadable manifest ({type(exc).__name__})"
    for name, entry in files.items():
        if not isinstance(entry, dict):
            return f"an unreadable manifest (the entry of {name})"
        path = folder / name
        try:
            size = path.stat().st_size
            if size != entry.get("size_bytes"):
                return f"{name} is {size} bytes, {entry.get('size_bytes')} expected"
            if _prefix_digest(path) != entry.get("sha256_prefix"):
                return f"{name} does not match its digest"
        except OSError as exc:
            return f"{name}: {exc.strerror or type(exc).__name__}"
    return None


def _remove_stale_staging(parent: Path, prefix: str) -> None:
    for stale in parent.glob(f"{prefix}*"):
        shutil.rmtree(stale, ignore_errors=True)


def provide(target: Path, build: Callable[[Path], None], lock_timeout_s: float = -1) -> tuple[Path, str | None]:
    """The verified artefact folder `target`, built first when it is missing or does not verify: `build(staging)`
    fills an empty folder, which is sealed and renamed to `target`. Returns (target, why it was rebuilt: the
    reason an existing artefact failed verification, None when it verified or did not exist).

    `lock_timeout_s` bounds the wait for a concurrent builder of the same artefact (negative: no bound); the wait
    ends in a ScoutbenchError. A build's own exception propagates, and its staging folder is removed."""
    reason = verify(target)
    if reason is None:
        return target, None
    from filelock import FileLock, Timeout

    target.parent.mkdir(parents=True, exist_ok=True)
    staging_prefix = f".{target.name}.staging-"
    try:
        with FileLock(str(target.parent / f".{target.name}.lock"), timeout=lock_timeout_s):
            reason = verify(target)  # a concurrent builder may have published it while this one waited
            if reason is None:
                return target, None
            existed = target.exists()
            _remove_stale_staging(target.parent, staging_prefix)  # left by a killed builder: this one holds its lock
            staging = Path(tempfile.mkdtemp(prefix=staging_prefix, dir=target.parent))
            try:
                staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
                build(staging)
                seal(staging)
                if existed and target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif existed:
                    target.unlink()
                os.rename(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except Timeout:
        raise ScoutbenchError(f"another process has been building {target} for over {lock_timeout_s:.0f} s; "
                              "wait for it or remove its lock file") from None
    return target, reason if existed else None
