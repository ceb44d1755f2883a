"""Successive halving on Ray Tune (issue 93): the rungs, the pool and the study's plan checked without Ray (the tiny
pools trained under ASHA are in tests/test_study.py, with the other tests that start a Ray: one worker runs them one at a time)."""
import pytest
from rnn_darts.asha import rungs_of, asha_pool
from rnn_darts.core import UsageError
from rnn_darts.study import plan_stages, waits_for, study_settings, check_study

def test_rungs_and_pool_are_checked_in_one_line():
    assert rungs_of('1,3,9') == dict(grace_period=1, max_t=9, reduction_factor=3)
    for bad in ('3', '1,3,8', '3,1', '1,x', '0,1'):
        with pytest.raises(UsageError, match='^--rungs'): rungs_of(bad)
    with pytest.raises(UsageError, match='the ASHA pool is empty'): asha_pool()
    pool = asha_pool(dict(mine='DARTS_V2'), n_random=2, ops=('tanh', 'gelu'), nodes=3, seed=5)
    assert list(pool) == ['mine', 'random-1', 'random-2'] and {op for n in ('random-1', 'random-2') for op, _ in pool[n].recurrent} <= {'tanh', 'gelu'}

def test_a_study_choosing_by_asha_plans_one_stage_in_place_of_the_short_trainings():
    "--select asha: the searches, then `asha` waiting for every search, then the final training waiting for it; no short trainings"
    s, src = study_settings(methods='first,random', seeds='1,2', references='DARTS_V2', select='asha', random_cells=4)
    stages = plan_stages(check_study(s, src))
    assert [x.name for x in stages] == ['search-first-1', 'search-first-2', 'search-random-1', 'search-random-2', 'asha', 'final']
    assert [x.name for x in waits_for(stages[4], stages)] == [x.name for x in stages[:4]] and waits_for(stages[5], stages) == [stages[4]]
    s, src = study_settings(methods='first', seeds='1', references='DARTS_V2')   # the paper's selection: a short training each
    assert [x.kind for x in plan_stages(check_study(s, src))] == ['search', 'short', 'short', 'final']
