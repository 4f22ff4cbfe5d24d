"""The door (issue #33): every bad input a command reads is refused before anything starts,
one table of cases for `klrl train`, `eval`, `report`, `sweep` and `submit`. The README's
promise, checked for each case:

    "A config or environment mistake that can be seen before the start [...] exits with code
    2 and one or two lines naming the fix, before Ray, vLLM or the model build starts, and
    leaves no run directory behind"

Each case runs the CLI's `main` in-process from a working directory of its own, with every
step past the door (the model build, Ray, vLLM, the evaluation, a job submission, a sweep's
runs, the report's writing) replaced by a guard that fails the test. It asserts exit code 2,
one or two lines on stderr naming the input and the fix, no file or directory left (under the
working directory, which holds output_dir, nor in the temporary directory), Ray not started.
The table holds every case of tests/test_failfast.py too; cases that accept an input (the other
side of a threshold, a cached hub name) follow it.
"""
from __future__ import annotations

import json
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG, dump_config
from cluster.config.train_config import load_train_config
from cluster.train import checkpoint as ckpt

DEMO = str(DEMO_CONFIG)
# Only a hang fails on time: that nothing heavy starts is what the refusing stand-ins of Ray
# and the model (_refuse) enforce, not a clock.
HANG_S = 120
MATH_FIXTURE = Path(__file__).resolve().parents[1] / "rewards" / "data" / "math_fixture.jsonl"


class GotPastTheDoor(AssertionError):
    """Raised where something heavy would start."""


def _refuse(*_args, **_kw):
    raise GotPastTheDoor("the command got past its checks")


@pytest.fixture
def work(monkeypatch, tmp_path) -> Path:
    """A working directory of its own (current), a private temporary directory and Hugging Face
    cache, no wandb key, Ray stopped, and a guard on every heavy step."""
    import ray

    import actors.evaluate
    from actors.prompting import PromptRenderer
    from cluster.cli import cmd_model, cmd_sweep
    from cluster.launchers.ray_job import RayJobLauncher
    from cluster.train import run

    if ray.is_initialized():
        ray.shutdown()
    for target, name in ((run, "resolve_model"), (run, "start_ray"),
                         (actors.evaluate, "evaluate"), (PromptRenderer, "from_pretrained"),
                         (cmd_model, "init_default_model"), (RayJobLauncher, "start"),
                         (RayJobLauncher, "follow"), (cmd_sweep, "run_sweep"),
                         (cmd_sweep, "write_report")):
        monkeypatch.setattr(target, name, _refuse)
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL",
                "RAY_ADDRESS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.syspath_prepend(str(tmp_path / "work"))
    return tmp_path / "work"


# ---- inputs, made in the working directory -----------------------------------------------


def model_dir(w: Path, name: str = "model", *, config: str | None = "{}", weights: str = "good",
              tokenizer: bool = True) -> Path:
    """A model directory: config.json (None: none), weights ("good", "none", "cut": a
    safetensors file cut short, "bin-garbage", "decoder": a decoder LM's embedding, 10 x 4, and
    two layers) and a tokenizer file."""
    path = w / name
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(config)
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    if weights in ("good", "cut"):
        save_file({"w": torch.zeros(64)}, path / "model.safetensors")
    if weights == "cut":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) - 100])
    if weights == "decoder":
        save_file({"model.embed_tokens.weight": torch.zeros(10, 4),
                   "model.layers.0.mlp.weight": torch.zeros(4, 4),
                   "model.layers.1.mlp.weight": torch.zeros(4, 4)}, path / "model.safetensors")
    if weights == "bin-garbage":
        (path / "pytorch_model.bin").write_bytes(b"not a torch file")
    return path


def scorer_module(w: Path, source: str) -> str:
    """A plug-in scorer module in the working directory (on sys.path); its spec."""
    name = f"door_scorer_{abs(hash(source)) % 10**8}"
    (w / f"{name}.py").write_text(source)
    return f"{name}:score"


def math_rows(w: Path, good: int, broken: int = 0, name: str = "train.jsonl") -> Path:
    lines = MATH_FIXTURE.read_text().splitlines()
    rows = [lines[i % len(lines)] for i in range(good)] + ['{"problem": "cut'] * broken
    (w / name).write_text("\n".join(rows) + "\n")
    return w / name


