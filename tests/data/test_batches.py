"""Packing and eval batches, checked against a reference built independently of the RNG."""

import pytest
import torch

from megaft.data import Encoded, PackedStream, count_targets, eval_batches

# Example k starts with the unique id 100 + k, so the stream can be parsed back into
# examples; lengths differ and masks vary, so a misplaced window shows.
EXAMPLES = [
    Encoded([100 + k] + [k] * (k % 4 + 1) + [7] * (k % 3),
            [False] + [(k + i) % 2 == 0 for i in range(k % 4 + 1 + k % 3)])
    for k in range(9)
]
TOKENS = sum(len(e.ids) for e in EXAMPLES)


def parse_epoch(ids, target):
    """Split one epoch's stream back into example indices; asserts it is a permutation."""
    order, pos = [], 0
    while pos < len(ids):
        k = ids[pos] - 100
        ex = EXAMPLES[k]
        assert ids[pos:pos + len(ex.ids)] == ex.ids and target[pos:pos + len(ex.ids)] == ex.target
        order.append(k)
        pos += len(ex.ids)
    assert sorted(order) == list(range(len(EXAMPLES)))
    return order


def reference_stream(stream, epochs):
    """(ids, target) of the first `epochs` epochs, each checked to be a permutation."""
    ids, target, orders = [], [], []
    for e in range(epochs):
        e_ids, e_target = stream.tokens(e * TOKENS, (e + 1) * TOKENS)
        e_ids, e_target = e_ids.tolist(), e_target.tolist()
        orders.append(parse_epoch(e_ids, e_target))
        ids += e_ids
        target += e_target
    return ids, target, orders


def test_epochs_are_shuffled_permutations_and_depend_on_the_seed():
    stream = PackedStream(EXAMPLES, seq_len=5, seed=3)
    assert stream.tokens_per_epoch == TOKENS
    _, _, orders = reference_stream(stream, 4)
    assert len({tuple(o) for o in orders}) > 1  # reshuffled each epoch
    _, _, other = reference_stream(PackedStream(EXAMPLES, seq_len=5, seed=4), 4)
    assert other != orders


@pytest.mark.parametrize("seq_len,size", [(5, 3), (16, 8), (1, 2), (TOKENS, 1)])
def test_global_batch_is_the_windowed_stream(seq_len, size):
    stream = PackedStream(EXAMPLES, seq_len=seq_len, seed=11)
    steps = 6  # with these sizes the batches run across several epoch boundaries
    ids, target, _ = reference_stream(stream, steps * size * seq_len // TOKENS + 2)
    for step in range(steps):
        x, y = stream.global_batch(step, size)
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (size, seq_len)
        for r in range(size):
            start = (step * size + r) * seq_len  # windows overlap by one token
            window = ids[start:start + seq_len + 1]
            assert x[r].tolist() == window[:-1]
            assert y[r].tolist() == [t if m else -100 for t, m in
                                     zip(window[1:], target[start + 1:start + seq_len + 1])]
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
    _, target = stream.tokens(2 * 6 * 7 + 1, 3 * 6 * 7 + 1)
    assert mask.flatten().tolist() == target.tolist()
    assert count_targets(y) == int(target.sum())


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
