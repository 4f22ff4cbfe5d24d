"""Every file in configs/ parses and validates; the loader names bad fields."""
from pathlib import Path

import pytest

from cluster.config.loader import ConfigError, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((ROOT / "configs").rglob("*.yaml"))


def model_for(path: Path):
    """Which pydantic model a file in configs/ is validated by."""
    from cluster.config.train_config import TrainConfig
    from cluster.sweeps.sweep import SweepConfig
    from kl.table import KLTableConfig

    if path.name == "kl_table.yaml":
        return KLTableConfig
    if path.parent.name == "sweeps":
        return SweepConfig
    if path.name.startswith("tiny_cpu") or path.parent.name == "paper":
        return TrainConfig
    raise AssertionError(f"no config model is registered for {path}; add it to model_for()")


def test_there_are_configs():
    assert CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_file_validates(path):
    load_config(model_for(path), path)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweeps").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_sweep_expands_to_valid_train_configs(path):
    from cluster.sweeps.sweep import expand, load_sweep, validate_runs

    cfg = load_sweep(path)
    runs = expand(cfg)
    configs = validate_runs(cfg, runs)  # each grid point is a valid TrainConfig
    assert len(configs) == len(runs) > 1


def test_overrides_are_typed_and_nested():
    assert parse_overrides(["kl.beta=0.05", "max_lag=2", "kl.truncate=null", "name=abc"]) == {
        "kl": {"beta": 0.05, "truncate": None}, "max_lag": 2, "name": "abc"}
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["max_lag"])


def test_errors_name_the_field_and_the_file(tmp_path):
    from kl.table import KLTableConfig

    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: -1\nvocab: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_config(KLTableConfig, bad, ["lenght=3"])
    text = str(exc.value)
    assert "bad.yaml" in text and "seed" in text and "lenght" in text
    with pytest.raises(ConfigError, match="not found"):
        load_config(KLTableConfig, tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(KLTableConfig, tmp_path / "list.yaml")


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path):
    """Plain YAML keeps the last of two equal keys: a second `kl:` section would silently drop
    the first one's settings."""
    from cluster.config.train_config import TrainConfig

    for text, key, lines in [("seed: 1\nkl:\n  beta: 0.1\nseed: 2\n", "'seed'", (4, 1)),
                             ("kl:\n  beta: 0.1\nmax_lag: 1\nkl:\n  estimator: k3\n", "'kl'",
                              (4, 1)),
                             ("kl:\n  beta: 0.1\n  beta: 0.2\n", "'beta'", (3, 2))]:
        (tmp_path / "dup.yaml").write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_config(TrainConfig, tmp_path / "dup.yaml")
        assert f"dup.yaml, line {lines[0]}: key {key} is written twice" in str(exc.value)
        assert f"first on line {lines[1]}" in str(exc.value)
    # YAML merge keys are not duplicates: `<<: *base` then an override of one of its keys
    (tmp_path / "merge.yaml").write_text("x: &b {beta: 0.1, estimator: k3}\n"
                                         "kl: {<<: *b, beta: 0.2}\n")
    from cluster.config.loader import read_yaml

    assert read_yaml(tmp_path / "merge.yaml")["kl"] == {"beta": 0.2, "estimator": "k3"}


def test_errors_name_the_override_and_suggest_the_key():
    from cluster.config.train_config import TrainConfig

    tiny = ROOT / "configs" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError) as exc:
        load_config(TrainConfig, tiny, ["kl.betta=3", "max_lag=-1", "task.name=arith", "seed=1"])
    text = str(exc.value)
    assert "tiny_cpu.yaml with overrides: invalid configuration" in text
    assert ("kl.betta: unknown key (got 3); did you mean 'beta'? "
            "(from the override kl.betta=3)") in text
    assert "max_lag: " in text and "(from the override max_lag=-1)" in text
    assert "did you mean 'arithmetic'?" in text and "seed=1" not in text
    # an error about several fields names the overrides it is about
    with pytest.raises(ConfigError,
                       match=r"learner\.num_ranks \(3\).*override learner\.num_ranks=3"):
        load_config(TrainConfig, tiny, ["learner.num_ranks=3", "seed=1"])

