"""The daemon behind `dsv4 serve`: one ZeroMQ ROUTER socket in front of one engine
(`server.py`), its wire protocol (`protocol.py`), the client the CLI uses (`client.py`),
where it lives on disk (`paths.py`) and how it starts and stops (`process.py`)."""
