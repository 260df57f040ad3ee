"""The GPU-busy measure of the operator profiles."""

from dsv.bench.profiling import covered_ns


def test_covered_time_counts_overlapping_kernels_once():
    # Two streams overlap on [5, 10); a gap [12, 20) is idle; a kernel inside another adds nothing.
    assert covered_ns([(0, 10), (5, 12), (20, 30), (22, 25)]) == 12 + 10
    assert covered_ns([(20, 30), (0, 10)]) == 20  # order of the events does not matter
    assert covered_ns([(0, 10), (10, 15)]) == 15  # touching intervals
    assert covered_ns([]) == 0
