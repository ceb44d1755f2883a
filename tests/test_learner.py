"fastai's idioms on the project's learners (lr_find, fit_one_cycle, get_preds, validate, predict, export / load_learner), hand-built Learners, presets in Python and the top-level API"
import subprocess, sys, traceback, warnings
import pytest, torch, torch.nn.functional as F
from fastai.learner import Learner, load_learner
from fastai.callback.core import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from fastai.losses import CrossEntropyLossFlat
from fastai.callback.rnn import ModelResetter, RNNCallback
from rnn_darts.core import set_seed
from rnn_darts.data import numbers_corpus, lm_dls, search_stream, test_dl as split_dl   # not collected as a test
from rnn_darts.model import DartsRnnSearch
from rnn_darts.engine.runners import Fused
from rnn_darts.learner import SeqCrossEntropy, load_preset, flat_splitter
from rnn_darts.callbacks.arch import ArchParamUpdate
from rnn_darts.callbacks.training import FlatGradClip
from rnn_darts.engine.speed import FusedDecoderLoss
from tests._devices import ON_DEVICES
from tests._learners import twin_learner, tiny_learner

TINY = dict(emsize=16, nhid=16)

@pytest.fixture(scope='module')
def corpus(): return numbers_corpus(n_train=1_500, n_valid=600, n_test=400)

def state(o):
    "Weights of a learner's or a model's (α and BatchNorm statistics included), as copies"
    return {k: v.detach().clone() for k, v in getattr(o, 'model', o).state_dict().items()}

def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a: assert torch.equal(a[k], b[k]), k

@pytest.mark.gpu
@pytest.mark.parametrize('kind', ['search', 'train'])
def test_fused_steps_fit_like_the_unfused_ones(kind, corpus, tmp_path):
    """`fuse=True` on CUDA: the training time steps run as Triton kernels (`rnn_darts.engine.fused`), inside the captured graphs,
    and an epoch's batch losses are the unfused epoch's (float32, cuBLAS against `tl.dot`: within 1e-3)"""
    pytest.importorskip('triton')
    losses = []
    for fuse in (False, True):
        learn = twin_learner(kind, corpus, tmp_path/str(fuse), device='cuda', compile=False, fuse=fuse)
        learn.fit(1)
        assert isinstance(learn.model.runner, Fused) == fuse
        losses.append(torch.stack([torch.as_tensor(l) for l in learn.recorder.losses]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-3, atol=1e-3)

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['search', 'train'])
def test_lr_find_suggests_steps_aside_and_leaves_the_run_as_before(kind, corpus, tmp_path):
    "lr_find over more than one epoch: a suggestion, no checkpoint/log/switch, and a later fit is the fit without lr_find, bit for bit"
    kw = dict(asgd=True) if kind == 'train' else {}
    a, b = twin_learner(kind, corpus, tmp_path/'a', **kw), twin_learner(kind, corpus, tmp_path/'b', **kw)
    w0, rng, dl0 = state(a), torch.get_rng_state(), a.dls.train.state_dict()
    res = a.lr_find(num_it=30, show_plot=False)   # 30 batches: crosses the end of the first epoch
    assert 0 < res.valley < 10 and len(a.recorder.losses) >= 20
    assert_same(state(a), w0)
    assert torch.equal(torch.get_rng_state(), rng) and a.dls.train.state_dict()['gen'] == dl0['gen']
    assert not (tmp_path/'a'/'checkpoints').exists() and not (tmp_path/'a'/'history.json').exists()
    if kind == 'train': assert not a.asgd_switch.active   # NT-ASGD's start=True switch waits for the real fit
    else: assert not a.genotype_logger.history
    set_seed(1); a.fit(1)
    set_seed(1); b.fit(1)
    assert_same(state(a), state(b))   # streams and hidden states were restored too
    assert a.recorder.values[-1] == b.recorder.values[-1]
    assert (tmp_path/'a'/'checkpoints'/'epoch_0000.pth').exists()
    if kind == 'train': assert a.asgd_switch.active

