"""parallel.tp_overlap=ring: the ring collective matmuls equal the plain sequence-parallel path
(tests/parallel/overlap_cases.py) at tp=4 and at tp=2 groups inside a world of 4."""
from multirank import spawn

from parallel import overlap_cases


def test_ring_column_row_pair_matches_plain_sequence_parallel():
    spawn(4, overlap_cases.run_all)
