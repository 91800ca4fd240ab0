"""Stop strings over streamed text.

`StopChecker.feed(new_text)` takes the text decoded since the last call and returns
`(text_to_emit, stopped)`. A stop string is matched across token boundaries and is
never emitted (unless `include`: vLLM's include_stop_str_in_output), nor is anything after it. Text that could still be the start of a stop
string is held back until the next pieces decide it; `flush()` returns what is held
when the stream ends without a stop.

Why holding back the longest such suffix is enough: if a stop string began inside text
already emitted, the text from its start to the end of the buffer would be a longer
suffix that is a prefix of a stop string, which contradicts the choice of the suffix.
"""

from __future__ import annotations

from typing import Sequence


class StopChecker:
    """Incremental stop-string matcher for one request."""

    def __init__(self, stop: Sequence[str], include: bool = False):
        self.stop = [s for s in stop if s]
        self.include = include  # the matched stop string is emitted too
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Add text; return the text now safe to emit and whether a stop string was hit."""
        if self.stopped:
            return "", True
        buf = self._held + new_text
        if not self.stop:
            self._held = ""
            return buf, False
        best = -1
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, self.matched = i, s
        if best >= 0:
            self.stopped = True
            self._held = ""
            assert self.matched is not None
            return buf[:best + (len(self.matched) if self.include else 0)], True
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of stream: the held-back text (empty after a stop)."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
