"""The sweep's dashboard in wandb (cluster/publish/dashboard.py): `klrl report` on a
directory of runs logs one summary run in the runs' project and group, offline, and what it
recorded is read back from its files (tests/wandb_records.py), as `wandb sync` would upload it.
The runs are synthetic run directories (tests/test_report.py's `write_run`)."""
import csv
import json

import pytest
import yaml
from test_report import write_run
from wandb_records import config, history, records, run_record

from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG
from cluster.publish.dashboard import configuration_measures, report_figures, report_tables

# One xdist worker runs this module: its module fixture writes a report and starts wandb
# (about 4 s), and spread over both workers, each worker did it again.
pytestmark = pytest.mark.xdist_group("test_dashboard")


def _sweep(root, mode="offline"):
    for seed in (0, 1):
        write_run(root / f"k1-reward-lag0-s{seed}", seed=seed)
        write_run(root / f"k3-loss-lag4-s{seed}", "k3", "loss", 4, seed,
                  kl=(lambda s: 0.05 * 1.3 ** s) if seed else (lambda s: 0.01 * s))
    for run in root.iterdir():  # as a sweep sets them: the group, a project, the mode
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["logging"] |= {"wandb_group": "grid", "wandb_project": "klrl-test",
                           "wandb_mode": mode}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root


@pytest.fixture(scope="module")
def summarised(tmp_path_factory):
    """A sweep of synthetic runs and `klrl report` on it: its summary run (one wandb start,
    shared by the tests below)."""
    import contextlib
    import io
    import os

    sweep = _sweep(tmp_path_factory.mktemp("dashboard") / "grid")
    mode = os.environ.pop("WANDB_MODE", None)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["report", str(sweep)]) == 0
    finally:
        if mode is not None:
            os.environ["WANDB_MODE"] = mode
    return sweep, printed.getvalue()


