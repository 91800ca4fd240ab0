"""`dsv4 bench --plot`: a report drawn as PNG and SVG, both arms visible; bad suffixes refused."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dsv4.cli.bench_plot import STYLE, PlotError, check, plot


def _report() -> dict:
    res = []
    for c in (1, 2, 4, 8):
        for arm, speed in (("on", 1.2), ("off", 1.0)):
            res.append({"concurrency": c, "mtp": arm, "output_throughput_tok_s": 100 * speed * c ** 0.7,
                        "ttft_s": {"p50": 0.02 * c, "p90": 0.03 * c}, "tpot_s": {"p50": 0.01 / speed, "p90": 0.012}})
    return {"config": {"model": "tiny", "device": "cpu", "dtype": "float32", "prompt_len": 256, "gen_len": 16,
                       "num_prompts": 16, "num_speculative_tokens": 1}, "results": res}


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


def assert_plotted(path: Path) -> None:
    """A PNG of the three panels with both arms' lines drawn in their colours."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    assert img.size[0] > 1000 and img.size[1] > 300
    colours = {c for _, c in img.getcolors(maxcolors=1 << 20)}
    for arm in ("on", "off"):
        assert _rgb(STYLE[arm]["color"]) in colours, arm


def test_png_and_svg(tmp_path: Path) -> None:
    assert_plotted(plot(_report(), tmp_path / "b.png"))
    svg = plot(_report(), tmp_path / "sub" / "b.svg")
    root = ET.parse(svg).getroot()
    text = svg.read_text()
    assert root.tag.endswith("svg") and all(STYLE[a]["color"] in text for a in ("on", "off"))


@pytest.mark.parametrize("name", ["b.pdf", "b", "b.png.txt"])
def test_bad_suffix_is_one_line(name: str) -> None:
    with pytest.raises(PlotError, match=r"must end in \.png or \.svg"):
        check(name)
