"""Progress output where stdout is not a terminal (ray job logs, sweep log files)."""
import json

from cluster.train.progress import TrainProgress, default_every, eval_line, print_summary


def test_plain_lines_every_n_steps_and_one_per_evaluation(capsys):
    with TrainProgress(10, every=4, live=False) as progress:
        for step in range(1, 11):
            metrics = {"reward/mean": 0.1 * step, "kl/pi_ref": 0.01, "lag/max": 2}
            if step == 5:
                metrics |= {"eval/in_domain/accuracy": 0.25, "eval/in_domain/sampled_accuracy": 0.2}
            progress.update(step, metrics)
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["4/10", "8/10", "10/10"]
    assert "reward 0.400" in steps[0] and "lag 2" in steps[0] and "s/step" in steps[0]
    assert "eta" in steps[0] and "acc 0.250" in steps[1]
    assert lines.count("eval step 5: in_domain greedy 0.250 sampled 0.200") == 1


def test_the_step_0_evaluation_has_its_line_and_sets_the_accuracy(capsys):
    with TrainProgress(4, every=2, live=False) as progress:
        progress.show_evaluation(0, {"eval/in_domain/accuracy": 0.455,
                                     "eval/in_domain/sampled_accuracy": 0.315})
        progress.show_evaluation(0, {})  # a resumed run logs no step-0 evaluation
        progress.update(2, {"reward/mean": 0.5})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "eval step 0: in_domain greedy 0.455 sampled 0.315"
    assert len(lines) == 2 and lines[1].startswith("step 2/4") and "acc 0.455" in lines[1]


def test_a_multi_turn_run_shows_its_turns_tool_calls_and_failures(capsys):
    with TrainProgress(2, every=1, live=False) as progress:
        progress.update(1, {"reward/mean": 0.5, "env/turns_mean": 1.5, "env/tool_call_rate": 0.25,
                            "env/failures_total": 0.0})
        progress.update(2, {"reward/mean": 0.5, "env/turns_mean": 2.0, "env/tool_call_rate": 0.5,
                            "env/failures_total": 3.0})
    first, second = capsys.readouterr().out.splitlines()
    assert "turns 1.50 tools 0.25 |" in first and "env-failures" not in first
    assert "turns 2.00 tools 0.50 env-failures 3 |" in second


def test_default_every_gives_about_twenty_lines():
    assert default_every(300) == 15 and default_every(5) == 1 and default_every(10_000) == 50
    assert eval_line(3, {"reward/mean": 1.0}) is None


def test_summary_of_a_run(tmp_path, capsys):
    rows = [{"step": 0, "eval/in_domain/accuracy": 0.1, "eval/in_domain/sampled_accuracy": 0.05},
            {"step": 1, "reward/mean": 0.2},
            {"step": 2, "eval/in_domain/accuracy": 0.3, "eval/in_domain/sampled_accuracy": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print_summary(tmp_path, "run finished")
    out = capsys.readouterr().out
    assert "run finished" in out and "(step 0 -> 2)" in out
    assert "in_domain greedy" in out and "0.100 -> 0.300" in out and "0.050 -> 0.250" in out


def test_on_a_terminal_every_evaluation_is_printed_and_logged(tmp_path, capsys):
    """Issue 48: with the live bar (a terminal), evaluations after step 0 were only in the
    status field, neither printed nor in train.log. Run under `klrl train`'s own output filter
    (run_output.quiet_output), each evaluation's line reaches the screen and the log."""
    from cluster.train.run_output import quiet_output

    log = tmp_path / "train.log"
    with quiet_output(log), TrainProgress(4, live=True) as progress:
        progress.show_evaluation(0, {"eval/in_domain/accuracy": 0.25})
        progress.update(1, {"reward/mean": 0.5})
        progress.update(2, {"reward/mean": 0.5, "eval/in_domain/accuracy": 0.5,
                            "eval/out_of_domain/accuracy": 0.125})
    shown = capsys.readouterr().out
    for text in (shown, log.read_text()):
        assert "eval step 0: in_domain greedy 0.250" in text
        assert "eval step 2: in_domain greedy 0.500 | out_of_domain greedy 0.125" in text
