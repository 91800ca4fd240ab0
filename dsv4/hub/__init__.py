"""Models by name: `--model ORG/NAME` through the Hugging Face hub cache.

Resolved as transformers and vLLM resolve a name: a local directory of that name wins;
otherwise a repo id names a snapshot in the hub cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`,
else `~/.cache/huggingface/hub`) at `--revision` (default main). The cache's layout is
huggingface_hub's own, so a model pulled by dsv4 is one transformers and vLLM find.

* `cache`: names and the cache, no network (what `EngineConfig` uses to turn a repo id
  into a directory; huggingface_hub is imported only when a repo id is given);
* `pull`: the download (`dsv4 pull`, and `serve`/`run --local`/... when a model is missing):
  only the files dsv4 reads, resumable, each file's hash checked against the hub's;
* `listing`: what `dsv4 models` shows (format, stored weight bytes, whether it fits).
Details: docs/models.md, 'dsv4/hub/__init__.py'.
"""
