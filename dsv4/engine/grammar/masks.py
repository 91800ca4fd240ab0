"""Structured outputs: a request's grammar (JSON schema, JSON object, regex, choice, EBNF or
Lark) turned by llguidance into per-token masks, kept exact under MTP speculative decoding.

* `check_spec(spec)`: the shape of `SamplingParams.structured` (no llguidance needed).
* `Grammars` (one per engine): `submit(spec)` compiles in the background (`grammar_compile`),
  EOS as the stop token; `state(compiled, prompt_ids)` -> a `GrammarState` (no grammar work
  on the engine's loop).
* `GrammarState` (one per request, on rank 0): `masks(drafts)`, every verified row's bitmask
  (row j's after drafts 0..j-1); `commit(tokens)`; nothing is constrained before `</think>`.
* `draft_masks` (the MTP's logits masked the same way), `apply_masks` (-inf where forbidden).

Once the answer is complete only EOS is allowed, and the scheduler ends a constrained
request at EOS even under `ignore_eos`. Details: docs/serving.md, 'dsv4/engine/grammar/masks.py'.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any, Sequence

from dsv4.engine.errors import RequestError

if TYPE_CHECKING:  # torch is imported where tensors are made: `check_spec` runs in params.py, without torch
    from concurrent.futures import Future

    import torch

    from dsv4.engine.grammar.compile_pool import CompilePool, Compiled

    from dsv4.engine.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")
MAX_SPEC_BYTES = 64 << 10  # a spec's JSON: larger schemas are refused
MAX_CHOICES = 1024
INSTALL_HINT = "scripts/venv.sh http, or pip install 'dsv4[http]'"


def check_spec(spec: Any) -> None:
    """Raise `RequestError` unless `spec` is {kind: value} with one kind of `KINDS`."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise RequestError(f"structured must be a map with one of {', '.join(KINDS)}, got {_short(spec)}")
    (kind, value), = spec.items()
    if kind not in KINDS:
        raise RequestError(f"structured: unknown kind {_short(kind)} (expected one of {', '.join(KINDS)})")
    try:
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError) as e:
        raise RequestError(f"structured {kind}: not JSON data: {e}") from None
    if size > MAX_SPEC_BYTES:
        raise RequestError(f"structured {kind} is {size} bytes, over the limit of {MAX_SPEC_BYTES}")
    if kind == "json_schema" and not isinstance(value, (dict, str, bool)):
        raise RequestError(f"structured json_schema must be a JSON schema (an object), got {_short(value)}")
    if kind == "json_object" and value is not True:
        raise RequestError(f"structured json_object must be true, got {_short(value)}")
    if kind in ("regex", "ebnf") and (not isinstance(value, str) or not value):
        raise RequestError(f"structured {kind} must be a non-empty string, got {_short(value)}")
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise RequestError(f"structured choice must be a list of 1..{MAX_CHOICES} non-empty strings, "
                               f"got {_short(value)}")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class Grammars:
    """The engine's grammars over its tokenizer's vocabulary (module docstring)."""

    def __init__(self, tokenizer: "Tokenizer | None", vocab_size: int, eos_id: int | None,
                 think_start: int | None = None, think_end: int | None = None, *, budget_s: float = 10.0) -> None:
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.think_start, self.think_end = think_start, think_end
        self.budget_s = budget_s
        self._pool: "CompilePool | None" = None
        self._pool_lock = threading.Lock()  # creating the pool at the first structured request (any thread)

    def submit(self, spec: dict[str, Any]) -> "Future":
        """A Future of the compiled grammar of a checked spec (`grammar_compile.CompilePool`:
        off this thread, in a worker process, within the budget); it fails with a one-line
        `RequestError` (no llguidance, no tokenizer, a grammar that does not compile or is over
        budget) or `RequestBusy`. Cancelling it drops the compile."""
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    from dsv4.engine.grammar.compile_pool import CompilePool

                    self._pool = CompilePool(self._tokenizer_info, budget_s=self.budget_s)
        return self._pool.submit(spec)

    def compile(self, spec: dict[str, Any]) -> Any:
        """`submit(spec)`, waited for: for callers without a loop to keep going (the offline LLM)."""
        return self.submit(spec).result()

    def status(self) -> dict[str, Any]:
        return self._pool.status() if self._pool is not None else {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _tokenizer_info(self) -> tuple[dict[str, Any], "Future"]:
        """The workers' vocabulary message and a Future of llguidance's tokenizer of it (built
        once, the message on the compile pool's thread, the tokenizer on a thread of its own:
        seconds for V4's 129k ids, docs/serving.md, 'dsv4/engine/grammar/masks.py')."""
        try:
            from dsv4.engine.grammar.worker import tokenizer
            import llguidance  # noqa: F401
        except ImportError:
            raise RequestError(f"structured outputs need llguidance, which is not installed: {INSTALL_HINT}") \
                from None
        tok = self.tokenizer
        if tok is None:
            raise RequestError("structured outputs need a tokenizer; this model has no tokenizer.json")
        special = set(tok.special_token_ids()) | {t for t in (self.think_start, self.think_end) if t is not None}
        n = min(tok.vocab_size, self.vocab_size)
        vocab = [b"" if i in special else tok.token_bytes(i) for i in range(n)]
        vocab += [b""] * (self.vocab_size - n)
        eos = self.eos_id if self.eos_id is not None else self.vocab_size - 1
        msg = {"tokens": vocab, "special": sorted(i for i in special if i < self.vocab_size), "eos": eos,
               "tokenizer_json": tok.to_json()}
        from concurrent.futures import Future

        built: Future = Future()  # the in-process copy builds while the workers start (two cores, not one after the other)

        def build() -> None:
            try:
                built.set_result(tokenizer(msg))
            except BaseException as e:  # noqa: BLE001  (reported to the first compile that needs it)
                built.set_exception(e)

        threading.Thread(target=build, name="dsv4-grammar-vocab", daemon=True).start()
        return msg, built

    def state(self, compiled: "Compiled", prompt_ids: Sequence[int]) -> "GrammarState":
        """A fresh matcher of a compiled grammar for a request (a copy of its initial matcher:
        cheap, the engine loop calls it); it starts unconstrained when the prompt ends in `<think>`."""
        thinking = self.think_start is not None and bool(prompt_ids) and prompt_ids[-1] == self.think_start
        return GrammarState(compiled.matcher.deep_copy(), self.vocab_size, active=not thinking,
                            think_end=self.think_end, eos=self.eos_id)


class GrammarState:
    """One request's matcher, its thinking switch and whether it has ended (module docstring).
    EOS is the grammar's stop token: it is never consumed by the matcher (llguidance's matcher
    only says it is allowed, once the grammar is satisfied); taking it ends the grammar."""

    def __init__(self, matcher: Any, vocab_size: int, *, active: bool = True, think_end: int | None = None,
                 eos: int | None = None) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.active = active  # False until </think> in thinking mode
        self.think_end, self.eos = think_end, eos
        self.done = False  # EOS taken (or the matcher failed): nothing more is constrained

    def masks(self, drafts: Sequence[int], out: torch.Tensor, first: int = 0, last_only: bool = False
              ) -> list[bool]:
        """Fill rows first.. of `out` [R, words] int32 with the bitmask of each verified row
        (row first + j: after drafts 0..j-1); returns which of the len(drafts) + 1 rows are
        constrained. The matcher ends where it began. `last_only`: fill only the last row."""
        m, active, dead, ended, accepted = self.matcher, self.active, False, self.done, 0
        rows = []
        for j in range(len(drafts) + 1):
            live = active and not dead and not ended
            if live and (not last_only or j == len(drafts)):
                _fill(m, out, first + j)
            rows.append(live)
            if j < len(drafts):
                d = int(drafts[j])
                if live:
                    if d == self.eos and m.validate_tokens([d]) == 1:
                        ended = True  # the grammar's end: the rows after it are free
                    elif d != self.eos and m.try_consume_tokens([d]) == 1:  # refused: the matcher is as it was
                        accepted += 1
                    else:
                        dead = True  # row j forbids d: verification stops there
                elif not active and d == self.think_end:
                    active = True
        if accepted:
            m.rollback(accepted)
        return rows

    def last_mask(self, drafts: Sequence[int], out: torch.Tensor, row: int) -> bool:
        """Fill row `row` of `out` with the mask after `drafts` (an MTP draft's); False when
        that position is free (thinking, or a draft the grammar refused)."""
        return self.masks(drafts, out, row - len(drafts), last_only=True)[-1]

    def commit(self, tokens: Sequence[int]) -> None:
        """Accept the tokens a step emitted (after `</think>` in thinking mode)."""
        for t in tokens:
            if not self.active:
                self.active = int(t) == self.think_end
                continue
            if self.done:
                return
            if int(t) == self.eos or not self.matcher.consume_token(int(t)):
                self.done = True  # EOS; or a token the mask forbade (a bug), after which nothing is constrained


def apply_masks(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [R, V] with each row of `rows` limited to the tokens its row of `bitmask`
    [R, words] allows (-inf elsewhere): a new tensor, `logits` itself when `rows` is empty.
    On CPU numpy unpacks the bits; elsewhere torch unpacks the bytes of the constrained rows
    through a table."""
    if not rows:
        return logits
    import torch

    out = logits.clone()
    dev = logits.device
    allowed = unpack(bitmask[list(rows)], logits.shape[-1], numpy=dev.type == "cpu").to(dev)  # [n, V]
    idx = torch.tensor(list(rows), dtype=torch.long, device=dev)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def unpack(words: "torch.Tensor", v: int, *, numpy: bool = True) -> "torch.Tensor":
    """Bitmask rows [n, W] int32 (bit b of word w: token 32 w + b) -> allowed [n, v] bool, by
    numpy's unpackbits (CPU: one pass, the faster) or through a byte table in torch (any
    device; timings: docs/serving.md, 'dsv4/engine/grammar/masks.py')."""
    import torch

    words = words.contiguous()
    if numpy:
        import numpy as np

        bits = np.unpackbits(words.cpu().numpy().view(np.uint8), axis=1, bitorder="little")[:, :v]
        return torch.from_numpy(bits).bool()
    dev = words.device
    table = (torch.arange(256, device=dev)[:, None] >> torch.arange(8, device=dev)) & 1  # [256, 8]
    return table.bool()[words.view(torch.uint8).long()].reshape(words.shape[0], -1)[:, :v]  # little-endian bytes


def _fill(matcher: Any, out: "torch.Tensor", row: int) -> None:
    """Write `matcher`'s next-token bitmask into row `row` of `out` [R, words] int32 (CPU)."""
    v = out[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


def draft_masks(logits: torch.Tensor, heads: Sequence[Any], drafts: dict[int, list[int]]) -> torch.Tensor:
    """The MTP's logits [N, V] of `heads` (requests, one row each) with each constrained
    request's row masked by its grammar after its drafts so far this step (`drafts`: slot -> tokens)."""
    rows = []
    bm = new_bitmask(len(heads), logits.shape[-1])
    for i, req in enumerate(heads):
        if req.grammar is not None and req.grammar.last_mask(drafts.get(req.slot, []), bm, i):
            rows.append(i)
    return apply_masks(logits, rows, bm)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask of `rows` rows over `vocab_size` tokens, every token allowed."""
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
