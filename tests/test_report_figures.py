"""The figures of `klrl report` as a paper would use them, and reports comparing runs. Every
figure a report writes keeps its text (titles, labels, ticks, legend) inside its canvas, is a
column or a page wide, prints plain numbers on its axes, tells overlapping bands apart, and
states the moving-average window it draws; `klrl report A B ...` compares run directories,
each labelled by the config keys that differ (bookkeeping keys aside). Synthetic run
directories (config.yaml + metrics.jsonl: all a report reads), drawn with real matplotlib."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from matplotlib.figure import Figure
from test_report import write_run

from cluster.cli.main import main
from cluster.analysis.report import ReportConfig, gather_runs, group_runs, write_report
from cluster.analysis import report_plots
from cluster.analysis.report_plots import COLUMN_WIDTH_IN, PAGE_WIDTH_IN

# One xdist worker runs this module: its module fixture writes four reports (about 9 s), and
# spread over both workers, each worker wrote them again.
pytestmark = pytest.mark.xdist_group("test_report_figures")


@dataclass
class Drawn:
    """A saved figure, and what it drew: matplotlib's tight bounding box (every artist: titles,
    tick and axis labels, the legend) and the canvas, in inches, as laid out when saved."""
    figure: Figure
    tight: object
    canvas: object


@pytest.fixture(scope="module")
def saved():
    """Every figure the report saves (report_plots.save_png, its one way to a file) while this
    module's tests run: its path -> Drawn."""
    figures: dict[Path, Drawn] = {}
    real = report_plots.save_png

    def keep(fig, path):
        real(fig, path)
        tight = fig.get_tightbbox(fig.canvas.get_renderer())
        figures[Path(path)] = Drawn(fig, tight, fig.bbox_inches)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report_plots, "save_png", keep)
        yield figures


def drawn(saved: dict, report: Path, name: str) -> Figure:
    """The figure saved as `name` beside report.md."""
    return saved[report.parent / name].figure


