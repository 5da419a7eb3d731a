"""Packing that keeps documents apart: the plan (pure functions) and PackedDocs batches."""
import numpy as np
import pytest
import torch

from megaft.data.encode import Encoded
from megaft.data.packed import EncodedCorpus, PackedDocs, cu_seqlens, document_mask
from megaft.data.plan import epoch_plan, first_fit, pieces
from megaft.data.sources import mixture

SEQ = 16


def reference_first_fit(lengths, capacity):
    room, bins = [], []
    for need in lengths:
        b = next((i for i, r in enumerate(room) if r >= need), len(room))
        if b == len(room):
            room.append(capacity)
        room[b] -= need
        bins.append(b)
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_first_fit_matches_the_quadratic_definition(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, SEQ + 1, size=int(rng.integers(1, 300)))
    assert first_fit(lengths, SEQ).tolist() == reference_first_fit(lengths.tolist(), SEQ)
    assert first_fit([], SEQ).tolist() == []


# Document k: ids 1000*k + i (unique, so rows parse back), varied masks, lengths 0..40.
LENGTHS = [5, 16, 17, 40, 0, 1, 3, 9, 12, 2, 33, 7, 15, 6, 11, 4, 8, 10]


def document(k, n):
    return Encoded([1000 * k + i for i in range(n)], [i > 0 and (i + k) % 3 != 0 for i in range(n)])


DOCS = [document(k, n) for k, n in enumerate(LENGTHS)]


def test_pieces_keep_documents_whole_unless_too_long():
    docs = np.arange(len(LENGTHS))
    lens = np.array(LENGTHS)
    for mode in ("split", "truncate", "drop"):
        doc, start, length = pieces(docs, lens, SEQ, mode)
        assert (length >= 1).all() and (length <= SEQ).all()
        for k, n in enumerate(LENGTHS):
            mine = np.flatnonzero(doc == k)
            if n == 0 or (n > SEQ and mode == "drop"):
                assert len(mine) == 0
            elif n <= SEQ:
                assert start[mine].tolist() == [0] and length[mine].tolist() == [n]
            elif mode == "truncate":
                assert start[mine].tolist() == [0] and length[mine].tolist() == [SEQ]
            else:  # split: consecutive pieces cover the document once
                assert start[mine].tolist() == list(range(0, n, SEQ))
                assert int(length[mine].sum()) == n


@pytest.mark.parametrize("packing", ["docs", "none"])
def test_epoch_plan_fills_sequences_without_overflow(packing):
    plan = epoch_plan(np.arange(len(LENGTHS)), np.array(LENGTHS), SEQ, seed=3, epoch=0, packing=packing)
    used = np.add.reduceat(plan.length, plan.ptr[:-1])
    assert (used <= SEQ).all() and (np.diff(plan.ptr) >= 1).all()
    if packing == "none":
        assert (np.diff(plan.ptr) == 1).all()
    else:  # first-fit beats one-per-row
        assert plan.num_sequences < len(plan.doc)
    again = epoch_plan(np.arange(len(LENGTHS)), np.array(LENGTHS), SEQ, seed=3, epoch=0, packing=packing)
    assert all((a == b).all() for a, b in zip(plan, again))


def rows_of_epoch(packed, epoch_sequences):
    batch = packed.doc_batch(0, epoch_sequences)
    return batch


@pytest.mark.filterwarnings("ignore:.*longer than seq_len")
@pytest.mark.parametrize("packing", ["docs", "none"])
def test_every_token_once_per_epoch_positions_restart_and_padding_is_ignored(packing):
    packed = PackedDocs(EncodedCorpus(DOCS), SEQ, seed=7, pad_id=-1, packing=packing, long_docs="split")
    n = packed.sequences_per_epoch(0)
    b = packed.doc_batch(0, n)
    seen = {}
    for r in range(n):
        ids, lab, pos, seg = (t[r].tolist() for t in (b.input_ids, b.labels, b.position_ids, b.doc_ids))
        j = 0
        while j < SEQ:
            if ids[j] == -1:  # padding to the end of the row, one segment of its own, no loss
                assert set(ids[j:]) == {-1} and set(lab[j:]) == {-100}
                assert pos[j:] == list(range(SEQ - j)) and len(set(seg[j:])) == 1 and seg[j] > seg[j - 1]
                break
            k, first = divmod(ids[j], 1000)
            n_tok = 1
            while j + n_tok < SEQ and ids[j + n_tok] == 1000 * k + first + n_tok:
                n_tok += 1
            # A piece: consecutive tokens of document k, positions from 0, one segment.
            assert pos[j:j + n_tok] == list(range(n_tok)) and len(set(seg[j:j + n_tok])) == 1
            assert j == 0 or seg[j] == seg[j - 1] + 1
            doc = DOCS[k]
            for i in range(first, first + n_tok):
                seen[(k, i)] = seen.get((k, i), 0) + 1
                nxt = i + 1
                want = doc.ids[nxt] if nxt < len(doc.ids) and doc.target[nxt] else -100
                assert lab[j + i - first] == want  # next token of the same document, never across
            j += n_tok
    assert seen == {(k, i): 1 for k, n in enumerate(LENGTHS) for i in range(n)}
    # Epoch 1 starts right after: the next sequence is a new plan's first.
    assert packed.epoch_at(0, n) == 0 and packed.epoch_at(1, n) == 1.0


