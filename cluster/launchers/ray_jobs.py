"""The Ray Jobs client behind the Ray job launcher (ray_job.py: `klrl submit`, and one job
per run of `klrl sweep --address`).

A job runs `PYTHON -m cluster.cli train ...` on the head node with the project's tracked files
uploaded as its working directory (job_upload.py: which files, and the check
that the cluster's PYTHON has klrl's dependencies, made before the upload). What the run needs
beyond them travels in the job's runtime_env (`job_spec`):
- a config file outside the uploaded files (elsewhere, or untracked): its YAML (with `base:`
  resolved) in the environment variable CONFIG_ENV, which `python -m cluster.cli.job_entry`
  writes back to a file;
- a plug-in scorer or task (`task.reward`, `task.name`, `eval.<set>.task`; `plugin_specs`)
  found outside the uploaded files: its package directory in `py_modules` (a single-file module
  `name.py` goes as a package `name/` of which it is the `__init__.py`: Ray's job client
  uploads only directories, and the import name is the same);
- `--env KEY[=VALUE]` and a user's `--runtime-env FILE`, merged with klrl's own entries
  (a conflict is an error naming the key, never a silent overwrite).
Secret values never reach the output: `JobSpec.describe` shows env values as ***.
Ray is imported inside the functions: `klrl --help` and local sweeps must not pay for it.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shlex
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from cluster.config.loader import read_yaml
from cluster.config.train_config import load_train_config
from cluster.launchers.base import RESUME_IF_STARTED, SubmitError
from cluster.launchers.job_upload import (
    Upload,
    UploadError,
    probe_python,
    project_upload,
    staged,
)
from cluster.train.stopping import HANDLED
from rewards.config import EVAL_SETS

# Never uploaded with a plug-in's package directory (py_modules): caches.
EXCLUDES = ["**/__pycache__", ".pytest_cache"]
# The YAML of a submitted config outside the uploaded files (read by cluster.cli.job_entry).
CONFIG_ENV = "KLRL_JOB_CONFIG"
# How long `klrl submit` waits for the dashboard to answer before giving up on the address.
CONNECT_TIMEOUT_S = 10.0
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]{0,127}$")


class JobFailed(Exception):
    """The submitted job ended other than SUCCEEDED (exit 1); `info` is its JobInfo."""

    def __init__(self, message: str, info=None, job_id: str | None = None):
        super().__init__(message)
        self.info, self.job_id = info, job_id


# The exit codes `klrl train` chooses itself (cluster/cli/cmd_train.py): 0 finished, 1 failed
# or stopped with its checkpoint, 2 refused before the start, 128 + a signal it handles (a
# stop asked for). A driver that ends with one of them decided to: a resubmission would not
# help. Any other code means it was killed (a signal: the OOM killer, a lost node's SIGKILL).
OWN_EXIT_CODES = frozenset({0, 1, 2, *(128 + s for s in HANDLED)})
# Ray's job errors where the driver went with Ray's job supervisor (its node lost, say).
_SUPERVISOR_LOST = ("JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE")


def driver_lost(info) -> str | None:
    """Why the job of `info` (a Ray JobInfo) lost its driver: FAILED with an exit code that
    klrl train never chooses (killed by a signal), or with Ray's job supervisor lost. None
    for any other end: klrl's own exit codes, a runtime_env or entrypoint that failed to
    start (a resubmission would fail alike), STOPPED (`ray job stop`), SUCCEEDED."""
    status, error = str(info.status), getattr(info, "error_type", None)
    error = getattr(error, "value", error)
    if status != "FAILED":
        return None
    code = getattr(info, "driver_exit_code", None)
    if error == "JOB_ENTRYPOINT_COMMAND_ERROR" and code is not None and code not in OWN_EXIT_CODES:
        return f"its driver was killed ({_exit_description(code)})"
    if error in _SUPERVISOR_LOST:
        return f"Ray lost its driver ({error})"
    return None


def _exit_description(code: int) -> str:
    """-9 or 137 -> 'SIGKILL'; another code as itself."""
    import signal

    number = -code if code < 0 else code - 128 if code > 128 else None
    try:
        return f"{signal.Signals(number).name}, exit code {code}" if number else f"exit code {code}"
    except ValueError:
        return f"exit code {code}"


def resubmission(spec: JobSpec, attempt: int) -> JobSpec:
    """The first job `spec` again, resubmission `attempt`, to continue its run:
    `--resume-if-started` added (the continuation rule decides where the job runs: resume from
    the last checkpoint, start if the lost driver never began it, nothing if it finished) and,
    with a job name, a new one (`NAME-r1`, `NAME-r2`: Ray keeps the names of ended jobs)."""
    entrypoint = spec.entrypoint if spec.entrypoint.endswith(f" {RESUME_IF_STARTED}") \
        else f"{spec.entrypoint} {RESUME_IF_STARTED}"
    name = spec.job_name and f"{spec.job_name}-r{attempt}"
    return replace(spec, entrypoint=entrypoint, job_name=name)


def check_resubmittable(cfg, max_resubmits: int, wait: bool) -> None:
    """A job may be resubmitted only if its run can be found again: it is followed here (not
    --no-wait), and its output_dir is absolute (a relative one lies in the job's unpacked
    working_dir, which Ray deletes once no job uses it). SubmitError otherwise."""
    if not max_resubmits:
        return
    if not wait:
        raise SubmitError("--max-resubmits: klrl submit resubmits a job it follows; drop "
                          "--no-wait (or --max-resubmits)")
    if not Path(cfg.output_dir).is_absolute():
        raise SubmitError(f"--max-resubmits: output_dir={cfg.output_dir} is relative, so the run "
                          "would live in the job's unpacked working_dir, which Ray deletes when "
                          "the job ends; give output_dir=/ABSOLUTE/PATH on storage the cluster "
                          "keeps")


def auth_headers() -> dict:
    """Bearer token for a token-auth cluster (`ray start --head` writes ~/.ray/auth_token):
    RAY_AUTH_TOKEN, else the file at RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. Sent explicitly
    because Ray's client decides whether to attach it from process-wide state read once,
    before a token may exist; so RAY_AUTH_MODE=token is not needed here."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not token and path.is_file():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def dashboard_url(address: str) -> str:
    """`address` as the Jobs API's http(s) URL (`HEAD:8265` -> `http://HEAD:8265`)."""
    if address.startswith("ray://"):
        raise SubmitError(f"--address {address} is a Ray Client address; jobs are submitted to "
                          "the dashboard: --address http://HEAD:8265")
    return (address if "://" in address else f"http://{address}").rstrip("/")


