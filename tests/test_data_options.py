"""The `data:` options (DataConfig; the training prompt stream, cluster/train/prompts.py):
prompts too long for `max_prompt_length`, measured with the policy's real tokenizer as the
rollout workers render them, are dropped and counted; a dataset split is read epoch by epoch
(every row once per epoch, a new seeded order each, or file order), resumably, and
`epochs` ends the run; every bad combination fails at config validation. No Ray: a real run
that ends at its epochs costs more than this suite may spend, so the stop rule is checked on
the controller's own methods."""
from __future__ import annotations

import json
import shutil

import pytest

from cluster.config.loader import DEMO_CONFIG, ConfigError
from cluster.config.train_config import load_train_config
from cluster.train.controller import Controller, InFlight
from cluster.train.progress import data_lines, print_summary
from cluster.train.prompts import CHUNK, DataExhausted, PromptStream, rendered_length
from cluster.train.run_meaning import resume_changes

# Ten distinct countdown rows; 3-number rows render 3 tokens longer than 2-number rows.
ROWS = [{"target": 20 + i, "nums": [i + 1, 7, 3][: 2 + i % 2]} for i in range(10)]


def _resume_changes(saved: dict, current: dict) -> list[str]:
    return [str(c) for c in resume_changes(saved, current)]


@pytest.fixture
def rows_path(tmp_path):
    path = tmp_path / "countdown.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def config(rows_path, *overrides):
    return load_train_config(DEMO_CONFIG, [
        "task.name=countdown", f"task.options.train={rows_path}", "rollout.prompts_per_step=4",
        *overrides])


def key(problem) -> tuple:
    return tuple(problem.metadata["numbers"]), problem.metadata["target"]


def drain(stream, k):
    """Every batch the stream gives: (problems, group ids) pairs."""
    out = []
    while stream.has_batch(k):
        out.append(stream.next_batch(k))
    return out


def test_every_row_once_per_epoch_in_a_new_seeded_order(rows_path):
    cfg = config(rows_path)
    stream = PromptStream(cfg.task, seed=0, data=cfg.data)
    problems, ids = stream.next_batch(30)  # three epochs of ten rows
    assert ids == list(range(30)) and stream.metrics(30) == {"data/epoch": 3.0}
    epochs = [[key(p) for p in problems[e * 10:(e + 1) * 10]] for e in range(3)]
    every_row = sorted((tuple(r["nums"]), r["target"]) for r in ROWS)
    assert all(sorted(epoch) == every_row for epoch in epochs)  # each row exactly once
    assert len({tuple(epoch) for epoch in epochs}) == 3          # a new order every epoch
    other_seed = PromptStream(cfg.task, seed=1, data=cfg.data).next_batch(10)[0]
    assert [key(p) for p in other_seed] != epochs[0]
    in_order = config(rows_path, "data.shuffle=false")
    problems, _ = PromptStream(in_order.task, seed=0, data=in_order.data).next_batch(20)
    file_order = [(tuple(r["nums"]), r["target"]) for r in ROWS]
    assert [key(p) for p in problems] == file_order * 2


def test_long_prompts_are_dropped_counted_and_a_resume_sees_the_same_stream(
        rows_path, tiny_model_dir):
    # 2-number rows render to 198 tokens (199 from target 29 on: 10 has two digits), 3-number
    # rows to 201: a limit of 198 keeps rows 0, 2, 4, 6, 8 of each epoch.
    cfg = config(rows_path, "data.max_prompt_length=198", "data.epochs=3")
    length = rendered_length(cfg, tiny_model_dir)
    one_go = PromptStream(cfg.task, seed=0, data=cfg.data, prompt_length=length)
    assert one_go.fitting_per_epoch == 5 and one_go.max_steps(4) == 3  # 15 // 4; 3 left over
    batches = drain(one_go, 4)
    assert len(batches) == 3
    served = [p for problems, _ in batches for p in problems]
    assert all(length(p) <= 198 for p in served)
    assert all(len(p.prompt) + 1 == length(p) for p in served)  # chars + BOS: the tiny tokenizer
    assert {key(p) for p in served} == {(tuple(r["nums"]), r["target"]) for r in ROWS[:9:2]}
    positions = [i for _, ids in batches for i in ids]
    end = positions[-1] + 1
    assert one_go.filtered_before(end) == end - len(positions) > 0  # every gap is counted
    assert one_go.metrics(end)["data/prompts_filtered"] == end - len(positions)
    with pytest.raises(DataExhausted):
        one_go.next_batch(4)
    assert one_go.position == end  # an exhausted stream consumes nothing
    # Resumed after the first batch (a checkpoint's data position): the same two batches and
    # the same counts, the stream's state being a function of (seed, position) alone.
    after_first = batches[0][1][-1] + 1
    resumed = PromptStream(cfg.task, seed=0, position=after_first, data=cfg.data,
                           prompt_length=rendered_length(cfg, tiny_model_dir))
    assert [(ids, [p.uid for p in ps]) for ps, ids in drain(resumed, 4)] == [
        (ids, [p.uid for p in ps]) for ps, ids in batches[1:]]
    for position in (after_first, end):
        assert resumed.metrics(position) == one_go.metrics(position)


