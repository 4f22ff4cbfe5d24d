"""The README is a landing page and the reference is a documentation site under docs/, built by
mkdocs in strict mode: a broken link or anchor, or a page left out of the navigation, fails
here, so `make test` builds the docs. The README stays one screenful of pages to read next."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_docs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # No --quiet: it hides the warnings from --strict too, and the build then passes them.
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_a_landing_page_that_reaches_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    first = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1).splitlines()
    assert [line.split("#")[0].strip() for line in first[:2]] == ["make demo", "make test"]
    assert text.index("make demo") < text.index("\n## ")
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)(?:#[^)]*)?\)", text))
    for target in linked:
        assert (ROOT / target).is_file(), f"README links {target}, which does not exist"
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = {f"docs/{page}" for page in _nav_pages(config["nav"])}
    hand_written = {p for p in pages if not p.startswith("docs/sweeps/") and p != "docs/index.md"}
    assert hand_written <= linked, (
        f"pages the README does not link: {sorted(hand_written - linked)}")


def test_docs_name_no_file_outside_the_repository():
    for page in [README, *(ROOT / "docs").rglob("*.md")]:
        text = page.read_text()
        # (spelt in two pieces so that this file does not cite them either)
        assert "DESIGN" + ".md" not in text and "../" + "shared" not in text, page


def test_the_mapping_page_names_only_klrl_options_that_exist():
    """docs/coming-from.md maps other libraries' names to klrl's: each klrl option it names
    (`kl.beta`, `learner.epochs`, ...) is a real one."""
    from cluster.config.options import option_rows

    keys = {key for key, _, _ in option_rows()}
    text = (ROOT / "docs" / "coming-from.md").read_text()
    named = set(re.findall(r"`((?:kl|learner|rollout|advantage)\.[a-z_]+)", text))
    assert named and not named - keys, sorted(named - keys)
