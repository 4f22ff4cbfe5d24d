"""The report's dose-response figure: for each KL configuration run at three or more lags (one
beta) or three or more betas (one lag), how often it broke, how far it ended from the
reference and how accurate it ended, against that dose. The findings' dose claims test the
break rate's trend (dose.breaks_with_dose); the KL and the accuracy are the continuous
outcomes beside it, since a configuration that never breaks can still move further from the
reference, and forget more, as the lag grows or beta falls.

Doses sit at evenly spaced positions labelled with their values, as the trend test ranks
them (0, 1, 2, ...). Every finished run counts (a broken one too: its KL and accuracy say how
it broke)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from cluster.analysis import stats
from cluster.analysis.arms import Arm, Study, arm_name
from cluster.analysis.labels import SET_LABELS
from cluster.analysis.report_plots import (
    FONT,
    Figure,
    finish_figure,
    log_or_linear,
    new_figure,
)

MIN_DOSES = 3  # a trend needs three doses; two are a comparison the claims table makes
ACCURACY_SETS = ("in_domain", "retained")  # the set a run learns, and the one it can forget
_SET_STYLE = {"in_domain": "-", "retained": "--"}

DOSE_RESPONSE = Figure(
    "dose_response.png", "Dose-response: breaking, distance and accuracy",
    "For each KL configuration run at three or more lags (one beta) or three or more betas "
    "(one lag): the share of its finished runs that broke under the failure definition, with "
    "its 95% upper bound (Clopper-Pearson; the median step of breaking beside a point where "
    "runs broke); its KL(pi || pi_ref) at the end (geometric mean, each run a faint point); and "
    "its final greedy accuracy (mean, each run a faint point; in-domain solid, retained "
    "dashed where evaluated). Doses are evenly spaced, as the trend test ranks them; the "
    "configurations sit side by side at each. Against beta, the no-KL control at the same lag "
    "(beta 0, where every beta series tends) is a grey dotted level where the sweep ran it.",
    ())


@dataclass(frozen=True)
class Series:
    """One configuration's arms over the doses of one setting, the other setting fixed."""

    configuration: str            # the arm's name without its beta and lag, e.g. "K1 in loss"
    over: str                     # "max_lag" or "beta"
    fixed: float                  # the other setting's value
    doses: tuple[float, ...]
    arms: tuple[Arm, ...]

    @property
    def label(self) -> str:
        other = f"beta {self.fixed:g}" if self.over == "max_lag" else f"max_lag {self.fixed:g}"
        return f"{self.configuration}, {other}"


def dose_series(study: Study) -> list[Series]:
    """Every configuration (estimator, placement, importance; the no-KL control over the lag)
    with arms at MIN_DOSES or more lags at one beta, or betas > 0 at one lag."""
    by_config: dict[tuple, dict[tuple[float, int], Arm]] = {}
    for (est, place, imp, beta, lag), arm in study.arms.items():
        by_config.setdefault((est, place, imp), {})[(beta, lag)] = arm
    out = []
    for (est, place, imp), arms in by_config.items():
        name = arm_name((est, place, imp, 0.0, 0))
        for beta in sorted({b for b, _ in arms}):
            lags = sorted(lg for b, lg in arms if b == beta)
            if len(lags) >= MIN_DOSES:
                out.append(Series(name, "max_lag", beta, tuple(map(float, lags)),
                                  tuple(arms[(beta, lg)] for lg in lags)))
        for lag in sorted({lg for _, lg in arms}):
            betas = sorted(b for b, lg in arms if lg == lag and b > 0)
            if len(betas) >= MIN_DOSES:
                out.append(Series(name, "beta", lag, tuple(betas),
                                  tuple(arms[(b, lag)] for b in betas)))
    return out


