"""Splitting a DeepSeek thinking-mode answer into `reasoning_content` and `content` as it streams.

In thinking mode the prompt ends with `<think>`, so the answer starts inside the thinking
block: text before `</think>` is reasoning, text after it is content (the tag itself is
dropped). A tag may arrive split over several deltas, so a tail that could be the start
of `</think>` is held back until the next delta (or `flush`) decides it.
"""

from __future__ import annotations

THINK_END = "</think>"


class ReasoningSplitter:
    """`feed(text) -> (reasoning, content)`; without thinking everything is content."""

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        buf = self._held + text
        cut = buf.find(THINK_END)
        if cut >= 0:
            self.in_reasoning, self._held = False, ""
            return buf[:cut], buf[cut + len(THINK_END):]
        keep = 0  # the longest tail of buf that is a proper prefix of THINK_END
        for n in range(min(len(THINK_END) - 1, len(buf)), 0, -1):
            if THINK_END.startswith(buf[-n:]):
                keep = n
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)
