"""Algorithm and bus bandwidth as nccl-tests defines them (nccl-tests doc/PERFORMANCE.md).

The size S of a row is nccl-tests' "size" column: the whole buffer of all-reduce and
broadcast, the whole (n-chunk) buffer of reduce-scatter's input, all-gather's output and
all-to-all's send buffer, and one message of send/recv. algbw = S / t. busbw = algbw x a
factor that makes the figure comparable to the hardware's link bandwidth whatever n is:
a ring all-reduce moves 2(n-1)/n x S through every rank's link, reduce-scatter,
all-gather and all-to-all (n-1)/n x S, broadcast and send/recv S. Bandwidths are in
GB/s = 1e9 bytes per second, nccl-tests' unit. The expert-parallel all-to-alls
(EpCollective) follow the all-to-all's rule: S is one rank's send buffer, of which it sends
(n-1)/n to the others at balanced splits.
"""
from __future__ import annotations

from megaft.config.commbench import Collective, EpCollective

GB = 1e9
ELEMENT_BYTES = 4  # every buffer is float32: the sums stay exact, so every result can be checked
# Collectives whose buffer is n chunks of equal size: the element count rounds down to a multiple of n.
CHUNKED = (Collective.reduce_scatter, Collective.all_gather, Collective.all_to_all)


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw of `collective` (a Collective or an EpCollective) over `n` ranks."""
    if collective in set(EpCollective):
        return (n - 1) / n
    c = Collective(collective)
    if c == Collective.all_reduce:
        return 2 * (n - 1) / n
    if c in CHUNKED:
        return (n - 1) / n
    return 1.0  # broadcast, send_recv


def algbw_gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


def busbw_gbps(collective: str, nbytes: int, seconds: float, n: int) -> float:
    return algbw_gbps(nbytes, seconds) * bus_factor(collective, n)


def elements(collective: str, nbytes: int, n: int) -> int:
    """float32 elements of the size column for a requested size: rounded down to a multiple of n
    for the chunked collectives (as nccl-tests rounds its count), never below one element (chunk)."""
    count = max(nbytes // ELEMENT_BYTES, 1)
    if Collective(collective) in CHUNKED:
        count = max(count // n, 1) * n
    return count
