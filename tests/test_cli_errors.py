"""The command line answers, it does not crash (issue 13): every bad input is one line `rnn-darts: error: ...` naming
the flag, key or file, exit status 2 for bad flags and values, 1 otherwise; no traceback unless --debug; run folders
are refused, locked, overwritten and resumed as documented; presets ship with the package; --help is fast."""
import errno, json, os, re, shutil, subprocess, sys, time
from pathlib import Path
import pytest, torch
from rnn_darts import cli, options, runs
from rnn_darts.core import UsageError
from rnn_darts.callbacks.checkpoint import latest_checkpoint
from tests._learners import corpus_folder

ROOT = Path(__file__).resolve().parents[1]
TINY = ['--epochs', '1', '--bs', '8', '--bptt', '10', '--eval-bs', '4', '--emsize', '8', '--nhid', '8', '--device', 'cpu']
NUM = ['--n-train', '3000', '--n-eval', '1500', *TINY]

def fails(capsys, argv, code, *parts):
    "Run `rnn-darts ARGV`: it must exit with `code` and print exactly one error line containing `parts`, no traceback"
    with pytest.raises(SystemExit) as e: cli.run_command(argv)
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert e.value.code == code, err
    assert len(lines) == 1 and lines[0].startswith('rnn-darts: error: '), err
    for p in parts: assert p in lines[0], (p, lines[0])
    assert 'Traceback' not in out + err
    return lines[0]

RUN = [*TINY, '--mode', 'first', '--curvature', 'false']   # the finished run's flags: what is refused or resumed is the point, not its math

@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
    "A finished 1-epoch search on a small corpus folder, 11 batches (its users share one worker: `xdist_group`, so it is made once)"
    d = tmp_path_factory.mktemp('run')
    data = corpus_folder(d/'corpus', lines=80)
    cli.run_command(['search', '--data', data, *RUN, '--out', str(d/'run')])
    return d/'run', data

uses_run_dir = pytest.mark.xdist_group('cli-errors-run')

