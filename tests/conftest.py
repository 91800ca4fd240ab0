"""Test-wide settings: one torch thread (the tiny models are dispatch-bound, and the
2-core machines this runs on are shared with the daemons the e2e tests start), and a
calibration cache of the session's own."""

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# auto K's calibration cache (dsv4/engine/spec/cost_cache.py): one per pytest session, shared
# by its engines and the daemons it starts, so no test reads what an earlier run left
os.environ["DSV4_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="dsv4-calibration-")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    import shutil

    shutil.rmtree(os.environ["DSV4_CALIBRATION_DIR"], ignore_errors=True)