def check_reachable(url: str, timeout: float | None = None) -> None:
    """One request to the dashboard's version endpoint, bounded by `timeout` (default
    CONNECT_TIMEOUT_S): Ray's client has no timeout of its own, so an address that accepts
    connections but never answers (a firewall, a wrong port) would hang it forever."""
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    request = urllib.request.Request(f"{url}/api/version", headers=auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise SubmitError(f"the Ray dashboard at {url} refused the request (HTTP {exc.code}): "
                              "the cluster uses token auth; set RAY_AUTH_TOKEN, or copy the "
                              "head's ~/.ray/auth_token here (or point RAY_AUTH_TOKEN_PATH at "
                              "it)") from None
        raise SubmitError(f"{url} answered HTTP {exc.code} to /api/version: is it a Ray "
                          "dashboard (http://HEAD:8265)?") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SubmitError(f"cannot reach the Ray dashboard at {url} ({reason}; waited at most "
                          f"{timeout:g} s): is the cluster up, and is this its dashboard address "
                          "(`ray start --head --dashboard-host=0.0.0.0`, port 8265)?") from None


def job_client(address: str):
    """A `JobSubmissionClient` for the dashboard at `address`, with the cluster's token;
    SubmitError (one line) when the dashboard cannot be reached within CONNECT_TIMEOUT_S."""
    from ray.job_submission import JobSubmissionClient

    url = dashboard_url(address)
    check_reachable(url)
    try:
        return JobSubmissionClient(url, headers=auth_headers())
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise SubmitError(f"cannot use the Ray dashboard at {url}: {_last_line(exc)}") from None


@dataclass
class JobSpec:
    """What `submit_job` gets: the command, the runtime_env, the job's name and metadata."""

    entrypoint: str
    runtime_env: dict
    job_name: str | None = None
    metadata: dict = field(default_factory=dict)
    # Hold the staged project files and single-file scorers until the upload (removed when
    # the spec is dropped); `describe` names them by their sources: {staged path: source}.
    staging: list = field(default_factory=list, repr=False)
    staged_from: dict = field(default_factory=dict)
    upload: Upload | None = None  # the project's files in working_dir
    python: str = "python"  # the entrypoint's first word, unquoted

    def with_python(self, python: str) -> JobSpec:
        """The spec run by `python` instead (the one the cluster's check chose)."""
        rest = self.entrypoint.removeprefix(shlex.quote(self.python))
        return replace(self, entrypoint=shlex.quote(python) + rest, python=python)

    def describe(self) -> str:
        """The spec for people: every environment value shown as *** (secrets), klrl's
        config upload by its size."""
        env = self.runtime_env.get("env_vars", {})
        shown = dict(self.runtime_env, env_vars={
            k: f"<config, {len(v)} bytes>" if k == CONFIG_ENV else "***" for k, v in env.items()})
        if not env:
            shown.pop("env_vars")
        if "py_modules" in shown:
            shown["py_modules"] = [f"{self.staged_from[m]} (as package {Path(m).name})"
                                   if m in self.staged_from else m for m in shown["py_modules"]]
        if self.upload is not None and "working_dir" in shown:
            shown["working_dir"] = self.upload.describe()
        lines = [f"entrypoint: {self.entrypoint}",
                 f"job name: {self.job_name or '(chosen by Ray)'}",
                 "runtime_env: " + json.dumps(shown, sort_keys=True)]
        return "\n".join(lines)


def parse_env(items: list[str], environ: dict | None = None) -> dict[str, str]:
    """`--env KEY=VALUE` or `--env KEY` (the value of KEY in this shell) -> {KEY: VALUE}."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not _ENV_KEY.match(key):
            raise SubmitError(f"--env {key}: not a variable name (letters, digits, _; give "
                              "KEY=VALUE, or KEY to pass this shell's value)")
        if not sep:
            if key not in environ:
                raise SubmitError(f"--env {key}: {key} is not set in this shell; export it, or "
                                  f"give the value: --env {key}=VALUE")
            value = environ[key]
        if key in out and out[key] != value:
            raise SubmitError(f"--env {key} is given twice with different values")
        out[key] = value
    return out


def plugin_specs(cfg) -> dict[str, str]:
    """{config field: 'pkg.mod:name'} of every plug-in a run imports: its scorer (task.reward)
    and plug-in tasks (task.name, eval.<set>.task). Their modules travel with a job."""
    from rewards.registry import is_plugin

    specs = {"task.reward": cfg.task.reward} if cfg.task.reward else {}
    named = {"task.name": cfg.task.name} | {
        f"eval.{name}.task": s.task for name in EVAL_SETS
        if (s := getattr(cfg.eval, name)) is not None and s.task}
    return specs | {field: name for field, name in named.items() if is_plugin(name)}


def plugin_module_path(field: str, spec: str, upload: Upload) -> Path | None:
    """Where the plug-in `spec` ('pkg.mod:name', the value of config `field`) must be uploaded
    from, or None when the job imports it without an upload: a top-level module of the
    project that `upload` carries (the job's working_dir, on its sys.path) or an installed
    package (site-packages: it must be installed on the cluster too). SubmitError when it is
    not importable here."""
    top = spec.split(":")[0].split(".")[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise SubmitError(f"{field}={spec}: module {top!r} is not importable here, so klrl "
                          "submit cannot upload it with the job; put the directory that holds it "
                          "on PYTHONPATH (PYTHONPATH=DIR klrl submit ...), or move it into this "
                          "repository")
    locations = list(found.submodule_search_locations or [])
    if len(locations) > 1 or (not locations and not (found.origin or "").endswith(".py")):
        what = ("a namespace package spread over several directories" if locations
                else f"not Python source ({found.origin})")
        raise SubmitError(f"{field}={spec}: {top!r} is {what}; Ray can upload one package "
                          "directory or one .py file: make it one")
    path = Path(locations[0] if locations else found.origin).resolve()
    if path.parent == upload.root and upload.holds(path):  # e.g. rewards/: on the job's path
        return None
    if any(p.name in ("site-packages", "dist-packages") for p in path.parents):
        return None
    return path


def job_spec(config: str | Path, overrides: list[str], *, plugins: dict[str, str] | None = None,
             python: str = "python", env: dict[str, str] | None = None,
             runtime_env: dict | None = None, runtime_env_source: str = "--runtime-env",
             job_name: str | None = None, upload: Upload | None = None) -> JobSpec:
    """The job that runs `klrl train CONFIG overrides` on the cluster (see the module doc).
    `plugins`: the config's `plugin_specs`; `runtime_env`: the user's, merged into klrl's;
    `upload`: the project's files the job carries (default: `job_upload.project_upload()`)."""
    try:
        upload = upload or project_upload()
    except UploadError as exc:
        raise SubmitError(str(exc)) from None
    path = Path(config).resolve()
    own_env: dict[str, str] = {}
    args = [*map(shlex.quote, overrides)]
    if upload.holds(path):  # uploaded with the working_dir: named, as it is
        command = ["-m cluster.cli train", shlex.quote(path.relative_to(upload.root).as_posix())]
    else:
        own_env[CONFIG_ENV] = yaml.safe_dump(read_yaml(path), sort_keys=False)
        command = ["-m cluster.cli.job_entry", shlex.quote(path.name)]
    modules = {path for field, spec in (plugins or {}).items()
               if (path := plugin_module_path(field, spec, upload)) is not None}
    holder, workdir = staged(upload)
    staging, staged_from = [holder], {}
    ours: dict = {"working_dir": str(workdir), "excludes": list(EXCLUDES)}
    for module in sorted(modules):
        if module.is_file():  # name.py -> name/__init__.py: the job client uploads directories
            package = Path(holder.name) / "modules" / module.stem
            package.parent.mkdir(exist_ok=True)
            package.mkdir()
            shutil.copy2(module, package / "__init__.py")
            module, staged_from[str(package)] = package, str(module)
        ours.setdefault("py_modules", []).append(str(module))
    env = dict(env or {})
    if CONFIG_ENV in env:
        raise SubmitError(f"--env {CONFIG_ENV}: klrl sets {CONFIG_ENV} itself; choose another name")
    ours["env_vars"] = {**own_env, **env}
    merged = merge_runtime_env(ours, runtime_env or {}, runtime_env_source)
    if not merged["env_vars"]:
        merged.pop("env_vars")
    if job_name is not None and not _JOB_NAME.match(job_name):
        raise SubmitError(f"--job-name {job_name!r}: use letters, digits, '_', '-', '.' "
                          "(at most 128 characters)")
    metadata = {"klrl_config": str(config)}
    return JobSpec(" ".join([shlex.quote(python), *command, *args]), merged, job_name, metadata,
                   staging, staged_from, upload, python)


def merge_runtime_env(ours: dict, theirs: dict, source: str) -> dict:
    """klrl's runtime_env with the user's added: lists (py_modules, excludes) are joined,
    env_vars merged; a key that would replace one of klrl's values is a SubmitError naming it
    (klrl's working_dir is the repository the job runs from)."""
    if not isinstance(theirs, dict):
        raise SubmitError(f"{source}: a runtime_env is a mapping (working_dir, py_modules, "
                          f"env_vars, pip, ...), not a {type(theirs).__name__}")
    merged = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
              for k, v in ours.items()}
    for key, value in theirs.items():
        if key == "working_dir":
            raise SubmitError(f"{source}: working_dir: klrl submit uploads the project's "
                              "tracked files as the job's working_dir (--upload-list FILE "
                              "chooses others); remove it (add other code with py_modules)")
        if key in ("py_modules", "excludes"):
            if not isinstance(value, list):
                raise SubmitError(f"{source}: {key} must be a list")
            merged[key] = merged.get(key, []) + [v for v in value if v not in merged.get(key, [])]
        elif key == "env_vars":
            if not isinstance(value, dict):
                raise SubmitError(f"{source}: env_vars must be a mapping of names to values")
            for name, val in value.items():
                if not isinstance(val, str):
                    raise SubmitError(f"{source}: env_vars.{name} must be a string (quote it: "
                                      f"{name}: \"{val}\")")
                if name == CONFIG_ENV:
                    raise SubmitError(f"{source}: env_vars.{name}: klrl sets {name} itself; "
                                      "remove it")
                if name in merged["env_vars"] and merged["env_vars"][name] != val:
                    raise SubmitError(f"{source}: env_vars.{name} is also given by --env, with "
                                      "another value; give it once")
                merged["env_vars"][name] = val
        else:
            merged[key] = value
    return merged


def read_runtime_env(path: str | Path) -> dict:
    """A runtime_env file: YAML or JSON (JSON is YAML), a mapping."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SubmitError(f"--runtime-env {path}: {_last_line(exc)}") from None
    return {} if data is None else data


def submit(config: str | Path, address: str, overrides: list[str], wait: bool = True,
           python: str = "python", *, spec: JobSpec | None = None,
           upload: Upload | None = None) -> str:
    """Submit `klrl train CONFIG overrides` as a Ray job (the job `spec`, by default
    `job_spec(config, overrides)` with the config's plug-ins uploaded if need be); with
    `wait`, follow its logs and raise JobFailed unless it succeeds. Returns the job id.
    `python` is the cluster's, checked beforehand (`cluster_python`); `upload`: the project's
    files (default: `job_upload.project_upload()`), whose size is said before they are sent.
    SubmitError when the cluster cannot be reached or refuses the job."""
    if spec is None:
        cfg = load_train_config(config, [o for o in overrides if "=" in o])
        spec = job_spec(config, overrides, plugins=plugin_specs(cfg), python=python,
                        upload=upload)
    client = job_client(address)
    if spec.job_name is not None:
        _check_name_free(client, spec.job_name)
    if spec.upload is not None:
        print(f"uploading {spec.upload.describe()}", flush=True)
    try:
        job_id = client.submit_job(entrypoint=spec.entrypoint, runtime_env=spec.runtime_env,
                                   submission_id=spec.job_name, metadata=spec.metadata)
    except (RuntimeError, ValueError, TypeError, OSError) as exc:
        if spec.job_name is not None and "already exists" in str(exc):
            raise SubmitError(_name_taken(spec.job_name, "")) from None
        too_big = ("; the upload is larger than the dashboard takes: list fewer files with "
                   "--upload-list FILE") if "413" in str(exc) else ""
        raise SubmitError(f"the cluster refused the job: {_last_line(exc)}{too_big}") from None
    print(f"submitted {job_id}: {spec.entrypoint}")
    if wait:
        follow(client, job_id)
    return job_id


def cluster_python(address: str, candidates: list[str]) -> str:
    """The first of `candidates` (`job_upload.python_candidates`) that runs klrl on the cluster
    at `address`: checked by a probe job that uploads nothing, before any run's files are
    uploaded. SubmitError naming each candidate's problem and the fix otherwise."""
    try:
        return probe_python(job_client(address), candidates)
    except UploadError as exc:
        raise SubmitError(str(exc)) from None


def follow(client, job_id: str) -> None:
    """Print the job's logs until it ends; JobFailed unless it SUCCEEDED."""
    from ray.job_submission import JobStatus

    for chunk in _tail(client, job_id):
        print(chunk, end="")
    info = client.get_job_info(job_id)
    print(f"job {job_id}: {info.status}")
    if info.status != JobStatus.SUCCEEDED:
        raise JobFailed(f"job {job_id} ended {info.status}"
                        + (f": {_last_line(info.message)}" if info.message else ""), info, job_id)


def _check_name_free(client, name: str) -> None:
    """Ray refuses a second job with the same submission_id (HTTP 500 with a server traceback,
    also when the first one finished long ago), after the working_dir upload: say so first."""
    try:
        info = client.get_job_info(name)
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            return
        raise SubmitError(f"cannot look up job {name}: {_last_line(exc)}") from None
    raise SubmitError(_name_taken(name, f" ({info.status})"))


def _name_taken(name: str, status: str) -> str:
    return (f"--job-name {name}: the cluster already has a job of that name{status}; Ray keeps "
            f"the names of finished jobs too, so choose another (e.g. {name}-2)")


def _last_line(exc) -> str:
    """The last non-empty line of an error: Ray's HTTP errors carry the server's traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _tail(client, job_id):
    """The job's log lines as they come (the client's async iterator, driven here)."""
    async def collect():
        async for lines in client.tail_job_logs(job_id):
            yield lines

    agen = collect()
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()
