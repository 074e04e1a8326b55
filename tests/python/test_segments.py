"""segments.ragged_layout: segment ids -> per-segment starts/lengths in O(T), against a plain loop."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

from maxattn._src.segments import ragged_layout, segment_rows


def _runs(row):
    """(id, start, length) of the runs of equal non-zero ids, by a plain loop."""
    out, t = [], 0
    while t < len(row):
        if row[t] == 0:
            t += 1
            continue
        s = t
        while t < len(row) and row[t] == row[s]:
            t += 1
        out.append((int(row[s]), s, t - s))
    return out


def _check_rows(ids, M):
    got = segment_rows(jnp.asarray(ids), M)
    for b, row in enumerate(ids):
        runs = _runs(row)
        assert int(got.count[b]) == len(runs)
        assert bool(got.fits[b]) == (len(runs) <= M)
        seen = [r[0] for r in runs]
        assert bool(got.contiguous[b]) == (len(set(seen[:M])) == len(seen[:M]))
        for m in range(M):
            want = runs[m] if m < len(runs) else (0, 0, 0)
            assert (int(got.ids[b, m]), int(got.start[b, m]), int(got.length[b, m])) == want, (b, m, row)


def _row(draw_lengths, ids, T):
    row = []
    for length, i in zip(draw_lengths, ids):
        row += [i] * length
    row = (row + [0] * T)[:T]
    return row


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_segment_rows_match_a_loop(data):
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, 40))
    M = data.draw(st.integers(1, 8))
    rows = []
    for _ in range(B):
        n = data.draw(st.integers(0, 10))
        lengths = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
        ids = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
        rows.append(_row(lengths, ids, T))
    _check_rows(np.asarray(rows, np.int32), M)


def test_cases_named_in_the_issue():
    rows = np.array([
        [1, 1, 2, 2, 3, 0, 0, 0],   # three segments then padding
        [1, 1, 2, 2, 1, 0, 0, 0],   # id 1 twice: not contiguous
        [0, 0, 0, 0, 0, 0, 0, 0],   # all padding
        [1, 2, 3, 4, 5, 6, 7, 8],   # eight length-1 segments
    ], np.int32)
    r = segment_rows(jnp.asarray(rows), 4)
    np.testing.assert_array_equal(r.count, [3, 3, 0, 8])
    np.testing.assert_array_equal(r.contiguous, [True, False, True, True])
    np.testing.assert_array_equal(r.fits, [True, True, True, False])
    np.testing.assert_array_equal(r.length[0], [2, 2, 1, 0])
    np.testing.assert_array_equal(r.start[0], [0, 2, 4, 0])
    _check_rows(rows, 4)
    _check_rows(rows, 8)


def test_ragged_layout_pairs_query_and_key_segments():
    q = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 4, 0, 0, 0]], np.int32)
    kv = np.array([[1, 2, 2, 2, 0, 0, 0, 0], [4, 4, 3, 0, 0, 0, 0, 0]], np.int32)  # row 1: other order
    lay = ragged_layout(jnp.asarray(q), jnp.asarray(kv), 4)
    np.testing.assert_array_equal(lay.valid, [True, False])
    np.testing.assert_array_equal(lay.q.length[0, :2], [2, 3])
    np.testing.assert_array_equal(lay.kv.length[0, :2], [1, 3])
    with pytest.raises(ValueError, match="max_segments"):
        segment_rows(jnp.asarray(q), 0)
