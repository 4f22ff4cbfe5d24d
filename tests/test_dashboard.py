"""The sweep's dashboard in wandb (cluster/experiments/dashboard.py): `klrl report` on a
directory of runs logs one summary run in the runs' project and group, offline, and what it
recorded is read back from its files (tests/wandb_records.py), as `wandb sync` would upload it.
The runs are synthetic run directories (tests/test_report.py's `write_run`)."""
import csv
import json

import yaml
from test_report import write_run
from wandb_records import config, history, records, run_record

from cluster.cli.main import main
from cluster.experiments.dashboard import configuration_measures, report_figures, report_tables


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


def test_report_logs_one_offline_summary_run_with_its_tables_charts_and_figures(
        tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sweep = _sweep(tmp_path / "grid")
    assert main(["report", str(sweep)]) == 0
    printed = capsys.readouterr().out
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


def test_no_summary_for_runs_without_wandb_or_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sweep = _sweep(tmp_path / "quiet", mode="disabled")
    assert main(["report", str(sweep)]) == 0
    assert not (sweep / "wandb").exists()
    sweep = _sweep(tmp_path / "grid")
    assert main(["report", str(sweep), "--no-wandb"]) == 0
    assert not (sweep / "wandb").exists()


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
