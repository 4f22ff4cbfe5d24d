"""`klrl report`: instability flags on synthetic series, grouping runs into configurations,
and the written report (markdown table, flags, PNGs) for a sweep and for a single run. The
runs are synthetic run directories (config.yaml + metrics.jsonl), which is all a report reads."""
import json
import math
from pathlib import Path

import pytest
import yaml

from cluster.analysis.report import (
    ReportConfig,
    accuracy_collapse,
    find_runs,
    group_runs,
    instability_flags,
    kl_blowup,
    load_run,
    write_report,
)

CFG = ReportConfig()


def write_run(run_dir: Path, estimator="k1", placement="reward", lag=0, seed=0, steps=40,
              kl=lambda s: 0.01 * s, acc=lambda s: 0.2 + 0.002 * s, finished=True, extra=None,
              beta=0.05):
    """A run directory like the controller's: config.yaml, metrics.jsonl (evaluations every 10
    steps and at step 0, merged into the step's row), final/config.json when finished."""
    run_dir.mkdir(parents=True)
    config = {"run_name": run_dir.name, "output_dir": str(run_dir.parent), "seed": seed,
              "total_steps": steps,
              "max_lag": lag, "kl": {"estimator": estimator, "placement": placement, "beta": beta},
              "learner": {"grad_clip": 1.0}, "logging": {"tags": [f"seed={seed}"]}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    rows = []
    for s in range(steps + 1):
        row = {"step": s}
        if s:
            row |= {"reward/mean": 0.1 + 0.005 * s + 0.01 * seed, "kl/pi_ref": kl(s),
                    "kl/pi_ref_k3": kl(s),
                    "is/ratio_max": 1 + 0.1 * lag, "is/ratio_min": 1 - 0.05 * lag, "lag/mean": lag,
                    "grad/norm": 2.0 + math.sin(s), "nonfinite": 0.0}
        if s % 10 == 0:
            row |= {"eval/in_domain/accuracy": acc(s), "eval/out_of_domain/accuracy": acc(s) / 2}
        row |= (extra or {}).get(s, {})
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (run_dir / "final").mkdir()
        (run_dir / "final" / "config.json").write_text("{}")
    return run_dir


def coloured_share(png: Path) -> float:
    """The share of a plot's pixels in colour (chroma above 60 of 255): the configurations'
    lines and bands. Axes, ticks, text and grid are grey, so an empty figure gives 0 (its
    palette PNG is as large as a drawn one's: a file size says nothing)."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as image:
        rgb = np.asarray(image.convert("RGB"), dtype=int)
    return float(((rgb.max(-1) - rgb.min(-1)) > 60).mean())


@pytest.mark.parametrize("values, expected_step", [
    ([0.2, 0.3, 0.25, 0.1, 0.05, 0.04], 30),   # falls below 0.5 x best (0.3) and stays
    ([0.2, 0.3, 0.1, 0.3, 0.28, 0.3], None),   # a dip that recovers
    ([0.3, 0.2, 0.16, 0.15], None),            # a slow decline that never halves
    ([0.04, 0.0, 0.0, 0.0], None),             # near zero: below collapse_min_peak, noise
    ([0.2, 0.3, 0.3, 0.3, 0.1, 0.1], 40),      # collapsed, confirmed by the last evaluation
    ([0.2, 0.3, 0.3, 0.3, 0.3, 0.1], None),    # one low last evaluation: not confirmed
])
def test_accuracy_collapse(values, expected_step):
    steps = [10 * i for i in range(len(values))]
    hit = accuracy_collapse(steps, values, CFG)
    assert (hit[0] if hit else None) == expected_step, hit


def test_accuracy_collapse_at_the_last_evaluation_counts_when_asked():
    values = [0.2, 0.3, 0.3, 0.3, 0.3, 0.1]
    steps = [10 * i for i in range(len(values))]
    assert accuracy_collapse(steps, values, ReportConfig(collapse_min_evals=1))[0] == 50
    assert accuracy_collapse(steps, [0.2, 0.3, 0.1, 0.1, 0.1],
                             ReportConfig(collapse_min_evals=4)) is None


def test_kl_blowup_grows_past_its_early_level_and_ignores_single_spikes():
    steps = list(range(1, 101))
    steady = [0.3 * s / 100 for s in steps]                   # trained KL: 0 -> 0.3
    assert kl_blowup(steps, steady, CFG) is None
    spiky = [v if s != 50 else 100.0 for s, v in zip(steps, steady)]  # one outlier batch
    assert kl_blowup(steps, spiky, CFG) is None
    blowing = [0.1 if s < 60 else 0.1 * 1.5 ** (s - 60) for s in steps]
    step, detail = kl_blowup(steps, blowing, CFG)
    # early level 0.1 -> threshold 2; 0.1 * 1.5^k > 2 first at k = 8, and the 5-step median
    # lags two steps behind
    assert step == 70 and "kl/pi_ref" in detail and "20 x early level 0.1" in detail
    assert kl_blowup(steps, steady, ReportConfig(kl_max=0.2))[0] == 69  # median 0.201 at 69
    assert kl_blowup(steps, steady, ReportConfig(kl_growth=2, kl_floor=0.01)) is not None


def test_flags_of_a_run(tmp_path):
    stable = load_run(write_run(tmp_path / "stable"))
    assert instability_flags(stable, CFG) == []
    bad = load_run(write_run(
        tmp_path / "bad", kl=lambda s: 0.05 if s < 20 else 5.0 * (s - 19),
        acc=lambda s: {0: 0.2, 10: 0.4, 20: 0.3}.get(s, 0.05),
        extra={33: {"nonfinite": 1.0, "grad/norm": "nan"}, 35: {"loss/total": "inf"}}))
    flags = {f.kind: f for f in instability_flags(bad, CFG)}
    assert set(flags) == {"accuracy collapse (in-domain)", "accuracy collapse (out-of-domain)",
                          "KL blow-up", "non-finite"}
    assert flags["accuracy collapse (in-domain)"].step == 30
    assert "(step 10)" in flags["accuracy collapse (in-domain)"].detail  # no problem count known
    # the evaluations' problem count makes a fall near zero read as the few problems it is
    config = yaml.safe_load((bad.dir / "config.yaml").read_text())
    (bad.dir / "config.yaml").write_text(yaml.safe_dump(config | {"eval": {"num_problems": 100}}))
    counted = {f.kind: f for f in instability_flags(load_run(bad.dir), CFG)}
    assert "(step 10; 40 -> 5 of 100 problems)" in counted["accuracy collapse (in-domain)"].detail
    assert flags["KL blow-up"].step == 22  # median of steps 18-22 = 5.0 * 1 > 20 x 0.05
    assert flags["non-finite"].step == 33 and "2 step(s)" in flags["non-finite"].detail
    assert "refused step" in flags["non-finite"].detail
    assert "grad/norm" in flags["non-finite"].detail


def test_replayed_steps_keep_the_later_row(tmp_path):
    run_dir = write_run(tmp_path / "resumed", steps=5)
    with open(run_dir / "metrics.jsonl", "a") as f:  # resumed from step 3's checkpoint
        f.writelines(json.dumps({"step": s, "reward/mean": 9.0}) + "\n" for s in (4, 5, 6))
        f.write('{"step": 7, "rew')  # cut by a crash
    run = load_run(run_dir)
    assert run.series("reward/mean")[0] == [1, 2, 3, 4, 5, 6]
    assert run.series("reward/mean")[1][3:] == [9.0, 9.0, 9.0] and run.last_step == 6


def test_runs_group_by_configuration_not_seed(tmp_path):
    for est, placement, lag in (("k1", "reward", 0), ("k1", "loss", 4)):
        for seed in (0, 1):
            write_run(tmp_path / f"{est}-{placement}-lag{lag}-s{seed}", est, placement, lag, seed)
    groups = group_runs(find_runs(tmp_path))
    assert list(groups) == ["k1-loss-lag4", "k1-reward-lag0"]
    assert [r.name for r in groups["k1-reward-lag0"]] == ["k1-reward-lag0-s0", "k1-reward-lag0-s1"]


def test_a_no_kl_control_is_labelled_with_its_beta(tmp_path):
    for lag in (0, 4):
        write_run(tmp_path / f"b0-lag{lag}", lag=lag, beta=0.0)
    assert list(group_runs(find_runs(tmp_path))) == ["k1-reward-b0-lag0", "k1-reward-b0-lag4"]


def test_plot_styles_colour_the_kl_configuration_and_dash_the_lag(tmp_path):
    import matplotlib.pyplot as plt

    from cluster.analysis.report_plots import _styles

    for est, placement, lag in (("k1", "reward", 0), ("k1", "reward", 4), ("k3", "loss", 0),
                                ("k3", "loss", 4)):
        write_run(tmp_path / f"{est}-{placement}-lag{lag}", est, placement, lag)
    styles = _styles(group_runs(find_runs(tmp_path)), plt)
    assert styles["k1-reward-lag0"][0] == styles["k1-reward-lag4"][0] != styles["k3-loss-lag0"][0]
    lag_styles = [styles[k][1] for k in ("k1-reward-lag0", "k1-reward-lag4", "k3-loss-lag4")]
    assert lag_styles == ["-", "--", "--"]


def test_report_of_a_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        write_run(sweep / f"k1-reward-lag0-s{seed}", seed=seed,
                  acc=lambda s, d=seed: 0.2 + 0.01 * s + 0.1 * d)
        write_run(sweep / f"k1-loss-lag4-s{seed}", "k1", "loss", 4, seed, finished=seed == 0,
                  kl=(lambda s: 0.05 * 1.3 ** s) if seed else (lambda s: 0.01 * s))
    report = write_report(sweep)
    assert report == sweep / "report" / "report.md"
    md = report.read_text()
    # final in-domain accuracy of k1-reward-lag0: 0.6 and 0.7 -> mean 0.650, sample std 0.071
    assert "| `k1-reward-lag0` | 2 | 40 | 0.650 ± 0.071 | 0.325 ± 0.035 | 0/2 |" in md
    assert "| `k1-loss-lag4` | 2 (1 unfinished) | 40 |" in md and "| 1/2 |" in md
    assert "| `k1-loss-lag4-s1` | KL blow-up |" in md
    # The legend defines every kind of flag the table can hold, the KL one as a distance.
    legend = next(line for line in md.splitlines() if line.startswith("Flags: "))
    for kind in ("accuracy collapse", "reward collapse", "gradient-norm blow-up", "non-finite",
                 "KL blow-up"):
        assert f"*{kind}*" in legend, kind
    assert "A KL blow-up is a distance, not an instability" in legend
    assert "labelled by `kl.estimator`, `kl.placement`, `max_lag`" in md
    for png in ("reward.png", "accuracy.png", "kl.png", "importance_ratio.png", "grad_norm.png"):
        assert coloured_share(sweep / "report" / png) > 0.001, png  # empty axes: 0
        assert f"]({png})" in md


def test_report_of_one_run_and_the_cli(tmp_path, capsys):
    from cluster.cli.main import main

    run_dir = write_run(tmp_path / "my-run", acc=lambda s: 0.4 if s < 30 else 0.1)
    assert main(["report", str(run_dir)]) == 0
    md = (run_dir / "report" / "report.md").read_text()
    assert "| `k1-reward` | 1 | 40 | 0.100 | 0.050 | 1/1 |" in md
    assert "| `my-run` | accuracy collapse (in-domain) | 30 |" in md
    assert main(["report", str(run_dir), "collapse_fraction=0.1"]) == 0
    assert "No run was flagged" in (run_dir / "report" / "report.md").read_text()
    assert main(["report", str(run_dir), "--out", str(tmp_path / "docs" / "page")]) == 0
    assert (tmp_path / "docs" / "page" / "report.md").read_text().startswith("# Report: my-run")
    assert (tmp_path / "docs" / "page" / "accuracy.png").is_file()
    assert main(["report", str(run_dir), "colapse_fraction=0.1"]) == 2
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "colapse_fraction" in capsys.readouterr().err


def test_an_unknown_kl_metric_fails_listing_the_logged_ones(tmp_path, capsys):
    from cluster.cli.main import main

    run_dir = write_run(tmp_path / "my-run")
    assert main(["report", str(run_dir), "kl_metric=kl/pi_rf"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("error: kl_metric='kl/pi_rf': no run logged it (did you mean "
                           "'kl/pi_ref'?); the KL metrics logged are kl/pi_ref, kl/pi_ref_k3")
    assert not (run_dir / "report").exists()
    assert main(["report", str(run_dir), "kl_metric=kl/pi_ref_k3", "smooth=1"]) == 0
    untrained = write_run(tmp_path / "new-run", steps=0)  # a sweep's run before its first step
    assert main(["report", str(untrained), "kl_metric=anything"]) == 0


def test_training_curves_can_be_placed_at_the_policy_version_that_sampled_them(tmp_path):
    from cluster.analysis.report_plots import FIGURES, _aggregate

    lag = 2
    extra = {s: {"rollout/policy_version": max(0, s - 1 - lag)} for s in range(1, 41)}
    run = load_run(write_run(tmp_path / "r", lag=lag, extra=extra))
    reward = FIGURES[0].panels[0]
    steps, _, _, _ = _aggregate([run], reward, 1, "step")
    versions, _, _, _ = _aggregate([run], reward, 1, "policy_version")
    assert steps[:4] == [1, 2, 3, 4] and versions[:3] == [0, 1, 2]  # steps 1-3 share version 0
    xs, _ = run.series("reward/mean", "policy_version")
    assert xs[:5] == [0, 0, 0, 1, 2]
    acc = FIGURES[1].panels[0]  # evaluations stay at the step whose weights they measured
    assert _aggregate([run], acc, 1, "policy_version")[0] == [0, 10, 20, 30, 40]
    with pytest.raises(ValueError):
        ReportConfig(x_axis="time")


def test_short_runs_are_drawn_unsmoothed_and_the_raw_values_stay_visible(tmp_path):
    """A moving-average window longer than the run would flatten its few steps into one line
    at their mean: the window shrinks with the run, and the raw values are drawn behind it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from cluster.analysis.report_plots import (
        FIGURES,
        _aggregate,
        effective_window,
        plot_figure,
        report_window,
    )

    # at most a fifth of the run, and odd: the centred window drawn is the one stated
    assert [effective_window(25, n) for n in (3, 10, 60, 300)] == [1, 1, 11, 25]
    rewards = {1: {"reward/mean": 0.117}, 2: {"reward/mean": 0.059}, 3: {"reward/mean": 0.113}}
    run = load_run(write_run(tmp_path / "short", steps=3, extra=rewards))
    window = report_window([run], 25)
    assert _aggregate([run], FIGURES[0].panels[0], window)[1] == [0.117, 0.059, 0.113]

    long = load_run(write_run(tmp_path / "long", steps=40))
    drawn = []
    real_subplots = Figure.subplots

    def keep_axes(*args, **kwargs):
        axes = real_subplots(*args, **kwargs)
        drawn.append(axes)
        return axes

    Figure.subplots = keep_axes
    try:
        assert plot_figure(FIGURES[0], {"k1": [long]}, [long], CFG, tmp_path) == "reward.png"
    finally:
        Figure.subplots = real_subplots
    ax = drawn[0].flat[0]
    raw, smoothed = ax.get_lines()[:2]
    assert list(raw.get_ydata()) == [long.rows[s]["reward/mean"] for s in range(1, 41)]
    assert raw.get_alpha() < 1 and smoothed.get_alpha() is None  # faint behind, full in front
    assert list(smoothed.get_ydata()) != list(raw.get_ydata())
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_ratio_axes_near_1_are_linear_with_readable_labels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cluster.analysis.report_plots import FIGURES, _style_axis

    ratio_max = FIGURES[3].panels[0]
    fig, (near, far) = plt.subplots(1, 2)
    near.plot([1, 2, 3], [0.99995, 1.0, 1.00005])
    _style_axis(near, ratio_max, (0.99995, 1.00005), [1.0], None, set())
    far.plot([1, 2, 3], [0.01, 1.0, 18.0])
    _style_axis(far, ratio_max, (0.01, 18.0), [1.0], None, set())
    fig.canvas.draw()
    labels = [t.get_text() for t in near.get_yticklabels() if t.get_text()]
    assert near.get_yscale() == "linear" and len(set(labels)) == len(labels) > 2
    assert "1" in labels and near.yaxis.get_offset_text().get_text() == ""
    assert far.get_yscale() == "log"
    plt.close(fig)


def test_pass_at_k_is_drawn_where_runs_logged_it(tmp_path):
    """A panel per set and k above 1 that a run logged (pass@1 is the sampled accuracy); no
    figure where none did."""
    from cluster.analysis.report_plots import pass_at_k_figure

    plain = write_run(tmp_path / "plain" / "r")
    assert pass_at_k_figure([load_run(plain)]).panels == ()
    extra = {s: {f"eval/{name}/pass@{k}": 0.2 + 0.01 * s * k
                 for name in ("in_domain", "out_of_domain") for k in (1, 2, 4)}
             for s in range(0, 41, 10)}
    run = load_run(write_run(tmp_path / "sweep" / "r", extra=extra))
    fig = pass_at_k_figure([run])
    assert [p.key for p in fig.panels] == ["eval/in_domain/pass@2", "eval/in_domain/pass@4",
                                           "eval/out_of_domain/pass@2",
                                           "eval/out_of_domain/pass@4"]
    md = write_report(tmp_path / "sweep").read_text()
    assert "](pass_at_k.png)" in md and (tmp_path / "sweep" / "report" / "pass_at_k.png").is_file()


def test_the_episode_figure_is_drawn_only_for_runs_with_an_environment(tmp_path):
    """docs/multi-turn.md's env/ metrics get a figure of their own in `klrl report`, and a
    single-turn run's report has none."""
    import matplotlib

    matplotlib.use("Agg")
    from cluster.analysis.report_plots import FIGURES, plot_figure

    episodes = next(f for f in FIGURES if f.file == "episodes.png")
    env = {s: {"env/turns_mean": 1 + s / 40, "env/tool_call_rate": s / 40,
               "env/truncated_turns_frac": 0.1, "env/truncated_length_frac": 0.0,
               "env/seconds_mean": 0.01, "env/failure_share": 0.0} for s in range(1, 41)}
    multi = load_run(write_run(tmp_path / "multi", extra=env))
    single = load_run(write_run(tmp_path / "single"))
    assert plot_figure(episodes, {"k1": [multi]}, [multi], CFG, tmp_path) == "episodes.png"
    assert plot_figure(episodes, {"k1": [single]}, [single], CFG, tmp_path / "x") is None
