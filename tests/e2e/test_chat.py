"""`dsv4 chat` on a real pseudo-terminal against the session's daemon: turns, /set, /clear,
Ctrl-C cancelling an answer (not the session), /bye."""

from __future__ import annotations

import pytest

import fcntl
import os
import pty
import select
import subprocess
import termios
import time

from tests.e2e.util import CMD, as_from_a_terminal, env_for, status_now, wait_until


def _controlling_tty() -> None:
    """In the child: a new session whose controlling terminal is the pty, so ^C sends SIGINT
    (with SIGINT's default action, as from a terminal's shell: `as_from_a_terminal`)."""
    as_from_a_terminal()
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Pty:
    def __init__(self, *args: str, endpoint: str) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([*CMD, *args], stdin=slave, stdout=slave, stderr=slave,
                                     env=env_for(endpoint, TERM="dumb"), preexec_fn=_controlling_tty)
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout: float = 60) -> str:
        """Read until `text` appears after what earlier expects consumed; returns what came before it."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} not seen; got {self.seen[-500:]!r}"
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:
                    break
        assert text in self.seen, f"{text!r} not seen; got {self.seen[-500:]!r}"
        before, _, self.seen = self.seen.partition(text)
        return before

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def some_output(self, timeout: float = 60) -> None:
        """Read until something other than white space arrives (without consuming it)."""
        deadline = time.monotonic() + timeout
        while not self.seen.strip():
            left = deadline - time.monotonic()
            assert left > 0, "no output"
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                self.seen += os.read(self.master, 4096).decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


def test_chat_session(daemon):
    t = Pty("chat", "--max-tokens", "6", endpoint=daemon.endpoint)
    try:
        t.expect("plain continuation")
        t.expect(">>> ")
        t.send("/set temperature 0\r")
        t.expect("temperature = 0.0")
        t.expect(">>> ")
        t.send("ROMEO:\r")
        first = t.expect(">>> ")
        assert first.strip().startswith("ROMEO:") and len(first.strip()) > len("ROMEO:")
        t.send("/set max_tokens 900\r")
        t.expect("max_tokens = 900")
        t.expect(">>> ")
        t.send("Speak on\r")
        t.expect("Speak on")  # the echo
        t.some_output()  # the answer streams: Ctrl-C at once (900 tokens take a few seconds)
        t.send("\x03")  # Ctrl-C: cancels this answer only
        t.expect("(answer cancelled)")
        t.expect(">>> ")
        assert wait_until(lambda: status_now(daemon.endpoint)["in_flight"] == 0, timeout=10)
        t.send("/clear\r")
        t.expect("(conversation cleared)")
        t.expect(">>> ")
        t.send("/bye\r")
        assert t.proc.wait(20) == 0
    finally:
        t.close()


def test_run_without_a_prompt_on_a_terminal_chats(daemon):
    t = Pty("run", "--max-tokens", "3", endpoint=daemon.endpoint)
    try:
        t.expect("dsv4 chat with")
        t.expect(">>> ")
        t.send("/bye\r")
        assert t.proc.wait(20) == 0
    finally:
        t.close()


def test_set_refuses_what_the_daemon_would_refuse(daemon):
    """/set checks the value as the daemon's SamplingParams validation does, at once,
    instead of failing the next turn; the refused value is not kept."""
    t = Pty("chat", endpoint=daemon.endpoint)
    try:
        t.expect(">>> ")
        for line, message in [("/set temperature -1", "refused: temperature must be in [0.0, inf), got -1.0"),
                              ("/set top_p 0", "refused: top_p must be in"),
                              ("/set top_k 1.5", "top_k takes an integer, got '1.5'")]:
            t.send(line + "\r")
            t.expect(message)
            t.expect(">>> ")
        t.send("/set\r")
        assert "temperature" not in t.expect(">>> ")
        t.send("/set temperature 0.5\r")
        t.expect("temperature = 0.5")
        t.expect(">>> ")
        t.send("/bye\r")
        assert t.proc.wait(20) == 0
    finally:
        t.close()


@pytest.mark.parametrize(("flag", "says"), [(("--think",), "--think: this model has no chat template, so no "
                                                            "thinking mode"),
                                           (("--tools", "TOOLS"), "--tools: this model has no chat template, so no "
                                                                  "tools")])
def test_chat_think_or_tools_without_a_chat_template_is_refused(daemon, tmp_path, flag, says):
    tools = tmp_path / "tools.json"
    tools.write_text('[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]')
    t = Pty("chat", *[str(tools) if a == "TOOLS" else a for a in flag], endpoint=daemon.endpoint)
    try:
        t.expect(says)
        assert t.proc.wait(20) == 2
    finally:
        t.close()
