"""Packing and eval batches, checked against a reference built independently of the RNG."""

import pytest
import torch

from megaft.data.batches import PackedStream, count_targets, eval_batches
from megaft.data.encode import Encoded


# Example k starts with the unique id 100 + k, so the stream can be parsed back into
# examples; lengths differ and masks vary, so a misplaced window shows. Odd examples
# are prompt/completion (a 2-token prompt), even ones are text with a varied mask.
def example(k):
    n = 2 + k % 4 + k % 3
    ids = [100 + k] + [k] * (n - 1)
    if k % 2:
        return Encoded(ids, [False, False] + [True] * (n - 2), prompt_len=2)
    return Encoded(ids, [False] + [(k + i) % 2 == 0 for i in range(n - 1)])


EXAMPLES = [example(k) for k in range(9)]
TOKENS = sum(len(e.ids) for e in EXAMPLES)


def parse_epoch(ids, target):
    """Split one epoch's stream back into example indices; asserts it is a permutation.
    Also returns, per token, the in-epoch start of its example when prompted, else -1."""
    order, starts, pos = [], [], 0
    while pos < len(ids):
        k = ids[pos] - 100
        ex = EXAMPLES[k]
        assert ids[pos:pos + len(ex.ids)] == ex.ids and target[pos:pos + len(ex.ids)] == ex.target
        order.append(k)
        starts += [pos if ex.prompt_len else -1] * len(ex.ids)
        pos += len(ex.ids)
    assert sorted(order) == list(range(len(EXAMPLES)))
    return order, starts


def reference_stream(stream, epochs):
    """(ids, target, start, orders) of the first `epochs` epochs, each checked to be a
    permutation; start[i] is the stream position of a prompted token's example, else -1."""
    ids, target, start, orders = [], [], [], []
    for e in range(epochs):
        e_ids, e_target, _ = stream.tokens(e * TOKENS, (e + 1) * TOKENS)
        e_ids, e_target = e_ids.tolist(), e_target.tolist()
        order, starts = parse_epoch(e_ids, e_target)
        orders.append(order)
        ids += e_ids
        target += e_target
        start += [s + e * TOKENS if s >= 0 else -1 for s in starts]
    return ids, target, start, orders


def expected_labels(ids, target, start, window, seq_len):
    """Labels of the window starting at stream position `window`: the next token where it
    is a target and its example's prompt is not cut off by the window start."""
    n = range(window + 1, window + seq_len + 1)
    return [ids[i] if target[i] and not 0 <= start[i] < window else -100 for i in n]


def test_epochs_are_shuffled_permutations_and_depend_on_the_seed():
    stream = PackedStream(EXAMPLES, seq_len=5, seed=3)
    assert stream.tokens_per_epoch == TOKENS
    *_, orders = reference_stream(stream, 4)
    assert len({tuple(o) for o in orders}) > 1  # reshuffled each epoch
    *_, other = reference_stream(PackedStream(EXAMPLES, seq_len=5, seed=4), 4)
    assert other != orders


