"A short search on real Penn Treebank text (../shared/data/penn) moves α away from uniform and changes the genotype."
import tempfile
from pathlib import Path
import pytest, torch
from rnn_darts.core import set_seed
from rnn_darts.data import read_corpus, lm_dls, search_stream
from rnn_darts.learner import search_learner

PENN = Path(__file__).resolve().parents[1].parent/'shared'/'data'/'penn'

@pytest.mark.slow
@pytest.mark.skipif(not (PENN/'valid.txt').exists(), reason=f"real PTB text not found at {PENN} (see shared/data/README.md)")
def test_search_on_ptb_moves_alpha_and_genotype():
    set_seed(3)
    c = read_corpus(PENN, unk='<unk>', files=dict(train='valid.txt', valid='test.txt', test='test.txt'))
    c.train, c.valid = c.train[:30_000], c.valid[:12_000]           # a short run: ~60 batches an epoch
    dls = lm_dls(c, 16, 30, phase='search', seed=3)
    learn = search_learner(dls, search_stream(c, 16), emsize=32, nhid=32, mode='second', arch_lr=3e-2,
                           dropout=0.2, dropouth=0.1, dropoutx=0.1, dropouti=0.1, checkpoint=False, path=tempfile.mkdtemp())
    learn.fit(3)
    w = learn.model.arch_weights().detach()
    assert (w - 0.2).abs().max() > 0.01, "α should have moved away from uniform"
    gens = [h['genotype']['recurrent'] for h in learn.genotype_logger.history]
    assert len({str(g) for g in gens}) > 1, f"the derived genotype should change over epochs: {gens}"
    names = learn.recorder.metric_names[1:-1]
    last = dict(zip(names, learn.recorder.values[-1]))
    assert all(last[k] == last[k] for k in ('train_loss', 'search_loss')), f"training and search losses must be finite: {last}"
    # Not asserted: the eval-mode validation loss. With one thread this run's third validation is NaN: with running
    # (per-node) statistics the supernet's recurrence is not contractive, and over the 1,200 continuous steps of the
    # validation stream the hidden state grows ~1e7-fold every 5 batches until it overflows (batch statistics, as in
    # training, keep it bounded). A known limit of eval-mode validation of the search model, see the README.
