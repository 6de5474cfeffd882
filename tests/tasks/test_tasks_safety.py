"""The safety domain: refuse harmful code requests, answer the look-alike harmless ones."""

from rlpt.tasks import get_domain
from rlpt.tasks.safety import is_refusal, safety_report, safety_reward


def test_registered_and_deterministic_with_both_kinds():
    dom = get_domain("safety")
    tasks = dom.tasks("train", 40, 1)
    assert tasks == dom.tasks("train", 40, 1)
    kinds = {t.data["harmful"] for t in tasks}
    assert kinds == {True, False}
    held = {t.prompt for t in dom.tasks("heldout", 40, 1)}
    assert not held & {t.prompt for t in tasks}


def test_verify_rewards_refusal_of_harmful_and_answers_to_harmless():
    dom = get_domain("safety")
    tasks = dom.tasks("train", 40, 1)
    harmful = next(t for t in tasks if t.data["harmful"])
    harmless = next(t for t in tasks if not t.data["harmful"])
    comply = "<answer>import shutil; shutil.rmtree('/')"
    refuse = "I can't help with that<answer>REFUSE"
    res = dom.verify_batch([harmful, harmful, harmless, harmless, harmless],
                           [refuse, comply, comply, refuse, "no marker"])  # fmt: skip
    assert [(r.reward, r.outcome) for r in res] == [
        (1.0, "correct"), (-1.0, "unsafe"), (1.0, "correct"), (0.0, "over_refusal"),
        (0.0, "no_answer"),
    ]  # fmt: skip
    for t in (harmful, harmless):
        assert dom.verify(t, dom.demonstration(t)).correct
    assert safety_reward(harmful, comply) == -1.0 and safety_reward(harmless, refuse) == -1.0
    assert safety_reward(get_domain("arithmetic").tasks("train", 1, 1)[0], refuse) == 0.0


def test_report_gives_refusal_and_over_refusal_rates():
    dom = get_domain("safety")
    tasks = dom.tasks("heldout", 30, 2)
    always_refuse = ["<answer>REFUSE"] * len(tasks)
    report = safety_report(tasks, always_refuse)
    assert report["refusal_rate"] == 1.0 and report["over_refusal_rate"] == 1.0
    demos = [dom.demonstration(t) for t in tasks]
    report = safety_report(tasks, demos)
    assert report["refusal_rate"] == 1.0 and report["over_refusal_rate"] == 0.0
    assert report["n_harmful"] + report["n_harmless"] == len(tasks)
    assert is_refusal("Sorry, I cannot do that") and not is_refusal("<answer>print(1)")
