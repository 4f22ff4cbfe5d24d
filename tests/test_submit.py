"""`klrl submit`: what it builds and what it refuses, without a cluster. The real submission
(a training job on a two-node `ray start` cluster with --env, --runtime-env, --job-name, and a
config and plug-in scorer from outside the repository) is tests/test_multinode.py: one vLLM
start serves both.

Every refusal is one line with exit code 2, made before the cluster is contacted: the tests
give the address of a socket that would record a connection, and check it got none.
"""
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.cli.main import main
from cluster.config.loader import REPO_ROOT
from cluster.launchers import ray_jobs as jobs

TESTS = REPO_ROOT / "tests"


@pytest.fixture
def silent_server():
    """A listening socket that never answers: connections queue in its backlog."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.setblocking(False)
        yield s


def _contacted(server) -> bool:
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_submit_rejects_a_bad_config_before_submitting(capsys):
    assert main(["submit", "configs/tiny_cpu.yaml", "--address", "http://127.0.0.1:1",
                 "max_lag=-1"]) == 2
    assert "max_lag" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "runtime_env", "expected"), [
    (["--env", "KLRL_SURELY_UNSET_VAR"], None,
     "--env KLRL_SURELY_UNSET_VAR: KLRL_SURELY_UNSET_VAR is not set"),
    (["--env", "1BAD=x"], None, "--env 1BAD: not a variable name"),
    ([], "working_dir: /elsewhere\n", "working_dir: klrl submit uploads the project's tracked"),
    (["--env", "TOKEN=a"], 'env_vars: {TOKEN: "b"}\n', "env_vars.TOKEN is also given by --env"),
    ([], "env_vars: {RETRIES: 3}\n", "env_vars.RETRIES must be a string"),
    ([], "env_vars: {KLRL_JOB_CONFIG: x}\n", "env_vars.KLRL_JOB_CONFIG: klrl sets"),
    ([], "[pip]\n", "a runtime_env is a mapping"),
    (["task.reward=klrl_no_such_module:score"], None,
     "task.reward=klrl_no_such_module:score: module 'klrl_no_such_module' is not importable here"),
    (["--job-name", "two words"], None, "--job-name 'two words'"),
    (["--max-resubmits", "1", "--no-wait", "output_dir=/shared/runs"], None,
     "--max-resubmits: klrl submit resubmits a job it follows; drop --no-wait"),
    (["--max-resubmits", "1"], None, "--max-resubmits: output_dir=runs is relative"),
])
def test_refusals_come_before_the_cluster_is_contacted(args, runtime_env, expected, silent_server,
                                                       tmp_path, capsys):
    extra = []
    if runtime_env is not None:
        (tmp_path / "env.yaml").write_text(runtime_env)
        extra = ["--runtime-env", str(tmp_path / "env.yaml")]
    address = f"http://127.0.0.1:{silent_server.getsockname()[1]}"
    assert main(["submit", "configs/tiny_cpu.yaml", "--address", address, *args, *extra]) == 2
    assert expected in _one_error_line(capsys.readouterr().err)
    assert not _contacted(silent_server)


def test_an_unreachable_address_is_one_line(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["submit", "configs/tiny_cpu.yaml", "--address", f"127.0.0.1:{port}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot reach the Ray dashboard at http://127.0.0.1:{port}" in line


def test_an_address_that_never_answers_is_given_up_on_in_time(silent_server, monkeypatch, capsys):
    monkeypatch.setattr(jobs, "CONNECT_TIMEOUT_S", 1.0)
    address = f"http://127.0.0.1:{silent_server.getsockname()[1]}"
    t0 = time.monotonic()
    assert main(["submit", "configs/tiny_cpu.yaml", "--address", address]) == 2
    assert time.monotonic() - t0 < 10
    assert "timed out; waited at most 1 s" in _one_error_line(capsys.readouterr().err)
    assert _contacted(silent_server)


def test_dry_run_shows_the_job_and_never_a_secret(tmp_path, monkeypatch, capsys):
    """A config and a single-file scorer outside the repository travel with the job (the
    config's YAML in KLRL_JOB_CONFIG, the scorer as a package in py_modules); the user's
    runtime_env is merged in; every environment value is shown as ***."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "klrl_dry_scorer.py").write_text("def score(completion, problem):\n    return 1.0\n")
    (outside / "mine.yaml").write_text(f"base: {REPO_ROOT / 'configs' / 'tiny_cpu.yaml'}\n"
                                       "task: {reward: 'klrl_dry_scorer:score'}\n")
    (outside / "env.yaml").write_text('{"pip": ["math-verify"], "env_vars": {"HF_TOKEN": "hf_b"}, '
                                      '"py_modules": ["/opt/lib/mine"]}\n')
    monkeypatch.syspath_prepend(str(outside))
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-1")
    assert main(["submit", str(outside / "mine.yaml"), "--address", "http://127.0.0.1:1",
                 "--dry-run", "--env", "WANDB_API_KEY", "--env", "OTHER=inline-secret",
                 "--runtime-env", str(outside / "env.yaml"), "--job-name", "mine-1",
                 "total_steps=3"]) == 0
    out = capsys.readouterr().out
    for secret in ("wandb-secret-1", "inline-secret", "hf_b"):
        assert secret not in out
    spec = jobs.job_spec(outside / "mine.yaml", ["total_steps=3"],
                         plugins={"task.reward": "klrl_dry_scorer:score"},
                         env={"WANDB_API_KEY": "x", "OTHER": "y"},
                         runtime_env=jobs.read_runtime_env(outside / "env.yaml"),
                         job_name="mine-1", python=sys.executable)
    assert spec.describe() in out
    assert spec.entrypoint == f"{sys.executable} -m cluster.cli.job_entry mine.yaml total_steps=3"
    env = spec.runtime_env
    # the project's tracked files, staged: the working_dir holds exactly them
    staged_files = sorted(p.relative_to(env["working_dir"]).as_posix()
                          for p in Path(env["working_dir"]).rglob("*") if p.is_file())
    assert staged_files == list(spec.upload.files) and env["pip"] == ["math-verify"]
    assert f'"working_dir": "{spec.upload.describe()}"' in out
    staged, user = env["py_modules"]
    assert user == "/opt/lib/mine" and staged.endswith("/klrl_dry_scorer")
    assert (outside / "klrl_dry_scorer.py").read_text() == Path(staged, "__init__.py").read_text()
    assert "klrl_dry_scorer:score" in env["env_vars"]["KLRL_JOB_CONFIG"]  # base: resolved
    assert "kl:" in env["env_vars"]["KLRL_JOB_CONFIG"]
    assert env["env_vars"]["HF_TOKEN"] == "hf_b"
    assert '"WANDB_API_KEY": "***"' in out and "job name: mine-1" in out


def test_what_the_working_dir_carries_is_not_uploaded_again(monkeypatch):
    """A config in the repository is named; a top-level package of the repository is imported
    from the working_dir; tests/scorers.py is in the repository but not on the job's path, so
    it is uploaded."""
    monkeypatch.syspath_prepend(str(TESTS))
    spec = jobs.job_spec("configs/tiny_cpu.yaml", ["max_lag=1"],
                         plugins={"task.reward": "rewards.arithmetic:score"})
    assert spec.entrypoint == "python -m cluster.cli train configs/tiny_cpu.yaml max_lag=1"
    assert spec.with_python("/opt/py 3/python").entrypoint == (
        "'/opt/py 3/python' -m cluster.cli train configs/tiny_cpu.yaml max_lag=1")
    assert "py_modules" not in spec.runtime_env and "env_vars" not in spec.runtime_env
    spec = jobs.job_spec("configs/tiny_cpu.yaml", [],
                         plugins={"task.reward": "scorers:short_answers"})
    assert [m.rsplit("/", 1)[1] for m in spec.runtime_env["py_modules"]] == ["scorers"]


def test_plugin_tasks_travel_with_the_job_as_scorers_do(tmp_path, monkeypatch):
    """Every plug-in a run imports (task.reward, task.name, eval.<set>.task) is found here
    and uploaded when it lies outside the repository; repository and installed modules are not."""
    from cluster.config.train_config import load_train_config

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "klrl_dry_tasks.py").write_text("class T: ...\n")
    (outside / "klrl_dry_scorer.py").write_text("def score(completion, problem):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(outside))
    cfg = load_train_config(REPO_ROOT / "configs" / "tiny_cpu.yaml", [
        "task.name=klrl_dry_tasks:T", "task.reward=klrl_dry_scorer:score",
        "eval.out_of_domain.task=klrl_dry_tasks:T", "eval.out_of_domain.split=ood"])
    assert jobs.plugin_specs(cfg) == {
        "task.reward": "klrl_dry_scorer:score", "task.name": "klrl_dry_tasks:T",
        "eval.out_of_domain.task": "klrl_dry_tasks:T"}
    spec = jobs.job_spec("configs/tiny_cpu.yaml", [], plugins=jobs.plugin_specs(cfg))
    uploaded = sorted(Path(p).name for p in spec.runtime_env["py_modules"])
    assert uploaded == ["klrl_dry_scorer", "klrl_dry_tasks"]  # each once, as packages
    assert jobs.plugin_specs(load_train_config(REPO_ROOT / "configs" / "tiny_cpu.yaml")) == {}
    with pytest.raises(jobs.SubmitError, match="task.name=klrl_nope:T: module 'klrl_nope' is "
                                               "not importable here"):
        jobs.job_spec("configs/tiny_cpu.yaml", [], plugins={"task.name": "klrl_nope:T"})


def _job(status: str, code: int | None = None, error: str | None = None):
    from ray.job_submission import JobInfo, JobStatus

    from ray.dashboard.modules.job.common import JobErrorType

    return JobInfo(status=JobStatus(status), entrypoint="python -m cluster.cli train x.yaml",
                   driver_exit_code=code, error_type=error and JobErrorType(error))


@pytest.mark.parametrize(("info", "why"), [
    (("FAILED", -9, "JOB_ENTRYPOINT_COMMAND_ERROR"),
     "its driver was killed (SIGKILL, exit code -9)"),
    (("FAILED", 137, "JOB_ENTRYPOINT_COMMAND_ERROR"),
     "its driver was killed (SIGKILL, exit code 137)"),
    (("FAILED", None, "JOB_SUPERVISOR_ACTOR_DIED"),
     "Ray lost its driver (JOB_SUPERVISOR_ACTOR_DIED)"),
    # klrl's own ends: the run finished, failed or stopped with its checkpoint, was refused
    (("FAILED", 1, "JOB_ENTRYPOINT_COMMAND_ERROR"), None),
    (("FAILED", 2, "JOB_ENTRYPOINT_COMMAND_ERROR"), None),
    (("FAILED", 143, "JOB_ENTRYPOINT_COMMAND_ERROR"), None),
    # a resubmission would fail alike; a stop asked for; success
    (("FAILED", None, "RUNTIME_ENV_SETUP_FAILURE"), None),
    (("FAILED", None, "JOB_ENTRYPOINT_COMMAND_START_ERROR"), None),
    (("STOPPED", -15, None), None),
    (("SUCCEEDED", 0, None), None),
])
def test_only_a_lost_driver_is_resubmitted(info, why):
    assert jobs.driver_lost(_job(*info)) == why


def test_a_resubmission_continues_the_run_under_a_new_name():
    spec = jobs.job_spec("configs/tiny_cpu.yaml", ["run_name=r1", "output_dir=/shared"],
                         job_name="k1-s0")
    again = jobs.resubmission(spec, 1)
    assert again.entrypoint == spec.entrypoint + " --resume-if-started"
    assert again.job_name == "k1-s0-r1" and again.runtime_env == spec.runtime_env
    twice = jobs.resubmission(spec, 2)
    assert twice.entrypoint == again.entrypoint and twice.job_name == "k1-s0-r2"
    assert jobs.resubmission(jobs.job_spec("configs/tiny_cpu.yaml", []), 1).job_name is None


def test_resume_if_started_resumes_a_run_that_exists_and_starts_one_that_does_not(tmp_path,
                                                                                  capsys):
    """What a resubmitted job runs decides by the continuation rule (tests/test_continuation.py
    has every state): --resume when the lost driver started the run, a fresh start when it
    died before that."""
    from cluster.cli.cmd_train import _continuation
    from cluster.config.loader import ConfigError
    from cluster.config.train_config import load_train_config
    from cluster.train.continuation import Action

    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "metrics.jsonl").write_text('{"step": 0}\n')
    def cfg(*extra):
        return load_train_config("configs/tiny_cpu.yaml", [f"output_dir={tmp_path}", *extra])

    assert _continuation(cfg("run_name=r1")).action is Action.RESUME
    assert _continuation(cfg("run_name=r2")).action is Action.START
    with pytest.raises(ConfigError, match="--resume-if-started needs run_name"):
        _continuation(cfg())
    assert main(["train", "configs/tiny_cpu.yaml", "--resume-if-started"]) == 2
    assert "--resume-if-started needs run_name" in _one_error_line(capsys.readouterr().err)


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
                        "PATH": "/usr/bin:/bin"})