def test_report_logs_one_offline_summary_run_with_its_tables_charts_and_figures(summarised):
    sweep, printed = summarised
    offline = list((sweep / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, offline
    assert f"wandb sync {offline[0]}" in printed

    run = run_record(offline[0])
    assert (run.project, run.run_group, run.job_type) == ("klrl-test", "grid", "summary")
    assert config(run)["summary_of"] == "grid"
    logged = history(offline[0])
    report = sweep / "report" / "report.md"
    tables = report_tables(report)
    assert {"final_accuracy", "instability_flags", "runs"} <= tables.keys()
    for key, table in tables.items():  # each table of report.md, its rows as the report shows
        if not table.rows:
            assert key not in logged, key
            continue
        ref = logged[key]
        assert ref["_type"] == "table-file", ref
        data = json.loads((offline[0] / "files" / ref["path"]).read_text())
        assert data["columns"] == table.columns and data["data"] == table.rows, key
    final = {row[0]: row for row in tables["final_accuracy"].rows}
    assert final["k1-reward-lag0"][1] == "2"

    measures = logged["configurations"]
    data = json.loads((offline[0] / "files" / measures["path"]).read_text())
    assert data["columns"][:2] == ["configuration", "runs"]
    with (sweep / "report" / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    by = {row[0]: dict(zip(data["columns"], row, strict=True)) for row in data["data"]}
    for label in by:  # the mean over the configuration's runs, of a column of runs.csv
        kl_end = [float(r["kl_end"]) for r in rows if r["configuration"] == label]
        assert by[label]["runs"] == 2 and abs(by[label]["kl_end"] - sum(kl_end) / 2) < 1e-9
    charts = {tuple(i.nested_key)[2:]: json.loads(i.value_json) for r in records(offline[0])
              if r.WhichOneof("record_type") == "config" for i in r.config.update
              if tuple(i.nested_key)[:2] == ("_wandb", "visualize")}
    bar = charts[("charts/kl_end",)]  # a bar chart per measure, by configuration, of its table
    assert bar["panel_config"]["fieldSettings"] == {"label": "configuration", "value": "kl_end"}
    assert logged["charts/kl_end_table"]["path"] == measures["path"]

    figures = report_figures(report)
    assert len(figures) >= 4
    for title, png in figures:
        image = logged[f"figures/{png.stem}"]
        assert image["_type"] == "image-file" and image["caption"] == title
        assert (offline[0] / "files" / image["path"]).stat().st_size > 10_000


def test_no_summary_for_runs_without_wandb_or_when_asked(summarised, tmp_path, monkeypatch):
    from cluster.publish.dashboard import log_summary

    monkeypatch.delenv("WANDB_MODE", raising=False)
    sweep, _ = summarised
    quiet = _sweep(tmp_path / "quiet", mode="disabled")
    assert log_summary(quiet, sweep / "report" / "report.md") is None
    assert not (quiet / "wandb").exists()
    asked = _sweep(tmp_path / "grid")
    assert main(["report", str(asked), "--no-wandb"]) == 0
    assert (asked / "report" / "report.md").is_file() and not (asked / "wandb").exists()


def test_measures_average_each_configuration_and_tables_keep_their_cells(tmp_path):
    (tmp_path / "runs.csv").write_text(
        "run,configuration,seed,finished,kl_end,final_in_domain,broken\n"
        "a,k1,0,True,1.0,0.5,\n"
        "b,k1,1,True,3.0,,KL blow-up at step 4\n"
        "c,k3,0,True,2.0,0.25,\n")
    table = configuration_measures(tmp_path / "runs.csv")
    assert table.columns == ["configuration", "runs", "broken", "kl_end", "final_in_domain"]
    assert table.rows == [["k1", 2, 1, 2.0, 0.5], ["k3", 1, 0, 2.0, 0.25]]
    (tmp_path / "report.md").write_text(
        "# Report\n\n## Findings\n\n| claim | verdict |\n|---|---|\n"
        "| K1 `loss` \\| off-policy | **reproduced** |\n\n## Plots\n\n![KL](kl.png)\n")
    tables = report_tables(tmp_path / "report.md")
    assert tables["findings"].columns == ["claim", "verdict"]
    assert tables["findings"].rows == [["K1 loss | off-policy", "reproduced"]]
    assert report_figures(tmp_path / "report.md") == []  # kl.png is not there


def test_workspace_groups_by_configuration_and_shows_the_summary_runs_keys(summarised, capsys):
    """The workspace built with wandb-workspaces (not saved: that needs a wandb server): runs
    of the sweep's group, grouped by the flat config keys but the seed, a line plot per metric
    the runs logged, and the verdict panels on keys the summary run really logged."""
    pytest.importorskip("wandb_workspaces", reason="the `dashboard` extra is not installed")
    from cluster.publish.workspace import build_workspace, logged_keys
    from cluster.train.run_log import FILTER_KEYS

    sweep, _ = summarised
    summary = history(next((sweep / "wandb").glob("offline-run-*")))
    figures = [k for k in summary if k.startswith("figures/")]
    runs = logged_keys(sweep)
    workspace = build_workspace("team", "klrl-test", "grid", runs, figures)

    assert [g.name for g in workspace.runset_settings.groupby] == [
        k for k in FILTER_KEYS if k != "seed"]
    assert str(workspace.runset_settings.filters) == "Metric(\"Group\") == 'grid'"
    sections = {s.name: s.panels for s in workspace.sections}
    plotted = {k for name, panels in sections.items() if name.startswith("Verdict") is False
               for p in panels for k in p.y}
    assert plotted <= runs and {"kl/pi_ref", "kl/pi_ref_k3", "reward/mean", "lag/mean",
                                "is/ratio_max", "eval/in_domain/accuracy"} <= plotted
    verdict = sections["Verdict (summary run)"]
    tables = [p.table_name for p in verdict if hasattr(p, "table_name")]
    assert tables and set(tables) <= summary.keys()  # each one a table the summary logged
    media = next(p for p in verdict if hasattr(p, "media_keys"))
    assert sorted(media.media_keys) == sorted(figures) and len(figures) >= 4
    view = workspace._to_model()  # what save() would send, made without a server
    assert view.project == "klrl-test" and view.display_name == "klrl: grid"

    assert main(["dashboard", str(sweep)]) == 0  # the command prints the layout, saves nothing
    out = capsys.readouterr().out
    assert "runs of group 'grid'" in out and "not saved" in out and "KL to the reference" in out


def test_save_without_an_entity_or_credentials_is_refused_before_anything(
        summarised, tmp_path, capsys, monkeypatch):
    """--save with no entity in the runs and none given needs the logged-in user's: without
    wandb credentials that is a mistake seen before the start (exit 2, the fix named), not
    wandb's traceback or a login prompt."""
    pytest.importorskip("wandb_workspaces", reason="the `dashboard` extra is not installed")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    sweep, _ = summarised
    assert main(["dashboard", str(sweep), "--save"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --save:") and "--entity" in err[0], err
    assert "workspace" not in captured.out  # refused before the layout was even printed


def test_the_end_of_a_sweep_logs_its_summary_run(tmp_path, capsys, monkeypatch):
    """`klrl sweep`'s last act (`_summarise`, after its runs) writes the report and logs the
    summary run, as `klrl report` does."""
    from cluster.cli.cmd_sweep import _summarise
    from cluster.sweeps.sweep import SweepConfig, expand
    from cluster.sweeps.sweep_run import Outcome

    monkeypatch.delenv("WANDB_MODE", raising=False)
    _sweep(tmp_path / "grid")
    cfg = SweepConfig.model_validate({"name": "grid", "train_config": str(DEMO_CONFIG),
                                      "output_dir": str(tmp_path),
                                      "grid": {"seed": [0, 1]}})
    runs = expand(cfg)
    assert _summarise(cfg, runs, [Outcome(r, "finished") for r in runs], None, write=True) == 0
    offline = list((tmp_path / "grid" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and f"wandb sync {offline[0]}" in capsys.readouterr().out
    run = run_record(offline[0])
    assert (run.run_group, run.job_type) == ("grid", "summary")
    assert "findings" in history(offline[0])
