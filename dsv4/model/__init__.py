"""DeepSeek V4 in PyTorch: the model math, its per-request state and its checkpoints.

    from dsv4.model import load_model, Batch
    model = load_model("/path/to/checkpoint", device="cpu", dtype=torch.float32)
    model = load_model("/path/to/checkpoint", quantization="w8a8")   # int8 weights (w8a8.py)
    logits = model(input_ids)                      # [B, S] -> [B, S, vocab], from position 0
    state = model.new_state(max_slots, max_len)    # preallocated slots, positions absolute
    hidden, logits = model.forward_batch(Batch.build([(slot, start, ids)]), state)
    z, mtp_logits = model.mtp_forward(Batch.build([(slot, t0, next_ids)]), hidden_rows, state)

See `model.py` (interfaces), `state.py` (state layout and rollback), `loader.py`,
`w8a8.py` and `kernels.py` (int8 weights), `convert.py` (`dsv4 convert`).
"""

from .loader import load_model
from .model import DeepseekV4, init_random
from .state import Batch, ModelState

__all__ = ["Batch", "DeepseekV4", "ModelState", "init_random", "load_model"]