# --- flag and preset values: exit 2, the flag or key named ----------------------------------------------------------
@pytest.mark.parametrize('argv,parts', [
    (['--lr', 'nan'], ['--lr must be a finite number > 0, got nan']),
    (['--lr', '-1'], ['--lr must be a finite number > 0, got -1.0']),
    (['--arch-lr', 'inf'], ['--arch-lr must be a finite number > 0, got inf']),
    (['--epochs', '0'], ['--epochs must be an integer >= 1, got 0']),
    (['--clip', '-0.5'], ['--clip must be a finite number >= 0']),
    (['--bs', '0'], ['--bs must be an integer >= 1, got 0']),
    (['--eval-bs', '-2'], ['--eval-bs must be an integer >= 1']),
    (['--bptt', '1'], ['--bptt must be an integer >= 2, got 1']),
    (['--seed', '-1'], ['--seed must be an integer >= 0']),
    (['--nhid', '0', '--emsize', '0'], ['must be an integer >= 1, got 0']),
    (['--emsize', '16'], ['--emsize (16) must equal --nhid (8)']),
    (['--dropout', '1.0'], ['--dropout is a dropout probability and must be in [0, 1), got 1.0']),
    (['--dropoute', '-0.1'], ['--dropoute is a dropout probability']),
    (['--mode', 'third'], ["--mode must be one of second, first, exact, mixed, single, random; got 'third'"]),
    (['--candidates', '5'], ['--candidates applies to random search (the cells it scores after training), not to mode second']),
    (['--mode', 'random', '--arch-lr', '0.1'], ['--arch-lr applies to the architecture weights α, which random search (mode random) does not have']),
    (['--mode', 'random', '--compile', 'true'], ['--compile true: random search runs another cell every batch']),
    (['--mode', 'random', '--candidates', '5', '--top', '6'], ['--top (6) cannot exceed --candidates (5)']),
    (['--mode', 'random', '--candidates', '0'], ['--candidates must be an integer >= 1, got 0']),
    (['--mode', 'random', '--early-stop', 'true'], ['--early-stop applies to the architecture weights α']),
    (['--early-stop', 'true', '--curvature', 'false'], ['--early-stop true needs --curvature true: DARTS-ES stops on λ_max']),
    (['--curvature-windows', '0'], ['--curvature-windows must be an integer >= 1, got 0']),
    (['--curvature', 'false', '--curvature-windows', '3'], ['--curvature-windows sets how λ_max is measured, and --curvature is false']),
    (['--mode', 'random', '--curvature-windows', '3'], ['--curvature-windows applies to the architecture weights α']),
    (['--on-nan', 'never'], ["--on-nan must be one of rollback, stop, skip; got 'never'"]),
    (['--relax', 'foo'], ["--relax must be one of softmax, sigmoid, gdas, snas, drnas; got 'foo'"]),
    (['--method', 'foo'], ["--method must be one of second, first, exact, random, darts, gdas"]),
    (['--method', 'gdas', '--mode', 'exact'], ["--method gdas sets mode to 'first'; --mode 'exact' contradicts it"]),
    (['--relax', 'snas', '--mode', 'exact'], ["--relax snas draws its mixing weights: the exact hypergradient (--mode exact)"]),
    (['--relax', 'drnas'], ["--relax drnas with --mode (default) second"]),
    (['--tau-min', '0.5'], ["--tau-min (GDAS's and SNAS's last temperature τ) has an effect only with --relax gdas or snas, and --relax (default) is softmax"]),
    (['--relax', 'gdas', '--tau-max', '1', '--tau-min', '2'], ["--tau-min (2.0) cannot exceed --tau-max (1.0)"]),
    (['--dirichlet-kl', '0.1'], ["--dirichlet-kl (DrNAS's Dirichlet KL weight) has an effect only with --relax drnas"]),
    (['--relax', 'drnas', '--mode', 'first', '--beta-decay', '5'], ["--beta-decay (β-DARTS's decay of α's logsumexp, a softmax's normaliser) has an effect only with --relax softmax, gdas or snas, and --relax is drnas"]),
    (['--perturb', 'random', '--relax', 'sigmoid'], ["--perturb (SDARTS) perturbs softmax mixing weights on the simplex; --relax sigmoid is not softmax"]),
    (['--mode', 'first', '--mixed-lambda', '2'], ["--mixed-lambda (MiLeNAS's weight of the validation gradient) has an effect only with --mode mixed, and --mode is first"]),
    (['--method', 'gdas', '--dirichlet-kl', '0.1'], ["--dirichlet-kl (DrNAS's Dirichlet KL weight) has an effect only with --relax drnas, and --relax (--method gdas) is gdas"]),
    (['--method', 'random', '--beta-decay', '5'], ["--beta-decay applies to the architecture weights α, which random search (mode random) does not have"]),
    (['--epsilon', '0'], ["--epsilon must be a finite number > 0, got 0.0"]),
    (['--epsilon', '0.5'], ["--epsilon (SDARTS's perturbation radius) has an effect only with --perturb random or adversarial, and --perturb (default) is none"]),
    (['--device', 'gpu'], ['--device gpu: not a device name; use cpu, cuda or cuda:N']),
    (['--fuse', 'true'], ["--fuse true runs Triton kernels on a GPU; the device is cpu (a CPU runs them in Triton's interpreter, for tests only)"]),
    (['--fuse', 'true', '--precision', 'bf16'], ['--fuse true runs its kernels in fp32 or tf32; --precision bf16 autocasts the products']),
    (['--epochs', 'abc'], ['search: argument --epochs: invalid int value', '(see rnn-darts search -h)']),
    (['--compile', 'maybe'], ['argument --compile']),
    (['--nhidd', '8'], ['unrecognized arguments: --nhidd 8 (did you mean --nhid?) (see rnn-darts search -h)']),
    (['--epoch', '2'], ['unrecognized arguments: --epoch 2 (did you mean --epochs?)']),
    (['--epocs=2', '--bz', '4'], ['unrecognized arguments: --epocs=2 --bz 4 (did you mean --epochs for --epocs, --bs for --bz?)']),
    (['--qqqqqqqq', '1'], ['unrecognized arguments: --qqqqqqqq 1 (see rnn-darts search -h)']),   # nothing near: no suggestion
    (['--threads', '0'], ['--threads must be an integer >= 1, got 0']),
    (['--op-decay', '-1'], ['--op-decay must be a finite number >= 0']),
    (['--unk', '<unk>'], ['--unk applies to a corpus folder, not --data numbers']),
    (['--url', 'http://127.0.0.1:9/penn'], ['--url applies to --data ptb', 'not --data numbers']),
    (['--resume', '--overwrite'], ['give one of them']),
    (['--settings', 'x.ini'], ['--settings names the file to read --preset from']),
])
def test_bad_search_flags(capsys, tmp_path, argv, parts):
    fails(capsys, ['search', *NUM, '--out', str(tmp_path/'o'), *argv], 2, *parts)
    assert not (tmp_path/'o').exists()   # nothing was started

def test_bad_train_flags(capsys, tmp_path):
    fails(capsys, ['train', *NUM, '--lr', '0'], 2, '--lr must be a finite number > 0, got 0.0')
    fails(capsys, ['train', *NUM, '--nonmono', '0'], 2, '--nonmono must be an integer >= 1')
    fails(capsys, ['train', *TINY, '--data', 'ptb', '--n-eval', '100'], 2, '--n-eval sets the size of the generated corpus (--data numbers), not of --data ptb')
    fails(capsys, ['train', *NUM, '--genotype', str(tmp_path/'nope.json')], 1, 'nope.json does not exist')

@pytest.mark.skipif(__import__('torch').cuda.is_available(), reason='needs a machine without CUDA')
def test_cuda_without_gpu(capsys):
    fails(capsys, ['search', *NUM[:-2], '--device', 'cuda'], 2, '--device cuda: CUDA was asked for')

