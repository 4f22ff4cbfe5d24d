"""docs/extending.md: its examples are the code run here.

Each code block that follows an `<!-- example: NAME -->` marker in docs/extending.md is read
from the file, written into a temporary package where it is a module, and run: the example task as a
plug-in task everywhere a task is named (training, evaluation sets, `klrl eval --task`, a sweep),
with the real scoring pool and in a Ray worker; the example scorer through `rewards.load_scorer`
and the pool; the example KL estimator through `kl.surrogate` and the exact enumeration of
tests/test_kl_exact.py. Ray appears in one test only (`kl` and `rewards` need none).
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

import kl.analysis as A
import kl.estimators as E
from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from kl import toy as T
from rewards import ScoringPool, get_task, load_scorer

ROOT = Path(__file__).resolve().parents[1]
SPEC = "mytasks.reverse:ReverseTask"
MODULES = ("mytasks", "mytasks.reverse", "myscorers")
# Its one slow test starts a Ray cluster of its own (workers inherit PYTHONPATH from the
# cluster's start), so it runs beside the other runs of their own processes: in the other
# group it would stop that worker's shared cluster, for the next test to start again.
XDIST_GROUP = "own-processes"


def readme_example(name: str) -> str:
    """The fenced code block right after `<!-- example: NAME -->` in docs/extending.md."""
    text = (ROOT / "docs" / "extending.md").read_text()
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w*\n(.*?)\n```", text, re.DOTALL)
    assert found, f"docs/extending.md has no example block {name!r}"
    return found.group(1) + "\n"


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory) -> Path:
    """The README's task and scorer as the user's own package and module."""
    root = tmp_path_factory.mktemp("user_code")
    (root / "mytasks").mkdir()
    (root / "mytasks" / "__init__.py").write_text("")
    (root / "mytasks" / "reverse.py").write_text(readme_example("task"))
    (root / "myscorers.py").write_text(readme_example("scorer"))
    return root


@pytest.fixture
def importable(example_dir, monkeypatch):
    """The examples importable in this process (and, through sys.path, its spawned scoring
    processes); forgotten afterwards."""
    monkeypatch.syspath_prepend(str(example_dir))
    yield example_dir
    for name in MODULES:
        sys.modules.pop(name, None)


class GotPastChecks(AssertionError):
    """Raised where a run would start Ray or build the model, or `klrl eval` load one."""


@pytest.fixture
def guarded(monkeypatch, tmp_path):
    """`klrl train` / `klrl eval` in-process that cannot start anything (as
    tests/test_failfast.py)."""
    from cluster.cli import cmd_model
    from cluster.train import run

    def refuse(*_args, **_kw):
        raise GotPastChecks("got past the checks")

    for target, name in ((run, "resolve_model"), (run, "start_ray"),
                         (cmd_model, "init_default_model")):
        monkeypatch.setattr(target, name, refuse)
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def readme_commands() -> dict[str, list[str]]:
    """The README's `klrl train` and `klrl eval` lines for the example task, as argv."""
    lines = [shlex.split(line) for line in readme_example("task-commands").splitlines() if line]
    return {argv[1]: argv[1:] for argv in lines}