def plain_probs(model, dl):
    "Next-word probabilities over `dl`, batch by batch with the hidden state carried, in eval mode"
    model.eval(); model.reset()
    with torch.no_grad(): res = [model(x)[0].softmax(-1) for x, _ in dl]
    return torch.cat(res, 1)

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['search', 'train'])
def test_fit_one_cycle_get_preds_validate_export_and_load_learner(kind, corpus, tmp_path):
    learn = twin_learner(kind, corpus, tmp_path, **(dict(asgd=True) if kind == 'train' else {}))
    w0 = state(learn)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        learn.fit_one_cycle(1, 1.)
    assert not [w for w in said if 'shadowing' in str(w.message)], [str(w.message) for w in said]   # no callback shadows the learner's attributes
    assert all(v == v for v in learn.recorder.values[-1])
    assert not torch.equal(state(learn)['encoder.weight'], w0['encoder.weight'])
    tdl = split_dl(corpus, 10, bs=2, device='cpu')
    preds, targs = learn.get_preds(dl=tdl)
    n = tdl.data.shape[1] - 1
    assert preds.shape == (2, n, len(corpus.vocab)) and torch.equal(targs, tdl.data[:, 1:])   # concatenated along time
    with learn.asgd_switch.averaged() if kind == 'train' else torch.no_grad():
        torch.testing.assert_close(preds, plain_probs(learn.model, tdl))
    nll = -preds.log().gather(-1, targs[..., None]).mean()
    v = learn.validate(dl=split_dl(corpus, n, bs=2, device='cpu'))[0]   # one batch: validate's loss is the token mean
    torch.testing.assert_close(torch.tensor(v), nll, rtol=1e-5, atol=1e-5)

    raw, opt = learn.model.flat.data.clone(), learn.opt
    learn.export(tmp_path/'export.pkl')
    assert learn.opt is opt and torch.equal(learn.model.flat.data, raw) and learn.dls.train is not None
    loaded = load_learner(tmp_path/'export.pkl')
    assert loaded.dls.vocab == corpus.vocab and loaded.opt is None
    torch.testing.assert_close(loaded.get_preds(dl=tdl)[0], preds, rtol=0, atol=0)
    if kind == 'train':   # the export holds the averaged weights, which evaluation uses
        ax = learn.asgd_switch.averages()
        assert ax is not None and not torch.equal(ax, raw) and torch.equal(loaded.model.flat.data, ax)
    learn.fit(1)   # the exported-from learner trains on, with its optimizer (ASGD's state too)
    assert learn.opt is opt

@pytest.mark.slow
def test_predict_generates_words_from_the_vocabulary_like_plain_sampling(corpus, tmp_path):
    learn = twin_learner('search', corpus, tmp_path)
    learn.fit(1)
    hidden = dict(learn.model.hidden); learn.model.train()
    torch.manual_seed(5); out = learn.predict('one two three', 7, temperature=0.7)
    words = out.split()
    assert words[:3] == ['one', 'two', 'three'] and len(words) == 10 and set(words) <= set(corpus.vocab)
    assert learn.model.training and learn.model.hidden.keys() == hidden.keys()   # mode and streams untouched
    torch.manual_seed(5); assert learn.predict('one two three', 7, temperature=0.7) == out
    # plain sampling: rerun the whole text from a fresh state for every word, as fastai's LMLearner does
    m, stoi, ids = learn.model, {w: i for i, w in enumerate(corpus.vocab)}, [corpus.vocab.index(w) for w in words[:3]]
    m.eval(); torch.manual_seed(5)
    with torch.no_grad():
        for _ in range(7):
            m.hidden.pop('plain', None)
            p = m(torch.tensor([ids]), stream='plain')[0][0, -1].softmax(-1).pow(1 / 0.7)
            ids.append(int(torch.multinomial(p, 1)))
    m.train()
    assert [corpus.vocab[i] for i in ids] == words
    with pytest.raises(KeyError, match="word 'zebra' is not in the vocabulary"): learn.predict('one zebra', 2)
    with pytest.raises(NotImplementedError, match='learn.predict'): learn.show_results()

