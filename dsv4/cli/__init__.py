"""The `dsv4` command (typer): `main.py` defines the commands, one module per bigger one
(`run.py`, `chat.py`, `bench.py`), `options.py` what they share. The top of the import
graph: it may import any other package, none imports it (docs/architecture.md)."""