def set_config(run_dir: Path, **changes) -> Path:
    """Change keys of a run's config.yaml (dotted keys, e.g. learner.lr=1e-3)."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


OFF_POLICY = {"is/tis_clipped_frac": 0.01, "is/truncated_frac": 0.02,
              "is/ppo_clip_clipped_frac": 0.0, "kl/mu_ref": 0.01}


def many_configurations(root: Path) -> Path:
    """A sweep of eight configurations with long labels (five keys differ), two seeds each,
    KL on a narrow range (0.0101-0.0105), off-policy metrics (six importance-ratio panels)."""
    for i in range(8):
        for seed in (0, 1):
            run = write_run(root / f"c{i}-s{seed}", estimator=("k1", "k3")[i % 2],
                            placement=("reward", "loss")[i // 2 % 2], lag=4 * (i // 4),
                            seed=seed, steps=20, extra=dict.fromkeys(range(1, 21), OFF_POLICY),
                            kl=lambda s, i=i: 0.0101 + 0.00005 * i + 1e-6 * s)
            set_config(run, **{"learner.lr": 10.0 ** -(6 - i % 3), "kl.importance": "prefix",
                               "kl.truncate": 2.0 + i, "rollout.temperature": 0.7 + 0.1 * i})
    return root


def lora_and_full(root: Path) -> tuple[Path, Path]:
    """Two runs as `klrl train` leaves them: one full, one LoRA, differing in bookkeeping
    (checkpoint_every, the adapter's save_merged) besides what they train."""
    full = set_config(write_run(root / "r2", steps=30), **{"learner.lora": None,
                                                           "checkpoint_every": 0})
    lora = set_config(write_run(root / "r3", steps=30, kl=lambda s: 0.02 * s),
                      **{"learner.lora": {"rank": 16, "alpha": None, "dropout": 0.0,
                                          "save_merged": False}, "learner.lr": 1e-3,
                         "checkpoint_every": 50})
    set_config(full, **{"learner.lr": 1e-6})
    return full, lora


def dose_sweep(root: Path) -> Path:
    """K1 in the loss and K1 in the reward at max_lag 0, 2 and 8 (beta 0.05), three seeds
    each; K1 in the loss collapses at 8 (its accuracy falls to 0.02 from step 20) and drifts
    further with the lag. K1 in the reward also at beta 0.005 and 0.3 at max_lag 8, beside
    the no-KL control there, which ends furthest from the reference."""
    from test_findings import COLLAPSE

    for place in ("loss", "reward"):
        for lag in (0, 2, 8):
            for seed in (0, 1, 2):
                broken = place == "loss" and lag == 8
                write_run(root / f"{place}-lag{lag}-s{seed}", placement=place, lag=lag,
                          seed=seed, kl=lambda s, lag=lag: 0.01 * s * (1 + lag / 4),
                          **({"acc": COLLAPSE} if broken else {}))
    for beta in (0.005, 0.3, 0.0):
        for seed in (0, 1, 2):
            write_run(root / f"b{beta}-s{seed}", lag=8, seed=seed, beta=beta,
                      kl=lambda s, beta=beta: 0.05 * s / (1 + 10 * beta))
    return root


@pytest.fixture(scope="module")
def reports(tmp_path_factory, saved):
    """Four reports, written once for this module's tests: a sweep of many configurations,
    two runs compared through the command line, one short run, and a sweep over three lags."""
    root = tmp_path_factory.mktemp("reports")
    full, lora = lora_and_full(root / "runs")
    assert main(["report", str(full), str(lora), "smooth=3"]) == 0
    return {"many": write_report(many_configurations(root / "many")),
            "pair": root / "runs" / "report-r2-vs-r3" / "report.md",
            "single": write_report(write_run(root / "short", steps=3)),
            "dose": write_report(dose_sweep(root / "dose"))}


def test_every_figure_keeps_its_text_inside_a_canvas_a_paper_can_hold(reports, saved):
    """matplotlib's tight bounding box (every artist drawn: titles, tick and axis labels, the
    legend) lies within the figure's own, for every figure of three reports: many long labels,
    a comparison of two runs, and one short run (its one-panel figures a column wide)."""
    checked = 0
    for report in reports.values():
        written = sorted(report.parent.glob("*.png"))
        assert written and set(written) <= set(saved)
        for path in written:
            fig, tight, canvas = saved[path].figure, saved[path].tight, saved[path].canvas
            assert (tight.x0 >= -0.01 and tight.y0 >= -0.01 and tight.x1 <= canvas.x1 + 0.01
                    and tight.y1 <= canvas.y1 + 0.01), (
                f"{report.parent.name}/{path.name}: text leaves the canvas: drawn "
                f"{tight.bounds}, canvas {canvas.bounds} (inches)")
            assert fig.get_figwidth() in (COLUMN_WIDTH_IN, PAGE_WIDTH_IN), path
            for ax in fig.axes:
                if ax.get_visible():
                    ticks = [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
                    assert not any("times" in t or "^" in t for t in ticks), (path, ticks)
            checked += 1
    assert checked >= 15


def test_the_dose_response_figure_shows_breaking_distance_and_accuracy_per_dose(reports, saved):
    """A sweep over three lags gets the dose-response figure: K1 in the loss's break rate
    rises to 3/3 at max_lag 8 (the median step of breaking beside it), its KL at the end
    grows with the lag, its accuracy falls; a sweep over two lags gets none."""
    fig = drawn(saved, reports["dose"], "dose_response.png")
    rate, kl, accuracy = fig.axes[:3]
    rates = {c.get_label(): list(c.lines[0].get_ydata()) for c in rate.containers}
    assert rates == {"K1 in loss, beta 0.05": [0, 0, 1], "K1 in reward, beta 0.05": [0, 0, 0]}
    assert any(t.get_text().startswith("step ") for t in rate.texts)
    assert [t.get_text() for t in rate.get_xticklabels()] == ["0", "2", "8"]
    means = [line for line in kl.get_lines() if len(line.get_ydata()) == 3]
    assert any(list(m.get_ydata()) == sorted(m.get_ydata()) and m.get_ydata()[2] >
               1.5 * m.get_ydata()[0] for m in means)
    assert any(m.get_ydata()[2] < 0.1 < m.get_ydata()[0] for m in accuracy.get_lines()
               if len(m.get_ydata()) == 3)
    assert "![Dose-response: breaking, distance and accuracy](dose_response.png)" in \
        reports["dose"].read_text()
    assert not (reports["many"].parent / "dose_response.png").exists()
    # against beta: K1 in the reward at max_lag 8, and the no-KL control there as a level
    beta_rate = fig.axes[3]
    assert [t.get_text() for t in beta_rate.get_xticklabels()] == ["0.005", "0.05", "0.3"]
    assert {c.get_label() for c in beta_rate.containers} == {"K1 in reward, max_lag 8"}
    assert [line.get_label() for line in beta_rate.get_lines()
            if line.get_label() == "no KL, max_lag 8"]


def test_a_narrow_kl_range_is_labelled_in_plain_numbers(reports, saved):
    """KL at the end from 0.0101 to 0.0105: a log axis would print 1.01x10^-2 at each tick;
    less than a decade is drawn linear, with plain labels and no offset."""
    ax = drawn(saved, reports["many"], "accuracy_vs_kl.png").axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert ax.get_xscale() == "linear" and "log scale" not in ax.get_xlabel()
    assert len(labels) >= 3 and all(0.01 <= float(t) <= 0.0106 for t in labels), labels
    assert ax.xaxis.get_offset_text().get_text() == ""


def test_overlapping_bands_are_told_apart(reports, saved):
    """Eight configurations whose seeds span the same reward band: each band has a hatch of
    its own (one colour over another would read as a third), and the legend shows each
    configuration's band with its line."""
    fig = drawn(saved, reports["many"], "reward.png")
    hatches = [c.get_hatch() for c in fig.axes[0].collections]
    assert len(hatches) == 8 and len(set(hatches)) == 8 and None not in hatches
    legend = fig.legends[0]
    assert len(legend.get_texts()) == 8 and "band: min to max" in legend.get_title().get_text()
    assert {h.get_hatch() for h in legend.legend_handles} == set(hatches)


def test_the_window_the_report_states_is_the_one_drawn(tmp_path, saved):
    """smooth=4 on 30 steps: a centred window is odd, so 3 steps are drawn, and report.md and
    the figure both say 3; a 12-step run (a fifth of it: 2, so 1) is drawn raw and says so."""
    run = write_run(tmp_path / "long", steps=30,
                    extra={s: {"reward/mean": float(s % 2)} for s in range(1, 31)})
    report = write_report(run, ReportConfig(smooth=4))
    assert "centred moving averages over 3 steps" in report.read_text()
    fig = drawn(saved, report, "reward.png")
    assert "3-step centred moving average" in " ".join(
        fig.legends[0].get_title().get_text().split())
    raw, smoothed = fig.axes[0].get_lines()[:2]
    ys = list(smoothed.get_ydata())
    assert ys[1] == pytest.approx((1 + 0 + 1) / 3) and ys[2] == pytest.approx((0 + 1 + 0) / 3)
    assert list(raw.get_ydata()) == [float(s % 2) for s in range(1, 31)]
    report = write_report(write_run(tmp_path / "short", steps=12), ReportConfig(smooth=5))
    assert "Per-step curves are the raw values" in report.read_text()
    assert "moving average" not in drawn(saved, report, "reward.png").legends[0].get_title(
        ).get_text()


def test_klrl_report_compares_runs_labelled_by_what_differs(reports, tmp_path, capsys):
    """`klrl report runs/r2 runs/r3`: one report of both, beside them; each run labelled by
    the keys that differ in what it trains (LoRA on or off, the learning rate), never by
    bookkeeping (checkpoint_every, the adapter's save_merged), a LoRA section one key."""
    md = reports["pair"].read_text()
    assert md.startswith("# Report: r2 vs r3")
    assert "labelled by `kl.estimator`, `kl.placement`, `learner.lora`, `learner.lr`," in md
    assert "| `r2` | `k1-reward-lora_off-lr1e-06` |" in md
    assert "| `r3` | `k1-reward-lora_on-lr0.001` |" in md
    assert "checkpoint_every" not in md and "save_merged" not in md and "rank" not in md
    run = reports["pair"].parents[1] / "r2"
    assert main(["report", str(run), str(tmp_path / "nothing-here")]) == 2
    assert "nothing-here: no such directory" in capsys.readouterr().err
    assert main(["report", "smooth=3"]) == 2
    assert "give a run directory" in capsys.readouterr().err


def test_runs_of_the_same_name_from_two_sweeps_are_told_apart(tmp_path):
    """The same grid point in two sweeps (the same name), compared: each keeps its sweep's
    name; the LoRA rank is named when the LoRA runs differ in it, save_merged never."""
    for sweep, rank in (("a", 8), ("b", 16)):
        set_config(write_run(tmp_path / sweep / "k1-reward-s0"),
                   **{"learner.lora": {"rank": rank, "save_merged": sweep == "a"}})
    runs = gather_runs([tmp_path / "a", tmp_path / "b", tmp_path / "a"])  # each run once
    assert [r.name for r in runs] == ["a/k1-reward-s0", "b/k1-reward-s0"]
    assert list(group_runs(runs)) == ["k1-reward-rank_16", "k1-reward-rank_8"]
