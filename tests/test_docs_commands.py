"""Every command block of the docs, run as written, so that a page cannot drift from the code.

The command lines of README.md and every page under docs/ (```bash / ```sh blocks, and the
`$ ` lines of a transcript block, whose following lines are the output it shows) are read
from the pages and run in-process through `klrl`'s own entry point, in a scratch directory
that holds what the pages tell a reader to create (my_run.yaml, myrewards/, data/,
models/my-model, mytasks/reverse.py: each from its page's own example block), the
repository's configs/, and runs where a page reads one (runs/r1/final: a tiny model; the run
and sweep directories that `klrl report` reads: synthetic run logs). How each runs:

- `klrl train` (and `klrl eval`): every check of the door, to the point where the run would
  start Ray (the model would load): an unknown or misspelt key, a bad value, a plug-in that
  does not import, a missing file fails here. The training itself runs in the tests named in
  TRAINED_BY for the shapes the pages train (on CPU, with shortened runs);
- `klrl submit`, `klrl sweep` and `klrl slurm`: with `--dry-run` (everything is checked,
  nothing starts or is submitted);
- `klrl report`, `kl-table`, `options`, `--help`: run to the end;
- a transcript's command: its output must be the one the page shows (`...` elides).

A line that cannot run here carries a visible marker, `(not run by the tests: WHY)` in its
comment, or the block is preceded by `*Not run by the tests: WHY.*`; a line run by another
test names it in ELSEWHERE. Any other line fails this test: mark it, or teach it to run."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from test_report import write_run

from cluster.cli.main import main
from cluster.config.train_config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINE_MARK = re.compile(r"\(not run by the tests: ([^)]+)\)")
BLOCK_MARK = re.compile(r"^\*Not run by the tests: (.+)\*$")

# Lines run by another test (page line as written -> the test that runs it).
ELSEWHERE = {
    "klrl bench --quick": "tests/test_bench.py::test_quick_bench_writes_every_figure",
    ".venv/bin/mkdocs build --strict": "tests/test_docs.py::test_docs_build_strict",
    "klrl bench --from-json docs/figures/gpu.json --docs docs/gpu.md":
        "tests/test_bench_report.py::test_the_gpu_page_quotes_a_committed_gpu_run_or_says_none_is",
}
# `make test`, `make test-quick` (with or without PYTEST_ARGS): the suite that runs this.
SUITE = re.compile(r"^make test(-quick)?( PYTEST_ARGS=.*)?$")
# Where the shapes the pages train are trained for real on CPU (shortened runs).
TRAINED_BY = {
    "configs/tiny_cpu.yaml": "tests/test_e2e_train.py::test_lag0_metrics_and_exact_sync",
    "my_run.yaml": "tests/test_own_model.py::test_the_page_config_trains_on_cpu",
    "learner.lora.rank": "tests/test_lora.py::test_only_adapters_train_and_the_engine_serves_"
                         "them_exactly",
    "--resume": "tests/test_resume.py::test_half_resume_half_equals_one_go_bit_for_bit",
}


@dataclass
class Command:
    page: str
    line: int
    text: str              # the command as written (continuations joined, comment dropped)
    comment: str
    expected: list[str]    # a transcript's output lines
    skip: str | None       # why it is not run (its marker), or the test that runs it


def _blocks(text: str):
    """(line number, language, lines, the paragraph line just above) of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        yield i + 1, fence.group(1), lines[i + 1:end], above
        i = end + 1


def _split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the first ` #` outside quotes starts the comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def page_commands(page: Path) -> list[Command]:
    commands = []
    for start, lang, lines, above in _blocks(page.read_text()):
        transcript = lang == "" and any(line.startswith("$ ") for line in lines)
        if lang not in ("bash", "sh", "shell") and not transcript:
            continue
        block_mark = BLOCK_MARK.match(above.strip())
        i = 0
        while i < len(lines):
            number, raw = start + 1 + i, lines[i]
            if transcript and not raw.startswith("$ "):
                i += 1
                continue
            raw = raw[2:] if transcript else raw
            while raw.endswith("\\") and i + 1 < len(lines):  # a continued line
                i += 1
                raw = raw[:-1] + " " + lines[i].strip()
            i += 1
            text, comment = _split_comment(raw)
            expected = []
            while transcript and i < len(lines) and not lines[i].startswith("$ "):
                expected.append(lines[i])
                i += 1
            if not text:
                continue
            mark = LINE_MARK.search(comment)
            text = " ".join(text.split())
            skip = (block_mark.group(1) if block_mark else mark.group(1) if mark
                    else ELSEWHERE.get(text) or ("the test suite itself" if SUITE.match(text)
                                                 else None))
            commands.append(Command(page.relative_to(ROOT).as_posix(), number, text, comment,
                                    expected, skip))
    return commands


ALL = [c for page in PAGES for c in page_commands(page)]