def math_on(path) -> list[str]:
    return ["task.name=math", f"task.options.train={path}", f"task.options.in_domain={path}",
            "eval.out_of_domain=null"]


def dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def fake_run(w: Path, *, finished: bool, checkpoint: bool, steps: int = 2,
             learner: str = "good", controller: str | None = None) -> Path:
    """runs/r as a run of `steps` steps leaves it; its checkpoint's learner state "good",
    "none" or "cut" (a torch archive cut short), controller.json replaced by `controller`."""
    cfg = load_train_config(DEMO_CONFIG, ["output_dir=runs", "run_name=r", f"total_steps={steps}"])
    run = w / "runs" / "r"
    run.mkdir(parents=True)
    dump_config(cfg, run / "config.yaml")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n"
                                               for i in range(steps + 1)))

    def save(directory: Path, tag: str) -> None:
        (directory / tag).mkdir()
        if learner != "none":
            torch.save({"version": steps}, directory / tag / "mp_rank_00_model_states.pt")
        if learner == "cut":
            state = directory / tag / "mp_rank_00_model_states.pt"
            state.write_bytes(state.read_bytes()[:40])

    if checkpoint:
        state = ckpt.ControllerState(step=steps, prompt_position=64 * steps,
                                     config=cfg.model_dump(mode="json"))
        saved = ckpt.write_checkpoint(run, state, save, keep=2)
        if controller is not None:
            (saved / "controller.json").write_text(controller)
    if finished:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    return run


def sweep_file(w: Path, name: str = "s", overrides: dict | None = None,
               grid: dict | None = None) -> str:
    (w / "s.yaml").write_text(yaml.safe_dump({
        "name": name, "train_config": DEMO, "output_dir": "runs",
        "overrides": overrides or {}, "grid": grid or {"seed": [0, 1]}}))
    return str(w / "s.yaml")


# ---- the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Path], list[str]]   # makes the case's inputs, returns the command line
    expect: tuple[str, ...]             # fragments of the message
    env: dict = field(default_factory=dict)


def train(*extra: str) -> Callable[[Path], list[str]]:
    return lambda w: ["train", DEMO, "output_dir=runs", "run_name=r", *extra]


def train_with(make: Callable[[Path], list[str]]) -> Callable[[Path], list[str]]:
    return lambda w: ["train", DEMO, "output_dir=runs", "run_name=r", *make(w)]


def eval_(*extra: str, model: str = "default") -> Callable[[Path], list[str]]:
    return lambda w: ["eval", model, *extra]


SIGNATURE = "def score(completion):\n    return 1.0\n"

