"""The wandb workspace a researcher opens first: a project's (or one sweep's) runs grouped by
their configuration (the flat config keys runs carry, run_log.FILTER_KEYS, the seed left out so
that a group's lines are its seeds: mean, min to max), in sections of line plots of what klrl
logs (KL to the reference by K1 and K3, reward, accuracy, lag, importance ratios, the learner),
and the sweep's verdict: the summary run's claims and per-configuration tables, its bar charts
and figures (cluster/publish/dashboard.py).

Built with wandb's own library for workspaces, `wandb-workspaces` (the `dashboard` extra;
imported only here). `build_workspace` makes it without any server; `save_workspace` writes
it to the wandb server, which needs wandb online with an API key (not run in klrl's tests).
"""
from __future__ import annotations

from cluster.analysis.runs import ACCURACY_KEYS
from cluster.train.run_log import FILTER_KEYS

# (section, [(panel title, [metric keys])]): the curves, one line per configuration.
CURVES: list[tuple[str, list[tuple[str, list[str]]]]] = [
    ("KL to the reference", [
        ("KL(pi || ref), K1 estimate", ["kl/pi_ref"]),
        ("KL(pi || ref), K3 estimate", ["kl/pi_ref_k3"]),
        ("KL(mu || ref) of the sampler", ["kl/mu_ref"]),
        ("KL term of the loss", ["loss/kl"]),
    ]),
    ("Reward and accuracy", [
        ("reward", ["reward/mean"]),
        ("prompt groups without reward spread (no signal)", ["reward/zero_spread_groups"]),
        *((f"{label} accuracy", [key]) for key, label in ACCURACY_KEYS),
    ]),
    ("Off-policy", [
        ("lag (policy versions)", ["lag/mean", "lag/max"]),
        ("importance ratios", ["is/ratio_min", "is/ratio_max"]),
        ("|log ratio| per token", ["is/abs_log_ratio_token_mean"]),
    ]),
    ("Learner", [
        ("gradient norm", ["grad/norm"]),
        ("loss", ["loss/total", "loss/task"]),
        ("policy entropy", ["policy/entropy"]),
        ("seconds per step", ["time/step"]),
    ]),
]
# The summary run's tables (dashboard.py logs them under these keys) and its figures' prefix.
VERDICT_TABLES = ("findings", "configurations", "final_accuracy")
GROUP_BY = tuple(k for k in FILTER_KEYS if k != "seed")


def _library():
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        from cluster.config.loader import ConfigError

        raise ConfigError("building a wandb workspace needs the wandb-workspaces library: "
                          "pip install -e '.[dashboard]'") from None
    return ws, wr


def build_workspace(entity: str, project: str, group: str | None = None,
                    logged: set[str] | None = None, figures: list[str] = ()):
    """The workspace (a `wandb_workspaces.workspaces.Workspace`, not saved) of `project`, its
    runs filtered to wandb group `group` (a sweep's name) when given. `logged`: the metric keys
    the runs logged; a panel whose keys they all lack is left out (None: every panel).
    `figures`: the summary run's figure keys (`figures/NAME`) for its media panel."""
    ws, wr = _library()
    grouping = [ws.Config(k) for k in GROUP_BY]
    sections = []
    for name, panels in CURVES:
        plots = [wr.LinePlot(title=title, x="Step", y=keys, groupby_aggfunc="mean",
                             groupby_rangefunc="minmax", smoothing_type="none")
                 for title, keys in panels if logged is None or set(keys) & logged]
        if logged is not None:  # keys none of the runs logged would draw empty lines
            for plot in plots:
                plot.y = [k for k in plot.y if k in logged]
        if plots:
            sections.append(ws.Section(name=name, panels=plots, is_open=True))
    verdict = [wr.WeavePanelSummaryTable(table_name=t) for t in VERDICT_TABLES]
    if figures:
        verdict.append(wr.MediaBrowser(title="the report's figures", media_keys=list(figures),
                                       num_columns=2))
    sections.append(ws.Section(name="Verdict (summary run)", panels=verdict, is_open=True))
    filters = ws.And(ws.Metric("Group") == group) if group is not None else ""
    return ws.Workspace(
        entity=entity, project=project, name=f"klrl: {group or project}", sections=sections,
        settings=ws.WorkspaceSettings(x_axis="Step", max_runs=100),
        runset_settings=ws.RunsetSettings(filters=filters, groupby=grouping))


def save_workspace(workspace) -> str:
    """Save `workspace` to the wandb server (online, with an API key); returns its URL."""
    return workspace.save().url


def logged_keys(runs_dir) -> set[str]:
    """Every metric key the runs under `runs_dir` (one run, or a directory of them) logged."""
    from pathlib import Path

    from cluster.train.run_log import has_metrics, read_metrics

    runs_dir = Path(runs_dir)
    runs = [runs_dir] if has_metrics(runs_dir) else [p for p in sorted(runs_dir.iterdir())
                                                      if has_metrics(p)]
    return {k for run in runs for row in read_metrics(run) for k in row}
