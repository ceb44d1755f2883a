"The fast path users get by default: compiled steps on GPUs; on CPUs, compiled for a search long enough to pay back the warm-up."
import pytest, torch
from rnn_darts.data import numbers_corpus, lm_dls, search_stream
from rnn_darts.genotypes import DARTS_V2
from rnn_darts.learner import search_learner, train_learner
from rnn_darts.callbacks.speed import AutoCompile, COMPILE_MIN_STEPS

TINY = dict(emsize=8, nhid=8, checkpoint=False)

@pytest.fixture(scope='module')
def corpus(): return numbers_corpus(n_train=1_500, n_valid=600, n_test=400)

def test_compile_default_on_cpu_and_the_flag(corpus, tmp_path):
    "On a CPU the search learner decides per fit (`AutoCompile`), the training learner runs eager; the flag decides outright"
    dls = lm_dls(corpus, 4, 6, device='cpu')
    search = lambda **k: search_learner(dls, search_stream(corpus, 4), path=tmp_path, **TINY, **k)
    train = lambda **k: train_learner(dls, DARTS_V2, path=tmp_path, **TINY, **k)
    learn = search()
    assert learn.model.cell._compiled is None and learn.auto_compile.min_steps == COMPILE_MIN_STEPS
    assert not any(isinstance(cb, AutoCompile) for cb in train().cbs) and train().model.cell._compiled is None
    for make in (search, train):
        assert make(compile=True).model.cell._compiled is not None     # asked for: compiled (lazily, at the first batch)
        f = make(compile=False)
        assert f.model.cell._compiled is None and not any(isinstance(cb, AutoCompile) for cb in f.cbs)

@pytest.mark.slow
def test_auto_compile_compiles_a_long_search_fit_only(tmp_path):
    """A fit shorter than `min_steps` batches runs eager; a longer one runs its time steps through the compiled step. The decision
    is the point: `compile_step` here installs the eager step behind a counter as the "compiled" one (what compiling gives
    is tests/test_model.py's; a compile in this fit took 40-95 s on 2 cores). 12 batches an epoch"""
    c = numbers_corpus(n_train=300, n_valid=100, n_test=100)
    dls = lm_dls(c, 4, 6, device='cpu')
    learn = search_learner(dls, search_stream(c, 4), path=tmp_path, mode='first', curvature=False, **TINY)
    cell, calls = learn.model.cell, []
    def counted(step): return lambda *a: calls.append(1) or step(*a)
    def compile_step():
        cell._compiled, cell._compiled_tapped = counted(cell._plain_step), counted(cell._tapped_step)
        return cell
    cell.compile_step = compile_step
    n = len(dls.train)
    learn.auto_compile.min_steps = n + 1
    learn.fit(1)
    assert cell._compiled is None and not calls
    learn.fit(2)
    assert cell._compiled is not None and len(calls) >= 2 * n * 6 * 0.9   # every time step of the training batches at least
    assert all(torch.isfinite(torch.tensor(v)) for v in learn.recorder.values[-1])

def test_compile_default_is_on_for_cuda(corpus, tmp_path, monkeypatch):
    "The auto rule looks at the learner's device: a CUDA device gets the compiled step (checked without a GPU)"
    from rnn_darts import learner as L
    seen = []
    monkeypatch.setattr(L.torch.nn.Module, 'to', lambda self, *a, **k: self)      # no GPU here: moving is a no-op
    monkeypatch.setattr(L, 'DartsLearner', lambda dls, model, **k: seen.append(model) or model)
    m = L.DartsRnnSearch(20, 8, 8)
    L._learner(None, m, L.SearchConfig(), '.', 'cuda', 'search')
    assert m.cell._compiled is not None
    m = L.DartsRnnSearch(20, 8, 8)
    L._learner(None, m, L.SearchConfig(), '.', 'cpu', 'search')   # 'auto': AutoCompile decides by the fit's length
    assert m.cell._compiled is None
