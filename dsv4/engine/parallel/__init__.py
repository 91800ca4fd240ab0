"""Tensor parallelism on torch.distributed: how ranks start (`launch.py`, torchrun or spawned),
the followers and their lifecycle (`ranks.py`), each step's plan broadcast from rank 0
(`step_plan.py`) over the shared-memory channel (`transport.py`). Details: docs/distributed.md."""
