"""The README's quick start: `./dsv4.sh` sets up a venv with the http extra, and a
`serve --http` without that extra names the command that installs it into the Python
running dsv4 (never a bare `pip`, which may belong to another Python)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dsv4.cli.options import install_hint
from tests.e2e.util import env_for

ROOT = Path(__file__).resolve().parents[2]
WITHOUT_UVICORN = "import sys; sys.modules['uvicorn'] = None; from dsv4.cli.main import main; sys.exit(main(sys.argv[1:]))"


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def test_dsv4_sh_installs_the_http_extra(tmp_path: Path) -> None:
    """./dsv4.sh on a fresh environment: scripts/venv.sh installs `.[http]` (its pip
    records the arguments here), then the CLI runs."""
    venv, record = tmp_path / "venv", tmp_path / "pip-args"
    (venv / "bin").mkdir(parents=True)
    _script(venv / "bin" / "python", f'exec "{sys.executable}" "$@"')
    _script(venv / "bin" / "pip", f'echo "$*" >> "{record}"')
    _script(venv / "bin" / "dsv4", f'exec "{sys.executable}" -m dsv4.cli.main "$@"')
    r = subprocess.run([str(ROOT / "dsv4.sh"), "--version"], capture_output=True, text=True, timeout=60,
                       env=env_for(DSV4_VENV=str(venv)), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("dsv4 ")
    installs = record.read_text().splitlines()
    assert any(line.endswith("-e .[http]") for line in installs), installs
    assert (venv / ".dsv4-installed-http").is_file()


def test_serve_http_without_the_extra_names_this_pythons_installer(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", WITHOUT_UVICORN, "serve", "--http", "127.0.0.1:8000",
                        "--socket", f"ipc://{tmp_path}/d.sock"], capture_output=True, text=True, timeout=60,
                       env=env_for(), stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--http needs the http extra (uvicorn is missing)" in lines[0], r.stderr
    hint = install_hint("http")
    assert lines[0].endswith(f": {hint}")
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve() and not os.environ.get("DSV4_VENV"):
        assert hint == f"{ROOT / 'scripts' / 'venv.sh'} http"  # the quick start's venv: its own script
    else:
        assert hint.startswith(f"{sys.executable} -m pip install ")  # this Python's pip, not whatever pip is first