def hand_built(corpus, path, loss_func, cbs=(), clip=True, **kw):
    "A plain fastai `Learner` (fastai's default splitter and Adam unless `kw` says otherwise) around a tiny search model"
    set_seed(0)
    dls = lm_dls(corpus, bs=8, bptt=10, eval_bs=4, device='cpu')
    cbs = [ModelResetter(), RNNCallback(), ArchParamUpdate(search_stream(corpus, 8, device='cpu'), mode='first')] + [FlatGradClip(0.25)] * clip + list(cbs)
    return Learner(dls, DartsRnnSearch(len(corpus.vocab), **TINY), loss_func=loss_func, path=path, cbs=cbs, **kw)

def test_hand_built_learner_with_flat_splitter_trains(corpus, tmp_path):
    "With `splitter=flat_splitter` and fastai's Adam the flat weights are stepped, never α; the fused loss and CrossEntropyLossFlat on the logits give the same run"
    runs = {}
    for name, loss_func, cbs in [('fused', SeqCrossEntropy(), [FusedDecoderLoss()]), ('logits', CrossEntropyLossFlat(), [])]:
        learn = hand_built(corpus, tmp_path, loss_func, cbs, splitter=flat_splitter)
        w0 = runs['w0'] = state(learn)
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
        assert [p for p, *_ in learn.opt.all_params()] == [learn.model.flat.param]   # the flat buffer alone: no view, no α
        w1 = runs[name] = state(learn)
        runs[name + ' values'] = learn.recorder.values[-1]
        assert not torch.equal(w1['alpha'], w0['alpha']) and not torch.equal(w1['encoder.weight'], w0['encoder.weight'])
        assert all(torch.isfinite(v).all() for v in w1.values()) and all(v == v for v in learn.recorder.values[-1])
    # the two losses are the same function: one epoch of either gives the same losses up to rounding, which Adam's
    # normalised α steps amplify (α ends 2% apart with one thread, 27% with two), so only the losses are compared
    torch.testing.assert_close(runs['fused values'], runs['logits values'], rtol=1e-2, atol=0)   # train and valid loss, perplexity

@pytest.mark.parametrize('what', ['default', 'views', 'alpha'])
@pytest.mark.parametrize('clip', [True, False])
def test_hand_built_learner_with_another_splitter_fails_at_once_saying_what_to_pass(what, clip, corpus, tmp_path):
    "fastai's default splitter (the per-layer views and α), a splitter of the views, or one with α: an error before any step"
    split = dict(default={}, views=dict(splitter=lambda m: [m.weight_parameters()]),
                 alpha=dict(splitter=lambda m: [[m.flat.param] + m.arch_parameters()]))[what]
    learn = hand_built(corpus, tmp_path, SeqCrossEntropy(), clip=clip, **split)   # without FlatGradClip, ArchParamUpdate checks
    w0 = state(learn)
    msg = 'α' if what == 'alpha' else 'its per-layer views'
    with learn.no_bar(), pytest.raises(ValueError, match=f'gave it {msg}.*pass splitter=flat_splitter'): learn.fit(1)
    assert_same(state(learn), w0)   # nothing moved: the error came before the first step

class HostReads(TorchDispatchMode):
    "Records operators that bring a tensor's values to the host (`.item()`, `bool(t)`, `float(t)`, data-dependent shapes): each a sync on CUDA"
    OPS = {'_local_scalar_dense', 'is_nonzero', 'equal', 'nonzero', 'masked_select', 'unique', '_unique2', 'repeat_interleave'}
    def __init__(self, reads): super().__init__(); self.reads = reads
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.OPS:
            where = [f'{f.filename.split("/")[-1]}:{f.lineno} {f.name}' for f in traceback.extract_stack() if '/torch/' not in f.filename]
            self.reads.append((func.overloadpacket.__name__, args[0], where[-3:-1]))
        return func(*args, **(kwargs or {}))

def host_reads_in_training_batches(learn, n_epoch=1):
    "Fit `learn` with every training batch (`before_batch` to `after_batch`, all callbacks) inside `HostReads`; returns the reads"
    reads, one_batch = [], learn.one_batch
    def watched(i, b):
        if not learn.training: return one_batch(i, b)
        with HostReads(reads): return one_batch(i, b)
    learn.one_batch = watched
    try:
        with learn.no_bar(), learn.no_logging(): learn.fit(n_epoch)
    finally: del learn.one_batch
    return reads

