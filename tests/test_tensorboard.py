"""--tensorboard DIR (issue 69): a search's and a training's epochs in TensorBoard's event files, read back with
TensorBoard's own reader; a resume appends its epochs without repeating any; without the package, one line. A study's
stages, each its own run: tests/test_study.py (in turn, and on Ray)."""
import json, math, sys
from pathlib import Path
import pytest
from rnn_darts import cli
from rnn_darts.plot import dot_path

tb = pytest.importorskip('tensorboard', reason="tensorboard is not installed (pip install -e '.[dev]' installs it)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TINY = ['--data', 'numbers', '--n-train', '1500', '--n-eval', '600', '--bs', '8', '--bptt', '10', '--eval-bs', '4', '--emsize', '16',
        '--nhid', '16', '--threads', '1', '--device', 'cpu']

def events(d) -> EventAccumulator:
    "Every event file in the run folder `d`, as TensorBoard reads them (images and text kept whole)"
    return EventAccumulator(str(d), size_guidance={'images': 0, 'tensors': 0, 'scalars': 0}).Reload()

def steps(ea, tag): return [s.step for s in ea.Scalars(tag)]

@pytest.mark.slow
def test_a_search_writes_its_epochs_and_a_resume_appends_without_repeats(tmp_path, capsys):
    """Two epochs of a first-order search with λ_max: each epoch's valid_loss and lambda_max, as log.csv has them, α's
    image and the cell's text; the run resumed to 3 epochs adds the third, each step once; the settings as hparams"""
    run, board = tmp_path/'s', tmp_path/'tb'
    argv = ['search', *TINY, '--mode', 'first', '--curvature-windows', '1', '--epochs', '2', '--out', run, '--tensorboard', board]
    cli.run_command(list(map(str, argv)))
    said = [l.split(' = ', 1)[1] for l in capsys.readouterr().out.splitlines() if l.startswith('epoch ') and ': genotype = ' in l]
    ea = events(board)
    log = [l.split(',') for l in (run/'log.csv').read_text().splitlines()]
    col = lambda name: [float(r[log[0].index(name)]) for r in log[1:]]
    assert steps(ea, 'valid_loss') == steps(ea, 'lambda_max') == [0, 1]
    for name in ('valid_loss', 'lambda_max', 'train_loss', 'search_loss'):   # log.csv's numbers, to its six decimals
        assert [s.value for s in ea.Scalars(name)] == pytest.approx(col(name), abs=1e-6), name
    assert [s.value for s in ea.Scalars('lr')] == pytest.approx([20., 20.])
    assert len(ea.Images('alpha')) == 2 and ea.Images('alpha')[0].width > 100
    assert ('cell diagram' in ea.Tags()['images']) == (dot_path() is not None)   # graphviz's picture of the cell, where dot is present
    assert [t.tensor_proto.string_val[0].decode() for t in ea.Tensors('cell/text_summary')] == said and len(said) == 2   # each epoch's cell, as printed
    cli.run_command(list(map(str, [a if a != '2' else '3' for a in argv] + ['--resume'])))   # one epoch more
    ea = events(board)
    assert steps(ea, 'valid_loss') == [0, 1, 2] and len(ea.Images('alpha')) == 3
    hp = EventAccumulator(str(board)).Reload()
    best = json.loads((run/'run.json').read_text())['best_valid_loss']
    assert [s.value for s in hp.Scalars('hparam/best_valid_loss')][-1] == pytest.approx(best)
    assert [s.value for s in hp.Scalars('hparam/best_valid_ppl')][-1] == pytest.approx(math.exp(best), rel=1e-6)

def test_a_training_writes_its_epochs(tmp_path):
    "A derived cell's training: its numbers each epoch, no α"
    board = tmp_path/'tb'
    cli.run_command(list(map(str, ['train', *TINY, '--test-bs', '4', '--epochs', '2', '--out', tmp_path/'t', '--tensorboard', board])))
    ea = events(board)
    assert steps(ea, 'valid_loss') == steps(ea, 'perplexity') == [0, 1] and 'alpha' not in ea.Tags()['images']

def test_without_tensorboard_one_line_and_nothing_written(tmp_path, capsys, monkeypatch):
    "As --ray without Ray: one line saying how to install it, exit 1, before any run folder is made"
    monkeypatch.setitem(sys.modules, 'torch.utils.tensorboard', None)
    for argv in (['search', *TINY, '--out', str(tmp_path/'s')], ['train', *TINY, '--out', str(tmp_path/'t')]):
        with pytest.raises(SystemExit) as e: cli.run_command([*argv, '--tensorboard', str(tmp_path/'tb')])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and err == ("rnn-darts: error: --tensorboard needs TensorBoard, an optional extra of rnn-darts: "
                                             "pip install 'rnn-darts[tensorboard]' (in a checkout: pip install -e '.[tensorboard]')"), err
    assert not any(Path(tmp_path).iterdir())

def test_a_failing_dot_turns_the_diagrams_off_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    "graphviz present but failing (a broken install): one line, no diagram, every epoch still written"
    from rnn_darts import plot
    def broken(g): raise RuntimeError("dot -Tpng failed: no fonts")
    monkeypatch.setattr(plot, 'dot_path', lambda: '/usr/bin/dot')
    monkeypatch.setattr(plot, 'genotype_png', broken)
    board = tmp_path/'tb'
    cli.run_command(list(map(str, ['train', *TINY, '--test-bs', '4', '--epochs', '2', '--out', tmp_path/'t', '--tensorboard', board])))
    assert "TensorBoard: no cell diagrams from here on (dot -Tpng failed: no fonts)" in capsys.readouterr().out
    ea = events(board)
    assert steps(ea, 'valid_loss') == [0, 1] and 'cell diagram' not in ea.Tags()['images']

def test_a_path_that_cannot_be_a_folder_is_one_line_before_any_run_folder(tmp_path, capsys):
    "--tensorboard naming a file, or a path under one: exit 2, one line naming the file, no run folder made (issue 80: it was an 80-line traceback and a folder holding only .lock)"
    (tmp_path/'notes.txt').write_text('mine')
    for logdir in (tmp_path/'notes.txt', tmp_path/'notes.txt'/'tb'):
        with pytest.raises(SystemExit) as e: cli.run_command(['search', *TINY, '--out', str(tmp_path/'s'), '--tensorboard', str(logdir)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err == (f"rnn-darts: error: --tensorboard {logdir}: {tmp_path/'notes.txt'} is a file; "
                                             "name a folder for TensorBoard's event files"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt'] and (tmp_path/'notes.txt').read_text() == 'mine'