def test_batch_sizes_fit_their_splits_before_training(capsys, tmp_path):
    data = corpus_folder(tmp_path/'c')
    fails(capsys, ['train', '--data', data, *TINY, '--test-bs', '1000', '--out', str(tmp_path/'o')], 2,
          '--test-bs 1000 is too large for', 'test.txt (400 tokens)', 'use at most 200')
    fails(capsys, ['search', '--data', data, *TINY, '--bs', '2000', '--out', str(tmp_path/'o')], 2, '--bs 2000 is too large for', 'train.txt')
    fails(capsys, ['search', '--data', data, *TINY, '--eval-bs', '300', '--out', str(tmp_path/'o')], 2, '--eval-bs 300', 'valid.txt')
    fails(capsys, ['search', '--data', data, *TINY, '--bs', '40', '--out', str(tmp_path/'o')], 2,   # valid: 400 tokens < 40 rows x 11
          '--bs 40 is too large for', 'valid.txt', 'slices of --bptt 10 + 1')
    assert not (tmp_path/'o').exists()

def test_model_too_large_for_memory(capsys, tmp_path):
    fails(capsys, ['search', *NUM, '--emsize', '300000', '--nhid', '300000', '--out', str(tmp_path/'o')], 1,
          'this run needs about', 'weights and optimizer state', '--nhid 300000, --emsize 300000')

# --- presets and settings files ----------------------------------------------------------------------------------------
def test_settings_file_errors(capsys, tmp_path):
    ini = tmp_path/'my.ini'
    fails(capsys, ['search', *NUM, '--preset', 'x', '--settings', str(tmp_path)], 2, f'--settings {tmp_path} is a folder')
    fails(capsys, ['search', *NUM, '--preset', 'x', '--settings', str(ini)], 1, f'settings file {ini} does not exist')
    ini.write_text('lr = 3\n[x]\nnhid = 8\n')
    fails(capsys, ['search', *NUM, '--preset', 'x', '--settings', str(ini)], 1, f"{ini}: line 1: 'lr = 3' comes before any [section]")
    ini.write_text('[x]\nnhid 8\n')
    fails(capsys, ['search', *NUM, '--preset', 'x', '--settings', str(ini)], 1, f"{ini}: line 2: 'nhid 8' is not a 'key = value' line")
    ini.write_text('[x]\nlrr = 3\n')
    fails(capsys, ['search', *NUM, '--preset', 'x', '--settings', str(ini)], 2, "preset [x] has key 'lrr' (did you mean lr?), which no option knows")
    ini.write_text('[x]\nbf16 = true\n')   # a renamed setting: its new name, not the nearest spelling (arch_bf16)
    fails(capsys, ['search', *NUM, '--preset', 'x', '--settings', str(ini)], 2, "preset [x] has key 'bf16' (bf16 is now precision = bf16), which no option knows")
    fails(capsys, ['search', *NUM, '--bf16', 'true'], 2, "unrecognized arguments: --bf16 true (--bf16 is now --precision bf16)")
    ini.write_text('[x]\nnhid = sixteen\n')
    fails(capsys, ['search', *NUM, '--preset', 'x', '--settings', str(ini)], 2, "[x] nhid: expected int, got 'sixteen'")
    fails(capsys, ['search', *NUM, '--preset', 'nope', '--settings', str(ini)], 2, 'no preset [nope]; presets there: x')
    fails(capsys, ['search', *NUM, '--preset', 'quik'], 2, 'no preset [quik] (did you mean quick?)')
    ini.write_text('[x]\nlr = nan\n')   # a bad value from a preset names the file, the preset and the key
    fails(capsys, ['search', '--preset', 'x', '--settings', str(ini), '--out', str(tmp_path/'o')], 2,
          f'{ini}: [x] lr must be a finite number > 0, got nan')

def test_presets_ship_with_the_package(tmp_path, monkeypatch):
    "From a folder without settings.ini the packaged presets are read; a local settings.ini that has the preset wins"
    monkeypatch.chdir(tmp_path)
    s, src = options.settings_and_sources('search', 'quick')
    assert s['nhid'] == 64 and src['nhid'].endswith("settings.ini: [quick] nhid") and str(tmp_path) not in src['nhid']
    (tmp_path/'settings.ini').write_text('[quick]\nnhid = 24\nemsize = 24\n')
    s, src = options.settings_and_sources('search', 'quick')
    assert s['nhid'] == 24 and src['nhid'] == f"{tmp_path/'settings.ini'}: [quick] nhid" and s['bs'] == 256
    (tmp_path/'settings.ini').write_text('[other]\nnhid = 24\n')   # a local file without the preset does not hide the packaged one
    assert options.resolve_settings('search', 'quick')['nhid'] == 64
    assert (ROOT/'rnn_darts'/'settings.ini').read_text() == (ROOT/'settings.ini').read_text()

