"""The run directory (`runs/<name>/`): its one owner. Every other module reads and writes it
through here.

Layout: `config.yaml` (the resolved TrainConfig), `provenance.jsonl` (klrl version and git
commit, one line per start), `metrics.jsonl` (one JSON object per step,
with at least `step`; flushed each line so a crash loses nothing), `samples.jsonl` (rows of
sample generations every `logging.samples_every` steps, one JSON object each, with `step`),
`wandb/`, `checkpoints/` and `hf/` (cluster/train/checkpoint.py) and `final/` (the trained
policy; `final/config.json`, with LoRA `final/adapter_config.json`, is written last, so it marks
a finished run). The local directory is always written, whatever wandb does;
wandb mirrors the same metrics, its mode from the config, else WANDB_MODE, else offline (files
only, no account needed).

One rule for metrics.jsonl (and samples.jsonl) lines that are not a JSON object with an
integer `step`: they are skipped, by every reader. The writer only ever leaves one such line,
the last, cut by a crash. A resume cuts both logs back to its checkpoint's step
(`keep_logs_through`), so no step's rows appear twice.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml

from actors.outputs import fast_backend, stream_text
from cluster.config.loader import dump_config
from cluster.train.checkpoint import hf_root
from cluster.train.provenance import provenance

CONFIG_FILE = "config.yaml"
PROVENANCE_FILE = "provenance.jsonl"  # one line per start (fresh or resumed): code that ran
STARTED_AT_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # provenance.jsonl's started_at: local time, offset
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
FINAL_DIR = "final"
# The samples table's columns (samples.jsonl keys, wandb Table columns), in order.
SAMPLE_COLUMNS = ("step", "policy_version", "lag", "prompt", "response", "reward", "answer",
                  "finish_reason")
SAMPLES_KEY = "samples"  # the wandb key of the table
# Flat wandb config keys beside the nested config, so that a project's runs filter and group
# by them in one click (wandb nests kl.estimator under kl); the dashboard groups by them
# (cluster/publish/workspace.py).
FILTER_KEYS = ("estimator", "placement", "importance", "beta", "lag", "seed")


def filter_config(cfg) -> dict:
    """The FILTER_KEYS of a TrainConfig: its KL setting, max_lag and seed."""
    k = cfg.kl
    return dict(zip(FILTER_KEYS, (k.estimator, k.placement, k.importance, k.beta, cfg.max_lag,
                                  cfg.seed), strict=True))


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def samples_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SAMPLES_FILE


def config_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CONFIG_FILE


def final_dir(run_dir: str | Path) -> Path:
    """Where the trained policy goes, in Hugging Face format."""
    return Path(run_dir) / FINAL_DIR


def has_metrics(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds a run (started: it has a metrics log)."""
    return metrics_path(run_dir).is_file()


def is_finished(run_dir: str | Path) -> bool:
    """Whether the run finished: the final model's config.json (with LoRA the adapter's
    adapter_config.json), written last, is there."""
    return finished_at(run_dir) is not None


def finished_at(run_dir: str | Path) -> float | None:
    """When the run finished (the time its last-written file, is_finished's, was written);
    None if it has not."""
    final = final_dir(run_dir)
    for name in ("config.json", "adapter_config.json"):
        if (final / name).is_file():
            return (final / name).stat().st_mtime
    return None


def default_run_name(cfg) -> str:
    k = cfg.kl
    trunc = f"-C{k.truncate:g}" if k.truncate is not None else ""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return (f"{k.estimator}-{k.placement.replace('+', '_')}-{k.importance}{trunc}-b{k.beta:g}"
            f"-lag{cfg.max_lag}-s{cfg.seed}-{stamp}")


def wandb_mode(cfg) -> str:
    """logging.wandb_mode, else WANDB_MODE, else offline (files only, no account needed)."""
    return cfg.logging.wandb_mode or os.environ.get("WANDB_MODE") or "offline"