CASES = [
    # -- tests/test_failfast.py's cases --
    Case("model-path-missing", train("model.path=/nonexistent/klrl-model"),
         ("model.path", "no such directory")),
    Case("model-path-dot-relative", train("model.path=./qwen"), ("model.path=./qwen",
                                                                 "no such directory")),
    Case("model-path-under-a-local-directory", train_with(
        lambda w: ((w / "models").mkdir(), ["model.path=models/qwen"])[1]),
         ("model.path=models/qwen", "no such directory")),
    Case("reward-module-missing", train("task.reward=no_such_module:score"),
         ("task.reward", "cannot import module 'no_such_module'")),
    Case("task-option-unknown", train("task.options.foo=1"), ("task.options", "no option 'foo'")),
    Case("train-split-typo", train("task.train_split=trian"),
         ("task.train_split", "did you mean 'train'")),
    Case("eval-split-missing", train("eval.in_domain.split=test"),
         ("eval.in_domain.split", "its splits are train, in_domain")),
    Case("wandb-online-without-key", train("logging.wandb_mode=online"),
         ("logging.wandb_mode=online", "WANDB_API_KEY", "logging.wandb_mode=offline")),
    Case("wandb-env-online-without-key", train(), ("WANDB_MODE=online", "WANDB_API_KEY"),
         env={"WANDB_MODE": "online"}),
    Case("directory-without-config", train_with(
        lambda w: [f"model.path={model_dir(w, config=None)}"]), ("model.path", "no config.json")),
    Case("model-without-tokenizer", train_with(
        lambda w: [f"model.path={model_dir(w, tokenizer=False)}"]),
         ("model.path", "no tokenizer", "save_pretrained")),
    Case("dataset-missing", train(*math_on("train.jsonl")),
         ("task.options (split train)", "does not exist", "give an existing .jsonl")),
    Case("dataset-empty", train_with(lambda w: math_on(math_rows(w, 0))),
         ("task.options (split train)", "holds no rows")),
    Case("dataset-other-columns", train_with(lambda w: math_on(
        (w / "q.jsonl", (w / "q.jsonl").write_text('{"question": "1+1?", "final": "2"}\n'))[0])),
         ("task.options (split train)", "no usable rows", "columns")),
    Case("output-dir-in-proc", train("output_dir=/proc/klrl-x"), ("output_dir=", "writable")),
    Case("output-dir-under-a-file", train_with(
        lambda w: ((w / "a-file").write_text(""), ["output_dir=a-file/runs"])[1]),
         ("output_dir=", "writable output_dir")),
    Case("ray-address-dead", train_with(lambda w: [f"ray.address={dead_address()}"]),
         ("ray.address=", "nothing answers there", "ray start --head")),
    Case("ray-address-env-dead", train(), ("nothing answers there",),
         env={"RAY_ADDRESS": "DEAD"}),
    Case("resume-finished-without-checkpoint", lambda w: [
        "train", "--resume", str(fake_run(w, finished=True, checkpoint=False))],
         ("finished and kept no checkpoint", "model.path=", "checkpoint_every > 0")),
    Case("resume-with-changed-objective", lambda w: [
        "train", "--resume", str(fake_run(w, finished=False, checkpoint=True)), "kl.beta=0.5"],
         ("kl.beta: 0.05 -> 0.5",)),
    Case("resume-finished-run-asks-for-steps", lambda w: [
        "train", "--resume", str(fake_run(w, finished=True, checkpoint=True))],
         ("it finished at step 2", "total_steps=4")),
    Case("run-dir-without-resume", lambda w: [
        "train", str(fake_run(w, finished=False, checkpoint=False))], ("add --resume",)),
    Case("two-configs", lambda w: ["train", DEMO, DEMO, "--resume"], ("give one config file",)),
    Case("sweep-run-reward-missing", lambda w: [
        "sweep", sweep_file(w, overrides={"task.reward": "no_such_module:score"})],
         ("runs that would fail before they start", "every run: task.reward")),
    Case("sweep-dry-run-reward-missing", lambda w: [
        "sweep", sweep_file(w, overrides={"task.reward": "no_such_module:score"}), "--dry-run"],
         ("runs that would fail before they start", "every run: task.reward")),
    Case("sweep-run-model-missing", lambda w: [
        "sweep", sweep_file(w, grid={"model.path": [None, "/nonexistent/m"]})],
         ("runs that would fail before they start", "no such directory")),
    Case("eval-task-unknown", eval_("--task", "nosuch"), ("--task: unknown task 'nosuch'",)),
    Case("eval-split-typo", eval_("--task", "countdown", "--splits", "in_domian"),
         ("--splits", "did you mean 'in_domain'")),
    Case("eval-split-missing", eval_("--task", "mmlu"), ("--splits", "its splits are")),
    Case("eval-no-split", eval_("--splits", " , "), ("--splits: no split given",)),
    Case("eval-option-typo", eval_("--task", "math", "--option", "pth=fixture"),
         ("--option", "did you mean 'path'")),
    Case("eval-option-form", eval_("--option", "path"), ("not of the form key.sub=value",)),
    Case("eval-task-typo-with-option", eval_("--task", "mth", "--option", "path=fixture"),
         ("--task: unknown task 'mth'",)),
    Case("eval-split-of-a-dataset-task", eval_("--task", "math", "--option", "path=fixture",
                                               "--splits", "out_of_domain"),
         ("--splits: task 'math' has no split 'out_of_domain'",)),
    Case("eval-task-before-a-missing-model", eval_("--task", "nosuch", model="/nonexistent/m"),
         ("--task: unknown task 'nosuch'",)),
    Case("eval-n-zero", eval_("--n", "0"), ("argument --n: must be at least 1",)),
    Case("eval-n-negative", eval_("--n", "-3"), ("argument --n: must be at least 1",)),
    Case("eval-n-above-the-split", eval_("--n", "1000", "--splits", "in_domain,retained"),
         ("--n: arithmetic split 'retained' holds 800 distinct problems; asked for 1000",)),
    Case("eval-num-problems-above-a-set", train("eval.retained={split: retained}",
                                                "eval.num_problems=900"),
         ("eval.num_problems: arithmetic split 'retained' holds 800", "(eval.retained)")),
    Case("eval-samples-negative", eval_("--samples", "-1"), ("argument --samples",)),
    # -- issue #33: names and paths --
    Case("run-name-dotdot", train("run_name=.."), ("run_name", "not a name of its own")),
    Case("run-name-dot", train("run_name=."), ("run_name", "not a name of its own")),
    Case("run-name-separator", train("run_name=a/b"), ("run_name", "'/'")),
    Case("run-name-empty-in-file", lambda w: [
        "train", str((w / "c.yaml", (w / "c.yaml").write_text(
            f"base: {DEMO}\nrun_name: ''\noutput_dir: runs\n"))[0])],
         ("run_name", "must not be empty")),
    Case("run-name-yaml-document-end", train("run_name=..."), ("run_name=...", "not YAML")),
    Case("sweep-name-dotdot", lambda w: ["sweep", sweep_file(w, name="..")],
         ("name", "not a name of its own")),
    # -- models --
    Case("model-without-weights", train_with(lambda w: [
        f"model.path={model_dir(w, weights='none')}"]), ("model.path", "no weights")),
    Case("model-config-not-json", train_with(lambda w: [
        f"model.path={model_dir(w, config='{not json')}"]), ("config.json is not JSON",)),
    Case("model-weights-cut-short", train_with(lambda w: [
        f"model.path={model_dir(w, weights='cut')}"]), ("model.safetensors cannot be loaded",)),
    Case("model-config-of-another-size", train_with(lambda w: ["model.path=" + str(model_dir(
        w, config=json.dumps({"vocab_size": 10, "hidden_size": 8}), weights="decoder"))]),
         ("config.json says vocab_size=10 and hidden_size=8", "embed_tokens.weight is 10 x 4",
          "put back the one saved with them")),
    Case("model-config-with-other-layers", train_with(lambda w: ["model.path=" + str(model_dir(
        w, config=json.dumps({"num_hidden_layers": 3}), weights="decoder"))]),
         ("num_hidden_layers=3", "the weights hold 2 decoder layers")),
    Case("model-bin-garbage", train_with(lambda w: [
        f"model.path={model_dir(w, weights='bin-garbage')}"]), ("pytorch_model.bin cannot",)),
    Case("model-relative-missing-offline", train("model.path=models/my-model"),
         ("model.path=models/my-model", "not in the Hugging Face cache", "HF_HUB_OFFLINE=1"),
         env={"HF_HUB_OFFLINE": "1"}),
    Case("model-hub-unreachable", train("model.path=klrl-org/no-such-model"),
         ("model.path=klrl-org/no-such-model", "hub cannot be reached"),
         env={"HF_ENDPOINT": "DEAD_URL"}),
    Case("ref-path-without-weights", train_with(lambda w: [
        f"model.ref_path={model_dir(w, weights='none', tokenizer=False)}"]),
         ("model.ref_path", "no weights")),
    Case("context-longer-than-model", train_with(lambda w: [
        f"model.path={model_dir(w, config=json.dumps({'max_position_embeddings': 128}))}"]),
         ("rollout.max_model_len=512", "max_position_embeddings=128")),
    Case("completion-longer-than-context", train("rollout.max_new_tokens=512"),
         ("rollout.max_new_tokens (512) must be below rollout.max_model_len",)),
    # -- resources, environment, plug-ins, config files --
    Case("gpus-the-machine-lacks", train("learner.num_gpus_per_rank=8", "learner.num_ranks=2"),
         ("the run requests 16 GPU", "learner.num_gpus_per_rank=8", "this machine has")),
    Case("cpus-the-cluster-lacks", train("ray.num_cpus=1"),
         ("the run requests 2 CPU", "ray.num_cpus=1")),
    Case("shm-dir-missing", train("sync.shm_dir=/nonexistent/shm"),
         ("sync.shm_dir=/nonexistent/shm", "object_store")),
    Case("wandb-mode-env-invalid", train(), ("WANDB_MODE=bogus", "logging.wandb_mode"),
         env={"WANDB_MODE": "bogus"}),
    Case("reward-signature", train_with(lambda w: [
        f"task.reward={scorer_module(w, SIGNATURE)}"]), ("task.reward", "(completion, problem)")),
    Case("config-empty", lambda w: ["train", str((w / "e.yaml", (w / "e.yaml").write_text(""))[0])],
         ("the file is empty",)),
    Case("config-comments-only", lambda w: ["train", str(
        (w / "e.yaml", (w / "e.yaml").write_text("# nothing yet\n"))[0])], ("the file is empty",)),
    Case("dataset-malformed-rows", train_with(lambda w: math_on(math_rows(w, 22, broken=1))),
         ("1 of 23 rows malformed", "task.max_malformed_fraction=0.05")),
    # -- resume --
    Case("resume-never-started", train("--resume"), ("holds no run", "drop --resume")),
    Case("resume-no-such-dir", lambda w: ["train", "--resume", "runs/no-such-run"],
         ("--resume runs/no-such-run: no such run directory",)),
    Case("resume-controller-garbage", lambda w: ["train", "--resume", str(fake_run(
        w, finished=False, checkpoint=True, controller="{garbage"))],
         ("controller.json is not JSON", "damaged")),
    Case("resume-learner-state-missing", lambda w: ["train", "--resume", str(fake_run(
        w, finished=False, checkpoint=True, learner="none"))], ("learner's state is missing",)),
    Case("resume-learner-state-cut", lambda w: ["train", "--resume", str(fake_run(
        w, finished=False, checkpoint=True, learner="cut"))],
         ("mp_rank_00_model_states.pt is not a torch archive",)),
    # -- eval --
    Case("eval-empty-dir", lambda w: ["eval", str((w / "d", (w / "d").mkdir())[0])],
         ("MODEL_DIR", "no config.json")),
    Case("eval-run-dir", lambda w: ["eval", str(fake_run(w, finished=True, checkpoint=False))],
         ("is a run directory", "/final")),
    Case("eval-model-missing", eval_(model="no-such-model"), ("no such directory",)),
    Case("eval-model-without-weights", lambda w: ["eval", str(model_dir(w, weights="none"))],
         ("no weights",)),
    Case("eval-dataset-missing", eval_("--task", "math", "--option", "path=missing.jsonl",
                                       "--splits", "in_domain"), ("does not exist",)),
    Case("eval-dataset-malformed", lambda w: [
        "eval", "default", "--task", "math", "--option", f"path={math_rows(w, 9, broken=1)}",
        "--splits", "in_domain"], ("1 of 10 rows malformed", "--max-malformed-fraction=0.1")),
    # -- report --
    Case("report-garbage-metrics", lambda w: ["report", str(
        (w / "g", (w / "g").mkdir(), (w / "g" / "metrics.jsonl").write_text("garbage\n[1]\n"))[0])],
         ("nothing to report", "metrics.jsonl")),
    Case("report-no-runs", lambda w: ["report", str((w / "e", (w / "e").mkdir())[0])],
         ("no run directory",)),
    Case("report-out-onto-a-file", lambda w: [
        "report", str(fake_run(w, finished=True, checkpoint=False)), "--out",
        str((w / "taken", (w / "taken").write_text("mine"))[0])], ("--out", "is a file")),
    # -- submit and sweep on a cluster --
    Case("submit-empty-config", lambda w: [
        "submit", str((w / "e.yaml", (w / "e.yaml").write_text(""))[0]), "--address",
        "http://127.0.0.1:1"], ("the file is empty",)),
    Case("submit-run-name-dotdot", lambda w: ["submit", DEMO, "--address",
                                              "http://127.0.0.1:1", "run_name=.."],
         ("not a name of its own",)),
    Case("submit-reward-signature", lambda w: [
        "submit", DEMO, "--address", "http://127.0.0.1:1",
        f"task.reward={scorer_module(w, SIGNATURE)}"], ("(completion, problem)",)),
    Case("submit-wandb-mode-env", lambda w: [
        "submit", DEMO, "--address", "http://127.0.0.1:1", "--env", "WANDB_MODE=bogus"],
         ("WANDB_MODE=bogus", "--env")),
    Case("sweep-on-a-cluster-reward-signature", lambda w: [
        "sweep", sweep_file(w, overrides={"task.reward": scorer_module(w, SIGNATURE)}),
        "--address", "http://127.0.0.1:1", "output_dir=/shared/runs"], ("(completion, problem)",)),
]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _run(argv: list[str], capsys) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    return code, capsys.readouterr().err, time.monotonic() - t0


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_bad_input_is_refused_at_the_door(case, work, capsys, monkeypatch):
    import ray

    for var, value in case.env.items():
        value = {"DEAD": dead_address(), "DEAD_URL": f"http://{dead_address()}"}.get(value, value)
        monkeypatch.setenv(var, value)
    argv = case.argv(work)
    before, temp = _tree(work.parent), Path(tempfile.gettempdir())
    code, err, seconds = _run(argv, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), err
    for fragment in case.expect:
        assert fragment in err, (fragment, err)
    assert "train.log" not in err  # no log (nor run directory) is named that is never made
    assert _tree(work.parent) == before, "a file or directory was left behind"
    assert not list(temp.iterdir()), "a temporary file was left behind"
    assert not ray.is_initialized()
    assert seconds < HANG_S, f"took {seconds:.1f} s"


