"""Successive halving on Ray Tune (issue 93, its first part): the rungs and the pool checked without Ray; a tiny pool
trained under ASHA to its end, each cell's run folder the run `rnn-darts train` writes, the chosen cell the best of
those that reached the last rung."""
import json, importlib.util
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

needs_tune = pytest.mark.skipif(importlib.util.find_spec('ray') is None or importlib.util.find_spec('pyarrow') is None,
                                reason="Ray Tune is not installed (pip install 'rnn-darts[ray]')")

@pytest.mark.slow
@needs_tune
def test_a_tiny_pool_under_asha_chooses_the_best_cell_of_the_last_rung(tmp_path):
    "DARTS_V2 and 3 random cells, rungs 1,2: each trial's run folder logs the epochs it reached; the chosen cell reached 2 and is the best there"
    from rnn_darts.asha import select_asha
    from rnn_darts.options import code_defaults
    s = {**code_defaults('train'), **dict(data='numbers', n_train=1500, n_eval=600, bs=8, bptt=10, eval_bs=4, emsize=16, nhid=16, seed=3, threads=1)}
    pool = asha_pool(dict(DARTS_V2='DARTS_V2'), n_random=3, seed=1)
    chosen, table = select_asha(pool, s, rungs='1,2', out=tmp_path/'asha')
    import ray
    assert not ray.is_initialized()   # the local Ray it started is gone: no raylet or idle workers slow what runs next
    assert sorted(table.cell) == sorted(pool) and set(table.epochs) <= {1, 2}
    top = table[table.epochs == 2]
    assert chosen == top.cell[top.valid_ppl.idxmin()]
    for _, r in table.iterrows():
        run = tmp_path/'asha'/r.cell
        assert len((run/'log.csv').read_text().splitlines()) == 1 + r.epochs   # the epochs it reached, no more
        assert json.loads((run/'run.json').read_text())['genotype']['recurrent'] == [list(x) for x in pool[r.cell].recurrent]
