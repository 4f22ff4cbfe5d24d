"""docs/bench.md quotes `klrl bench` figures only through blocks rendered from the JSON the
runs wrote (docs/figures/bench.json, docs/figures/peers.json): `--docs` writes the blocks, and
this checks that nobody edited a figure by hand or refreshed one file without the other."""
import json
from pathlib import Path

import pytest

from cluster.bench import report
from cluster.config.options import read_block

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "bench.md"


@pytest.mark.parametrize("kind, name", [("bench", "bench.json"), ("peers", "peers.json")])
def test_the_bench_page_quotes_the_committed_runs(kind, name):
    result = json.loads((ROOT / "docs" / "figures" / name).read_text())
    render = report.peers_markdown if kind == "peers" else report.markdown
    assert read_block(PAGE.read_text(), report.MARKERS[kind]) == render(result)


def test_write_docs_replaces_only_its_own_block(tmp_path):
    result = json.loads((ROOT / "docs" / "figures" / "bench.json").read_text())
    page = tmp_path / "bench.md"
    page.write_text("intro\n<!-- bench:figures -->\nold\n<!-- /bench:figures -->\n"
                    "<!-- bench:peers -->\nkept\n<!-- /bench:peers -->\n")
    report.write_docs(result, page)
    text = page.read_text()
    assert "old" not in text and "kept" in text and text.startswith("intro\n")
    assert read_block(text, "bench:figures") == report.markdown(result)


def test_the_gpu_page_quotes_a_committed_gpu_run_or_says_none_is():
    """docs/gpu.md's block is the rendering of docs/figures/gpu.json (`klrl bench --from-json
    docs/figures/gpu.json --docs docs/gpu.md`), or, before a GPU run is committed, one line
    saying so: never figures typed by hand."""
    block = read_block((ROOT / "docs" / "gpu.md").read_text(), report.MARKERS["gpu"])
    committed = ROOT / "docs" / "figures" / "gpu.json"
    if committed.is_file():
        assert block == report.markdown(json.loads(committed.read_text()))
    else:
        assert block == report.NO_GPU_RUN
