"""`dsv4 bench` against the shared daemon: both MTP arms, every metric, in the JSON file and the tables."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.util import Daemon, dsv4
from tests.unit.test_bench_plot import assert_plotted

METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "output_throughput_tok_s", "request_throughput_req_s",
           "acceptance_rate", "mean_acceptance_length", "drafted", "accepted", "requests", "output_tokens", "wall_s")


def test_bench_both_arms_all_metrics(daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = dsv4("bench", "--prompt-len", "256", "--gen-len", "16", "--concurrency", "1,2", "--num-prompts", "4",
             "--mtp", "on,off", "--warmup", "1", "--json", str(out), "--plot", str(tmp_path / "bench.png"),
             endpoint=daemon.endpoint, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert_plotted(tmp_path / "bench.png")
    cfg = report["config"]
    assert cfg["prompt_len"] == 256 and cfg["gen_len"] == 16 and cfg["prompt_source"] == "random token ids"
    got = {(x["concurrency"], x["mtp"]) for x in report["results"]}
    assert got == {(1, "on"), (1, "off"), (2, "on"), (2, "off")}
    for res in report["results"]:
        assert set(METRICS) <= set(res), set(METRICS) - set(res)
        assert res["requests"] == 4 and res["output_tokens"] == 4 * 16  # EOS ignored: exactly --gen-len each
        for dist in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert set(res[dist]) == {"mean", "p50", "p90", "p99"} and res[dist]["p50"] > 0
        assert res["output_throughput_tok_s"] > 0
        if res["mtp"] == "on":
            assert res["drafted"] > 0 and 0 <= res["acceptance_rate"] <= 1
            assert 1 <= res["mean_acceptance_length"] <= 2  # K = 1
        else:
            assert res["drafted"] == 0 and res["acceptance_rate"] is None
    assert [c["concurrency"] for c in report["comparison"]] == [1, 2]
    ratio = report["comparison"][0]["output_throughput_tok_s"]
    assert ratio["ratio"] == ratio["on"] / ratio["off"]
    # tables on stdout: one per concurrency, arms side by side with their ratio
    assert "concurrency 1" in r.stdout and "concurrency 2" in r.stdout and "on/off" in r.stdout
    assert "TTFT p99" in r.stdout and "mean acceptance length" in r.stdout


def test_bench_json_to_stdout_and_real_text(daemon: Daemon, tmp_path: Path) -> None:
    text = tmp_path / "hamlet.txt"
    text.write_text("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40)
    r = dsv4("bench", "--prompt-len", "32", "--gen-len", "4", "--concurrency", "2", "--num-prompts", "2",
             "--mtp", "on", "--warmup", "0", "--dataset", str(text), "--json", "-", endpoint=daemon.endpoint)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # stdout is only the JSON
    assert report["config"]["prompt_source"].startswith("text windows from")
    assert [(x["concurrency"], x["mtp"]) for x in report["results"]] == [(2, "on")]
    assert report["comparison"] == []


def test_bench_plot_refuses_before_measuring(daemon: Daemon, tmp_path: Path) -> None:
    r = dsv4("bench", "--plot", str(tmp_path / "bench.pdf"), endpoint=daemon.endpoint, timeout=60)
    assert r.returncode == 2 and "--plot" in r.stderr and ".png or .svg" in r.stderr and len(r.stderr.splitlines()) == 1
