"""Random search with weight sharing (`--mode random`): the shared model is the derived model, cells are drawn uniformly,
the scores in candidates.csv are true, and a run killed in training or in the scoring resumes to the same result."""
import json, math, signal
import pytest, torch
import torch.nn.functional as F
from fastai.callback.core import Callback
from rnn_darts import cli
from rnn_darts.core import set_seed
from rnn_darts.data import numbers_corpus, lm_dls
from rnn_darts.genotypes import PRIMITIVES, sample_genotype, load_genotype
from rnn_darts.learner import search_learner
from rnn_darts.model import DartsRnn, DartsRnnShared
from rnn_darts.callbacks.checkpoint import load_checkpoint
from tests._signals import stop_at

DROP = dict(dropout=0.3, dropouth=0.2, dropoutx=0.2, dropouti=0.1, dropoute=0.1)   # every dropout on: the masks must agree too

def derived_copy(shared, g):
    "A `DartsRnn` of genotype `g` holding `shared`'s weights, copied matrix by matrix (the derived cell packs them in its own order)"
    d = DartsRnn(shared.ntoken, g, shared.emsize, shared.nhid, dropout=shared.dropout, dropouth=shared.cell.dropouth,
                 dropoutx=shared.cell.dropoutx, dropouti=shared.dropouti, dropoute=shared.dropoute)
    with torch.no_grad():
        d.encoder.weight.copy_(shared.encoder.weight); d.decoder_bias.copy_(shared.decoder_bias)
        d.cell.W0.copy_(shared.cell.W0)
        for i in range(1, len(g.recurrent) + 1): d.cell.W(i).copy_(shared.cell.W(i))
    return d

@pytest.mark.parametrize('seed', range(4))
def test_shared_model_runs_the_derived_cell(seed):
    "A drawn cell through the shared weights equals `DartsRnn` of that genotype with the same weights: losses (train, with dropout, and eval) and every gradient"
    torch.manual_seed(seed)
    g = sample_genotype(generator=torch.Generator().manual_seed(seed))
    s = DartsRnnShared(40, 16, 16, **DROP).use(g)
    d = derived_copy(s, g)
    x, y = torch.randint(0, 40, (4, 9)), torch.randint(0, 40, (4, 9))
    for train in (True, False):
        losses = []
        for m in (s, d):
            m.train(train); m.reset(); m.zero_grad()
            torch.manual_seed(100 + seed)             # the same dropout masks, drawn in the same order
            losses.append(m(x, y)[0])
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-6)
        if train:
            for l in losses: l.backward()
            torch.testing.assert_close(s.encoder.weight.grad, d.encoder.weight.grad, rtol=1e-5, atol=1e-7)
            n0 = s.cell.W0.numel()
            torch.testing.assert_close(s.cell.block.grad[:n0], d.cell.block.grad[:n0], rtol=1e-5, atol=1e-7)
            n2, nh = 2 * s.nhid, s.nhid
            for i in range(1, 9):   # node i's matrix: block i in the shared layout, block col[i-1] in the derived one
                gs = s.cell.block.grad[n0:].view(-1, nh)[(i - 1) * n2:i * n2]
                k = d.cell.col[i - 1]
                gd = d.cell.block.grad[n0:].view(-1, nh)[k * n2:(k + 1) * n2]
                torch.testing.assert_close(gs, gd, rtol=1e-5, atol=1e-7)

# chi-square critical values at p = 0.001 for 1..7 degrees of freedom
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32]

def chi2(counts, n):
    e = n / len(counts)
    return sum((c - e) ** 2 / e for c in counts)

def test_sampling_is_uniform_per_node():
    "Every node's op (4 of them, never `none`) and predecessor (any earlier node) are uniform: chi-square at p = 0.001"
    n, gen = 16000, torch.Generator().manual_seed(11)
    draws = [sample_genotype(generator=gen) for _ in range(n)]
    ops = PRIMITIVES[1:]
    for i in range(8):
        op_counts = [sum(g.recurrent[i][0] == o for g in draws) for o in ops]
        assert chi2(op_counts, n) < CHI2_999[len(ops) - 2], (i, op_counts)
        if i:
            pred_counts = [sum(g.recurrent[i][1] == p for g in draws) for p in range(i + 1)]
            assert chi2(pred_counts, n) < CHI2_999[i - 1], (i, pred_counts)
        else: assert all(g.recurrent[0][1] == 0 for g in draws)
    assert all(g.concat == tuple(range(1, 9)) for g in draws)

