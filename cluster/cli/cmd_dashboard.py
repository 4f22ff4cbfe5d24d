"""`klrl dashboard DIR`: the wandb workspace of a sweep (or a project), built with
wandb-workspaces (cluster/publish/workspace.py): printed here, saved with --save."""
from __future__ import annotations

import sys
from pathlib import Path

from cluster.config.loader import ConfigError


def _run_dashboard(args) -> int:
    from cluster.publish.dashboard import report_figures, wandb_target
    from cluster.publish.workspace import build_workspace, logged_keys, save_workspace

    path = Path(args.dir)
    try:
        if not path.is_dir():
            raise ConfigError(f"{path}: no such directory; give a sweep's directory of runs")
        target = wandb_target(path) or {}
        keys = logged_keys(path)
        if not keys:
            raise ConfigError(f"{path}: no run with metrics here or directly inside")
        entity = args.entity or target.get("entity")
        project = args.project or target.get("project") or "klrl"
        report = path / "report" / "report.md"
        figures = ([f"figures/{png.stem}" for _, png in report_figures(report)]
                   if report.is_file() else [])
        group = None if args.whole_project else target.get("group")
        workspace = build_workspace(entity or "ENTITY", project, group, keys, figures)
        if args.save and entity is None:  # the default entity needs credentials: asked now
            entity = _default_entity()
            workspace.entity = entity
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"workspace {workspace.name!r} of {entity or '(your default entity)'}/{project}"
          + (f", runs of group {group!r}" if group else "")
          + f", grouped by {', '.join(str(g.name) for g in workspace.runset_settings.groupby)}")
    for section in workspace.sections:
        names = [getattr(p, "title", None) or getattr(p, "table_name", "") for p in section.panels]
        print(f"  {section.name}: {'; '.join(names)}")
    if not args.save:
        print("not saved (--save writes it to wandb; it needs wandb online and an API key)")
        return 0
    try:
        print(f"saved: {save_workspace(workspace)}")
    except Exception as exc:  # noqa: BLE001 - the server's refusal, in one line
        print(f"error: the workspace was not saved: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _default_entity() -> str:
    """The wandb entity of the logged-in user (ConfigError naming the fix without one)."""
    import wandb

    try:
        entity = wandb.Api().default_entity
    except Exception as exc:  # noqa: BLE001 - wandb's UsageError and its network errors alike
        raise ConfigError(f"--save: the runs name no wandb entity and wandb could not give your "
                          f"default one ({type(exc).__name__}: {str(exc)[:120]}); run `wandb "
                          "login` or set WANDB_API_KEY, or give --entity") from None
    if not entity:
        raise ConfigError("--save: the runs name no wandb entity and you have no default one; "
                          "give --entity")
    return entity


def register(subparsers) -> None:
    p = subparsers.add_parser("dashboard", help="the wandb workspace of a sweep: KL, reward, "
                              "accuracy, lag and importance ratios per configuration, and the "
                              "verdict", description=__doc__.split("\n")[0])
    p.add_argument("dir", help="a sweep's directory of runs (or one run)")
    p.add_argument("--entity", default=None, help="wandb entity (default: the runs' "
                   "logging.wandb_entity, else your default entity)")
    p.add_argument("--project", default=None, help="wandb project (default: the runs' "
                   "logging.wandb_project)")
    p.add_argument("--whole-project", action="store_true", help="every run of the project, not "
                   "only the sweep's group")
    p.add_argument("--save", action="store_true", help="save the workspace to wandb (online, "
                   "with an API key)")
    p.set_defaults(func=_run_dashboard)