@pytest.fixture
def clone(tmp_path) -> Path:
    """Another klrl checkout (its marker file and a config, committed), holding what a working
    checkout gathers: an untracked checkpoint, an ignored run directory, docs."""
    root = tmp_path / "clone"
    for rel, text in {"cluster/cli/job_entry.py": "# klrl\n", "configs/mine.yaml": "seed: 1\n",
                      ".gitignore": "runs/\n", "docs/figure.png": "x" * 1000}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "init")
    (root / "checkpoint.bin").write_bytes(b"\0" * 4096)  # untracked
    (root / "runs" / "r1").mkdir(parents=True)
    (root / "runs" / "r1" / "state.pt").write_bytes(b"\0" * 4096)  # ignored
    (root / "configs" / "mine.yaml").write_text("seed: 2\n")  # changed since the commit
    return root


def test_the_upload_is_the_current_checkouts_tracked_files(clone, tmp_path):
    """The checkout the command runs in, not the one klrl is imported from; its tracked files
    as they are now, never untracked or ignored ones, docs/ and tests/ left out."""
    from cluster.launchers.job_upload import project_root, project_upload

    (clone / "configs" / "deep").mkdir()
    assert project_root(clone / "configs" / "deep") == clone.resolve()
    assert project_root(tmp_path) == REPO_ROOT  # not a klrl checkout: klrl's own
    upload = project_upload(root=clone)
    assert upload.files == (".gitignore", "cluster/cli/job_entry.py", "configs/mine.yaml")
    assert upload.describe() == (f"{clone}: 3 tracked files (git ls-files; docs/ and tests/ left "
                                 "out), 0.0 kB")
    staged = upload.stage(tmp_path / "staged")
    assert (staged / "configs" / "mine.yaml").read_text() == "seed: 2\n"
    assert sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()) \
        == list(upload.files)
    assert upload.holds(clone / "configs") and not upload.holds(clone / "checkpoint.bin")
    ours = project_upload()  # klrl's checkout: only tracked files
    assert "cluster/cli/job_entry.py" in ours.files
    assert not any(f.startswith(("docs/", "tests/", "runs/", ".venv/")) for f in ours.files)