@pytest.mark.filterwarnings("ignore:.*longer than seq_len")
def test_long_docs_truncate_and_drop_are_counted():
    with pytest.warns(UserWarning, match=r"3 of 18 documents are longer than seq_len=16 tokens and are dropped"):
        dropped = PackedDocs(EncodedCorpus(DOCS), SEQ, seed=0, long_docs="drop")
    n = dropped.sequences_per_epoch()
    ids = dropped.global_batch(0, n)[0]
    assert not any(int(x) // 1000 in (2, 3, 10) for x in ids.flatten() if x > 0)
    truncated = PackedDocs(EncodedCorpus(DOCS), SEQ, seed=0, long_docs="truncate", pad_id=-1)
    assert truncated.long_doc_count == 3
    x, y = truncated.global_batch(0, truncated.sequences_per_epoch())
    for k in (2, 3, 10):
        got = sorted(int(v) for v in x.flatten() if v >= 0 and v // 1000 == k)
        assert got == [1000 * k + i for i in range(SEQ)]
        # The cut piece's last position predicts the document's next token when it is a target.
        row, col = [int(v) for v in torch.nonzero(x == 1000 * k + SEQ - 1)[0]]
        assert y[row, col] == (1000 * k + SEQ if DOCS[k].target[SEQ] else -100)


@pytest.mark.filterwarnings("ignore:.*longer than seq_len")
def test_global_batch_is_a_pure_function_of_seed_and_step():
    a = PackedDocs(EncodedCorpus(DOCS), SEQ, seed=5)
    b = PackedDocs(EncodedCorpus(DOCS), SEQ, seed=5, cache_epochs=1)
    late = a.doc_batch(30, 4)  # several epochs in
    for step in (3, 0, 30, 1):
        for t, u in zip(a.doc_batch(step, 4), b.doc_batch(step, 4)):
            assert torch.equal(t, u)
    assert all(torch.equal(t, u) for t, u in zip(late, b.doc_batch(30, 4)))
    for s in (0, 1, 9):
        big = a.doc_batch(s, 4)
        halves = [a.doc_batch(2 * s + h, 2) for h in (0, 1)]
        for i in range(4):  # input_ids, labels, position_ids, doc_ids
            assert torch.equal(big[i], torch.cat([h[i] for h in halves]))
    other = PackedDocs(EncodedCorpus(DOCS), SEQ, seed=6)
    assert not torch.equal(other.global_batch(0, 4)[0], a.global_batch(0, 4)[0])
    x, y = a.global_batch(2, 4)
    pos, seg = a.positions(2, 4)
    batch = a.doc_batch(2, 4)
    assert torch.equal(x, batch.input_ids) and torch.equal(y, batch.labels)
    assert torch.equal(pos, batch.position_ids) and torch.equal(seg, batch.doc_ids)
    assert x.dtype == y.dtype == pos.dtype == torch.long and x.shape == (4, SEQ)


@pytest.mark.filterwarnings("ignore:.*longer than seq_len")
def test_cu_seqlens_and_the_block_causal_mask():
    batch = PackedDocs(EncodedCorpus(DOCS), SEQ, seed=1).doc_batch(0, 3)
    assert batch.cu_seqlens.dtype == torch.int32
    assert torch.equal(batch.cu_seqlens, cu_seqlens(batch.doc_ids))
    assert int(batch.cu_seqlens[-1]) == 3 * SEQ
    # Segments restart position ids at 0, and nowhere else.
    starts = set(batch.cu_seqlens[:-1].tolist())
    assert starts == {i for i, p in enumerate(batch.position_ids.flatten().tolist()) if p == 0}
    mask = document_mask(batch.doc_ids)
    for r in range(3):
        seg = batch.doc_ids[r]
        for q in range(SEQ):
            allowed = [k for k in range(SEQ) if k <= q and seg[k] == seg[q]]
            assert torch.nonzero(mask[r, q]).flatten().tolist() == allowed


def test_mixture_weights():
    source = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    mix = mixture(source, [3, 0.5], seed=0, epoch=0)
    counts = np.bincount(mix, minlength=10)
    assert counts[:4].tolist() == [3, 3, 3, 3] and counts[4:].sum() == 3 and set(counts[4:]) <= {0, 1}
    assert np.array_equal(mix, mixture(source, [3, 0.5], seed=0, epoch=0))
    subsets = {tuple(np.flatnonzero(np.bincount(mixture(source, [1, 0.5], 0, e), minlength=10)[4:]))
               for e in range(8)}
    assert len(subsets) > 1  # a fresh subset each epoch
    docs = [Encoded([1, 2, 3], [False, True, True])] * 4
    corpus = EncodedCorpus(docs)
    corpus.source = np.array([0, 0, 1, 1])
    packed = PackedDocs(corpus, 3, seed=0, packing="none", weights=[2, 1])
    assert packed.sequences_per_epoch() == 6


def test_nothing_to_pack():
    with pytest.raises(ValueError, match="no sequences"):
        PackedDocs(EncodedCorpus([Encoded([], [])]), SEQ, seed=0)