@pytest.mark.slow
def test_quick_preset_from_any_folder_by_subprocess(tmp_path):
    """A fresh `python -m rnn_darts.cli` in a folder without settings.ini reads [quick] from the package; run.json names the
    default run folder it wrote (the report's settings showed it blank). Its run's size is not the point (first order, no λ_max, 1,000 tokens)"""
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'OMP_NUM_THREADS': '1'}
    small = ['--mode', 'first', '--curvature', 'false', '--n-train', '1000', '--n-eval', '500']
    r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', 'search', '--preset', 'quick', *NUM, *small],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path/'runs'/'search'/'run.json').read_text())['settings']
    assert s['dropout'] == 0.2 and s['out'] == str(Path('runs')/'search'), s   # from [quick]; the default folder

# --- corpus files ------------------------------------------------------------------------------------------------------
def test_corpus_file_errors(capsys, tmp_path):
    fails(capsys, ['search', '--data', str(tmp_path/'nope'), *TINY], 1, f'corpus folder {tmp_path/"nope"} does not exist')
    (tmp_path/'loop').symlink_to(tmp_path/'loop')
    fails(capsys, ['search', '--data', str(tmp_path/'loop'), *TINY], 1, 'loop is a broken symbolic link or a symbolic link loop')
    c = Path(corpus_folder(tmp_path/'c1'))
    (c/'train.txt').unlink(); (c/'train.txt').symlink_to(c/'train.txt')
    fails(capsys, ['search', '--data', str(c), *TINY], 1, 'train.txt is a broken symbolic link or a symbolic link loop')
    c = corpus_folder(tmp_path/'c2', valid=b' one two \n one \x00 two \n' * 40)
    fails(capsys, ['search', '--data', c, *TINY], 1, 'valid.txt: line 2: a NUL byte at byte offset')
    c = corpus_folder(tmp_path/'c3', test=' one zebra \n' * 40)
    fails(capsys, ['search', '--data', c, *TINY], 1, "test.txt: line 1: word 'zebra' is not in the vocabulary")
    fails(capsys, ['search', '--data', c, *TINY, '--files', 'train.txt,valid.txt'], 2, '--files must name 3 files')

@pytest.mark.slow
def test_byte_order_mark_never_reaches_the_vocabulary(tmp_path):
    c = Path(corpus_folder(tmp_path/'c', lines=80))
    (c/'train.txt').write_text('\ufeff' + (c/'train.txt').read_text(), encoding='utf-8')   # as some editors save
    learn = cli.run_command(['search', '--data', str(c), *RUN, '--out', str(tmp_path/'o')])
    assert learn.dls.vocab[0] == 'one' and not any('\ufeff' in w for w in learn.dls.vocab)

# --- run folders -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@uses_run_dir
def test_fresh_run_into_a_run_folder_is_refused(capsys, run_dir):
    run, data = run_dir
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name != '.lock'}
    fails(capsys, ['search', '--data', data, *RUN, '--out', str(run)], 2, f'{run} already holds a run (run.json, log.csv',
          'pass --resume to continue it, --overwrite to replace it')
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.name != '.lock'} == before

@pytest.mark.slow
@uses_run_dir
def test_overwrite_clears_the_old_run(capsys, run_dir, tmp_path):
    run, data = run_dir
    shutil.copytree(run, tmp_path/'r')
    (tmp_path/'r'/'checkpoints'/'epoch_0007.pth').write_bytes(b'old')
    (tmp_path/'r'/'report').mkdir(); (tmp_path/'r'/'report'/'report.md').write_text('the old run')
    cli.run_command(['search', '--data', data, *RUN, '--out', str(tmp_path/'r'), '--overwrite'])
    assert '--overwrite: deleted run.json, log.csv, history.json, genotype.json, checkpoints, report' in capsys.readouterr().out
    assert not (tmp_path/'r'/'report').exists() and not (tmp_path/'r'/'.lock').exists()   # the lock goes with the run's end
    assert not (tmp_path/'r'/'checkpoints'/'epoch_0007.pth').exists()
    assert len((tmp_path/'r'/'log.csv').read_text().splitlines()) == 2   # header + the new epoch

def test_a_locked_run_folder_is_refused(capsys, tmp_path):
    data = corpus_folder(tmp_path/'c')
    with runs.RunLock(_mk(tmp_path/'o')):
        fails(capsys, ['search', '--data', data, *TINY, '--out', str(tmp_path/'o')], 1,
              f'run folder {tmp_path/"o"} is in use by pid {os.getpid()} on ')
    assert not (tmp_path/'o'/'.lock').exists()   # released: its file deleted

def _mk(p): p.mkdir(parents=True, exist_ok=True); return p

@pytest.mark.slow
@uses_run_dir
def test_resume_with_other_settings(capsys, run_dir, tmp_path):
    run, data = run_dir
    shutil.copytree(run, tmp_path/'r')
    fails(capsys, ['search', '--data', data, *RUN, '--out', str(tmp_path/'r'), '--resume', '--lr', '3', '--nhid', '16', '--emsize', '16'], 2,
          '--resume: these settings differ from', 'emsize: 8 -> 16; lr: 20.0 -> 3.0; nhid: 8 -> 16', '--override true')
    argv = ['search', '--data', data, *RUN, '--out', str(tmp_path/'r'), '--resume', '--lr', '3', '--epochs', '2', '--override', 'true']
    cli.run_command(argv)
    assert '--override: continuing' in capsys.readouterr().out
    info = json.loads((tmp_path/'r'/'run.json').read_text())
    assert info['overrides'] == [dict(epoch=1, changes=dict(lr=dict(old=20.0, new=3.0)))]
    assert info['settings']['lr'] == 3.0 and info['settings']['epochs'] == 2 and len(info['epoch_times']) == 2

