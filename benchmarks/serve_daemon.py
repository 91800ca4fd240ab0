"""A `dsv4 serve` daemon for a benchmark: started on a private ipc socket, waited for, stopped.

    with serving("--threads", "1") as ep:   # ep: "ipc:///tmp/dsv4b-XXXX/d.sock"
        ...                                 # talk to it with dsv4.daemon.client.Client(ep)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv4.daemon.client import Client  # noqa: E402


@contextlib.contextmanager
def serving(*serve_args: str, prefix: tuple[str, ...] = (), key: str | None = None) -> Iterator[str]:
    """Run `dsv4 serve SERVE_ARGS` (one OpenMP thread; no API key unless `key`, which the
    benchmark's clients then need in DSV4_API_KEY), under `prefix` (e.g. taskset), until the block ends."""
    d = Path(tempfile.mkdtemp(prefix="dsv4b-", dir="/tmp"))
    ep = f"ipc://{d}/d.sock"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("DSV4_API_KEY", None)
    if key:
        env["DSV4_API_KEY"] = key
    dsv4 = Path(sys.executable).parent / "dsv4"
    with open(d / "serve.log", "wb") as log:
        proc = subprocess.Popen([*prefix, str(dsv4), "serve", *serve_args, "--socket", ep], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        for _ in range(600):
            try:
                with Client(ep) as c:
                    c.connect(timeout_s=1)
                break
            except Exception:  # noqa: BLE001  (still loading)
                time.sleep(0.2)
        yield ep
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(d, ignore_errors=True)