@ON_DEVICES
@pytest.mark.parametrize('kind,kw', [('search', dict(mode='second')), ('search', dict(mode='first', alpha=2., beta=1.)),
                                     ('train', dict(asgd=True)), ('train', dict(asgd=False))])
@pytest.mark.slow
def test_a_training_step_never_reads_a_device_value_on_the_host(kind, kw, corpus, tmp_path, device):
    """The learners' whole training step (α's guarded Adam step, the unrolled and finite-difference passes, clipping, NT-ASGD's
    average, the divergence guard, the regularizer) reads no tensor value on the host, so on CUDA it never waits for the device.
    The one read is α's Adam step count, and only where it lives on the host: the optimizer is capturable (count on the device) on CUDA"""
    learn = twin_learner(kind, corpus, tmp_path, device=device, **kw)
    reads = host_reads_in_training_batches(learn)
    assert learn.train_iter >= 15   # every training batch was watched
    if kind == 'search':
        count = learn.arch_param_update.arch_opt.state[learn.model.alpha]['step']
        assert learn.arch_param_update.arch_opt.param_groups[0]['capturable'] == (device == 'cuda') and count.device.type == device
        if device == 'cuda': assert reads == []; return
        assert len(reads) >= learn.train_iter and all(r[1] is count for r in reads), [r for r in reads if r[1] is not count][:3]
    else: assert reads == []

def test_host_reads_are_seen(corpus, tmp_path):
    "The watch sees a host read that a callback adds to every training batch"
    class ReadsTheLoss(Callback):
        def after_batch(self):
            if self.training: self.seen = float(self.learn.loss.detach())
    learn = twin_learner('train', corpus, tmp_path, cbs=[ReadsTheLoss()])
    reads = host_reads_in_training_batches(learn)
    assert len(reads) == learn.train_iter and all(name == '_local_scalar_dense' for name, *_ in reads)
    assert all(any('after_batch' in w for w in where) for *_, where in reads), reads[0][2]

@pytest.mark.slow
def test_readme_python_example_with_a_preset(tmp_path):
    "The README's Python example, at tiny sizes: a preset's data settings and the learners' configs of it"
    from rnn_darts import numbers_corpus, lm_dls, search_stream, test_dl, search_learner, train_learner, evaluate, load_preset, SearchConfig, TrainConfig
    p = load_preset('quick')
    p.update(n_train=1_500, epochs=1, bs=8, bptt=10, eval_bs=4, emsize=16, nhid=16, curvature=False)   # tiny, for the test
    with pytest.raises(TypeError): search_learner(None, None, **p)   # a preset is not a list of learner keywords
    set_seed(p['seed'])
    corpus = numbers_corpus(seed=p['seed'], n_train=p['n_train'], n_valid=600, n_test=400)   # README: default valid/test sizes
    dls = lm_dls(corpus, bs=p['bs'], bptt=p['bptt'], eval_bs=p['eval_bs'], seed=p['seed'])
    learn = search_learner(dls, search_stream(corpus, bs=p['bs']), SearchConfig.of(p), path=tmp_path/'search')
    learn.fit(p['epochs'])
    g = learn.model.genotype()
    dls = lm_dls(corpus, bs=p['bs'], bptt=p['bptt'], phase='train', eval_bs=p['eval_bs'], seed=p['seed'])
    learn_t = train_learner(dls, g, TrainConfig.of(p), path=tmp_path/'train')
    learn_t.fit(1)
    res = evaluate(learn_t, test_dl(corpus, p['bptt']))
    assert learn.arch_param_update.mode == 'second' and learn.model.nhid == 16 and learn_t.model.genotype() == g
    assert res['ppl'] == pytest.approx(torch.tensor(res['loss']).exp().item()) and res['ppl'] < len(corpus.vocab) * 2