def test_every_command_line_is_run_or_says_why_not():
    """The harness's own contract: every line it does not run names why, visibly."""
    unrunnable = [c for c in ALL if c.skip is None and not _runnable(c)]
    assert not unrunnable, "\n".join(
        f"{c.page}:{c.line}: `{c.text}` is neither run here nor marked "
        "`(not run by the tests: WHY)`" for c in unrunnable)
    for test in [*ELSEWHERE.values(), *TRAINED_BY.values()]:
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{test} is gone"
    assert all(c.skip.strip() for c in ALL if c.skip is not None)
    assert len([c for c in ALL if c.skip is None]) >= 30


def _argv(command: Command) -> list[str]:
    """The command's klrl arguments, without environment assignments and the program;
    `make demo ARGS="..."` is `klrl demo ...` (the Makefile's recipe)."""
    words = shlex.split(command.text)
    if words[:2] == ["make", "demo"]:
        args = [w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")]
        return ["demo", *(shlex.split(args[0]) if args else [])]
    return [a for a in words if not re.match(r"^[A-Z_]+=", a)][1:]


def _runnable(command: Command) -> bool:
    words = [a for a in shlex.split(command.text) if not re.match(r"^[A-Z_]+=", a)]
    return words[:1] in (["klrl"], [".venv/bin/klrl"]) or words[:2] == ["make", "demo"]


# ---- the reader's working directory ------------------------------------------------------------


def _example(page: str, name: str) -> str:
    text = (ROOT / page).read_text()
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w*\n(.*?)\n```", text, re.DOTALL)
    assert found, f"{page} has no example block {name!r}"
    return found.group(1) + "\n"


def _page_yaml(page: str, name: str) -> str | None:
    """A page's YAML block that starts with `# NAME` (README's `# my_run.yaml`)."""
    for _, lang, lines, _ in _blocks((ROOT / page).read_text()):
        if lang == "yaml" and lines and lines[0].strip() == f"# {name}":
            return "\n".join(lines) + "\n"
    return None


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir):
    """What the pages tell a reader to create, in one scratch directory."""
    root = tmp_path_factory.mktemp("reader")
    (root / "configs").symlink_to(ROOT / "configs")
    (root / "myrewards").mkdir()
    (root / "myrewards" / "__init__.py").write_text("")
    (root / "myrewards" / "scoring.py").write_text(_example("docs/own-model.md", "own-reward"))
    (root / "data").mkdir()
    rows = _example("docs/own-model.md", "own-data")
    (root / "data" / "train.jsonl").write_text(rows * 4)
    (root / "data" / "test.jsonl").write_text(rows)
    (root / "mytasks").mkdir()
    (root / "mytasks" / "__init__.py").write_text("")
    (root / "mytasks" / "reverse.py").write_text(_example("docs/extending.md", "task"))
    shutil.copytree(tiny_model_dir, root / "models" / "my-model")
    # runs/r1 as docs/checkpoints.md's first line starts it, stopped at step 4 with its
    # checkpoint (controller state, a learner state archive) and a model in final/ (the tiny
    # one, for the pages' `klrl eval runs/r1/final`); and the directories `klrl report` reads.
    run = write_run(root / "runs" / "r1", steps=4)
    cfg = load_train_config(ROOT / "configs" / "tiny_cpu.yaml", [
        "run_name=r1", "checkpoint_every=50", f"output_dir={root / 'runs'}"])
    config = cfg.model_dump(mode="json")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    step = run / "checkpoints" / "step_000000004"
    (step / "learner").mkdir(parents=True)
    torch.save({}, step / "learner" / "mp_rank_00_model_states.pt")
    (step / "controller.json").write_text(json.dumps(
        {"step": 4, "prompt_position": 4 * cfg.rollout.prompts_per_step, "config": config}))
    (step / "COMPLETE").write_text("")
    shutil.rmtree(run / "final")
    shutil.copytree(tiny_model_dir, run / "final")
    shutil.copytree(tiny_model_dir, root / "runs" / "my-first-run" / "final")  # own-model.md's
    for sweep, names in (("offpolicy_tiny", ("k1-loss-b0.3-lag8-s0", "k3-reward-b0.3-lag0-s0")),
                         ("pilot_regime", ("b0.3-lag8-k1-reward-s0",)),
                         ("offpolicy_tiny_paper", ("k1-reward-b0.3-lag8-s0",))):
        for name in names:
            _reported_run(root / "runs" / sweep / name, estimator=name.split("-")[-3][:2]
                          if sweep == "pilot_regime" else name[:2])
        _record_sweep_configs(root, sweep, names)
    _reported_run(root / "runs" / "r2")
    _reported_run(root / "runs" / "r3", beta=0.5)
    (root / "runtime_env.yaml").write_text("env_vars: {}\n")
    return root