@uses_run_dir
def test_damaged_run_json(capsys, run_dir, tmp_path):
    run, data = run_dir
    shutil.copytree(run, tmp_path/'r')
    p = tmp_path/'r'/'run.json'
    p.write_text(p.read_text()[:40])
    fails(capsys, ['search', '--data', data, *RUN, '--out', str(tmp_path/'r'), '--resume'], 1, f'{p} is not valid JSON (line')
    fails(capsys, ['evaluate', str(tmp_path/'r'), '--device', 'cpu'], 1, f'{p} is not valid JSON')
    p.write_text('[1, 2]')
    fails(capsys, ['evaluate', str(tmp_path/'r'), '--device', 'cpu'], 1, f'{p} is not a run record')

@pytest.mark.slow
@uses_run_dir
def test_evaluate_errors(capsys, run_dir, tmp_path):
    run, data = run_dir
    fails(capsys, ['evaluate', str(run), '--split', 'train'], 2, "--split must be one of test, valid; got 'train'")
    fails(capsys, ['evaluate', str(tmp_path/'nope')], 1, f'run folder {tmp_path/"nope"} does not exist')
    fails(capsys, ['evaluate', str(tmp_path)], 1, f'{tmp_path/"run.json"} does not exist: is {tmp_path} a run folder?')
    fails(capsys, ['evaluate', str(run), '--checkpoint', str(tmp_path/'x.pth'), '--device', 'cpu'], 1, 'x.pth does not exist')
    (tmp_path/'junk.pth').write_text('junk')
    fails(capsys, ['evaluate', str(run), '--checkpoint', str(tmp_path/'junk.pth'), '--device', 'cpu'], 1, 'junk.pth cannot be read')
    bare = tmp_path/'bare'; (bare/'checkpoints').mkdir(parents=True); shutil.copy(run/'run.json', bare/'run.json')
    fails(capsys, ['evaluate', str(bare), '--device', 'cpu'], 1, 'the run has no best checkpoint; it has no checkpoint at all')
    last = latest_checkpoint(run/'checkpoints'); shutil.copy(last, bare/'checkpoints'/last.name)
    fails(capsys, ['evaluate', str(bare), '--device', 'cpu'], 1, f'the run has no best checkpoint; its latest is {last.name}: --checkpoint last')
    other = tmp_path/'other'
    cli.run_command(['search', '--data', data, *RUN, '--emsize', '16', '--nhid', '16', '--out', str(other)])
    capsys.readouterr()
    fails(capsys, ['evaluate', str(run), '--checkpoint', str(other/'checkpoints'/'best.pth'), '--device', 'cpu'], 1,
          'best.pth does not fit this model (', 'nhid: checkpoint 16, model 8')
    res = cli.run_command(['evaluate', str(run), '--split', 'valid', '--device', 'cpu'])
    assert res['ppl'] > 1

@pytest.mark.slow
def test_full_disk_while_checkpointing(capsys, tmp_path, monkeypatch):
    import rnn_darts.callbacks.checkpoint as ck
    def no_space(*a, **k): raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(ck.torch, 'save', no_space)
    fails(capsys, ['search', '--data', corpus_folder(tmp_path/'c', lines=80), *RUN, '--out', str(tmp_path/'o')], 1,
          'no space left on device while writing checkpoint', 'the previous checkpoints are intact')

def test_nan_with_on_nan_stop(capsys, tmp_path):
    "The weights blow up at once: --on-nan stop ends the first epoch with one line, exit 1, and derives no cell (the stop case of the test below)"
    out = tmp_path/'o'
    line = fails(capsys, ['search', '--data', corpus_folder(tmp_path/'c', lines=80), *TINY, '--epochs', '3', '--lr', '1e38', '--clip', '1e38',
                          '--on-nan', 'stop', '--out', str(out)], 1, 'had a non-finite loss or gradient and were not applied', "stopping (on_nan='stop')")
    assert not (out/'genotype.json').exists(), line

@pytest.mark.parametrize('on_nan,says', [('skip', 'no epoch of this run had a finite validation loss and perplexity'),
                                         ('rollback', 'no finite checkpoint to roll back to')])
@pytest.mark.slow
def test_a_search_that_never_validated_finitely_fails(capsys, tmp_path, on_nan, says):
    "--lr 1e30 blows the supernet up at once: every --on-nan mode ends with one line and exit 1, and derives no cell (stop: test_nan_with_on_nan_stop)"
    out = tmp_path/'o'
    line = fails(capsys, ['search', '--data', corpus_folder(tmp_path/'c', lines=80), *RUN, '--epochs', '3', '--lr', '1e30', '--on-nan', on_nan,
                          '--out', str(out)], 1, says, 'stopping')
    assert not (out/'genotype.json').exists(), line