def plot_dose_response(study: Study, out_dir: Path) -> str | None:
    """Draw DOSE_RESPONSE into out_dir: a row per setting some configuration ran at
    MIN_DOSES doses of (the lag, beta), three panels each. None when none did."""
    series = dose_series(study)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [over for over in ("max_lag", "beta") if any(s.over == over for s in series)]
    names = sorted({s.configuration for s in series})
    colours = dict(zip(names, plt.get_cmap("tab10").colors))
    with plt.rc_context(FONT):
        controls = _controls(study, [s for s in series if s.over == "beta"])  # beta row only
        fig, axes = new_figure(plt, 3 * len(rows), [s.label for s in series]
                               + [f"no KL, max_lag {lag:g}" for lag, _ in controls])
        for row, over in enumerate(rows):
            doses = sorted({d for s in series if s.over == over for d in s.doses})
            where = {d: i for i, d in enumerate(doses)}
            drawn = [s for s in series if s.over == over]
            row_controls = controls if over == "beta" else []
            for i, s in enumerate(drawn):  # side by side at each dose, so bars do not hide
                shift = (i - (len(drawn) - 1) / 2) * min(0.08, 0.4 / len(drawn))
                _draw(axes[row], s, [where[d] + shift for d in s.doses],
                      colours[s.configuration])
            for lag, control in row_controls:
                _draw_control(axes[row], control, f"no KL, max_lag {lag:g}")
            for ax in axes[row]:
                ax.set_xticks(range(len(doses)), [f"{d:g}" for d in doses])
                ax.set_xlabel("max_lag" if over == "max_lag" else "beta (kl.beta)")
                ax.grid(True, alpha=0.3)
            axes[row][0].set_ylim(-0.03, 1.03)
            axes[row][0].set_title("Break rate")
            axes[row][0].set_ylabel("share of runs broken")
            kls = [v for a in [a for s in drawn for a in s.arms] + [c for _, c in row_controls]
                   for v in a.kl_end if math.isfinite(v) and v > 0]
            log = bool(kls) and log_or_linear(axes[row][1].yaxis, axes[row][1].set_yscale,
                                              min(kls), max(kls))
            axes[row][1].set_title("KL at the end")
            axes[row][1].set_ylabel("KL(pi || ref) at the end (nats per sequence"
                                    + (", log scale)" if log else ")"))
            axes[row][2].set_title("Final accuracy")
            axes[row][2].set_ylabel("final greedy accuracy")
        for ax in axes.flat[3 * len(rows):]:
            ax.set_visible(False)
        sets = [SET_LABELS[k] for k in ACCURACY_SETS
                if any(s.arms[0].accuracy.get(k) for s in series)]
        finish_figure(fig, axes, DOSE_RESPONSE.title,
                      "accuracy: " + ", ".join(f"{label} {'solid' if i == 0 else 'dashed'}"
                                               for i, label in enumerate(sets)),
                      out_dir / DOSE_RESPONSE.file, plt)
    return DOSE_RESPONSE.file


def _controls(study: Study, series: list[Series]) -> list[tuple[float, Arm]]:
    """(lag, the no-KL control's arm there) for each lag a beta series is at: beta 0, the
    end every beta series falls toward."""
    lags = sorted({s.fixed for s in series})
    return [(lag, arm) for lag in lags if (arm := study.arm(None, None, 0.0, int(lag)))]


def _draw_control(axes, control: Arm, label: str) -> None:
    """The no-KL control as grey dotted levels across a beta row's three panels."""
    style = {"color": "0.45", "lw": 1.0}
    axes[0].axhline(control.broken / control.n, ls=":", label=label, **style)
    kls = [v for v in control.kl_end if math.isfinite(v) and v > 0]
    if kls:
        axes[1].axhline(math.exp(statistics.fmean(map(math.log, kls))), ls=":", **style)
    for key in ACCURACY_SETS:
        if values := control.accuracy.get(key):
            axes[2].axhline(statistics.fmean(values), ls=_SET_STYLE[key], **style)


def _draw(axes, s: Series, x: list[float], colour) -> None:
    """One series into a row's three panels."""
    rates = [a.broken / a.n for a in s.arms]
    bounds = [stats.rate_bound(a.broken, a.n) for a in s.arms]
    axes[0].errorbar(x, rates, yerr=[[0] * len(x), [b - r for b, r in zip(bounds, rates)]],
                     color=colour, marker="o", ms=3, lw=1.2, capsize=2, label=s.label)
    for xi, r, a in zip(x, rates, s.arms):
        if a.break_steps:
            axes[0].annotate(f"step {statistics.median(a.break_steps):g}", (xi, r),
                             xytext=(3, 3), textcoords="offset points", fontsize=6,
                             color=colour)
    kls = [[v for v in a.kl_end if math.isfinite(v) and v > 0] for a in s.arms]
    for xi, values in zip(x, kls):
        axes[1].scatter([xi] * len(values), values, color=colour, s=6, alpha=0.3)
    axes[1].plot(x, [math.exp(statistics.fmean(map(math.log, v))) if v else math.nan
                     for v in kls], color=colour, marker="o", ms=3, lw=1.2)
    for key in ACCURACY_SETS:
        values = [a.accuracy.get(key, ()) for a in s.arms]
        if not all(values):
            continue
        for xi, v in zip(x, values):
            axes[2].scatter([xi] * len(v), v, color=colour, s=6, alpha=0.3)
        axes[2].plot(x, [statistics.fmean(v) for v in values], color=colour, marker="o", ms=3,
                     lw=1.2, ls=_SET_STYLE[key])
