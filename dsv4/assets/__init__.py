"""Embedded model assets: `DEFAULT_MODEL`, the tiny model every command uses without
`--model` (re-exported as `dsv4.DEFAULT_MODEL`)."""

from pathlib import Path

DEFAULT_MODEL = Path(__file__).parent / "tiny-shakespeare"