# --- what is a user error, and --debug -----------------------------------------------------------------------------------
def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def buggy(*a, **k): return {}['missing']   # a KeyError from a lookup, not one of our messages
    monkeypatch.setattr(runs, 'check_fits', buggy)   # where the run reads it
    with pytest.raises(KeyError, match='missing'): cli.run_command(['search', *NUM, '--out', str(tmp_path/'o')])

def test_debug_shows_the_traceback(monkeypatch, tmp_path):
    with pytest.raises(UsageError, match='--lr must be'): cli.run_command(['--debug', 'search', *NUM, '--lr', '0'])
    with pytest.raises(UsageError, match='--lr must be'): cli.run_command(['search', *NUM, '--lr', '0', '--debug'])
    monkeypatch.setenv('RNN_DARTS_DEBUG', '1')
    with pytest.raises(UsageError): cli.run_command(['search', *NUM, '--lr', '0'])

def test_commands(capsys):
    fails(capsys, ['serach'], 2, "unknown command 'serach' (did you mean search?); commands: search, train, study, evaluate, bench, check, report")
    fails(capsys, ['--preset', 'quick'], 2, '--preset: give the command first')
    fails(capsys, ['report', 'x', '--fmt', 'pdf'], 2, "--fmt must be one of md, html; got 'pdf'")
    fails(capsys, ['bench', '--iters', '0'], 2, '--iters must be an integer >= 1')
    fails(capsys, ['bench', '--methods', 'gdas,foo'], 2, "--methods must be one of gdas, snas, drnas, milenas, beta-darts, sdarts-rs, sdarts-adv, fair-darts; got 'foo'")
    fails(capsys, ['bench', '--modes', 'first,third'], 2, "--modes must be one of second, first, exact, random; got 'third'")
    fails(capsys, ['bench', '--precision', 'fp16'], 2, "--precision must be one of fp32, tf32, bf16; got 'fp16'")
    fails(capsys, ['bench', '--fuse', '--device', 'cpu'], 2, "--fuse true runs Triton kernels on a GPU; the device is cpu")   # the plan's rule, as the learners'
    fails(capsys, ['bench', '--graphs', '--precision', 'bf16'], 2, "--graphs true with --precision bf16: bf16 autocast's cache of cast weights cannot be captured")
    fails(capsys, ['search', '--precision', 'fp16'], 2, "--precision must be one of fp32, tf32, bf16; got 'fp16'")
    fails(capsys, ['check', '--paths', 'graphs,jit'], 2, "--paths must be one of graphs, tf32, bf16, fused, fused+graphs, compiled, compiled+graphs; got 'jit'")
    fails(capsys, ['check', '--threads', '0'], 2, '--threads must be an integer >= 1')

def test_one_line_by_subprocess(tmp_path):
    "As a user sees it: one line on stderr and exit 2; with --debug the traceback"
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    env.pop('RNN_DARTS_DEBUG', None)
    r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', 'search', '--lr', 'nan', '--out', str(tmp_path/'o')],
                       capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stderr, r.stdout) == (2, 'rnn-darts: error: --lr must be a finite number > 0, got nan\n', '')
    r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', '--debug', 'search', '--lr', 'nan'], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and 'Traceback' in r.stderr and 'UsageError: --lr must be' in r.stderr

def test_ptb_offline_is_one_line_naming_the_flag(capsys, monkeypatch, tmp_path):
    "--data ptb without a network (here: a closed port on this machine): one line naming the file, the mirror flag; no traceback"
    from fastai.data.external import fastai_cfg
    monkeypatch.setenv('FASTAI_HOME', str(tmp_path/'fastai'))
    fastai_cfg.cache_clear()
    try:
        line = fails(capsys, ['search', '--data', 'ptb', '--url', 'http://127.0.0.1:9/penn', *TINY, '--out', str(tmp_path/'o')], 1,
                     "could not download Penn Treebank's train split from http://127.0.0.1:9/penn/ptb.train.txt",
                     str(tmp_path/'fastai'/'data'/'penn'/'train.txt'), '--url')
    finally: fastai_cfg.cache_clear()
    assert not (tmp_path/'o').exists() or not any((tmp_path/'o').iterdir())

def test_unknown_word_names_the_unk_flag(capsys, tmp_path):
    data = corpus_folder(tmp_path/'c', valid='one two zebra\n')
    fails(capsys, ['search', '--data', data, *TINY, '--out', str(tmp_path/'o')], 1, "word 'zebra' is not in the vocabulary", "--unk '<unk>'")

