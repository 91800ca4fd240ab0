"""Test-wide settings: one torch thread (the tiny models are dispatch-bound, and the
2-core machines this runs on are shared with the daemons the e2e tests start)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
