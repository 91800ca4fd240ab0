"""Tokenizer: text <-> token ids, DeepSeek V4 prompt building, streaming detokenisation.

Contract:
- `Tokenizer.from_dir(path)` loads `tokenizer.json` (+ optional `tokenizer_config.json`);
  BOS/EOS come from the config, else from DeepSeek's names.
- `encode(text)` treats text as plain text: a special-token string inside it is tokenised as
  ordinary characters, never mapped to the special id.
- `encode_chat(messages, ...)` and `encode_prompt(text, mode=...)` render through
  `dsv4.agents.prompts` (DeepSeek V4's encoding, special tokens by id, so no content can
  inject them). A raw prompt starts with BOS only where the tokenizer says so (`add_bos`).
- `IncrementalDetokenizer.push(id)` returns only completed text (never half of a UTF-8
  character); all pushes plus `flush()` equal `Tokenizer.decode(all_ids)` exactly.
Details: docs/serving.md, 'dsv4/engine/tokenizer.py'.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as HFTokenizer

from dsv4.agents.encoding import EncodingError
from dsv4.agents.prompts import ASSISTANT_TOKEN, USER_TOKEN, PromptMode, render_chat, render_turn

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"

_REPLACEMENT = "\ufffd"
_GIL_FREE_CHARS = 16 << 10  # texts this long are encoded without holding the GIL (same ids)


class TokenizerError(Exception):
    """A tokenizer could not be loaded or cannot do what was asked (one-line message)."""


class TokenizerMissing(TokenizerError):
    """The model directory has no tokenizer.json (the engine then takes token ids only)."""


def _token_content(value: object) -> str | None:
    """A tokenizer_config.json token entry: a plain string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A `tokenizers` tokenizer plus the few facts the engine needs (BOS, EOS, chat tokens).
    Not changed after it is built, so one object serves every thread; `from_dir` hands the
    daemon's HTTP front end and its engine the same one (it takes about 0.5 s to build)."""

    # the last directory's (path, tokenizer.json's hash, tokenizer_config.json) and tokenizer
    _last: tuple[tuple[str, str, str], "Tokenizer"] | None = None

    def __init__(self, tokenizer_json: str, config: dict | None = None, source: str = "<memory>") -> None:
        """Build from the text of a tokenizer.json and the parsed tokenizer_config.json (if any)."""
        try:
            self._tok = HFTokenizer.from_str(tokenizer_json)
            # A second copy without added tokens: encodes any text as plain characters, so
            # strings like "<｜User｜>" in user text never become special ids.
            spec = json.loads(tokenizer_json)
            spec["added_tokens"] = []
            self._plain = HFTokenizer.from_str(json.dumps(spec))
        except Exception as e:  # tokenizers raises plain Exception on malformed files
            raise TokenizerError(f"cannot parse tokenizer.json from {source}: {e}") from None
        self.source = source
        self.config: dict = dict(config or {})
        self.bos_id = self._special_id("bos_token", BOS_TOKEN)
        self.eos_id = self._special_id("eos_token", EOS_TOKEN)
        self.pad_id = self._special_id("pad_token", None)
        self.add_bos = self._adds_bos(spec.get("post_processor"))
        self._byte_level = _is_byte_level(spec.get("decoder"))  # vocabulary strings are GPT-2 byte maps
        # UTF-8 bytes of the longest vocabulary entry: an upper bound on the text one token covers
        self.max_token_bytes = max((len(t.encode("utf-8")) for t in self._tok.get_vocab(True)), default=1)

    def to_json(self) -> str:
        """This tokenizer as tokenizer.json text (for a process that needs its own copy)."""
        return self._tok.to_str()

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` and, when present, `tokenizer_config.json` from a model directory."""
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerMissing(f"no tokenizer.json in {d} (hint: point at a model directory that has one)")
        config: dict = {}
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            try:
                config = json.loads(tc.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot read {tc}: {e}") from None
        try:
            text = tj.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read {tj}: {e}") from None
        key = (str(d), hashlib.sha256(text.encode("utf-8")).hexdigest(), json.dumps(config, sort_keys=True))
        last = Tokenizer._last
        if last is not None and last[0] == key and type(last[1]) is cls:
            return last[1]
        tok = cls(text, config, source=str(d))
        Tokenizer._last = (key, tok)
        return tok

    def _adds_bos(self, post_processor: object) -> bool:
        """Whether a raw prompt starts with BOS: tokenizer_config.json's `add_bos_token`
        when it is there, else whether tokenizer.json's post-processor prepends BOS."""
        flag = self.config.get("add_bos_token")
        if isinstance(flag, bool):
            return flag and self.bos_id is not None
        return self.bos_id is not None and _prepends_special(post_processor, self.bos_id, self._tok)

    def _special_id(self, key: str, default: str | None) -> int | None:
        """Id of the config's token `key`, else of the default token name, else None."""
        for name in (_token_content(self.config.get(key)), default):
            if name is not None and (i := self._tok.token_to_id(name)) is not None:
                return i
        return None

    # --- vocabulary -------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding needs at least this many rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_tokens(self) -> bool:
        """True when the vocabulary has `<｜User｜>` and `<｜Assistant｜>`."""
        return self.token_to_id(USER_TOKEN) is not None and self.token_to_id(ASSISTANT_TOKEN) is not None

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (as in the vocabulary), or None."""
        return self._tok.token_to_id(token)

    # --- encode / decode --------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of plain `text` (special-token strings in it are ordinary characters)."""
        if len(text) >= _GIL_FREE_CHARS:  # encode_batch lets other threads run meanwhile; encode holds the GIL
            ids = self._plain.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._plain.encode(text, add_special_tokens=False).ids if text else []
        return [self._bos()] + ids if add_bos else ids

    def _bos(self) -> int:
        if self.bos_id is None:
            raise TokenizerError(f"tokenizer from {self.source} has no BOS token (hint: pass add_bos=False)")
        return self.bos_id

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens are kept unless `skip_special_tokens`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_prompt(self, text: str, *, mode: PromptMode = "auto", system: str | None = None,
                      thinking: bool = False, add_bos: bool | None = None,
                      tools: Sequence[dict] | None = None) -> list[int]:
        """Prompt ids for one user turn (`dsv4.agents.prompts.render_turn`); TokenizerError."""
        try:
            return render_turn(self, text, mode=mode, system=system, thinking=thinking, add_bos=add_bos, tools=tools)
        except EncodingError as e:
            raise TokenizerError(str(e)) from None

    def encode_chat(self, messages: Sequence[dict], *, thinking: bool = False, add_bos: bool = True,
                    **options: Any) -> list[int]:
        """Prompt ids for an OpenAI-style conversation in DeepSeek V4's encoding
        (`dsv4.agents.prompts.render_chat`: tools, tool_choice, reasoning_effort,
        response_format); TokenizerError."""
        try:
            return render_chat(self, messages, thinking=thinking, add_bos=add_bos, **options)
        except EncodingError as e:
            raise TokenizerError(str(e)) from None

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id (byte-level form, as `convert_ids_to_tokens`), or None."""
        return self._tok.id_to_token(token_id)

    def special_token_ids(self) -> list[int]:
        """Ids of the added tokens marked special (BOS, EOS, <｜User｜>, ...: control, not text;
        V4's `<think>`, `</think>` and `｜DSML｜` are added tokens that are not)."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for (a piece of a character for some byte-level
        tokens): the vocabulary string through GPT-2's byte map for a byte-level tokenizer,
        else (and for added tokens outside that map) the token decoded alone."""
        s = self._tok.id_to_token(token_id)
        if s is None:
            return b""
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in s):
            return bytes(_UNICODE_TO_BYTE[c] for c in s)
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8", "surrogatepass")

    def detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        """A fresh streaming detokeniser over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


class IncrementalDetokenizer:
    """Streaming detokenisation with the prefix-offset / read-offset window.

    `ids[prefix:read]` is already emitted text kept as left context; `ids[read:]` is pending.
    Each push decodes only the window `ids[prefix:]` (a few tokens) and emits the new text
    once the window's decode does not end in U+FFFD, i.e. its last character is complete;
    then the window slides to `prefix, read = read, len(ids)`. Offsets only move to such
    complete-character boundaries, so decoding from `prefix` agrees with decoding it all.

    Invalid bytes (a model emitting stray byte tokens) would otherwise stall the window:
    after `max_pending` pending tokens whose text still ends in U+FFFD, everything but the
    last character is emitted (lossy UTF-8 decoding never revises it), and the window
    slides to the last token when no character straddles that boundary.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False, max_pending: int = 8) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.max_pending = max_pending
        self.ids: list[int] = []
        self._prefix = 0  # window start; ids[prefix:read] is left context, already emitted
        self._read = 0  # first id whose text is not (fully) emitted yet
        self._emitted = 0  # chars of decode(ids[prefix:]) already emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _slide(self, read: int) -> None:
        """Move the window to prefix = old read, read = `read` (both complete-character boundaries)."""
        self._prefix, self._read = self._read, read
        self._emitted = len(self._decode(self._prefix, read))

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        n = len(self.ids)
        text = self._decode(self._prefix)
        if not text.endswith(_REPLACEMENT):
            out = text[self._emitted :]
            self._slide(n)
            return out
        if n - self._read <= self.max_pending:
            return ""
        out = text[self._emitted : -1]
        self._emitted = max(self._emitted, len(text) - 1)
        head, last = self._decode(self._prefix, n - 1), self._decode(n - 1)
        if last and head + last == text:  # ids[n-1] starts on a boundary: slide, keeping its U+FFFD pending
            self._slide(n - 1)
            self._emitted = max(self._emitted, len(self._decode(self._prefix)) - 1)
        return out

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        out = self._decode(self._prefix)[self._emitted :]
        self._prefix = self._read = len(self.ids)
        self._emitted = 0
        return out


def _byte_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable character -> the byte it stands for."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_map()


def _is_byte_level(decoder: object) -> bool:
    """Whether a tokenizer.json decoder is (or contains) ByteLevel."""
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(d) for d in decoder.get("decoders") or [])


def _prepends_special(post_processor: object, bos_id: int, tok: HFTokenizer) -> bool:
    """True when a tokenizer.json post-processor (TemplateProcessing, maybe inside a
    Sequence) puts the special token with id `bos_id` first in a single sequence."""
    if not isinstance(post_processor, dict):
        return False
    if post_processor.get("type") == "Sequence":
        return any(_prepends_special(p, bos_id, tok) for p in post_processor.get("processors") or [])
    if post_processor.get("type") != "TemplateProcessing":
        return False
    single = post_processor.get("single") or []
    first = single[0] if single and isinstance(single[0], dict) else {}
    name = (first.get("SpecialToken") or {}).get("id")
    return isinstance(name, str) and tok.token_to_id(name) == bos_id