def test_an_error_in_the_file_blames_no_override(tmp_path):
    from cluster.config.train_config import TrainConfig

    (tmp_path / "bad.yaml").write_text("max_lag: -1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(TrainConfig, tmp_path / "bad.yaml", ["seed=1"])
    assert str(exc.value).startswith(f"{tmp_path / 'bad.yaml'}: invalid configuration\n  max_lag:")
    assert "override" not in str(exc.value)


@pytest.mark.parametrize("family", ["qwen2.5-7b_math", "qwen3-4b-instruct_countdown",
                                    "llama-3.1-8b-instruct_math"])
def test_paper_variants_differ_only_in_kl(family):
    """Each family's four KL configurations (and, where shipped, its beta 0 control) differ
    from the family's base file in kl.* alone."""
    from cluster.config.train_config import TrainConfig

    paper = ROOT / "configs" / "paper"
    base = load_config(TrainConfig, paper / f"{family}.yaml")
    for est in ("k1", "k3"):
        for placement in ("reward", "loss"):
            cfg = load_config(TrainConfig, paper / f"{family}_{est}_{placement}.yaml")
            assert (cfg.kl.estimator, cfg.kl.placement) == (est, placement)
            assert cfg.model_dump(exclude={"kl"}) == base.model_dump(exclude={"kl"})
            assert cfg.kl.beta == base.kl.beta > 0
    nokl = paper / f"{family}_nokl.yaml"
    if family != "llama-3.1-8b-instruct_math":
        cfg = load_config(TrainConfig, nokl)
        assert cfg.kl.beta == 0
        assert cfg.model_dump(exclude={"kl"}) == base.model_dump(exclude={"kl"})


def test_cross_field_constraints_are_rejected_before_anything_starts():
    from cluster.config.train_config import TrainConfig

    tiny = ROOT / "configs" / "tiny_cpu.yaml"
    cases = [
        (["max_lag=-1"], "max_lag"),
        (["learner.num_ranks=3"], "num_ranks"),
        (["rollout.samples_per_prompt=1"], "samples_per_prompt"),
        (["sync.transport=nccl"], "nccl"),
        (["kl.truncate=2"], "truncate"),
        (["eval.max_new_tokens=512"], "max_model_len"),
        (["task.chat_template=none", "task.system_prompt=hi"], "system_prompt"),
        # the task's own rules (rewards.registry), not a worker's crash
        (["task.options.foo=1"], "task.options: task 'arithmetic' has no option 'foo'"),
        (["task.train_split=trian"], "task.train_split: .*did you mean 'train'"),
        (["task.name=mmlu"], "task.train_split: task 'mmlu' has no split 'train'"),
        (["eval.in_domain.split=test"], "eval.in_domain.split: .*no split 'test'"),
        (["task.name=math", "task.options.path=fixture"],
         "eval.out_of_domain.split: .*or none \\(eval.out_of_domain=null\\)"),
        (["eval.out_of_domain.task=mmlu", "eval.out_of_domain.options.subject=[x]"],
         "eval.out_of_domain.options: .*did you mean 'subjects'"),
        (["model.path=/tmp", "model.embedded=arith-retain"], "model.embedded names"),
        (["model.embedded=arith-forget"], "model.embedded"),
        (["eval.retained={split: retaind}"], "eval.retained.split: .*no split 'retaind'"),
    ]
    for overrides, field in cases:
        with pytest.raises(ConfigError, match=field):
            load_config(TrainConfig, tiny, overrides)
    # A run's saved config.yaml holds every field, the default embedded model beside its path.
    load_config(TrainConfig, tiny, ["model.path=/tmp", "model.embedded=arith"])


@pytest.mark.parametrize("learner_gpus, worker_gpus, workers, refused", [
    (1, 1, 2, None),
    (2, 1, 4, None),
    (0.6, 0.6, 1, None),        # cannot both fit on one GPU
    (1, 0.5, 1, None),          # the learner holds its GPU whole; one worker
    (0.5, 1, 2, None),
    (0.5, 0.5, 1, "learner rank 0 and a rollout worker"),
    (0.3, 0.7, 2, "learner rank 0 and a rollout worker"),
    (1, 0.5, 2, "two rollout workers"),
    (1, 0, 1, "no GPU of its own"),
])
def test_nccl_is_refused_when_two_group_members_could_share_a_gpu(learner_gpus, worker_gpus,
                                                                   workers, refused):
    """NCCL refuses two ranks of one group on a GPU; the config knows the Ray GPU requests,
    from which Ray's packing of fractional requests follows."""
    from cluster.config.train_config import TrainConfig

    overrides = ["sync.transport=nccl", f"learner.num_gpus_per_rank={learner_gpus}",
                 f"rollout.num_gpus_per_worker={worker_gpus}", f"rollout.num_workers={workers}",
                 "faults.max_worker_restarts=0"]
    tiny = ROOT / "configs" / "tiny_cpu.yaml"
    if refused is None:
        assert load_config(TrainConfig, tiny, overrides).sync.transport == "nccl"
        return
    with pytest.raises(ConfigError, match=refused) as e:
        load_config(TrainConfig, tiny, overrides)
    assert "sync.transport: shm" in str(e.value) and "object_store" in str(e.value)
    shm = load_config(TrainConfig, tiny, overrides[1:])  # the same placement with shm is fine
    assert shm.sync.transport == "shm"


def test_rollout_dtype_defaults_to_the_learners_and_reaches_the_engine():
    """rollout.dtype null is learner.dtype, resolved in one place (RolloutConfig.resolved, via
    TrainConfig.worker_rollout, which the workers get), and the engine is built with it: on a
    GPU an fp32 learner gets an fp32 engine, not vLLM's 'auto' (bf16 for fp32 checkpoints)."""
    from actors.config import RolloutConfig
    from actors.engine import llm_kwargs
    from actors.rollout_worker import engine_options
    from cluster.config.train_config import TrainConfig
    from learner.config import LearnerConfig

    tiny = ROOT / "configs" / "tiny_cpu.yaml"
    gpu = ["learner.num_gpus_per_rank=1", "rollout.num_gpus_per_worker=1"]
    cases = [([], "float32"), (gpu, "float32"), (gpu + ["learner.dtype=bfloat16"], "bfloat16"),
             (gpu + ["learner.dtype=bfloat16", "rollout.dtype=float32"], "float32"),
             (gpu + ["rollout.dtype=float16"], "float16")]
    for overrides, want in cases:
        cfg = load_config(TrainConfig, tiny, overrides)
        assert cfg.worker_rollout.dtype == want, overrides
        resolved = {"dtype", "threads_per_worker"}  # the thread rule: the next test
        assert cfg.worker_rollout.model_dump(exclude=resolved) == cfg.rollout.model_dump(
            exclude=resolved)
        options = engine_options(cfg.worker_rollout, cfg.sync, cfg.seed)
        options.pop("cpu_kvcache_gib")  # make_llm sets it as an environment variable
        for cpu in (True, False):
            assert llm_kwargs("model", cpu=cpu, **options)["dtype"] == want, (overrides, cpu)
    assert load_config(TrainConfig, tiny).rollout.dtype is None  # the file keeps null
    assert RolloutConfig().resolved(LearnerConfig().dtype, 1).dtype == "float32"
    # A worker built by hand with dtype null: make_llm's own default.
    assert llm_kwargs("model", cpu=True)["dtype"] == "float32"
    assert llm_kwargs("model", cpu=False)["dtype"] == "auto"
    with pytest.raises(ConfigError, match="dtype"):
        load_config(TrainConfig, tiny, ["rollout.dtype=float64"])


def test_thread_rule_gives_each_phase_every_core_at_lag_0_and_the_learner_all_of_them_above():
    """rollout.threads_per_worker / learner.threads_per_rank null: at max_lag 0 the phases
    alternate, so the workers share all the CPUs the run reserves, and so do the ranks; at
    max_lag >= 1 the workers keep their own reservation and the ranks still share every CPU,
    waiting passively (learner.omp_wait_policy null -> passive there only). Set values win;
    the parts get the resolved values (TrainConfig.worker_rollout / rank_learner, which the
    workers, the ranks and the bench's raw baselines are built from)."""
    from cluster.config.train_config import TrainConfig

    tiny = ROOT / "configs" / "tiny_cpu.yaml"

    def threads(*overrides):
        cfg = load_config(TrainConfig, tiny, list(overrides))
        return cfg.worker_rollout.threads, cfg.rank_learner.threads, cfg.reserved_cpus

    def wait(*overrides):
        return load_config(TrainConfig, tiny, list(overrides)).rank_learner.omp_wait_policy

    assert threads() == (2, 2, 2.0)  # the demo: 1 + 1 reserved CPUs, max_lag 0
    assert threads("max_lag=1") == threads("max_lag=4") == (1, 2, 2.0)
    assert threads("rollout.num_workers=2", "learner.num_cpus_per_rank=2") == (2, 4, 4.0)
    assert threads("rollout.num_cpus_per_worker=2.5", "max_lag=1") == (2, 3, 3.5)
    assert threads("learner.num_ranks=2", "max_lag=1") == (1, 1, 3.0)
    # Passive waiting only where a rank's threads overlap the generating workers' cores.
    assert wait() == "default" and wait("max_lag=1") == "passive"
    assert wait("learner.num_ranks=2", "max_lag=1") == "default"  # 1 thread on its own CPU
    assert wait("max_lag=1", "learner.omp_wait_policy=default") == "default"  # set values win
    assert wait("learner.omp_wait_policy=passive") == "passive"
    assert threads("rollout.threads_per_worker=3", "learner.threads_per_rank=1") == (3, 1, 2.0)
    assert threads("learner.threads_per_rank=4", "max_lag=2") == (1, 4, 2.0)
    assert load_config(TrainConfig, tiny).rollout.threads_per_worker is None  # the file keeps null
    with pytest.raises(ConfigError, match="threads_per_rank"):
        load_config(TrainConfig, tiny, ["learner.threads_per_rank=0"])


def test_task_and_eval_sections_are_the_rewards_configs():
    """TrainConfig's task/eval sections are rewards.config's models (the rollout worker takes
    them typed); the evaluation budget, sampler and seed default to the rollout budget, the
    policy itself (T=1, no top-k/top-p) and a seed of their own."""
    from cluster.config.train_config import TrainConfig
    from rewards.config import EvalConfig, TaskConfig

    cfg = load_config(TrainConfig, ROOT / "configs" / "tiny_cpu.yaml", ["seed=7"])
    assert isinstance(cfg.task, TaskConfig) and isinstance(cfg.eval, EvalConfig)
    ev = cfg.eval
    assert (ev.max_new_tokens, ev.temperature, ev.top_p, ev.top_k, ev.seed) == (None, 1.0, 1.0,
                                                                               -1, 0)
    assert (cfg.task.chat_template, cfg.task.system_prompt, cfg.task.stop) == ("auto", None, [])
    cfg = load_config(TrainConfig, ROOT / "configs" / "tiny_cpu.yaml", [
        "eval.max_new_tokens=32", "eval.seed=3", "eval.temperature=0.6",
        "task.stop=[</answer>,Question]"])
    assert (cfg.eval.max_new_tokens, cfg.eval.seed, cfg.eval.temperature) == (32, 3, 0.6)
    assert cfg.task.stop == ["</answer>", "Question"]
    sets = cfg.eval.sets(cfg.task)
    assert sets["in_domain"].task == cfg.task.name == "arithmetic"
    for bad in ("eval.temperature=0", "eval.top_p=1.5", "eval.seed=-1", "eval.max_new_tokens=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[1]):
            load_config(TrainConfig, ROOT / "configs" / "tiny_cpu.yaml", [bad])


def test_docs_option_table_is_klrl_options_output():
    """Every option is documented, with its current default and description: the table in
    docs/configuration.md is what `klrl options` renders from the config classes (regenerate it
    with `klrl options --docs`)."""
    from cluster.config.options import option_rows, options_markdown, read_block

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert read_block(page, "options") == options_markdown(), (
        "docs/configuration.md option table is stale: run `klrl options --docs`")
    keys = [key for key, _, _ in option_rows()]
    assert {"model.path", "kl.beta", "eval.in_domain", "ray.address"} <= set(keys)
    assert not [key for key, _, description in option_rows() if not description.strip()], (
        "every option needs a description")


def test_klrl_options_prints_every_option(capsys):
    from cluster.cli.main import main
    from cluster.config.options import option_rows

    assert main(["options"]) == 0
    out = capsys.readouterr().out
    assert all(f"| `{key}` |" in out for key, _, _ in option_rows())


def test_docs_paper_table_matches_the_configs():
    """docs/paper.md's 'setting / key / authors / klrl' table quotes the paper configs: every row
    with a key must hold the MATH / Countdown base files' values."""
    import yaml

    from cluster.config.train_config import TrainConfig

    readme = (ROOT / "docs" / "paper.md").read_text()
    start = readme.index("| setting | key | authors | klrl | why klrl differs |")
    lines = readme[start:].split("\n\n")[0].splitlines()[2:]
    paper = ROOT / "configs" / "paper"
    dumps = [load_config(TrainConfig, paper / f).model_dump()
             for f in ("qwen2.5-7b_math.yaml", "qwen3-4b-instruct_countdown.yaml")]
    checked = 0
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        key, klrl = cells[1].strip("`"), cells[3]
        if not key:
            continue
        values = [yaml.safe_load(v.strip().strip("`")) for v in klrl.split(" / ")]
        values = values * 2 if len(values) == 1 else values
        for dump, expected in zip(dumps, values, strict=True):
            actual = dump
            for part in key.split("."):
                actual = actual[part]
            assert actual == expected, (
                f"docs/paper.md says {key} = {expected}, the config has {actual}")
        checked += 1
    assert checked >= 20


def test_worker_restarts_are_refused_where_a_replaced_worker_cannot_rejoin_its_transport():
    """Under sync.transport nccl the weight-transfer group is formed once: a replaced worker
    could not join it, so faults.max_worker_restarts > 0 (the default 3) is refused before
    anything starts, naming the two ways on; 0 (a worker fault stops the run with its
    checkpoint) is taken, and so are restarts under a transport that re-syncs a new worker."""
    from cluster.config.train_config import TrainConfig

    tiny = ROOT / "configs" / "tiny_cpu.yaml"
    gpus = ["learner.num_gpus_per_rank=1", "rollout.num_gpus_per_worker=1"]
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, tiny, ["sync.transport=nccl", *gpus])
    message = str(e.value)
    assert "faults.max_worker_restarts=3 with sync.transport=nccl" in message
    assert "cannot join the NCCL weight-transfer group" in message
    assert "Set faults.max_worker_restarts=0" in message and "cuda_ipc" in message
    assert load_config(TrainConfig, tiny, ["sync.transport=nccl", *gpus,
                                           "faults.max_worker_restarts=0"]).faults \
        .max_worker_restarts == 0
    assert load_config(TrainConfig, tiny, gpus).faults.max_worker_restarts == 3  # shm
