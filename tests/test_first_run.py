"""Issue #23, the first ten minutes: the embedded model's first build talks off a terminal, and
builds of one model started together take turns instead of each doing the whole work."""
from __future__ import annotations

import time

from cluster.tiny import model as tiny_model
from cluster.tiny.model import init_default_model


def test_a_second_build_waits_for_the_first_and_reuses_its_model(tmp_path, monkeypatch, capsys):
    """Issue #23: builds of one model started together take turns on a lock, and the later one
    finds the model made instead of doing the whole work again."""
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


QUIET_SCRIPT = r"""
import logging, os, sys, warnings
from pathlib import Path
from cluster.train.run_output import quiet_output
from cluster.tiny.model import PlainLines

logging.basicConfig()  # a handler on the original stderr, as libraries set up at import
with quiet_output(Path(sys.argv[1]), heartbeat_s=1.5):
    PlainLines("klrl line", every=0).maybe("shown")
    print("a library's banner")
    os.write(1, b"a C extension's line\n")
    warnings.warn("a FutureWarning line", FutureWarning)
    logging.getLogger("vllm").warning("a logger's line")
    os.system("echo a child process line")
    from wandb.sdk.lib import console_capture  # wandb wraps the streams' write for its run
    console_capture.capture_stdout(lambda s, n: None)
    PlainLines("klrl through wandb's wrapper", every=0).maybe("shown")
    import builtins
    from ray.experimental import tqdm_ray  # a Ray driver's print is Ray's safe_print
    builtins.print = tqdm_ray.safe_print
    PlainLines("klrl through Ray's print", every=0).maybe("shown")
    print("a library's line through Ray's print")
    import time; time.sleep(2.5)
print("after: shown again")
"""


def test_quiet_output_shows_klrl_lines_and_logs_everything(tmp_path):
    """Issue #23, 3: other programs' lines go to the run's log, klrl's to the terminal too, and
    a heartbeat speaks when klrl has been silent."""
    import subprocess
    import sys
    from pathlib import Path

    log = tmp_path / "train.log"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", QUIET_SCRIPT, str(log)], cwd=root,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    shown = done.stdout + done.stderr
    assert "klrl line: shown" in shown and "after: shown again" in shown
    assert "klrl through wandb's wrapper: shown" in shown
    assert "klrl through Ray's print: shown" in shown
    assert "still working" in shown, shown
    for other in ("banner", "C extension", "FutureWarning", "logger's line", "child process",
                  "through Ray's print\n"):
        assert other not in shown, (other, shown)
        assert other in log.read_text(), other
    assert "klrl line: shown" in log.read_text()


def test_a_failure_after_the_start_is_one_line_naming_the_log(tmp_path, monkeypatch, capsys):
    """Issue #23, 2: what can only fail after the start (here: a run that made its directory,
    then raised) ends with one line naming the error and the full log, exit 1; the traceback
    is in RUN_DIR/train.log, and the directory does not block the name (no metrics)."""
    from cluster.cli.main import main
    from cluster.config.loader import DEMO_CONFIG
    from cluster.train import run
    from cluster.train.door.preflight import preflight

    def fails_midway(cfg, resume=False, passed=None):
        run_dir, _ = preflight(cfg, resume)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text("{}")
        print("a library's banner")
        raise FileNotFoundError("rows.jsonl: gone while reading\nsecond line")

    monkeypatch.setattr(run, "train", fails_midway)
    out = tmp_path / "runs"
    argv = ["train", str(DEMO_CONFIG), f"output_dir={out}", "run_name=r"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    log = out / "r" / "train.log"
    assert captured.err.strip().splitlines() == [
        "error: the run failed: FileNotFoundError: rows.jsonl: gone while reading "
        f"(full log: {log})"]
    assert "banner" not in captured.out
    assert "Traceback" in log.read_text() and "a library's banner" in log.read_text()
    assert main(argv) == 1  # the name is not blocked: the same run starts again
