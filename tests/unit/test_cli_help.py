"""The man page (man/dsv4.1) and `dsv4 ... --help` must agree: same commands, same options.

Options are read from the typer/click command tree (what `--help` prints, checked
against the printed help too) and from the man page's `.TP` tags: the global ones
under `.SH GLOBAL OPTIONS`, each command's under `.SS "dsv4 COMMAND"`. Environment
variables the CLI and daemon read and the exit statuses must be documented too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from dsv4.cli import options as O
from dsv4.cli.main import app, main

ROOT = Path(__file__).resolve().parents[2]
MAN = ROOT / "man" / "dsv4.1"
OPT_RE = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)")


def _plain(roff: str) -> str:
    """Roff text without font escapes, with `\\-` as '-'."""
    s = roff.replace("\\-", "-").replace("\\(aq", "'")
    s = re.sub(r"\\f[BIRP]", "", s)
    return s


def _man_sections() -> dict[str, list[str]]:
    """Lines of the man page by section: 'SH NAME' or the command name for `.SS "dsv4 CMD"`."""
    sections: dict[str, list[str]] = {}
    current = ""
    for line in MAN.read_text().splitlines():
        m = re.match(r'\.SH\s+"?([^"]+)"?', line)
        if m:
            current = f"SH {m.group(1).strip()}"
        m = re.match(r'\.SS\s+"dsv4 ((?:\w|\\-)+)"', line)  # e.g. "dsv4 draft\-vocab"
        if m:
            current = m.group(1).replace("\\-", "-")
        sections.setdefault(current, []).append(line)
    return sections


def _tp_options(lines: list[str]) -> set[str]:
    """Options named in the tag line after each `.TP`."""
    found: set[str] = set()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == ".TP":
            found.update(OPT_RE.findall(_plain(lines[i + 1])))
    return found


def _tp_tags(lines: list[str]) -> list[str]:
    return [_plain(lines[i + 1]).split()[-1] for i, line in enumerate(lines[:-1]) if line.strip() == ".TP"]


def _cli_options(cmd: object) -> set[str]:
    opts: set[str] = set()
    for p in cmd.params:  # type: ignore[attr-defined]
        if getattr(p, "param_type_name", "") == "option":
            opts.update(o for o in [*p.opts, *p.secondary_opts] if o.startswith("-"))
    return opts | {"-h", "--help"}


@pytest.fixture(scope="module")
def group() -> object:
    return typer.main.get_command(app)


@pytest.fixture(scope="module")
def man() -> dict[str, list[str]]:
    assert MAN.is_file(), f"missing {MAN}"
    return _man_sections()


def test_every_command_documented(group: object, man: dict[str, list[str]]) -> None:
    commands = set(group.commands)  # type: ignore[attr-defined]
    documented = {k for k in man if not k.startswith("SH ") and k}
    assert commands == documented, f"commands only in --help: {commands - documented}; " \
                                   f"only in the man page: {documented - commands}"


def test_global_options(group: object, man: dict[str, list[str]]) -> None:
    assert _cli_options(group) == _tp_options(man["SH GLOBAL OPTIONS"])


@pytest.mark.parametrize("name", ["serve", "run", "status", "stop", "bench"])
def test_command_options_match_man_page(name: str, group: object, man: dict[str, list[str]]) -> None:
    cli = _cli_options(group.commands[name])  # type: ignore[attr-defined]
    doc = _tp_options(man[name]) | {"-h", "--help"}  # -h/--help are documented once, globally
    assert not cli - doc, f"dsv4 {name}: options in --help but not in man/dsv4.1: {sorted(cli - doc)}"
    assert not doc - cli, f"dsv4 {name}: options in man/dsv4.1 but not in --help: {sorted(doc - cli)}"


@pytest.mark.parametrize("name", ["serve", "run", "status", "stop", "bench"])
def test_help_output_lists_every_option(name: str, group: object, capsys: pytest.CaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main([name, "--help"]) == 0
    printed = set(OPT_RE.findall(capsys.readouterr().out))
    cli = _cli_options(group.commands[name])  # type: ignore[attr-defined]
    assert cli <= printed, f"not in 'dsv4 {name} --help': {sorted(cli - printed)}"


def test_environment_documented(man: dict[str, list[str]]) -> None:
    documented = set(_tp_tags(man["SH ENVIRONMENT"]))
    used = set()
    for f in [*(ROOT / "dsv4" / "cli").glob("*.py"), *(ROOT / "dsv4" / "daemon").glob("*.py")]:
        used.update(re.findall(r'environ(?:\.get)?\(?\[?"([A-Z_][A-Z0-9_]*)"', f.read_text()))
    assert {"DSV4_SOCKET", "DSV4_DEBUG", "XDG_RUNTIME_DIR", "XDG_STATE_HOME"} <= documented
    assert used <= documented, f"environment variables read but not documented: {sorted(used - documented)}"


def test_exit_statuses_documented(man: dict[str, list[str]]) -> None:
    documented = {int(t) for t in _tp_tags(man["SH EXIT STATUS"])}
    codes = {v for k, v in vars(O).items() if k.startswith("EXIT_")}
    assert codes == documented == {0, 1, 2, 69, 75, 130}


def test_top_level_help_gives_each_command_a_whole_sentence(group: object, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Click would cut a summary at its first period ("Convert a checkpoint (e.g.") or at 45
    characters ("...;..."); each command's line is its whole `short_help` instead."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["--help"]) == 0
    listing = capsys.readouterr().out.split("Commands:\n", 1)[1]
    summaries: dict[str, str] = {}
    for line in listing.splitlines():
        name, _, text = line.strip().partition(" ")
        if line.startswith("  ") and not line.startswith("   "):
            summaries[name] = text.strip()
        elif line.strip():
            summaries[list(summaries)[-1]] += " " + line.strip()
    commands = group.commands  # type: ignore[attr-defined]
    assert set(summaries) == set(commands)
    for name, text in summaries.items():
        assert text == commands[name].short_help and text.endswith(".") and "..." not in text, (name, text)


@pytest.mark.parametrize("name", ["serve", "run", "chat", "bench", "status", "stop", "convert"])
def test_help_prints_no_integer_overflow_bounds(name: str, capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    for noise in (str(O.MAX_INT), str(O.MAX_SEED), "x<=2", "1<=x", "0<=x<=1844"):
        assert noise not in out, f"dsv4 {name} --help prints {noise!r}"


@pytest.mark.parametrize("args, message", [
    (["run", "--max-tokens", "0", "x"], "'--max-tokens': must be at least 1, got 0"),
    (["run", "--max-tokens", str(2**31), "x"], f"'--max-tokens': must be at most {2**31 - 1}, got {2**31}"),
    (["run", "--seed", "-1", "x"], "'--seed': must be at least 0, got -1"),
    (["serve", "--threads", "0"], "'--threads': must be at least 1, got 0"),
])
def test_integer_bounds_still_hold(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(args) == O.EXIT_USAGE
    assert message in capsys.readouterr().err
