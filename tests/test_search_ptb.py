"""A short search on real Penn Treebank text (../shared/data/penn): α moves, the genotype it derives leaves the one its
initial α gave, and the eval-mode
validation loss is finite at every epoch, its best epoch half a nat below a uniform guess. With plain running statistics this configuration's
validation once went NaN (seed 3, one thread, third epoch, torch 2.13). The bound that fixed it is proved where it shows
at the smallest size: `tests/test_model.py` runs 2,000 tokens through a fresh model, finite with the bound and not without.
Here seed 3 runs two epochs of 21 batches of 16 × 15 tokens, eager (the compiled step equals eager in
`tests/test_model.py`): about 35 s on one thread, where 43 batches of 16 × 30 took three minutes and the three seeds of three
epochs eight. The cost is the eager cell's per-time-step work, six passes of it in a second-order step. Its α learning rate (3e-2, ten times the paper's) makes the supernet itself worse
in some epochs (batch, re-estimated and running statistics all rose at seed 3's second epoch in 03_model's measurements),
so falling validation is measured on the paper's settings (the PTB run in 03_model, *The search cell, checked and
measured*), not asserted here. Nor is every epoch below a uniform guess: the trajectory depends on the torch release's
rounding, and with torch 2.14.1 seed 3's second epoch rose to 8.80 against a uniform 8.70 (7.24 with torch 2.13; it
rose to 8.01 at the paper's α learning rate too), while its first was 7.90:
hence half a nat, where the bound was a whole one. Nor does every epoch derive a new genotype: since the cell's products
are grouped by node (other rounding), seed 3's two epochs derive the same one on a Zen 4 with torch 2.14.1 (they differed
before), so the last is compared with the genotype of the initial α (seeds 1-3 move 6-8 of its 8 edges)."""
import math, tempfile
from pathlib import Path
import pytest, torch
from rnn_darts.core import set_seed
from rnn_darts.data import read_corpus, lm_dls, search_stream
from rnn_darts.learner import search_learner

PENN = Path(__file__).resolve().parents[1].parent/'shared'/'data'/'penn'
needs_ptb = pytest.mark.skipif(not (PENN/'valid.txt').exists(), reason=f"real PTB text not found at {PENN} (see shared/data/README.md)")

@pytest.fixture
def one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

def search(seed, epochs=2):
    set_seed(seed)
    c = read_corpus(PENN, unk='<unk>', files=dict(train='valid.txt', valid='test.txt', test='test.txt'))
    c.train, c.valid = c.train[:5_000], c.valid[:4_000]             # a short run: 21 batches an epoch
    dls = lm_dls(c, 16, 15, phase='search', seed=seed)
    learn = search_learner(dls, search_stream(c, 16), emsize=32, nhid=32, mode='second', arch_lr=3e-2,
                           dropout=0.2, dropouth=0.1, dropoutx=0.1, dropouti=0.1, checkpoint=False, path=tempfile.mkdtemp(),
                           curvature=False, compile=False)   # about validation: λ_max on a 10k-word decoder would double its time
    learn.initial_genotype = learn.model.genotype()
    with learn.no_bar(): learn.fit(epochs)
    return learn

def column(learn, name):
    names = learn.recorder.metric_names[1:-1]
    return [dict(zip(names, v))[name] for v in learn.recorder.values]

@pytest.mark.slow
@needs_ptb
def test_search_on_ptb_validation_is_finite(one_thread):
    "Two epochs of a second-order search on real text (seed 3), a 6,000-word vocabulary: over 20 s (see the module's docstring)"
    learn = search(3)
    valid = column(learn, 'valid_loss')
    assert all(v == v and v < float('inf') for v in valid), f"validation must be finite every epoch: {valid}"
    uniform = math.log(len(learn.dls.vocab))
    assert min(valid) < uniform - 0.5, f"the best epoch's validation vs a uniform guess ({uniform:.2f}): {valid}"
    assert all(v == v for k in ('train_loss', 'search_loss') for v in column(learn, k))
    w = learn.model.arch_weights().detach()
    assert (w - 0.2).abs().max() > 0.01, "α should have moved away from uniform"
    last = learn.genotype_logger.history[-1]['genotype']['recurrent']
    assert last == [list(e) for e in learn.model.genotype().recurrent], "the log's last genotype is the one α derives now"
    moved = sum(a != tuple(b) for a, b in zip(learn.initial_genotype.recurrent, last))
    assert moved >= 4, f"the search should move at least half the edges from its initial α's genotype: {moved} of 8 moved"
