"""torch's cpp_extension build lock: one left by a process killed mid-build would make every later engine start
wait on it forever; the kernel loader removes it once the build folder has been still for long enough."""

from __future__ import annotations

import os
import time
from pathlib import Path

from engine_core.cpu.kernels import STALE_LOCK_SECONDS, _clear_stale_lock


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_builds_lock_is_kept(tmp_path: Path) -> None:
    (tmp_path / "layer_ops.o").write_bytes(b"")
    lock = tmp_path / "lock"
    lock.write_bytes(b"")
    _clear_stale_lock(tmp_path)
    assert lock.exists()  # a build that is writing its objects now
    long_ago = time.time() - STALE_LOCK_SECONDS - 60
    for path in tmp_path.iterdir():
        os.utime(path, (long_ago, long_ago))
    _clear_stale_lock(tmp_path)
    assert not lock.exists()
    _clear_stale_lock(tmp_path / "never-built")  # no folder yet: nothing to do, no error
