"""Loading and validating a training config imports no torch, vLLM, Ray, DeepSpeed or
transformers (docs/layout.md, "traits"), and neither does `klrl --help`: each table's traits
that the config reads live in torch-free modules (kl.traits, learner.task_term_traits,
actors.weight_sync.traits, actors.generation's modes).

Each check runs in a fresh interpreter whose meta-path finder refuses those packages and
records every attempt, so an import caught by a `try: ... except ImportError` fails the test
too. Pure: nothing is started.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from test_configs import CONFIG_FILES, model_for

from cluster.config.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "vllm", "ray", "deepspeed", "transformers")
TRAIN_CONFIGS = [p for p in CONFIG_FILES if model_for(p) is TrainConfig]

_FINDER = textwrap.dedent(f"""
    import json, sys
    ATTEMPTS = []

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {BLOCKED!r}:
                ATTEMPTS.append(name)
                raise ImportError(f"{{name}} is blocked: this must run without it")
            return None

    sys.meta_path.insert(0, Refuse())

    def report(**more):
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in {BLOCKED!r})
        print(json.dumps(dict(attempts=ATTEMPTS, loaded=loaded, **more)))
""")


def _run(body: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _FINDER + textwrap.dedent(body)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_there_are_training_configs():
    assert len(TRAIN_CONFIGS) >= 3


def test_every_training_config_loads_and_validates_without_torch():
    found = _run(f"""
        from cluster.config.train_config import load_train_config
        for path in {[str(p) for p in TRAIN_CONFIGS]!r}:
            cfg = load_train_config(path)
            cfg.rollout.generation  # the generation mode the config picks, asked as code asks it
        report(loaded_configs={len(TRAIN_CONFIGS)})
    """)
    assert found["loaded_configs"] == len(TRAIN_CONFIGS)
    assert found["attempts"] == [] and found["loaded"] == [], found


def test_klrl_help_imports_none_of_them():
    found = _run("""
        import contextlib, io, sys
        from cluster.cli.main import main
        sys.argv = ["klrl", "--help"]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                main()
            except SystemExit as stop:
                assert stop.code in (0, None), stop.code
        assert "usage" in out.getvalue().lower()
        report()
    """)
    assert found["attempts"] == [] and found["loaded"] == [], found
