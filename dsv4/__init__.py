"""dsv4: serve DeepSeek V4 from one machine.

`dsv4.LLM` and `dsv4.SamplingParams` are the offline API (imported lazily, so the
CLI starts without loading torch). `DEFAULT_MODEL` is the embedded tiny model.
"""

from .assets import DEFAULT_MODEL  # noqa: F401  (re-exported: dsv4.DEFAULT_MODEL)

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
