"""Structured outputs: a request's grammar as token masks for verification and drafts
(`masks.py`, over llguidance), compiled off the daemon's loop in a pool of worker processes
(`compile_pool.py`, `worker.py`). Details: docs/serving.md and docs/http-api.md."""
