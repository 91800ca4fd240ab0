"""`dsv4 bench --http URL`: the serving benchmark over the OpenAI-compatible HTTP API.

One thread per request in flight streams `POST /v1/completions` (token-id prompt,
`stream_options.include_usage`, `ignore_eos`, and dsv4's `speculative` for the MTP arms)
and turns the server-sent events into the messages `dsv4 bench` reads from the daemon:
a delta per chunk with text (TTFT, ITL), then a final carrying the usage (token counts
come from it, not from chunks). Per-request MTP counters are not part of OpenAI's
responses, so each arm's acceptance comes from the difference of the server's
`vllm:spec_decode_*` Prometheus counters before and after it.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import urllib.parse
from typing import Any

from dsv4.cli.options import CliError


class HttpBackend:
    """The `submit` / `poll` interface of the bench backends, over HTTP."""

    def __init__(self, url: str, api_key: str | None) -> None:
        u = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if u.scheme != "http" or not u.hostname:
            raise CliError(f"--http {url}: expected http://HOST:PORT")
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.url = f"http://{self.host}:{self.port}"
        self._events: queue.Queue = queue.Queue()
        self._n = 0
        models = self._get_json("/v1/models")
        try:
            m = models["data"][0]
        except (KeyError, IndexError, TypeError):
            raise CliError(f"{self.url}/v1/models lists no model") from None
        self.model = m["id"]
        self.info = {"model": m.get("root") or m["id"], "device": "http", "dtype": None,
                     "num_speculative_tokens": None, "vocab_size": _vocab_size(m.get("root"))}

    # ------------------------------------------------------------------ helpers
    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=600)

    def _get(self, path: str) -> tuple[int, bytes]:
        c = self._conn()
        try:
            c.request("GET", path, headers=self.headers)
            r = c.getresponse()
            return r.status, r.read()
        except OSError as e:
            raise CliError(f"cannot reach {self.url}: {e}") from None
        finally:
            c.close()

    def _get_json(self, path: str) -> Any:
        status, body = self._get(path)
        if status != 200:
            raise CliError(f"{self.url}{path} answered {status}: {body[:200].decode(errors='replace')}")
        return json.loads(body)

    def spec_totals(self) -> dict[str, float]:
        """The server's vllm:spec_decode_* counters now."""
        status, body = self._get("/metrics")
        out = {"drafted": 0.0, "accepted": 0.0, "steps": 0.0}
        names = {"vllm:spec_decode_num_draft_tokens_total": "drafted",
                 "vllm:spec_decode_num_accepted_tokens_total": "accepted",
                 "vllm:spec_decode_num_drafts_total": "steps"}
        for line in body.decode(errors="replace").splitlines() if status == 200 else []:
            name, _, value = line.partition(" ")
            key = names.get(name.split("{")[0])
            if key is not None:
                out[key] += float(value)
        return out

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], params: dict[str, Any]) -> str:
        rid = f"b{self._n}"
        self._n += 1
        body = {**params, "model": self.model, "prompt": prompt, "stream": True,
                "stream_options": {"include_usage": True}}
        threading.Thread(target=self._stream, args=(rid, body), daemon=True).start()
        return rid

    def _stream(self, rid: str, body: dict[str, Any]) -> None:
        put = self._events.put
        c = self._conn()
        try:
            c.request("POST", "/v1/completions", body=json.dumps(body), headers=self.headers)
            r = c.getresponse()
            if r.status != 200:
                err = json.loads(r.read() or b"{}").get("error") or {}
                put({"type": "error", "id": rid, "message": f"HTTP {r.status}: {err.get('message')}"})
                return
            usage, reason = None, None
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    put({"type": "final", "id": rid, "finish_reason": "error", "error": chunk["error"].get("message")})
                    return
                for ch in chunk.get("choices") or []:
                    if ch.get("text"):
                        put({"type": "delta", "id": rid, "n": 1})
                    reason = ch.get("finish_reason") or reason
                usage = chunk.get("usage") or usage
            if usage is not None:  # OpenAI's shape -> the daemon's (the report reads cached_tokens)
                usage = {**usage, "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
            put({"type": "final", "id": rid, "finish_reason": reason, "usage": usage})
        except (OSError, ValueError) as e:
            put({"type": "final", "id": rid, "finish_reason": "error", "error": f"{type(e).__name__}: {e}"})
        finally:
            c.close()

    def poll(self) -> list[dict[str, Any]]:
        out = []
        try:
            out.append(self._events.get(timeout=0.5))
            while True:
                out.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return out

    def close(self) -> None:
        pass


def _vocab_size(root: str | None) -> int:
    """The tokenizer's vocabulary when the model directory is readable here (random prompts need it)."""
    if not root:
        return 0
    from dsv4.engine.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.from_dir(root).vocab_size
    except (TokenizerError, OSError):
        return 0