@pytest.mark.filterwarnings("ignore:.*longer than seq_len")  # short windows on purpose
@pytest.mark.parametrize("seq_len,size", [(5, 3), (16, 8), (1, 2), (TOKENS, 1)])
def test_global_batch_is_the_windowed_stream(seq_len, size):
    stream = PackedStream(EXAMPLES, seq_len=seq_len, seed=11)
    steps = 6  # with these sizes the batches run across several epoch boundaries
    ids, target, start, _ = reference_stream(stream, steps * size * seq_len // TOKENS + 2)
    cut = 0
    for step in range(steps):
        x, y = stream.global_batch(step, size)
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (size, seq_len)
        for r in range(size):
            window = (step * size + r) * seq_len  # windows overlap by one token
            assert x[r].tolist() == ids[window:window + seq_len]
            labels = expected_labels(ids, target, start, window, seq_len)
            assert y[r].tolist() == labels
            cut += sum(target[i] and lab == -100 for i, lab in enumerate(labels, window + 1))
    assert seq_len == TOKENS or cut > 0  # some windows did cut a prompt off
    # Inputs of consecutive batches concatenate to the stream itself.
    flat = torch.cat([stream.global_batch(s, size)[0].flatten() for s in range(steps)])
    assert flat.tolist() == ids[:steps * size * seq_len]


def test_labels_are_inputs_shifted_with_ignore_exactly_at_non_targets():
    stream = PackedStream(EXAMPLES, seq_len=7, seed=0)
    x, y = stream.global_batch(2, 6)
    nx, _ = stream.global_batch(3, 6)
    following = torch.cat([x[:, 1:], torch.cat([x[1:, :1], nx[:1, :1]])], dim=1)
    mask = y != -100
    assert torch.equal(y[mask], following[mask])
    _, target, start = stream.tokens(2 * 6 * 7 + 1, 3 * 6 * 7 + 1)
    window = 2 * 6 * 7 + 7 * torch.arange(6).repeat_interleave(7)
    cut = (torch.from_numpy(start) >= 0) & (torch.from_numpy(start) < window)
    assert mask.flatten().tolist() == (torch.from_numpy(target) & ~cut).tolist()
    assert count_targets(y) == int(mask.sum())


def test_text_examples_are_never_cut_and_every_target_is_predicted_once_per_epoch():
    text = [Encoded(e.ids, [False] + [True] * (len(e.ids) - 1)) for e in EXAMPLES]
    stream = PackedStream(text, seq_len=4, seed=2)
    steps = TOKENS * 3 // 4  # three epochs, in batches of one sequence
    total = sum(count_targets(stream.global_batch(s, 1)[1]) for s in range(steps))
    # The very first token of the stream is never a label; all others are exactly once.
    assert total == 3 * (TOKENS - len(EXAMPLES))


@pytest.mark.filterwarnings("ignore:.*longer than seq_len")  # short windows on purpose
def test_a_completion_is_trained_only_in_the_window_that_holds_its_prompt():
    ex = Encoded([1, 2, 3, 4, 5, 6], [False, False, False, True, True, True], prompt_len=3)
    stream = PackedStream([ex], seq_len=4, seed=0)
    # Stream: 1 2 3 4 5 6 | 1 2 3 4 5 6 | ...; windows start at 0, 4, 8, ...
    x, y = stream.global_batch(0, 4)
    assert x.tolist() == [[1, 2, 3, 4], [5, 6, 1, 2], [3, 4, 5, 6], [1, 2, 3, 4]]
    assert y.tolist() == [[-100, -100, 4, 5],        # prompt 1 2 3 in view: 4 and 5 trained
                          [-100, -100, -100, -100],  # 6: prompt cut off; then 1 2 3: prompt
                          [-100, -100, -100, -100],  # 4 5 6 of the copy whose prompt began at 6
                          [-100, -100, 4, 5]]


def test_global_batch_is_a_pure_function_of_seed_step_and_size():
    a = PackedStream(EXAMPLES, seq_len=6, seed=5)
    b = PackedStream(EXAMPLES, seq_len=6, seed=5, cache_epochs=1)
    # Out-of-order and repeated access give what a fresh stream gives.
    late = a.global_batch(40, 8)
    for step in (3, 0, 40, 1):
        for t, u in zip(a.global_batch(step, 8), b.global_batch(step, 8)):
            assert torch.equal(t, u)
    assert all(torch.equal(t, u) for t, u in zip(late, b.global_batch(40, 8)))
    # Batch size 8 at step s holds sequences 8s .. 8s+7, whatever size others use.
    for s in (0, 1, 7):
        big = a.global_batch(s, 8)
        halves = [a.global_batch(2 * s + h, 4) for h in (0, 1)]
        ones = [a.global_batch(8 * s + k, 1) for k in range(8)]
        for i in (0, 1):
            assert torch.equal(big[i], torch.cat([h[i] for h in halves]))
            assert torch.equal(big[i], torch.cat([o[i] for o in ones]))
    # The returned tensors are copies: editing one does not corrupt the cache.
    x, _ = a.global_batch(0, 2)
    x.fill_(-1)
    assert torch.equal(a.global_batch(0, 2)[0], b.global_batch(0, 2)[0])


def test_stream_needs_tokens():
    with pytest.raises(ValueError):
        PackedStream([Encoded([], [])], seq_len=4, seed=0)


def test_eval_batches_pad_right_and_mask():
    encoded = [
        Encoded([5, 6, 7, 8], [False, False, True, True]),
        Encoded([9, 10], [False, True]),
        Encoded([11], [False]),
    ]
    batches = eval_batches(encoded, batch_size=2, pad_id=0)
    assert len(batches) == 2
    (x0, y0), (x1, y1) = batches
    assert x0.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert y0.tolist() == [[-100, 7, 8], [10, -100, -100]]
    assert x1.tolist() == [[0]] and y1.tolist() == [[-100]]  # a 1-token line predicts nothing
    assert x0.dtype == y0.dtype == torch.long
    assert sum(count_targets(y) for _, y in batches) == 3


def test_eval_batches_truncate_long_lines_with_a_warning():
    encoded = [Encoded(list(range(1, 11)), [False] + [True] * 9),
               Encoded([1, 2, 3], [False, True, True])]
    with pytest.warns(UserWarning, match="1 of 2 examples are longer than max_len=4"):
        [(x, y)] = eval_batches(encoded, batch_size=4, pad_id=0, max_len=4)
    assert x.tolist() == [[1, 2, 3, 4], [1, 2, 0, 0]]
    assert y.tolist() == [[2, 3, 4, 5], [2, 3, -100, -100]]


def test_prompted_examples_longer_than_a_window_are_reported():
    long = Encoded([1] * 10, [False] * 3 + [True] * 7, prompt_len=3)
    with pytest.warns(UserWarning, match=r"1 of 2 prompt/completion examples are longer than "
                                         r"seq_len \+ 1 = 9 tokens"):
        PackedStream([long, EXAMPLES[1]], seq_len=8, seed=0)