def _record_sweep_configs(root: Path, sweep: str, names: tuple[str, ...]) -> None:
    """Give a sweep's synthetic runs the config the sweep gives them (as a real run records
    it): `klrl sweep --dry-run` on the pages refuses runs trained with other settings."""
    from cluster.sweeps.sweep import expand, load_sweep, validate_runs

    cfg = load_sweep(ROOT / "configs" / "sweeps" / f"{sweep}.yaml",
                     [f"output_dir={root / 'runs'}"])
    runs = [r for r in expand(cfg) if r.name in names]
    for name, config in validate_runs(cfg, runs).items():
        (root / "runs" / sweep / name / "config.yaml").write_text(
            yaml.safe_dump(config.model_dump(mode="json")))


def _reported_run(run_dir: Path, estimator: str = "k1", beta: float = 0.05) -> None:
    """A finished 4-step run that logged its reward, KL and in-domain accuracy (a report of it
    draws four figures, not six: a report's cost is its figures)."""
    write_run(run_dir, estimator=estimator, beta=beta, steps=0)
    rows = [{"step": s, "reward/mean": 0.1 * s, "kl/pi_ref": 0.01 * s} for s in range(1, 5)]
    rows += [{"step": s, "eval/in_domain/accuracy": 0.2 + 0.01 * s} for s in (0, 4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


class GotPastChecks(AssertionError):
    """Raised where a run would start Ray or build the model, or `klrl eval` load one."""


@pytest.fixture
def reader(workspace, monkeypatch):
    """The workspace as the current directory, importable; nothing can start."""
    from cluster.cli import cmd_model
    from cluster.train import run

    def refuse(*_args, **_kw):
        raise GotPastChecks("got past the checks")

    real_door = cmd_model._eval_door

    def eval_door(args):
        real_door(args)
        raise GotPastChecks("got past the checks")

    for target, name in ((run, "resolve_model"), (run, "start_ray"),
                         (cmd_model, "init_default_model")):
        monkeypatch.setattr(target, name, refuse)
    monkeypatch.setattr(cmd_model, "_eval_door", eval_door)
    monkeypatch.chdir(workspace)
    monkeypatch.syspath_prepend(str(workspace))
    for var in ("WANDB_MODE", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_API_KEY", "HF_TOKEN"):  # `--env KEY` sends the value set here
        monkeypatch.setenv(var, "x" * 40)
    monkeypatch.setenv("NETRC", str(workspace / "no-netrc"))
    yield workspace
    for name in [m for m in sys.modules if m.split(".")[0] in ("myrewards", "mytasks")]:
        sys.modules.pop(name, None)


def _as_run(command: Command) -> list[str]:
    """The klrl arguments run for a page's line: a submission or a sweep dry (`--dry-run`),
    a new run's directory under fresh-runs/."""
    argv = _argv(command)
    if argv[:1] in (["submit"], ["sweep"], ["slurm"]) and "--dry-run" not in argv:
        argv.append("--dry-run")
    fresh = argv[:1] in (["train"], ["demo"]) and "--resume" not in argv
    if fresh and not any(a.startswith("output_dir=") for a in argv):
        argv.append("output_dir=fresh-runs")  # a new run, beside the ones the pages continue
    return argv


def _run(argv: list[str], capsys) -> tuple[str, int | str]:
    """Run klrl in-process: (its output, exit code or "started")."""
    try:
        code: int | str = main(argv)
    except GotPastChecks:
        code = "started"
    except SystemExit as exc:  # --help
        code = exc.code or 0
    captured = capsys.readouterr()
    return captured.out + captured.err, code


def _matches(shown: str, printed: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in shown.split("..."))
    return re.fullmatch(pattern, printed) is not None


_DONE: dict[tuple[str, ...], tuple[str, int | str]] = {}  # a line the pages repeat runs once


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES
                                  if any(c.skip is None for c in page_commands(p))])
def test_the_page_commands_run_as_written(page, reader, capsys):
    for command in [c for c in ALL if c.page == page and c.skip is None]:
        my_run = _page_yaml(page, "my_run.yaml") or _example("docs/own-model.md", "own-config")
        (reader / "my_run.yaml").write_text(my_run)
        where = f"{page}:{command.line}: `{command.text}`"
        argv = _as_run(command)
        key = (page if "my_run.yaml" in argv else "", *argv)
        if key not in _DONE:
            _DONE[key] = _run(argv, capsys)
        output, code = _DONE[key]
        if command.expected:  # a transcript: the output it shows, line by line
            printed = [line for line in output.splitlines() if line.strip()]
            for shown in command.expected:
                assert any(_matches(shown.strip(), p.strip()) for p in printed), (
                    f"{where} no longer prints\n  {shown}\nit printed:\n{output}")
            continue
        assert code in (0, "started"), f"{where} failed (exit {code}):\n{output}"