# ---- the other side of each line ----------------------------------------------------------


def test_malformed_rows_within_the_allowed_share_are_said_on_the_terminal(work, capsys):
    data = math_rows(work, 22, broken=1)
    with pytest.raises(GotPastTheDoor):
        main(["train", DEMO, "output_dir=runs", *math_on(data), "task.max_malformed_fraction=0.05"])
    err = capsys.readouterr().err
    assert "warning: task.options (split train)" in err and "1 of 23 rows malformed" in err
    assert "skipped (task.max_malformed_fraction=0.05)" in err


def test_a_model_directory_that_is_whole_and_a_cached_hub_name_pass(work, monkeypatch):
    model = model_dir(work, config=json.dumps({"max_position_embeddings": 512}))
    with pytest.raises(GotPastTheDoor):
        main(["train", DEMO, "output_dir=runs", f"model.path={model}"])
    decoder = model_dir(work, "decoder", weights="decoder", config=json.dumps(
        {"vocab_size": 10, "hidden_size": 4, "num_hidden_layers": 2}))
    with pytest.raises(GotPastTheDoor):  # its config.json is the weights'
        main(["train", DEMO, "output_dir=runs", f"model.path={decoder}"])
    # a hub name that is in the Hugging Face cache passes offline, its config checked
    snapshot = (work.parent / "hf-cache" / "models--org--cached" / "snapshots" / "abc")
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    refs = work.parent / "hf-cache" / "models--org--cached" / "refs"
    refs.mkdir()
    (refs / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", DEMO, "output_dir=runs", "model.path=org/cached"]) == 2  # 64 < 512
    with pytest.raises(GotPastTheDoor):
        main(["train", DEMO, "output_dir=runs", "model.path=org/cached",
              "rollout.max_model_len=64", "rollout.max_new_tokens=6"])


def test_a_relative_path_is_absolute_in_the_config_every_process_gets(work):
    from cluster.train.door.preflight import resolve_paths

    model = model_dir(work, "models/my-model")
    math_rows(work, 3, name="data.jsonl")
    cfg = load_train_config(DEMO_CONFIG, ["model.path=models/my-model", *math_on("data.jsonl"),
                                          "output_dir=runs", "sync.shm_dir=shm"])
    resolved = resolve_paths(cfg)
    assert resolved.model.path == str(model)
    assert resolved.task.options["train"] == str(work / "data.jsonl")
    assert resolved.output_dir == str(work / "runs") and resolved.sync.shm_dir == str(work / "shm")
    assert resolve_paths(resolved) == resolved  # once is enough
    hub = load_train_config(DEMO_CONFIG, ["model.path=Qwen/Qwen2.5-7B"])
    assert resolve_paths(hub).model.path == "Qwen/Qwen2.5-7B"  # not a path here: left as given


def test_klrl_deletes_only_inside_a_run_directory(tmp_path):
    run = tmp_path / "runs" / "r"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (tmp_path / "keep").mkdir()
    for where, inside in ((tmp_path / "runs" / "..", tmp_path / "keep"),
                          (run, tmp_path / "keep"), (run, run)):
        with pytest.raises(AssertionError, match="refusing to delete"):
            ckpt.remove_tree(inside, where)
    assert (tmp_path / "keep").is_dir() and run.is_dir()
    ckpt.remove_tree(run / "checkpoints" / "step_1", run)
    assert not (run / "checkpoints" / "step_1").exists()