@pytest.mark.slow
def test_readme_python_example_and_the_command_line_write_the_same_run(tmp_path):
    """The README's Python example and `rnn-darts search --preset quick --threads 1`, at tiny sizes: the same losses, bit
    for bit, and the same run folder (log.csv's rows, genotype.json, history.json, run.json's settings and data); into a
    file, no bar frames. The Python run is then a run for the commands: `report`, `train --genotype RUN` and
    `search --resume --out RUN --epochs 2` (no other flag: the settings are run.json's), and the command's run
    continues in Python (`resume_learner`) as the Python run does from the command line"""
    import json
    from rnn_darts import cli, set_seed, numbers_corpus, lm_dls, search_stream, search_learner, load_preset, plain_output, SearchConfig, resume_learner
    tiny = dict(n_train=1_500, epochs=1, bs=8, bptt=10, eval_bs=40, emsize=16, nhid=16, curvature=False)   # eval_bs 40: the example's 20,000 validation tokens in 50 batches; λ_max is tests/test_curvature.py's
    n = torch.get_num_threads()
    try:
        flags = [f for k, v in tiny.items() for f in ('--' + k.replace('_', '-'), str(v))]
        by_cli = cli.run_command(['search', '--preset', 'quick', *flags, '--threads', '1', '--device', 'cpu', '--out', str(tmp_path/'cli')])
        p = load_preset('quick'); p.update(tiny)
        torch.set_num_threads(4)   # not the command's: the example sets its own
        set_seed(p['seed']); torch.set_num_threads(1)   # the README's example, as written there
        corpus = numbers_corpus(seed=p['seed'], n_train=p['n_train'])
        dls = lm_dls(corpus, bs=p['bs'], bptt=p['bptt'], eval_bs=p['eval_bs'], seed=p['seed'])
        learn = plain_output(search_learner(dls, search_stream(corpus, bs=p['bs']), SearchConfig.of(p), path=tmp_path/'py'))
        learn.fit(p['epochs'])
    finally: torch.set_num_threads(n)
    assert learn.recorder.values == by_cli.recorder.values and learn.model.genotype() == by_cli.model.genotype()
    assert not any(type(cb).__name__ == 'ProgressCallback' for cb in learn.cbs)   # pytest's stdout is no terminal: lines, not bars
    cli_run, py_run = tmp_path/'cli', tmp_path/'py'
    rows = lambda d: [l.rsplit(',', 1)[0] for l in (d/'log.csv').read_text().splitlines()]   # less the time column
    assert len(rows(py_run)) == 2 and rows(py_run) == rows(cli_run)
    for f in ('genotype.json', 'history.json'): assert (py_run/f).read_text() == (cli_run/f).read_text(), f
    a, b = (json.loads((d/'run.json').read_text()) for d in (cli_run, py_run))
    assert b['finished'] and b['settings'] == {**a['settings'], 'out': str(py_run)} and b['data'] == a['data']
    assert {k: a[k] for k in ('genotype', 'best_valid_loss', 'command', 'device')} == {k: b[k] for k in ('genotype', 'best_valid_loss', 'command', 'device')}
    assert b['sources']['out'] == 'search_learner path' and b['sources']['nhid'] == 'SearchConfig.of' and b['sources']['bs'] == 'lm_dls'
    assert cli.run_command(['report', str(py_run)]) is not None and (py_run/'report').is_dir()
    t = cli.run_command(['train', '--genotype', str(py_run), *flags[:-2], '--device', 'cpu', '--out', str(tmp_path/'train')])   # train has no --curvature
    assert t.model.genotype() == learn.model.genotype()
    cli.run_command(['train', '--resume', '--out', str(tmp_path/'train'), '--epochs', '2'])   # train too: run.json's settings, its cell
    assert len(rows(tmp_path/'train')) == 3 and json.loads((tmp_path/'train'/'run.json').read_text())['finished']
    more = cli.run_command(['search', '--resume', '--out', str(py_run), '--epochs', '2'])   # the command continues the Python run,
    resumed = resume_learner(cli_run)                                                       # and Python the command's
    with resumed.no_bar(): resumed.fit(2)
    assert len(rows(py_run)) == 3 and rows(py_run) == rows(cli_run) and more.model.nhid == resumed.model.nhid == 16
    for d in (cli_run, py_run): assert json.loads((d/'run.json').read_text())['settings']['epochs'] == 2