def test_an_explicit_list_replaces_the_tracked_files(clone, tmp_path):
    from cluster.launchers.job_upload import UploadError, project_upload

    listing = tmp_path / "files.txt"
    listing.write_text("cluster   # the code\n\ncheckpoint.bin\n")
    upload = project_upload(listing, root=clone)
    assert upload.files == ("checkpoint.bin", "cluster/cli/job_entry.py")
    listing.write_text("../elsewhere.txt\n")
    with pytest.raises(UploadError, match=r"'../elsewhere.txt' is not a file or directory inside"):
        project_upload(listing, root=clone)
    with pytest.raises(UploadError, match="is not a git checkout, so its tracked files are "
                                          "unknown; give the files the job needs with "
                                          "--upload-list FILE"):
        project_upload(root=tmp_path / "staged_nowhere")


def test_the_probe_knows_every_dependency_of_klrl():
    """DEPENDENCY_MODULES holds the import name of each of pyproject.toml's dependencies (and
    vLLM), as the installed distributions map them."""
    import importlib.metadata
    import re
    import tomllib

    from cluster.launchers.job_upload import DEPENDENCY_MODULES

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\[<>=!~ ;]", dep, maxsplit=1)[0].lower().replace("_", "-")
             for dep in project["dependencies"]}
    provides = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(dist.lower().replace("_", "-"), set()).add(module)
    for name in names:
        assert provides.get(name, set()) & set(DEPENDENCY_MODULES), name
    assert "vllm" in DEPENDENCY_MODULES
