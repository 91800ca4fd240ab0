"""Compiled decode steps (`--compile`): the captured dispatches per bucket (`compiled.py`), their
artifacts on disk (`artifacts.py`), the background build in a second process (`builder.py`,
`start.py`), the compiler's environment (`env.py`) and the check of a loaded bucket
(`bucket_check.py`). Details: docs/compile.md."""