class RunLog:
    """Owns runs/<name>/ and the metrics sinks. Use as a context manager."""

    def __init__(self, cfg, run_dir: Path, resume_wandb_id: str | None = None,
                 rewind_to: int | None = None):
        """`resume_wandb_id`: the wandb run to continue; `rewind_to`: the step it continues
        after (a resume's checkpoint: the rows of later steps are redone, `_start_wandb`)."""
        self.cfg, self.dir = cfg, Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, config_path(self.dir))
        with open(self.dir / PROVENANCE_FILE, "a") as f:
            f.write(json.dumps({"started_at": time.strftime(STARTED_AT_FORMAT),
                                "resumed": resume_wandb_id is not None, **provenance()}) + "\n")
        self._metrics = open(metrics_path(self.dir), "a", buffering=1)  # noqa: SIM115 - open for the run
        self._samples = None  # samples.jsonl, opened by the first rows (none: no file)
        self._wandb = None
        self.wandb_id = resume_wandb_id
        self._start_wandb(rewind_to)

    def _start_wandb(self, rewind_to: int | None = None) -> None:
        """Start (or continue: `wandb_id`) the wandb run. wandb keeps one row per step and
        ignores a step at or below the last it has, so the rows of redone steps (after
        `rewind_to`) would keep their first attempt's values: online, the run is rewound to
        `rewind_to` (W&B's rewind, `resume_from`: the later rows go, the redone ones replace
        them); where W&B refuses that (a preview feature of theirs), and offline, it is
        continued as it stands, with a warning. metrics.jsonl always holds the redone rows."""
        mode = wandb_mode(self.cfg)
        if mode == "disabled":
            return
        import wandb

        lg = self.cfg.logging
        settings = {"entity": lg.wandb_entity, "project": lg.wandb_project,
                    "group": lg.wandb_group, "tags": lg.tags or None, "mode": mode,
                    "name": lg.wandb_name or self.dir.name, "dir": str(self.dir),
                    "config": self.cfg.model_dump(mode="json") | filter_config(self.cfg)}
        if self.wandb_id and rewind_to is not None and mode == "online":
            try:
                self._wandb = wandb.init(**settings,
                                         resume_from=f"{self.wandb_id}?_step={rewind_to + 1}")
            except Exception as exc:  # noqa: BLE001 - the run goes on; wandb is a mirror
                print(f"wandb: could not rewind run {self.wandb_id} to step {rewind_to} "
                      f"({type(exc).__name__}: {exc}); continuing it, so wandb keeps the first "
                      f"rows of steps after {rewind_to} (metrics.jsonl holds the redone ones)",
                      file=sys.stderr)
        if self._wandb is None:
            self._wandb = wandb.init(**settings, id=self.wandb_id,
                                     resume="allow" if self.wandb_id else None)
        self.wandb_id = self._wandb.id

    def rewind(self, step: int) -> None:
        """Cut the logs back to `step` (a learner restart redoes the later steps, so each step
        keeps one row: keep_logs_through) and rewind the wandb run to it (`_start_wandb`)."""
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        keep_logs_through(self.dir, step)
        self._metrics = open(metrics_path(self.dir), "a", buffering=1)  # noqa: SIM115 - open for the run
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
            self._start_wandb(rewind_to=step)

    def log(self, metrics: dict) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                 for k, v in metrics.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"},
                            step=int(metrics["step"]))

    def record_warning(self, key: str, text: str) -> None:
        """A warning about the run for wandb (the caller prints it, which puts it in the log):
        kept in the run's summary under `warning/KEY` and, online, sent as a wandb alert."""
        if self._wandb is None:
            return
        self._wandb.summary[f"warning/{key}"] = text
        if wandb_mode(self.cfg) == "online":
            try:
                self._wandb.alert(title=f"klrl {self.dir.name}: {key}", text=text)
            except Exception as exc:  # noqa: BLE001 - the run goes on; wandb is a mirror
                print(f"wandb: the alert was not sent ({type(exc).__name__}: {exc})",
                      file=sys.stderr)

    def log_samples(self, rows: list[dict]) -> None:
        """Append one step's sample rows (`sample_rows`) to samples.jsonl, and log them to
        wandb as a Table under `samples` at their step."""
        if not rows:
            return
        if self._samples is None:
            self._samples = open(samples_path(self.dir), "a", buffering=1)  # noqa: SIM115 - open for the run
        self._samples.write("".join(json.dumps(row) + "\n" for row in rows))
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=list(SAMPLE_COLUMNS),
                                data=[[row[c] for c in SAMPLE_COLUMNS] for row in rows])
            self._wandb.log({SAMPLES_KEY: table}, step=rows[0]["step"])

    def close(self) -> None:
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def parse_row(line: str) -> dict | None:
    """One metrics.jsonl line as a dict, or None when it breaks the rule (module docstring)."""
    try:
        row = json.loads(line)
    except ValueError:  # not JSON: a line cut by a crash (or the cut start of a tail)
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every row of RUN_DIR/metrics.jsonl, in order (a resumed run may log a step twice)."""
    lines = metrics_path(run_dir).read_text().splitlines()
    return [row for line in lines if (row := parse_row(line)) is not None]


def read_provenance(run_dir: str | Path) -> list[dict]:
    """Every start of the run (provenance.jsonl: time, code, machine); [] when it has none."""
    path = Path(run_dir) / PROVENANCE_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut by a crash
            continue
    return [row for row in rows if isinstance(row, dict)]


def started_at(row: dict) -> datetime | None:
    """When the start a provenance.jsonl row records began; None where the row has no
    readable time."""
    try:
        return datetime.strptime(row["started_at"], STARTED_AT_FORMAT)  # noqa: DTZ007 - it ends in %z
    except (KeyError, TypeError, ValueError):
        return None


def last_step(run_dir: str | Path) -> int:
    """Step of the last row of RUN_DIR/metrics.jsonl (0 if none yet); reads only the tail,
    so a sweep can poll every running run cheaply."""
    path = metrics_path(run_dir)
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    rows = (parse_row(line) for line in reversed(lines))
    return next((row["step"] for row in rows if row is not None), 0)


def keep_logs_through(run_dir: str | Path, step: int) -> None:
    """Cut RUN_DIR/metrics.jsonl and samples.jsonl back to the rows of steps <= `step` (a
    resume redoes the later ones); lines that break the rule go too."""
    for path in (metrics_path(run_dir), samples_path(run_dir)):
        if path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if (row := parse_row(line)) is not None and row["step"] <= step]
            path.write_text("".join(line + "\n" for line in keep))


def abandon_metrics(run_dir: str | Path) -> Path:
    """Move an earlier attempt's logs and exports aside, as metrics.jsonl.abandoned-N (and
    samples.jsonl.abandoned-N, hf.abandoned-N): a run started afresh in a directory whose
    earlier attempt left no checkpoint must not mix its rows or prune its exports with
    theirs. Returns the metrics log's new path."""
    run_dir = Path(run_dir)
    n = len(list(run_dir.glob(f"{METRICS_FILE}.abandoned-*")))
    for path in (samples_path(run_dir), hf_root(run_dir)):
        if path.exists():
            path.rename(run_dir / f"{path.name}.abandoned-{n}")
    return metrics_path(run_dir).rename(run_dir / f"{METRICS_FILE}.abandoned-{n}")


