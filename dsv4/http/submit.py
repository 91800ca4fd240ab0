"""An HTTP request's prompts to the daemon: the prompts-per-request cap, the client each
counts for, and every refusal as an HTTP status.

    q, rids = await submit(bridge, parsed, client=client_of(request, body), max_prompts=64)

* `max_prompts` (`serve --max-prompts-per-request`, default DEFAULT_MAX_PROMPTS): a longer
  `prompt` list is a 400 naming the limit, before anything is sent.
* `client_of`: the client a request counts for in the engine's fair admission: the body's
  `user` when it has one, else the peer's address.
* Refusals: over the daemon's message limit 413 (`MessageTooLarge`), daemon not answering or
  its send queue full 503 (`DaemonUnavailable`, `DaemonBusy`); the prompts sent before a
  refusal are cancelled. Why the cap and its default: docs/http-api.md, 'dsv4/http/submit.py'.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dsv4.http.bridge import Bridge, DaemonBusy, DaemonUnavailable, MessageTooLarge
from dsv4.http.openai_requests import ApiError, Parsed

DEFAULT_MAX_PROMPTS = 64
MAX_USER_CHARS = 128
# Logprob entries one request may ask for (each a top token of a position, or its own): its
# samples' tokens x (1 + logprobs), echoed prompts, prompt_logprobs, for every choice. At ~30-80
# bytes each in JSON, ~10-20 MB of answer at most.
MAX_LOGPROB_ENTRIES = 1 << 18


def client_of(request: Any, body: dict[str, Any]) -> str:
    """The client a request counts for: `user` from the body, else the peer's host."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user[:MAX_USER_CHARS]
    peer = getattr(request, "client", None)
    return "peer:" + (peer.host if peer is not None and peer.host else "unknown")


def logprob_entries(parsed: Parsed, prompt_len: int, max_model_len: int) -> int:
    """The logprob entries the n choices of one prompt of `prompt_len` tokens may carry."""
    lp, plp = parsed.logprobs, parsed.prompt_logprobs
    if lp is None and plp is None:
        return 0
    mt = parsed.params.get("max_tokens")
    out = mt if isinstance(mt, int) else max(0, max_model_len - prompt_len)
    per = 0
    if lp is not None:
        per += (out + (prompt_len if parsed.echo else 0)) * (1 + lp)
    if plp is not None:
        per += prompt_len * (1 + plp)
    return parsed.n * per


async def check_output_budget(parsed: Parsed, max_model_len: int, count_tokens: Any) -> None:
    """400 when the request may answer more than MAX_LOGPROB_ENTRIES logprob entries. Text
    prompts are counted by their bytes first (at least one each per token) and tokenized
    (`count_tokens`, on a worker thread) only when that bound is over the limit."""
    def total(lengths: list[int]) -> int:
        return sum(logprob_entries(parsed, min(n, max_model_len), max_model_len) for n in lengths)

    lengths = [len(p) if isinstance(p, list) else len(p.encode("utf-8", "surrogatepass")) for p in parsed.prompts]
    if total(lengths) <= MAX_LOGPROB_ENTRIES:
        return
    exact = [len(p) if isinstance(p, list) else await asyncio.to_thread(count_tokens, p) for p in parsed.prompts]
    asked = total(exact)
    if asked > MAX_LOGPROB_ENTRIES:
        what = "max_tokens" if "max_tokens" in parsed.params else "no max_tokens (the context's length)"
        raise ApiError(400, f"the request may answer {asked} logprob entries (n = {parsed.n}, {what}, logprobs, "
                            f"echo and prompt_logprobs, for every choice), over the limit of {MAX_LOGPROB_ENTRIES} "
                            f"per request; ask for fewer samples, tokens or logprobs",
                       "logprobs" if parsed.logprobs is not None else "prompt_logprobs")


def check_prompt_count(parsed: Parsed, max_prompts: int) -> None:
    """400 when the request has more prompts (times `n`) than `max_prompts`."""
    count = len(parsed.prompts) * parsed.n
    if count > max_prompts:
        what = f"{len(parsed.prompts)} prompts x n = {parsed.n}" if parsed.n > 1 else f"{count} prompts"
        raise ApiError(400, f"the request has {what}, over the limit of {max_prompts} per "
                            f"request (--max-prompts-per-request); send fewer per request",
                       "n" if parsed.n > 1 else "prompt")


def sample_params(params: dict[str, Any], j: int) -> dict[str, Any]:
    """The parameters of sample j of a prompt: a seed s gives its samples s, s + 1, ... (the
    same answers for the same request, different ones for its samples). Only sample 0 asks
    for the prompt's logprobs: its siblings share them (`Replies`), as they share its prefill."""
    if j == 0:
        return params
    out = {k: v for k, v in params.items() if k != "prompt_logprobs"}
    if params.get("seed") is not None:
        out["seed"] = (int(params["seed"]) + j) % (1 << 64)
    return out


async def submit(bridge: Bridge, parsed: Parsed, *, client: str, max_prompts: int, param: str = "prompt"
                 ) -> tuple[asyncio.Queue, list[str]]:
    """Send one generate per prompt; all replies arrive on the returned queue. Raises ApiError
    (400, 413, 503; `param` names the body field of the prompts) with whatever was sent cancelled."""
    check_prompt_count(parsed, max_prompts)
    q: asyncio.Queue = asyncio.Queue()
    rids: list[str] = []
    try:
        for prompt in parsed.prompts:
            first = None
            for j in range(parsed.n):  # n samples: the siblings of the first start from its prefill
                # an explicit max_tokens must fit (400 otherwise); without one, generation stops at the model's length
                rid, _ = await bridge.generate(prompt, sample_params(parsed.params, j), mode=parsed.mode,
                                               thinking=parsed.thinking, queue=q,
                                               strict_length="max_tokens" in parsed.params, client=client,
                                               follows=first)
                first = first or rid
                rids.append(rid)
    except BaseException as e:
        for rid in rids:
            bridge.cancel(rid)
        if isinstance(e, (DaemonUnavailable, DaemonBusy)):
            raise ApiError(503, str(e), code="busy" if isinstance(e, DaemonBusy) else None) from None
        if isinstance(e, MessageTooLarge):
            raise ApiError(413, str(e), param) from None
        raise
    return q, rids
