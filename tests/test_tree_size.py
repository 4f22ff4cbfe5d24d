"""The repository stays light (issue 63 item 5): every tracked file together under 15 MB, so
that a clone is quick and a lent GPU machine's 64 MiB call carries the tree with room for its
payload (docs/gpu.md). Sweeps add records as they run; keep.py keeps only what a report reads,
compacted, and report plots are palette PNGs at a docs page's size (report_plots.save_png):
this fails the day a sweep's records outgrow that, so that the choice is made then."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 15 * 1024 * 1024


def test_the_tracked_tree_is_under_15_mb():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True, timeout=30).stdout.split(b"\0")
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: nothing tracked to measure")
    sizes = {name.decode(): (ROOT / name.decode()).stat().st_size for name in listed
             if name and (ROOT / name.decode()).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total < LIMIT_BYTES, (
        f"tracked files total {total / 2**20:.1f} MiB, over {LIMIT_BYTES / 2**20:.0f}: largest "
        + ", ".join(f"{n} ({b / 2**20:.1f} MiB)" for n, b in largest))
