"""Issue #23, the first ten minutes: the embedded model's first build talks off a terminal, and
builds of one model started together take turns instead of each doing the whole work."""
from __future__ import annotations

import time

from cluster.tiny import model as tiny_model
from cluster.tiny.model import init_default_model


def test_a_second_build_waits_for_the_first_and_reuses_its_model(tmp_path, monkeypatch, capsys):
    """Issue #23: builds of one model started together each did the whole work. Now they take
    turns on a lock and the later one finds the model made."""
    import threading

    calls = []

    def slow_build(out, *args):
        calls.append(out)
        time.sleep(1.5)
        out.mkdir()
        (out / "model.safetensors").write_text("")
        (out / tiny_model.METADATA_FILE).write_text("{}")

    monkeypatch.setattr(tiny_model, "_build", slow_build)
    out = tmp_path / "m"
    results = []
    threads = [threading.Thread(target=lambda: results.append(init_default_model(out)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    for thread in threads:
        thread.join(timeout=30)
    assert results == [out, out] and calls == [out]
    printed = capsys.readouterr().out
    assert "another process is building m; waiting for it" in printed
    assert printed.count("building the embedded tiny model") == 1


def test_the_warm_start_prints_plain_lines_off_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(tiny_model, "VALIDATION_PROBLEMS", 8)
    model, tok = tiny_model._new_model(0)
    tiny_model.warm_start(model, tok, seed=0, target=None, max_steps=3, progress=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines and lines[0].startswith("warm-start SFT (fixed budget): step 1, loss "), lines
