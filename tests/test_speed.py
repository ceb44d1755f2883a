"The fast path users get by default: compiled steps on GPUs; on CPUs, compiled for a search long enough to pay back the warm-up."
import pytest, torch
from rnn_darts.data import numbers_corpus, lm_dls, search_stream
from rnn_darts.genotypes import DARTS_V2
from rnn_darts.learner import search_learner, train_learner
from rnn_darts.engine.speed import AutoCompile, COMPILE_MIN_STEPS
from rnn_darts.engine import runners
from rnn_darts.engine.runners import Compiled, plain_step, tapped_step

TINY = dict(emsize=8, nhid=8, checkpoint=False)

@pytest.fixture(scope='module')
def corpus(): return numbers_corpus(n_train=1_500, n_valid=600, n_test=400)

def test_compile_default_on_cpu_and_the_flag(corpus, tmp_path):
    "On a CPU the search learner decides per fit (`AutoCompile`), the training learner runs eager; the flag decides outright"
    dls = lm_dls(corpus, 4, 6, device='cpu')
    search = lambda **k: search_learner(dls, search_stream(corpus, 4), path=tmp_path, **TINY, **k)
    train = lambda **k: train_learner(dls, DARTS_V2, path=tmp_path, **TINY, **k)
    learn = search()
    assert not learn.model.runner.compiles and learn.auto_compile.min_steps == COMPILE_MIN_STEPS
    assert not any(isinstance(cb, AutoCompile) for cb in train().cbs) and not train().model.runner.compiles
    for make in (search, train):
        assert make(compile=True).model.runner.compiles     # asked for: compiled (lazily, at the first batch)
        f = make(compile=False)
        assert not f.model.runner.compiles and not any(isinstance(cb, AutoCompile) for cb in f.cbs)

@pytest.mark.slow
def test_auto_compile_compiles_a_long_search_fit_only(tmp_path, monkeypatch):
    """A fit shorter than `min_steps` batches runs eager; a longer one runs its time steps through the compiled step. The decision
    is the point: `Compiled` here runs the eager step behind a counter as the "compiled" one (what compiling gives
    is tests/test_model.py's; a compile in this fit took 40-95 s on 2 cores). 12 batches an epoch"""
    c = numbers_corpus(n_train=300, n_valid=100, n_test=100)
    dls = lm_dls(c, 4, 6, device='cpu')
    learn = search_learner(dls, search_stream(c, 4), path=tmp_path, mode='first', curvature=False, **TINY)
    cell, calls = learn.model.cell, []
    class Counted(Compiled):
        def __init__(self, cell, fused_loss=True, tap_min_numel=None):
            super().__init__(cell, fused_loss, tap_min_numel)   # compiles nothing until called: its functions replaced here
            self.plain = lambda *a: calls.append(1) or plain_step(cell, *a)
            self.tapped = lambda *a: calls.append(1) or tapped_step(cell, *a)
    monkeypatch.setattr(runners, 'Compiled', Counted)
    n = len(dls.train)
    learn.auto_compile.min_steps = n + 1
    learn.fit(1)
    assert not learn.model.runner.compiles and not calls
    learn.fit(2)
    assert type(learn.model.runner) is Counted and len(calls) >= 2 * n * 6 * 0.9   # every time step of the training batches at least
    assert learn.model.runner.tap_min_numel == learn.plan.tap_min_numel   # compiled as the plan says
    assert all(torch.isfinite(torch.tensor(v)) for v in learn.recorder.values[-1])

def test_compile_default_is_on_for_cuda(corpus, tmp_path, monkeypatch):
    "The auto rule looks at the learner's device: a CUDA device gets the compiled step (checked without a GPU)"
    from rnn_darts import learner as L
    seen = []
    monkeypatch.setattr(L.torch.nn.Module, 'to', lambda self, *a, **k: self)      # no GPU here: moving is a no-op
    monkeypatch.setattr(L, 'DartsLearner', lambda dls, model, **k: seen.append(model) or model)
    m = L.DartsRnnSearch(20, 8, 8)
    L._learner(None, m, L.SearchConfig(), '.', 'cuda', 'search')
    assert m.runner.compiles
    m = L.DartsRnnSearch(20, 8, 8)
    L._learner(None, m, L.SearchConfig(), '.', 'cpu', 'search')   # 'auto': AutoCompile decides by the fit's length
    assert not m.runner.compiles

def test_the_plan_decides_compiling_for_the_fit_and_says_why(tmp_path):
    """The command line's plan decides compiling for the fit it counts (`plan.with_fit`): the quick preset's shapes for
    one epoch (62 batches) run eager, saying why; 4 epochs compile, saying it is a first compile; once the plan's ledger
    holds the step (Inductor's cache does), one epoch compiles too, 'cached'"""
    from rnn_darts import runs
    from rnn_darts.config import compile_key
    from rnn_darts.engine.plan import record_compile
    flags = dict(data='numbers', n_train=40_000, n_eval=1_500, emsize=64, nhid=64, bs=32, bptt=20, epochs=1, device='cpu', curvature=False)
    def plan(out, **kw):
        r = runs._prepare('search', dict(flags, out=str(tmp_path/out), **kw)); r.close()
        return r
    r = plan('a')
    assert r.plan.compile is False and r.plan.path == 'eager (62 batches: compiling would not pay), fp32'
    r = plan('b', epochs=4)
    assert r.plan.compile is True and r.plan.path == 'compiled (first compile, about 1 min), fp32'
    record_compile(compile_key(r.s, 'search', r.dev), 50.)
    assert plan('c').plan.path == 'compiled (cached), fp32'
    assert plan('d', bs=16).plan.path == 'eager (125 batches: compiling would not pay), fp32'   # another batch size: another step, not in the cache

def test_auto_compile_of_a_python_fit_reads_the_ledger_that_a_compile_writes(monkeypatch):
    """A learner of Python's ('auto'): `AutoCompile` compiles 48 batches only once the plan's ledger holds its step, and
    `CompileNotice` writes the ledger when a compiled step's first training batch ends"""
    import io
    from contextlib import redirect_stdout
    from types import SimpleNamespace
    from rnn_darts.model import DartsRnnSearch
    from rnn_darts.engine.plan import compiled_here
    from rnn_darts.engine.speed import CompileNotice
    def auto(key):
        cb = AutoCompile(key)
        cb.learn = SimpleNamespace(model=DartsRnnSearch(20, 8, 8), n_epoch=4, epoch=0, dls=SimpleNamespace(train=range(12)))
        cb.before_train()
        return cb.learn.model
    assert not auto('k').runner.compiles and compiled_here('k') is None
    m = auto('k'); m.runner = Compiled(m.cell)   # compiled: its first batch is timed
    notice = CompileNotice(quiet=60., key='k'); notice.learn = SimpleNamespace(model=m)
    with redirect_stdout(io.StringIO()) as out: notice.say('training')   # the notice of a first compile
    assert 'min with an empty Inductor cache' in out.getvalue(), out.getvalue()
    notice.before_train(); notice.after_batch()
    assert compiled_here('k') is not None and auto('k').runner.compiles
    with redirect_stdout(io.StringIO()) as out: notice.say('training')   # and once the cache holds the step
    assert "Inductor's cache holds its code, so only the tracing" in out.getvalue(), out.getvalue()