def test_a_generated_split_is_filtered_chunk_by_chunk(tiny_model_dir):
    cfg = load_train_config(DEMO_CONFIG, ["data.max_prompt_length=5"])  # BOS + 4 characters
    length = rendered_length(cfg, tiny_model_dir)
    stream = PromptStream(cfg.task, seed=0, data=cfg.data, prompt_length=length)
    problems, ids = stream.next_batch(6)
    assert all(len(p.prompt) <= 4 for p in problems)  # "7+3=", never "37-54="
    assert stream.filtered_before(ids[-1] + 1) == ids[-1] + 1 - 6
    assert "data/epoch" not in stream.metrics(stream.position)  # a generated split has none
    resumed = PromptStream(cfg.task, seed=0, position=ids[3] + 1, data=cfg.data,
                           prompt_length=length)
    assert resumed.next_batch(2) == (problems[4:], ids[4:])


def test_the_length_is_the_rendered_one_chat_template_and_system_prompt_included(
        rows_path, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    chat_dir = tmp_path / "chat_model"
    shutil.copytree(tiny_model_dir, chat_dir)
    tok = AutoTokenizer.from_pretrained(str(chat_dir))
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.save_pretrained(str(chat_dir))
    system = "Answer inside <answer> tags."
    cfg = config(rows_path, f"task.system_prompt='{system}'", "data.max_prompt_length=300")
    problem = PromptStream(cfg.task, seed=0).next_batch(1)[0][0]
    rendered = f"<|system|>{system}\n<|user|>{problem.prompt}\n<|assistant|>"
    assert rendered_length(cfg, chat_dir)(problem) == len(rendered)  # one token a character
    plain = config(rows_path, "task.chat_template=none", "data.max_prompt_length=300")
    assert rendered_length(plain, chat_dir)(problem) == len(problem.prompt) + 1  # BOS


def test_a_split_where_no_prompt_fits_fails_clearly(rows_path, tiny_model_dir):
    cfg = config(rows_path, "data.max_prompt_length=100")
    with pytest.raises(ConfigError, match=r"data.max_prompt_length=100: every one of the 10 "
                                          r"prompts of task 'countdown' split 'train' is longer"):
        PromptStream.for_run(cfg, tiny_model_dir)
    cfg = load_train_config(DEMO_CONFIG, ["data.max_prompt_length=2"])
    with pytest.raises(ConfigError, match=f"none of {CHUNK} prompts drawn from task "
                                          "'arithmetic' split 'train' fits"):
        PromptStream.for_run(cfg, tiny_model_dir)
    cfg = config(rows_path, "data.epochs=1", "rollout.prompts_per_step=16")
    with pytest.raises(ConfigError, match=r"data.epochs=1 x 10 prompts .* less than one batch"):
        PromptStream.for_run(cfg, tiny_model_dir)


def test_the_run_ends_at_the_end_of_its_epochs_or_at_total_steps(rows_path, tmp_path):
    """The controller's stop rule: another step while total_steps is not reached and a batch
    is in flight or left in the data; the progress bar plans the smaller of the two."""
    cfg = config(rows_path, "data.epochs=2", "total_steps=100")
    c = Controller(cfg, tmp_path / "run", tmp_path / "model")  # starts nothing
    assert c._planned_steps() == 5 and c._another_step()  # 2 x 10 rows in batches of 4
    for _ in range(5):
        c.prompts.next_batch(4)
    assert not c.prompts.has_batch(4)
    c.pending.append(InFlight([], start_position=16, requested_at_version=4))
    assert c._another_step()  # the last batch is still to be trained on
    assert c.trained_position == 16 and c.prompts.metrics(16) == {"data/epoch": 1.6}
    c.pending.clear()
    assert not c._another_step()  # the data's epochs are used up
    short = Controller(config(rows_path, "data.epochs=2", "total_steps=3"), tmp_path / "r2",
                       tmp_path / "model")
    assert short._planned_steps() == 3
    short.step = 3
    assert not short._another_step()


def test_the_summary_says_what_the_data_options_did(tmp_path, capsys):
    rows = [{"step": 0, "eval/in_domain/accuracy": 0.1},
            {"step": 5, "eval/in_domain/accuracy": 0.2, "data/prompts_filtered": 7,
             "data/epoch": 1.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(
        "total_steps: 100\ndata: {max_prompt_length: 512, shuffle: true, epochs: 2}\n")
    print_summary(tmp_path)
    out = capsys.readouterr().out
    assert "7 longer than data.max_prompt_length=512" in out
    assert "data.epochs=2 used up at step 5, before total_steps=100" in out
    ended = data_lines([{"step": 5, "data/epoch": 1.9}], {"epochs": 2}, total_steps=5)
    assert ended == [("  ended                      total_steps=5 reached after 1.90 epochs "
                      "of data.epochs=2")]
    assert data_lines([{"step": 5, "data/epoch": 0.5}], {"epochs": None}, 5) == []


def test_resume_refuses_a_changed_stream_but_takes_more_epochs(rows_path):
    saved = config(rows_path, "data.epochs=1").model_dump(mode="json")
    more = config(rows_path, "data.epochs=3").model_dump(mode="json")
    assert _resume_changes(saved, more) == []
    for override, change in (("data.shuffle=false", "data.shuffle: True -> False"),
                             ("data.max_prompt_length=300", "data.max_prompt_length: None -> 300")):
        assert _resume_changes(saved, config(rows_path, override).model_dump(
            mode="json")) == [change]
    older = {k: v for k, v in saved.items() if k != "data"}  # a checkpoint from before `data`
    assert _resume_changes(older, more) == []


@pytest.mark.parametrize("overrides,message", [
    (["data.epochs=2"], "data.epochs=2: task 'arithmetic' split 'train' is generated"),
    (["data.shuffle=false"], "data.shuffle=false: task 'arithmetic' split 'train' is generated"),
    (["task.name=countdown", "data.epochs=1"], "data.epochs=1: task 'countdown' split 'train'"),
    (["data.max_prompt_length=507"], (r"data.max_prompt_length \(507\) \+ "
                                      r"rollout.max_new_tokens \(6\) must fit in "
                                      r"rollout.max_model_len \(512\)")),
    (["data.epochs=0"], "data.epochs"),
    (["data.max_prompt_length=0"], "data.max_prompt_length"),
    (["data.shufle=false"], "did you mean 'shuffle'"),
    (["task.name=countdown", "task.options.columns={a: nums}"], "`columns` renames"),
    (["task.name=countdown", "task.options.train=true", "task.options.in_domain=true"],
     "train and in_domain read the same rows"),
    (["task.name=countdown", "task.options.train=5"], "task.options"),
])
def test_bad_data_options_fail_at_validation_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(DEMO_CONFIG, overrides)


def test_good_data_options_validate(rows_path):
    cfg = config(rows_path, "data.epochs=2", "data.shuffle=false", "data.max_prompt_length=506")
    assert (cfg.data.epochs, cfg.data.shuffle, cfg.data.max_prompt_length) == (2, False, 506)
    assert load_train_config(DEMO_CONFIG, []).data.model_dump() == {
        "max_prompt_length": None, "shuffle": True, "epochs": None}
