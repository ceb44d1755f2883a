"The fast path users get by default: compiled steps on GPUs, eager on CPUs (where the warm-up outweighs the gain)."
import pytest, torch
from rnn_darts.data import numbers_corpus, lm_dls, search_stream
from rnn_darts.genotypes import DARTS_V2
from rnn_darts.learner import search_learner, train_learner

TINY = dict(emsize=8, nhid=8, checkpoint=False)

@pytest.fixture(scope='module')
def corpus(): return numbers_corpus(n_train=1_500, n_valid=600, n_test=400)

def test_compile_default_is_eager_on_cpu_and_follows_the_flag(corpus, tmp_path):
    dls = lm_dls(corpus, 4, 6, device='cpu')
    for make in (lambda **k: search_learner(dls, search_stream(corpus, 4), path=tmp_path, **TINY, **k),
                 lambda **k: train_learner(dls, DARTS_V2, path=tmp_path, **TINY, **k)):
        assert make().model.cell._compiled is None                     # auto on a CPU: eager
        assert make(compile=True).model.cell._compiled is not None     # asked for: compiled (lazily, at the first batch)
        assert make(compile=False).model.cell._compiled is None

def test_compile_default_is_on_for_cuda(corpus, tmp_path, monkeypatch):
    "The auto rule looks at the learner's device: a CUDA device gets the compiled step (checked without a GPU)"
    from rnn_darts import learner as L
    seen = []
    monkeypatch.setattr(L.torch.nn.Module, 'to', lambda self, *a, **k: self)      # no GPU here: moving is a no-op
    monkeypatch.setattr(L, 'DartsLearner', lambda dls, model, **k: seen.append(model) or model)
    m = L.DartsRnnSearch(20, 8, 8)
    L._learner(None, m, 1., 0., None, [], '.', 'cuda')
    assert m.cell._compiled is not None
    m = L.DartsRnnSearch(20, 8, 8)
    L._learner(None, m, 1., 0., None, [], '.', 'cpu')
    assert m.cell._compiled is None