class CellSpy(Callback):
    "Record the cell the model runs at every batch (after RandomArch chose it)"
    order = 50
    def before_fit(self): self.trained, self.validated = [], []
    def after_pred(self): (self.trained if self.training else self.validated).append(self.model.genotype())

def test_a_new_cell_every_training_batch_from_the_seeded_sampler(tmp_path):
    "In a fit: training batch k runs the sampler's k-th cell; validation runs the same fixed sequence every epoch; no α anywhere"
    set_seed(0)
    c = numbers_corpus(0, 2000, 600, 300)
    learn = search_learner(lm_dls(c, 8, 10, 'search', eval_bs=4, seed=0), None, emsize=8, nhid=8, mode='random', path=tmp_path,
                           checkpoint=False, cbs=[spy := CellSpy()])
    assert not any(n == 'alpha' for n, _ in learn.model.named_parameters())
    gen = torch.Generator().manual_seed(learn.random_arch.seed)
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    assert spy.trained == [sample_genotype(8, gen) for _ in spy.trained]
    half = len(spy.validated) // 2
    assert half > 1 and spy.validated[:half] == spy.validated[half:] and len(set(spy.validated[:half])) > 1

def test_compile_and_alpha_options_are_refused_in_python():
    c = numbers_corpus(0, 2000, 600, 300)
    dls = lm_dls(c, 8, 10, 'search', eval_bs=4)
    with pytest.raises(ValueError, match="op_decay applies to the architecture weights α, which random search"): search_learner(dls, None, emsize=8, nhid=8, mode='random', op_decay=0.1)
    with pytest.raises(ValueError, match='compile true: random search runs another cell every batch, and a compiled step would recompile'): search_learner(dls, None, emsize=8, nhid=8, mode='random', compile=True)
    with pytest.raises(ValueError, match="mode must be one of"): search_learner(dls, None, emsize=8, nhid=8, mode='randm')

# --- the command line ---------------------------------------------------------------------------------------------
TINY = ['--data', 'numbers', '--n-train', '1500', '--n-eval', '1500', '--bs', '8', '--bptt', '10', '--eval-bs', '4', '--emsize', '16', '--nhid', '16',
        '--device', 'cpu', '--threads', '1', '--mode', 'random']

def plain_stream_loss(model, data, bptt):
    "Token-weighted mean cross-entropy over `data`'s rows, window by window, state carried: written out with the plain decoder"
    model.eval(); model.reset(); total, n, h = 0., 0, None
    with torch.no_grad():
        for i in range(0, data.shape[1] - 1, bptt):
            y = data[:, i + 1:i + 1 + bptt]
            logits = model(data[:, i:i + y.shape[1]])[0]
            total += F.cross_entropy(logits.reshape(-1, model.ntoken).double(), y.reshape(-1), reduction='sum').item()
            n += y.numel()
    return total / n