def test_the_example_task_trains_evaluates_and_scores(importable, guarded, tmp_path):
    commands = readme_commands()
    # klrl train: the config loads (the spec's form) and the pre-flight imports the task,
    # builds it with its options and checks its splits, then the run would start.
    train = commands["train"]
    overrides = train[2:] + [f"output_dir={tmp_path / 'runs'}"]
    cfg = load_train_config(ROOT / train[1], overrides)
    assert (cfg.task.name, cfg.task.options) == (SPEC, {"max_len": 6})
    with pytest.raises(GotPastChecks):
        main(["train", str(ROOT / train[1]), *overrides])
    # klrl eval: the same task by the same spec, checked before a model is loaded.
    evaluate = commands["eval"]
    assert evaluate[evaluate.index("--task") + 1] == SPEC
    with pytest.raises(GotPastChecks):
        main(["eval", "default", *evaluate[2:]])

    task = get_task(SPEC, max_len=6)
    train_problems = task.problems("train", 200, seed=3)
    assert train_problems == get_task(SPEC, max_len=6).problems("train", 200, seed=3)
    assert train_problems != task.problems("train", 200, seed=4)
    from mytasks.reverse import held_out
    in_domain = task.problems("in_domain", 50, seed=0)
    ood = task.problems("out_of_domain", 50, seed=0)
    words = {split: [p.prompt[len("reverse "):-1] for p in ps]
             for split, ps in (("train", train_problems), ("in_domain", in_domain),
                               ("out_of_domain", ood))}
    assert all(2 <= len(w) <= 6 and not held_out(w) for w in words["train"])
    assert all(2 <= len(w) <= 6 and held_out(w) for w in words["in_domain"])
    assert all(len(w) == 9 for w in words["out_of_domain"])
    assert len(task.problems("train")) == 1000 and all(p.task == "reverse" for p in ood)

    problems = in_domain[:4]
    completions = [problems[0].answer, problems[1].answer + "\nmore text", problems[2].prompt, ""]
    with ScoringPool(workers=1, timeout_s=30.0) as pool:  # real worker processes import the task
        results = pool.score(task.scorer, problems, completions)
    assert [(r.reward, r.failure) for r in results] == [(1.0, None), (1.0, None), (0.0, None),
                                                        (0.0, None)]


TYPO_CASES = [
    (["task.name=reverse"], ("task.name: unknown task 'reverse'; known tasks: arithmetic, "
                             "countdown, counting, math, mmlu, calculator, or a plug-in task "
                             "'package.module:TaskClass'")),
    (["task.name=mytasks.reverse:ReversTask"],
     ("task.name: task 'mytasks.reverse:ReversTask': module 'mytasks.reverse' has no attribute "
      "'ReversTask' (did you mean 'ReverseTask'?)")),
    (["task.name=mytasks.reverse:score_reverse"], "is a function, not a rewards.Task subclass"),
    (["task.name=klrl_not_installed.tasks:Task"],
     ("cannot import module 'klrl_not_installed.tasks': ModuleNotFoundError: No module named "
      "'klrl_not_installed' (install its package, or put the directory that holds it on "
      "PYTHONPATH)")),
    ([f"task.name={SPEC}", "task.options.max_lenn=3"],
     ("task.options: task 'mytasks.reverse:ReverseTask' has no option 'max_lenn' (did you mean "
      "'max_len'?)")),
    ([f"task.name={SPEC}", "task.options.max_len=1"],
     "task.options: .*max_len must be between 2 and 20, got 1"),
    ([f"task.name={SPEC}", "task.train_split=trian"],
     "task.train_split: task 'reverse' has no split 'trian' (did you mean 'train'?)"),
    ([f"eval.out_of_domain.task={SPEC}", "eval.out_of_domain.split=ood"],
     "eval.out_of_domain.split: task 'reverse' has no split 'ood'"),
    ([f"task.name={SPEC}", "data.epochs=2"],  # checked where the plug-in imports, not at load
     "data.epochs=2: task 'mytasks.reverse:ReverseTask' split 'train' is generated"),
]


