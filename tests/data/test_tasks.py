"""Generated tasks: correct answers, disjoint held-out split, scoring, tokenizer."""

import pytest

from megaft.data.encode import encode_example
from megaft.data.errors import DataError
from megaft.data.tasks import TASKS, make_task, task_tokenizer
from megaft.data.tokenizer import special_ids


def test_registry_has_more_than_one_task():
    assert {"addition", "reverse"} <= set(TASKS)


def test_addition_answers_are_the_reversed_zero_padded_sum():
    task = make_task("addition", train_size=500, eval_size=100, seed=0)
    for ex in task.train + task.eval:
        prompt, completion = ex["prompt"], ex["completion"]
        assert len(prompt) == 6 and prompt[2] == "+" and prompt[5] == "="  # fixed width: "07+45="
        a, b = int(prompt[:2]), int(prompt[3:5])
        assert len(completion) == 3 == task.max_new_tokens
        assert int(completion[::-1]) == a + b
    # Operands are digit-count balanced: single-digit ones are common, two-digit ones too.
    operands = [int(ex["prompt"][i:i + 2]) for ex in task.train for i in (0, 3)]
    assert 0.4 < sum(x < 10 for x in operands) / len(operands) < 0.7
    assert {"prompt": "07+45=", "completion": "250"} == {
        "prompt": "07+45=", "completion": TASKS["addition"].answer("07+45=")}


def test_reverse_answers():
    task = make_task("reverse", train_size=300, eval_size=50, seed=0)
    for ex in task.train + task.eval:
        word = ex["prompt"][:-1]
        assert ex["prompt"][-1] == "=" and 3 <= len(word) <= 6 and word.isalpha() and word.islower()
        assert ex["completion"] == word[::-1]
    assert task.max_new_tokens == 6


@pytest.mark.parametrize("name", sorted(TASKS))
def test_split_sizes_disjoint_and_deterministic(name):
    task = make_task(name, train_size=3000, eval_size=256, seed=7)
    assert len(task.train) == 3000 and len(task.eval) == 256
    eval_prompts = [ex["prompt"] for ex in task.eval]
    assert len(set(eval_prompts)) == 256  # held-out prompts are distinct
    assert not set(eval_prompts) & {ex["prompt"] for ex in task.train}
    again = make_task(name, train_size=3000, eval_size=256, seed=7)
    assert again.train == task.train and again.eval == task.eval
    assert make_task(name, train_size=3000, eval_size=256, seed=8).eval != task.eval


def test_score_is_exact_match():
    task = make_task("addition", train_size=10, eval_size=4, seed=1)
    right = [ex["completion"] for ex in task.eval]
    assert task.score(right) == 1.0
    assert task.score(right[:2] + ["", right[3] + "0"]) == 0.5
    assert task.score(["x"], task.eval[:1]) == 0.0
    with pytest.raises(ValueError):
        task.score(right[:3])


def test_task_tokenizer_covers_the_task_and_decodes_answers():
    for name in TASKS:
        task = make_task(name, train_size=50, eval_size=10, seed=2)
        tok = task_tokenizer(task)
        unk = tok.token_to_id("<unk>")
        eos, pad = special_ids(tok)
        assert (eos, pad) == (1, 0)
        for ex in task.train + task.eval:
            enc = encode_example(tok, ex, eos)
            assert unk not in enc.ids
            assert len(enc.ids) == len(ex["prompt"]) + len(ex["completion"]) + 1
            answer = enc.ids[len(ex["prompt"]):]
            assert tok.decode(answer) == ex["completion"]


def test_unknown_task_and_oversized_eval():
    with pytest.raises(DataError,
                       match=r"unknown task 'nope'; fix: use one of \['addition', 'reverse'"):
        make_task("nope", 1, 1, 0)
    with pytest.raises(DataError, match="holds out at most 5000 of its 10000 prompts"):
        make_task("addition", 1, 5001, 0)
    # The largest allowed hold-out still generates quickly and stays disjoint.
    task = make_task("addition", 2000, 5000, 0)
    assert len({ex["prompt"] for ex in task.eval}) == 5000
    assert not {ex["prompt"] for ex in task.eval} & {ex["prompt"] for ex in task.train}