@pytest.mark.slow
def test_random_search_cli_end_to_end(tmp_path, capsys):
    "search --mode random writes candidates.csv (sorted, true scores), genotype.json (its winner), a report with the histogram; train takes the winner"
    import pandas as pd
    out = tmp_path/'r'
    learn = cli.run_command(['search', *TINY, '--epochs', '2', '--candidates', '24', '--top', '4', '--out', str(out)])
    said = capsys.readouterr().out
    assert 'scoring 24 cells with the shared weights' in said and 'chose ' in said
    df = pd.read_csv(out/'candidates.csv')
    assert list(df['rank']) == list(range(1, 25)) and len(set(df.cell)) == 24
    assert df.valid_loss[:4].notna().all() and df.valid_loss[4:].isna().all()
    assert df.valid_loss[:4].is_monotonic_increasing and df.screen_loss[4:].is_monotonic_increasing
    assert df.screen_loss[:4].max() <= df.screen_loss[4:].min()          # the full pass took the screen's best 4
    win = load_genotype(out/'genotype.json')
    assert win == load_genotype(df.genotype[0]) == load_genotype(json.loads((out/'run.json').read_text())['genotype'])
    assert json.loads(df.genotype[0]) == json.loads((out/'genotype.json').read_text())   # each row as genotype.json has it, its op set too
    # the numbers are true: the winner and the 4th as a plain DartsRnn with the final checkpoint's weights, scored by hand
    state = load_checkpoint(out/'checkpoints'/'epoch_0001.pth')
    shared = DartsRnnShared(learn.model.ntoken, 16, 16); shared.load_state_dict(state['model'])
    vdata = learn.dls.valid.data
    for r in (0, 3):
        g = load_genotype(df.genotype[r])
        assert plain_stream_loss(derived_copy(shared, g), vdata, 10) == pytest.approx(df.valid_loss[r], abs=2e-5)
        assert math.exp(df.valid_loss[r]) == pytest.approx(df.valid_ppl[r], rel=1e-9)
    ids = vdata.reshape(-1)
    rows = min(1024, len(ids) // 11)
    screen = ids[:len(ids) // rows * rows].view(rows, -1)
    g = load_genotype(df.genotype[10])
    assert plain_stream_loss(derived_copy(shared, g), screen, 10) == pytest.approx(df.screen_loss[10], abs=2e-5)
    # the report, and the winner trained from scratch as any genotype file
    cli.run_command(['report', str(out)])
    assert (out/'report'/'candidates.png').is_file() and 'candidates.png' in (out/'report'/'report.md').read_text()
    t = cli.run_command(['train', *TINY[:-2], '--epochs', '1', '--genotype', str(out/'genotype.json'), '--out', str(tmp_path/'t')])
    assert t.model.genotype() == win
    res = cli.run_command(['evaluate', str(out), '--split', 'valid', '--checkpoint', 'last', '--threads', '1'])
    assert res['loss'] == pytest.approx(df.valid_loss[0], abs=0.05)   # fastai's validate weighs windows, not tokens: close, not equal

def _same_result(ref, run):
    for f in ('candidates.csv', 'genotype.json'): assert (ref/f).read_text() == (run/f).read_text(), f
    strip = lambda d: [l.rsplit(',', 1)[0] for l in (d/'log.csv').read_text().splitlines()]   # without the time column
    assert strip(ref) == strip(run)

@pytest.mark.slow
def test_a_kill_while_scoring_resumes_exactly(tmp_path, capsys):
    """SIGKILL while the cells are scored (by subprocess: the kill is the point): --resume ends with the same log, candidates.csv and
    genotype.json as an uninterrupted run (both in this process). 30 cells screened, then the best 8 on the full split (~0.4 s
    each): the kill lands where the first scores are saved (held there). (A kill in training: tests/test_resume.py's random
    case and test_reliability's SIGKILL)"""
    args = [*TINY, '--epochs', '1', '--candidates', '30', '--top', '8']
    run = tmp_path/'run'
    code, out, err = stop_at(['search', *args, '--out', run], 'run scores saved', signal.SIGKILL, tmp_path)   # held at the first scores saved
    assert code == -signal.SIGKILL, out + err
    assert not (run/'candidates.csv').exists()
    capsys.readouterr()
    cli.run_command(['search', *args, '--out', str(run), '--resume'])
    said = capsys.readouterr().out
    assert 'resumed from' in said and 'continuing the scoring' in said, said
    cli.run_command(['search', *args, '--out', str(tmp_path/'ref')])
    _same_result(tmp_path/'ref', run)

def test_readme_python_example(tmp_path):
    "The random-search lines in Python (15_random, *Running it*), at tiny sizes: a preset's config with mode='random', fit, choose_cell"
    from rnn_darts import numbers_corpus, lm_dls, search_learner, load_preset, SearchConfig, choose_cell
    p = load_preset('quick')
    p.update(n_train=1_500, epochs=1, bs=8, bptt=10, eval_bs=4, emsize=16, nhid=16)
    corpus = numbers_corpus(seed=p['seed'], n_train=p['n_train'], n_valid=600, n_test=400)
    dls = lm_dls(corpus, bs=p['bs'], bptt=p['bptt'], eval_bs=p['eval_bs'], seed=p['seed'])
    learn = search_learner(dls, None, SearchConfig.of(p), path=tmp_path/'py_random', mode='random')
    learn.fit(p['epochs'])
    df = choose_cell(learn, show=False)
    assert len(df) == 100 and df['rank'].tolist() == list(range(1, 101))   # at least 100 cells by default
    assert load_genotype(tmp_path/'py_random'/'genotype.json') == learn.model.genotype() == learn.random_arch.chosen