def test_a_mistake_in_a_plugin_task_fails_before_anything_starts(importable, guarded, capsys,
                                                                  tmp_path):
    """Every way of naming the example task wrongly: `klrl train` exits 2 in a second with one
    message naming the field, no run directory; `klrl eval` and `klrl sweep` alike."""
    out = tmp_path / "runs"
    for overrides, message in TYPO_CASES:
        code = main(["train", str(DEMO_CONFIG), f"output_dir={out}", "run_name=r", *overrides])
        err = capsys.readouterr().err
        assert code == 2 and 1 <= len(err.strip().splitlines()) <= 2, (overrides, err)
        assert re.search(re.escape(message).replace(re.escape(".*"), ".*"), err), (message, err)
        assert not out.exists()
    for argv, message in [
        (["--task", "mytasks.reverse:ReversTask"],
         ("error: --task: task 'mytasks.reverse:ReversTask': module 'mytasks.reverse' has no "
          "attribute 'ReversTask' (did you mean 'ReverseTask'?)")),
        (["--task", SPEC, "--splits", "in_domian"],
         ("error: --splits: task 'reverse' has no split 'in_domian' (did you mean 'in_domain'?); "
          "its splits are train, in_domain, out_of_domain")),
    ]:
        assert main(["eval", "default", *argv]) == 2
        assert capsys.readouterr().err.strip() == message
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: s\ntrain_config: {DEMO_CONFIG}\noutput_dir: {out}\n"
                     "overrides: {task.name: 'mytasks.reverse:ReverseTask', "
                     "task.train_split: trian}\n"
                     "grid: {seed: [0, 1]}\n")
    assert main(["sweep", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "every run: task.train_split: task 'reverse' has no split 'trian'" in err


@pytest.mark.slow
def test_the_example_task_imports_in_ray_workers_through_pythonpath(example_dir, monkeypatch):
    """README: a local cluster passes PYTHONPATH to its workers, so a worker (and the scoring
    processes it starts) imports the plug-in task by its spec and draws the driver's problems."""
    import ray

    import rewards

    if ray.is_initialized():  # workers inherit the environment of the cluster's start
        ray.shutdown()
    monkeypatch.setenv("PYTHONPATH", str(example_dir))

    def draw_and_score(spec: str):  # local: Ray ships it by value, as a closure
        task = rewards.get_task(spec)
        problems = task.problems("in_domain", 5, seed=1)
        with rewards.ScoringPool(workers=1, timeout_s=30.0) as pool:
            results = pool.score(task.scorer, problems, [p.answer for p in problems])
        return [p.uid for p in problems], [r.reward for r in results]

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        uids, rewards_ = ray.get(ray.remote(draw_and_score).remote(SPEC), timeout=120)
    finally:
        ray.shutdown()
    monkeypatch.syspath_prepend(str(example_dir))
    try:
        assert uids == [p.uid for p in get_task(SPEC).problems("in_domain", 5, seed=1)]
    finally:
        for name in MODULES:
            sys.modules.pop(name, None)
    assert rewards_ == [1.0] * 5


def test_the_example_scorer_loads_and_scores(importable):
    scorer = load_scorer("myscorers:near_miss")
    problems = get_task("arithmetic").problems("in_domain", 4, seed=0)
    answers = [int(p.answer) for p in problems]
    completions = [str(answers[0]), f"{answers[1] + 1}\n", f"{answers[2] - 2}", "twelve"]
    with ScoringPool(workers=1, timeout_s=30.0) as pool:
        results = pool.score(scorer, problems, completions)
    assert [(r.reward, r.failure) for r in results] == [(1.0, None), (0.5, None), (0.0, None),
                                                        (0.0, None)]
    cfg = load_train_config(DEMO_CONFIG, ["task.reward=myscorers:near_miss"])
    from cluster.train.door.preflight import check_environment

    check_environment(cfg)  # the pre-flight imports it as the rollout workers will


# ---- the KL estimator ---------------------------------------------------------------------

ON = T.ToyProblem.make(seed=0, lag=0.0)
OFF = T.ToyProblem.make(seed=0, lag=3.0)  # the same pi and ref, a behaviour policy 3 units off


@pytest.fixture
def k_abs(monkeypatch):
    """The README's formula, under the name `abs`, in the table kl.surrogate reads."""
    namespace = {"torch": torch}
    exec(readme_example("kl-estimator"), namespace)  # noqa: S102 (the README's own code)
    monkeypatch.setitem(E.FORMULAS, "abs", namespace["k_abs"])
    return namespace["k_abs"]


def test_the_example_estimator_meets_its_contract_exactly(k_abs):
    """kl.surrogate's exact expected gradient with `abs` is the contract's, in every placement,
    on-policy and off-policy with exact weights; its loss part is E_pi[sum_t sign(delta_t) grad
    logp_t] computed without the formula; in reward+loss it is not g* (README: 0.844)."""
    on, off = A.reference_grads(ON), A.reference_grads(OFF)
    for placement in ("reward", "loss", "reward+loss"):
        v = A.KLVariant("abs", placement)
        g = A.expected_grad(ON, v)
        assert A.relative_error(g, A.on_policy_prediction(v, on)) < 1e-9
        assert A.relative_error(g, on.g_star) > 0.5
        for importance in ("sequence", "prefix"):
            w = A.KLVariant("abs", placement, importance)
            assert A.relative_error(A.expected_grad(OFF, w), A.on_policy_prediction(w, off)) < 1e-9
        assert A.relative_error(A.expected_grad(OFF, v), off.g_star) > 0.5  # none: no correction
    both = A.relative_error(A.expected_grad(ON, A.KLVariant("abs", "reward+loss")), on.g_star)
    assert abs(both - 0.844) < 5e-4

    sp = ON.space

    def sign_score(x):  # E_pi[sum_t sign(delta_t) logp_t] with pi(y) and sign held fixed
        lp, ref = T.token_logp(x, sp), T.token_logp(ON.ref_logits, sp)
        weight = lp.detach().sum(-1).exp()[:, None] * torch.sign(lp.detach() - ref) * sp.mask
        return (weight * lp).sum()

    loss = A.expected_grad(ON, A.KLVariant("abs", "loss"))
    assert A.relative_error(loss, T.grad_of(sign_score, ON.logits)) < 1e-9


def test_kl_table_covers_the_example_estimator(k_abs, monkeypatch):
    """With `abs` among the estimators, `klrl kl-table` computes its 15 rows and every row of
    the table matches its prediction (the design table's or, for abs, its contract)."""
    from kl.table import KLTableConfig, compute_table

    monkeypatch.setattr(A, "ESTIMATORS", (*E.ESTIMATORS, "abs"))
    rows = compute_table(KLTableConfig())["rows"]
    abs_rows = {r["config"]: r for r in rows if r["estimator"] == "abs"}
    assert len(abs_rows) == 15 and all(r["matches_design_table"] for r in rows)
    assert abs(abs_rows["abs/reward+loss/none"]["on_rel_error"] - 0.844) < 5e-4
    assert not any(r["unbiased_off_policy"] for r in abs_rows.values())


def test_the_contract_is_the_design_table_and_names_the_unbiased_estimators(monkeypatch):
    """The contract (from the formula alone) equals docs/design.md's closed forms for K1, K2,
    K3; and (K1 + K3) / 2, of the form K1 + c (K3 - K1), is unbiased in reward+loss."""
    r = A.reference_grads(ON)
    for estimator in E.ESTIMATORS:
        for placement in ("reward", "loss", "reward+loss"):
            v = A.KLVariant(estimator, placement)
            closed, contract = A.on_policy_prediction(v, r), A.contract_prediction(ON, v)
            assert (closed - contract).norm() <= 1e-9 * max(float(r.g_star.norm()), 1.0)
    monkeypatch.setitem(E.FORMULAS, "k13", lambda d: (E.k1(d) + E.k3(d)) / 2)
    assert A.relative_error(A.expected_grad(ON, A.KLVariant("k13", "reward+loss")), r.g_star) < 1e-9
    assert A.relative_error(A.expected_grad(ON, A.KLVariant("k13", "reward")), r.g_star) > 0.05


def test_the_readme_steps_applied_to_kl_estimators(k_abs):
    """README step 2 on a copy of kl/estimators.py: with the README's formula and name lines
    the module loads and estimates `abs`; the name in the Literal alone is refused at import."""
    source = (ROOT / "kl" / "estimators.py").read_text()
    names = readme_example("kl-estimator-names").splitlines()

    def edit(lines: list[str], formula: bool) -> str:
        text = source
        for line in lines:
            head = line.split(" = ")[0] + " = "
            old = [x for x in source.splitlines() if x.startswith(head)]
            assert len(old) == 1, f"kl/estimators.py has no single line starting {head!r}"
            assert line.replace(', "abs": k_abs', "").replace(', "abs"', "") == old[0]
            text = text.replace(old[0], line)
        if formula:
            text = text.replace("\nFormula = ",
                                "\n" + readme_example("kl-estimator") + "\n\nFormula = ")
        return text

    module: dict = {"__name__": "estimators_with_abs"}
    exec(compile(edit(names, formula=True), "estimators_with_abs", "exec"), module)  # noqa: S102
    assert module["ESTIMATORS"] == ("k1", "k2", "k3", "abs")
    delta = torch.tensor([-0.5, 0.25])
    assert torch.equal(module["estimate"](delta, torch.zeros(2), "abs"), delta.abs())
    with pytest.raises(ImportError, match="must name exactly the Estimator Literal's estimators"):
        half_done = compile(edit(names[:1], formula=False), "estimators_half_done", "exec")
        exec(half_done, {"__name__": "estimators_half_done"})  # noqa: S102