def test_a_learner_built_by_hand_writes_the_run_with_run_records_callbacks(corpus, tmp_path, capsys):
    """fastai's `Learner` built by hand, with `run_record`'s callbacks (and the `BestValidLoss` they read): run.json with
    its settings and their sources, log.csv, genotype.json, the run finished; a run `rnn-darts report` takes"""
    import json
    from fastai.callback.rnn import ModelResetter, RNNCallback
    from rnn_darts import cli
    from rnn_darts.config import SearchConfig
    from rnn_darts.learner import run_record
    from rnn_darts.callbacks.epochs import BestValidLoss
    dls, out = lm_dls(corpus, bs=8, bptt=10, eval_bs=4), tmp_path/'mine'
    learn = Learner(dls, DartsRnnSearch(len(corpus.vocab), **TINY), loss_func=SeqCrossEntropy(), splitter=flat_splitter, path=out,
                    cbs=[ModelResetter(), RNNCallback(), ArchParamUpdate(search_stream(corpus, 8)), FlatGradClip(0.25), BestValidLoss(),
                         *run_record('search', SearchConfig(**TINY), dls, out)])
    with learn.no_bar(): learn.fit(1, 1e-2)
    info = json.loads((out/'run.json').read_text())
    assert info['finished'] and info['settings']['nhid'] == 16 and info['sources']['nhid'] == 'SearchConfig' and info['sources']['out'] == 'run_record path'
    assert info['genotype'] == json.loads((out/'genotype.json').read_text()) and len((out/'log.csv').read_text().splitlines()) == 2
    assert info['memory']['estimate'] > 0 and info['memory']['peak_of'] == 'resident memory growth since the fit began'
    cli.run_command(['report', str(out)])
    assert (out/'report'/'report.md').is_file()

def test_top_level_api_is_lazy_and_complete():
    code = ("import sys, rnn_darts; assert 'fastai' not in sys.modules, 'import rnn_darts imported fastai'; "
            "from rnn_darts import search_learner; assert 'fastai' in sys.modules; "
            "assert 'torch._dynamo' not in sys.modules, 'importing the learners imported torch._dynamo (~2 s of every start)'; "
            "print(rnn_darts.__version__)")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import rnn_darts, rnn_darts.learner, rnn_darts.genotypes
    assert r.stdout.strip() == rnn_darts.__version__ and rnn_darts.__version__.count('.') >= 2
    for name in rnn_darts.__all__: assert getattr(rnn_darts, name) is not None, name   # every listed name resolves
    assert rnn_darts.search_learner is rnn_darts.learner.search_learner and rnn_darts.DARTS_V2 is rnn_darts.genotypes.DARTS_V2
    with pytest.raises(AttributeError): rnn_darts.no_such_name

def test_ar_penalises_the_output_after_its_dropout():
    """AR (`alpha`) adds alpha·mean(out²) of the cell's output *after* its output dropout (`dropout`), as AWD-LSTM and the
    original do: with the dropout on (p = 0.5) the learner's loss gains exactly that, which differs from the same term on
    the output before dropout; the dropped output is the raw one times a locked mask (one per sequence, 0 or 1/(1 − p))"""
    from rnn_darts.callbacks.training import RNNRegularizer
    seen = {}
    class Spy(Callback):
        order = RNNRegularizer.order + 1
        def after_loss(self):
            if self.training and not seen:
                seen.update(loss=self.loss.detach().clone(), grad=self.loss_grad.detach().clone(),
                            raw=self.rnn.raw_out.detach().clone(), out=self.rnn.out.detach().clone())
    learn = tiny_learner('train', n_train=200, dropout=0.5, alpha=2., beta=0., cbs=[Spy()])
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    raw, out = seen['raw'].float(), seen['out'].float()   # (bs, T, nhid)
    kept = out != 0
    assert kept.any() and (~kept).any() and (kept == kept[:, :1]).all()   # a locked mask: the same at every time step
    torch.testing.assert_close(out, raw * kept / 0.5)
    ar = 2. * out.pow(2).mean()
    torch.testing.assert_close(seen['grad'] - seen['loss'], ar, rtol=1e-5, atol=1e-7)
    assert abs(float(ar - 2. * raw.pow(2).mean())) > 1e-3 * float(ar)   # before dropout: another number
