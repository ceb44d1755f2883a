"""The tests' one tiny learner (`tiny_learner`) and one corpus folder (`corpus_folder`): every test file builds from these (issue 77)"""
import tempfile
from pathlib import Path
from rnn_darts.core import set_seed
from rnn_darts.data import numbers_corpus, lm_dls, search_stream
from rnn_darts.genotypes import DARTS_V2

NODROP = dict(dropout=0., dropouth=0., dropoutx=0., dropouti=0., dropoute=0.)

def tiny_learner(kind='search', corpus=None, path=None, seed=0, n_train=1500, n_valid=800, n_test=300, dl_seed=None, bs=8, bptt=10,
                 phase=None, eval_bs=None, nhid=8, device=None, genotype=DARTS_V2, quiet=True, **kw):
    """A tiny learner: `kind` 'search' (no λ_max unless `curvature=True`; random search: `mode='random'`) or 'train' (the cell `genotype`), on `corpus` (else a
    numbers corpus of about `n_train` / `n_valid` / `n_test` tokens drawn with `seed`: at bs 8 and bptt 10, `n_train` // 80
    batches an epoch), at width `nhid`, without checkpoints unless `checkpoint=True`, its loaders shuffled by `dl_seed`
    (default `seed`); `quiet`: no bar, no printed rows. The global seed is set first: two calls with one seed build equal
    learners. Its corpus is `learn.dls.corpus`"""
    from rnn_darts.learner import search_learner, train_learner
    set_seed(seed)
    c = corpus if corpus is not None else numbers_corpus(seed=seed, n_train=n_train, n_valid=n_valid, n_test=n_test)
    dls = lm_dls(c, bs, bptt, phase or kind, seed=seed if dl_seed is None else dl_seed, device=device,
                 **({} if eval_bs is None else dict(eval_bs=eval_bs)))
    kw = {'emsize': nhid, 'nhid': nhid, 'checkpoint': False, 'path': path or tempfile.mkdtemp(), **kw}
    if kind == 'train': learn = train_learner(dls, genotype, **kw)
    else: learn = search_learner(dls, search_stream(c, bs, device=device), **{**({} if 'random' in (kw.get('mode'), kw.get('method')) else {'curvature': False}), **kw})
    if quiet:
        learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
        learn.recorder.silent = True
    dls.corpus = c
    return learn

def twin_learner(kind, corpus, path, **kw):
    "The learner of the CPU and CUDA twins (tests/test_graphs.py, tests/test_learner.py): a first-order search unless `mode` says, width 16, evaluation batches of 4, checkpoints on"
    return tiny_learner(kind, corpus, path, **{'nhid': 16, 'eval_bs': 4, 'dl_seed': 0, 'checkpoint': True, **({'mode': 'first'} if kind == 'search' else {}), **kw})

WORDS = 'one two three four five six seven eight nine ten'.split()

def corpus_folder(d, train=None, valid=None, test=None, lines=300, eval_lines=40, words=WORDS, length=lambda i: 9) -> str:
    """The folder `d` as a corpus: train.txt, valid.txt and test.txt, each the text (or bytes) given, else `lines` (`eval_lines`)
    generated lines of `length(i)` of `words` (by default about 3,000 / 400 / 400 tokens); returns it as `--data` takes it"""
    d = Path(d); d.mkdir(parents=True, exist_ok=True)
    line = lambda i: ' '.join(words[(i * 7 + k) % len(words)] for k in range(length(i)))
    for s, n, t in (('train', lines, train), ('valid', eval_lines, valid), ('test', eval_lines, test)):
        (d/f'{s}.txt').write_bytes(t if isinstance(t, bytes) else (t if t is not None else ''.join(f' {line(i)} \n' for i in range(n))).encode())
    return str(d)
