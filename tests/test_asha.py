"""Successive halving on Ray Tune (issue 93, its first part): the rungs and the pool checked without Ray (the tiny pool
trained under ASHA is in tests/test_study.py, with the other tests that start a Ray: one worker runs them one at a time)."""
import pytest
from rnn_darts.asha import rungs_of, asha_pool
from rnn_darts.core import UsageError

def test_rungs_and_pool_are_checked_in_one_line():
    assert rungs_of('1,3,9') == dict(grace_period=1, max_t=9, reduction_factor=3)
    for bad in ('3', '1,3,8', '3,1', '1,x', '0,1'):
        with pytest.raises(UsageError, match='^--rungs'): rungs_of(bad)
    with pytest.raises(UsageError, match='the ASHA pool is empty'): asha_pool()
    pool = asha_pool(dict(mine='DARTS_V2'), n_random=2, ops=('tanh', 'gelu'), nodes=3, seed=5)
    assert list(pool) == ['mine', 'random-1', 'random-2'] and {op for n in ('random-1', 'random-2') for op, _ in pool[n].recurrent} <= {'tanh', 'gelu'}
