"""The serving engine: `engine.py` runs the step loop (scheduler -> runner -> tokens ->
text), `config.py` validates its settings, `llm.py` is the offline API (`dsv4.LLM`).
It imports `dsv4.model` and nothing above it (docs/architecture.md)."""