def sample_rows(rollouts, step: int, trained_by: int, n: int, decode) -> list[dict]:
    """The samples table of `step`: the first `n` of the rollouts it trained on (whole prompt
    groups, in the order the workers returned them: a function of the seed and the data
    position, so a resumed run picks the same rows). `trained_by` is the learner version that
    trained them (the lag is counted from it, as lag/max is); `decode(rollout)` gives the
    response text (`completion_text`)."""
    return [{"step": step, "policy_version": r.policy_version, "lag": trained_by - r.policy_version,
             "prompt": r.problem.prompt, "response": decode(r), "reward": r.reward,
             "answer": r.problem.answer, "finish_reason": r.finish_reason}
            for r in rollouts[:n]]


def completion_text(tokenizer, prompt_ids, response_ids, stop=()) -> str:
    """The text the scorer was given for these sampled tokens, rebuilt in the driver (rollout
    records carry token ids only). vLLM detokenizes a fast tokenizer's output incrementally
    after the prompt (tokenizers' DecodeStream): a leading space stays, a trailing incomplete
    UTF-8 sequence is left out (a plain decode shows it as U+FFFD), special tokens are skipped;
    then it cuts the text before the first stop string. Other tokenizers: a plain decode."""
    backend = fast_backend(tokenizer)  # a fast tokenizer's, as vLLM takes it
    if backend is not None:
        text = stream_text(backend, prompt_ids, response_ids)
    else:
        text = tokenizer.decode(list(response_ids), skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


def read_samples(run_dir: str | Path) -> list[dict]:
    """Every row of RUN_DIR/samples.jsonl, in order ([] when there is none)."""
    path = samples_path(run_dir)
    lines = path.read_text().splitlines() if path.is_file() else []
    return [row for line in lines if (row := parse_row(line)) is not None]


def read_config(run_dir: str | Path) -> dict:
    """The run's resolved config as written (a plain dict; {} when there is none)."""
    path = config_path(run_dir)
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
