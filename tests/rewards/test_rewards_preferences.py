"""Preference files, their bad inputs, and pairs built from verifier and sandbox traces."""

import json

import pytest

from rlpt.rewards import (
    PreferencePair,
    Trace,
    correctness_pairs,
    encode_pairs,
    load_preferences,
    load_traces,
    pairs_from_traces,
    traces_from_results,
)
from rlpt.tasks import get_domain
from rlpt.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def _write(tmp_path, lines, name="prefs.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


GOOD = {"prompt": "1+1=", "chosen": "<answer>2", "rejected": "<answer>3"}


def test_loads_good_records_with_optional_margin_and_domain(tmp_path):
    path = _write(tmp_path, [GOOD, "", dict(GOOD, margin=1.5, domain="arithmetic")])
    pairs, skipped = load_preferences(path)
    assert pairs == [
        PreferencePair("1+1=", "<answer>2", "<answer>3"),
        PreferencePair("1+1=", "<answer>2", "<answer>3", 1.5, "arithmetic"),
    ]
    assert skipped.total == 0


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "p", "chosen": "a"}, r"prefs.jsonl:2: missing field\(s\) \['rejected'\]"),
        (dict(GOOD, chosen="  "), "prefs.jsonl:2: field 'chosen' is an empty completion"),
        (dict(GOOD, rejected=3), "prefs.jsonl:2: field 'rejected' must be a string"),
        (dict(GOOD, margin="big"), "prefs.jsonl:2: field 'margin' must be a finite number"),
        ("{not json", "prefs.jsonl:2: invalid JSON"),
        ("[1, 2]", "prefs.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_records_raise_naming_file_and_line(tmp_path, record, message):
    path = _write(tmp_path, [GOOD, record])
    with pytest.raises(ValueError, match=message):
        load_preferences(path)


def test_bad_records_are_skipped_and_counted_when_asked(tmp_path):
    lines = [GOOD, {"prompt": "p"}, dict(GOOD, rejected=""), "{oops", dict(GOOD, chosen=1), GOOD]
    pairs, skipped = load_preferences(_write(tmp_path, lines), on_error="skip")
    assert len(pairs) == 2
    assert dict(skipped.counts) == {
        "missing_field": 1, "empty_completion": 1, "invalid_json": 1, "bad_field": 1,
    }  # fmt: skip
    with pytest.raises(ValueError, match="on_error"):
        load_preferences(_write(tmp_path, [GOOD]), on_error="ignore")


def test_prompts_longer_than_the_context_raise_or_are_skipped():
    pairs = [PreferencePair("x" * 50, "a", "b"), PreferencePair("1+1=", "<answer>2", "<answer>3")]
    with pytest.raises(ValueError, match="pair 0: 53 tokens exceed the model's context of 32"):
        encode_pairs(pairs, TOK, 32)
    arrays, skipped = encode_pairs(pairs, TOK, 32, on_error="skip", pad_to=16)
    assert len(arrays) == 1 and skipped.counts["too_long"] == 1
    assert arrays.chosen.shape == (1, 16)
    row = arrays.chosen[0][arrays.chosen_mask[0]]
    assert list(row) == TOK.encode("1+1=", add_bos=True) + TOK.encode("<answer>2", add_eos=True)
    assert not arrays.chosen_mask[0, 8:].any()


def test_pairs_from_sandbox_trace_file(tmp_path):
    rows = [
        {"task_id": "t1", "domain": "d", "prompt": "P1", "completion": "bad1", "status": "failed"},
        {"task_id": "t1", "domain": "d", "prompt": "P1", "completion": "good", "status": "passed"},
        {"task_id": "t1", "domain": "d", "prompt": "P1", "completion": "bad2", "status": "timeout"},
        {"task_id": "t1", "domain": "d", "prompt": "P1", "completion": "bad3",
         "status": "sandbox_error"},
        {"task_id": "t2", "domain": "d", "prompt": "P2", "completion": "x", "outcome": "wrong"},
        {"task_id": "t3", "domain": "d", "prompt": "P3", "completion": "y", "outcome": "correct"},
        {"task_id": "t3", "domain": "d", "prompt": "P3", "completion": "y", "outcome": "correct"},
        {"task_id": "t3", "domain": "d", "prompt": "P3", "completion": "z", "outcome": "no_answer"},
    ]  # fmt: skip
    traces, skipped = load_traces(_write(tmp_path, rows, "traces.jsonl"))
    assert skipped.total == 0 and len(traces) == 8
    pairs = pairs_from_traces(traces)
    # t1: one correct, two judged wrong (the sandbox failure is no verdict); t2 has no
    # correct completion; t3's duplicate correct completion counts once.
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ("P1", "good", "bad1"), ("P1", "good", "bad2"), ("P3", "y", "z"),
    ]  # fmt: skip
    assert len(pairs_from_traces(traces, max_pairs_per_prompt=1)) == 2


def test_trace_file_errors(tmp_path):
    path = _write(tmp_path, [{"task_id": "t", "prompt": "p", "completion": "c"}], "t.jsonl")
    with pytest.raises(ValueError, match=r"t.jsonl:1: missing field\(s\) \['outcome/status'\]"):
        load_traces(path)
    traces, skipped = load_traces(path, on_error="skip")
    assert traces == [] and skipped.counts["missing_field"] == 1


def test_pairs_from_verifier_results():
    dom = get_domain("arithmetic")
    tasks = dom.tasks("train", 2, 1)
    completions = [dom.demonstration(tasks[0]), "<answer>-999", dom.demonstration(tasks[1])]
    job_tasks = [tasks[0], tasks[0], tasks[1]]
    traces = traces_from_results(job_tasks, completions, dom.verify_batch(job_tasks, completions))
    assert [t.correct for t in traces] == [True, False, True]
    pairs = pairs_from_traces(traces)
    assert len(pairs) == 1 and pairs[0].chosen == completions[0]
    assert isinstance(traces[0], Trace) and pairs[0].domain == "arithmetic"


@pytest.mark.parametrize("name", ["arithmetic", "stepwise_math"])
def test_correctness_pairs_differ_only_in_correctness(name):
    dom = get_domain(name)
    tasks = dom.tasks("heldout", 20, 3)
    pairs = correctness_pairs(dom, tasks, seed=1)
    assert [(p.prompt, p.chosen, p.domain) for p in pairs] == [
        (t.prompt, dom.demonstration(t), name) for t in tasks
    ]
    # The domain's own verifier, run here: every chosen completion right, every rejected wrong.
    verdicts = dom.verify_batch(
        tasks + tasks, [p.chosen for p in pairs] + [p.rejected for p in pairs]
    )
    assert [v.correct for v in verdicts] == [True] * len(tasks) + [False] * len(tasks)
    for pair in pairs:
        assert pair.chosen != pair.rejected
        # Same shape: the same number of steps and markers, only numbers differ.
        assert pair.chosen.count("<step>") == pair.rejected.count("<step>")
        assert pair.rejected.count("<answer>") == 1
        strip = lambda s: "".join(ch for ch in s if not ch.isdigit() and ch != "-")
        assert strip(pair.chosen) == strip(pair.rejected)