PLANTED = """
import logging, sys, warnings
from rnn_darts import cli
from rnn_darts.core import UsageError
def planted(argv):
    warnings.warn_explicit('planted: `torch.jit.script` is deprecated', FutureWarning, 'thirdparty.py', 1, module='thirdparty')
    warnings.warn_explicit('planted environment note', UserWarning, 'thirdparty.py', 2, module='thirdparty.sub')
    logging.getLogger('torch.utils.cpp_extension').warning("No CUDA runtime is found, using CUDA_HOME='/planted'")
    warnings.warn_explicit('ours: statistics copied', UserWarning, 'model.py', 3, module='rnn_darts.model')
    raise UsageError('--lr must be a finite number > 0, got nan')
cli._dispatch = planted
sys.argv = ['rnn-darts', 'search']
cli.main()
"""

def test_foreign_warnings_stay_off_stderr():
    "Other packages' warnings and torch's CUDA_HOME notice during a command stay off stderr; ours still show"
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'PYTHONWARNINGS': 'default'}
    r = subprocess.run([sys.executable, '-c', PLANTED], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert 'planted' not in r.stderr and 'CUDA_HOME' not in r.stderr, r.stderr
    assert 'ours: statistics copied' in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == 'rnn-darts: error: --lr must be a finite number > 0, got nan', r.stderr

def test_warning_filter_ends_with_the_command(monkeypatch):
    "`run_command` called from Python leaves the caller's warning filters as they were"
    import warnings
    monkeypatch.setattr(cli, '_dispatch', lambda argv: None)
    cli.run_command(['search'])
    with pytest.warns(FutureWarning, match='after the command'):
        warnings.warn_explicit('after the command', FutureWarning, 'thirdparty.py', 4, module='thirdparty')

# --- help ------------------------------------------------------------------------------------------------------------------
def test_help_is_fast_and_does_not_import_torch():
    "Help, a missing corpus folder and a path `check` does not know answer before torch and fastai are imported"
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    code = ("import sys; from rnn_darts.cli import run_command\n"
            "for a in (['--help'], ['search', '-h'], ['train', '-h'], ['study', '-h'], ['evaluate', '-h']):\n"
            "    try: run_command(a)\n    except SystemExit as e: assert e.code == 0\n"
            "try: run_command(['search', '--data', '/no/such/corpus'])\nexcept SystemExit as e: assert e.code == 1\n"   # a missing folder: said at once
            "try: run_command(['check', '--paths', 'nonsense'])\nexcept SystemExit as e: assert e.code == 2\n"
            "assert 'torch' not in sys.modules and 'fastai' not in sys.modules, 'help (or a missing corpus folder, or a wrong path) imported torch'")
    t0 = time.time()
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', '-h'], capture_output=True, text=True, env=env, timeout=60)
    assert time.time() - t0 < 10   # time is the property (help answers at once); 10 s is ~20x two starts without torch, whose absence is asserted above
    for cmd, fn in cli.COMMANDS.items():   # every command, with its one-line description
        assert re.search(rf'^  {cmd} +{re.escape(fn.__doc__.splitlines()[0])}$', r.stdout, re.M), cmd
    r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli'], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and 'commands:' in r.stdout

@pytest.mark.parametrize('cmd', list(cli.COMMANDS))
def test_every_flag_has_help_and_its_default(cmd):
    p = cli.command_parser(cmd)
    defaults = options.code_defaults(cmd) if cmd in ('search', 'train') else {}
    for a in p._actions:
        if a.dest == 'help': continue
        assert a.help, (cmd, a.dest)
        d = a.default if a.default is not None else defaults.get(a.dest)
        if a.option_strings and d not in (None, '', False) and a.dest not in ('out', 'device', 'threads', 'op_decay', 'unk'):
            shown = str(d).lower() if isinstance(d, bool) else str(d)
            assert f'(default: {shown}' in a.help, (cmd, a.dest, a.help)

def test_resume_where_there_is_no_run_is_one_line_and_makes_nothing(capsys, tmp_path):
    "--resume asks to continue a run: where the folder holds none (or does not exist), exit 2 naming it, no folder made, nothing run (issue 80)"
    for out in (tmp_path/'never', tmp_path/'empty'):
        if out.name == 'empty': out.mkdir()
        fails(capsys, ['search', *NUM, '--out', str(out), '--resume'], 2, f"--resume: {out} holds no run to continue")
    assert sorted(p.name for p in tmp_path.iterdir()) == ['empty'] and not any((tmp_path/'empty').iterdir())

@pytest.mark.slow
def test_resume_of_a_finished_run_says_how_to_extend_it_and_rewrites_nothing(capsys, tmp_path):
    "--resume on a run that finished its epochs: exit 2, one line with its epochs and how to extend it; its files untouched (issue 80). --epochs 2 extends it"
    out = tmp_path/'run'
    cli.run_command(['search', *NUM, '--curvature', 'false', '--out', str(out)])
    files = {p: p.read_bytes() for p in out.rglob('*') if p.is_file() and p.name != '.lock'}
    fails(capsys, ['search', *NUM, '--curvature', 'false', '--out', str(out), '--resume'], 2,
          f"--resume: {out} has finished its 1 epoch; to extend it, give --epochs M (the total, above 1) with --resume")
    assert {p: p.read_bytes() for p in out.rglob('*') if p.is_file() and p.name != '.lock'} == files
    cli.run_command(['search', *[a if a != '1' else '2' for a in NUM], '--curvature', 'false', '--out', str(out), '--resume'])
    assert len(json.loads((out/'run.json').read_text())['epoch_times']) == 2

def test_search_help_names_every_method_the_flag_takes():
    "`--method`'s help names each value it accepts: the bare modes (first, second, exact, random) as well as the family's"
    from rnn_darts.config import METHODS
    helps = [a.help for a in cli.command_parser('search')._actions if a.dest == 'method']
    assert len(helps) == 1 and all(re.search(rf'(^|[ :(|]){re.escape(m)}( |\.|,|$)', helps[0]) for m in METHODS), helps

def test_an_empty_op_set_or_an_unknown_op_in_a_cell_is_a_usage_error(capsys, tmp_path):
    "`--ops ''` on a search: exit 2 naming --ops before any folder exists; an unknown op in a genotype's cell: exit 2 naming it and --import, as in its ops list"
    fails(capsys, ['search', '--ops', '', *NUM, '--out', str(tmp_path/'x')], 2, '--ops names no op')
    assert not (tmp_path/'x').exists()
    for g in (dict(recurrent=[['swirl', 0]], concat=[1]), dict(recurrent=[['tanh', 0]], concat=[1], ops=['tanh', 'swirl'])):
        (tmp_path/'g.json').write_text(json.dumps(g))
        fails(capsys, ['train', '--genotype', str(tmp_path/'g.json'), *NUM, '--out', str(tmp_path/'t')], 2, "unknown op 'swirl'", '--import MODULE_OR_FILE')
    assert not (tmp_path/'t').exists()

@pytest.mark.parametrize('error', [torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB'), MemoryError(),
                                   RuntimeError('DefaultCPUAllocator: not enough memory: you tried to allocate 9 GB')])
def test_running_out_of_memory_mid_run_is_one_line_naming_memory(capsys, tmp_path, monkeypatch, error):
    "Memory another process took after the up-front check: the step's out-of-memory error ends in one line (exit 1) that says so, not a traceback"
    from rnn_darts.model import LanguageModel
    def no_memory(*a, **k): raise error
    monkeypatch.setattr(LanguageModel, 'forward', no_memory)
    fails(capsys, ['search', *NUM, '--out', str(tmp_path/'o')], 1, 'rnn-darts: error: out of memory (', 'lower --bs, --bptt, --nhid or --nodes')

@uses_run_dir
def test_what_resume_refuses_at_either_door(capsys, run_dir, tmp_path):
    """--resume with --overwrite, a --resume value but auto (the command, and `search(resume=...)` from Python); from
    Python, `resume_learner` on a folder without a checkpoint, and on data changed since the run started: one line each"""
    run, data = run_dir
    fails(capsys, ['search', '--resume', '--overwrite', '--out', str(run)], 2, '--resume continues the run in the folder and --overwrite deletes it')
    fails(capsys, ['search', '--resume', 'sometimes', '--out', str(run)], 2, "--resume: invalid choice: 'sometimes'")
    with pytest.raises(UsageError, match=r"--resume takes no value, or auto; got 'sometimes'"): runs.search(resume='sometimes', out=str(run))
    from rnn_darts.runs import resume_learner
    bare = tmp_path/'bare'; bare.mkdir(); (bare/'run.json').write_text(json.dumps(dict(command='search', settings={})))
    with pytest.raises(UsageError, match=f"{bare} holds no checkpoint to continue from"): resume_learner(bare)
    moved = tmp_path/'moved'; shutil.copytree(run.parent, moved)
    info = json.loads((moved/'run'/'run.json').read_text())
    info['settings']['data'] = str(moved/'corpus')
    (moved/'run'/'run.json').write_text(json.dumps(info))
    (moved/'corpus'/'train.txt').write_text((moved/'corpus'/'train.txt').read_text() + 'a new line\n')
    with pytest.raises(UsageError, match=r"the data changed since the run started \(the data train was .*, it is "): resume_learner(moved/'run')

def test_a_flag_two_commands_share_shows_each_its_own_choices():
    "`--select` is DARTS-PT's argmax|pt on a search and the cell's selection, short|asha, on a study: each -h names its own"
    metavar = lambda cmd: next(a.metavar for a in cli.command_parser(cmd)._actions if a.dest == 'select')
    assert (metavar('search'), metavar('study')) == ('argmax|pt', 'short|asha')

def test_bench_floor_is_refused_off_the_cpu(capsys, monkeypatch):
    "`bench --floor` measures a CPU core: on a GPU it is one line naming the flag and the device, before anything is timed"
    import torch
    monkeypatch.setattr(cli, 'get_device', lambda d: torch.device('cuda'))   # a GPU machine, as this CPU one cannot be
    fails(capsys, ['bench', '--floor', '--device', 'cuda'], 2, "--floor measures a CPU core's product rate; the device is cuda: pass --device cpu")
