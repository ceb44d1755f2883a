"""Bad inputs probed through `rnn-darts` (run_command, in process), for the before/after count of issue 13.

    PYTHONPATH=<checkout> python tests/_cli_probes.py [--md]

Each probe runs in a fresh temporary folder. Outcome: `clean` (exit != 0 and exactly one `rnn-darts: error:` line
or argparse's usage error, no traceback), `traceback` (an exception escaped), `accepted` (the command returned:
the input was accepted silently), `handled` (for inputs that must be accepted and fixed, e.g. a byte-order mark).
"""
import contextlib, io, json, os, sys, tempfile, traceback
from pathlib import Path
from tests._learners import corpus_folder

TINY = ['--n-train', '3000', '--epochs', '1', '--bs', '8', '--bptt', '10', '--eval-bs', '4', '--emsize', '8', '--nhid', '8',
        '--device', 'cpu']

def corpus(d, train=" a b c \n b c a \n" * 40, valid=" a b \n" * 40, test=" c a \n" * 40, name='corp'):
    "The probes' corpus: three words"
    return corpus_folder(Path(d)/name, train, valid, test)

def tiny_run(d, name='run', extra=()):
    "A finished 1-epoch search run folder (made with the code under test)"
    from rnn_darts.cli import run_command
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run_command(['search', *TINY, '--out', str(Path(d)/name), *extra])
    return str(Path(d)/name)

def _ini(d, text):
    p = Path(d)/'my.ini'; p.write_text(text); return str(p)

def _loop(d, name='loop'):
    p = Path(d)/name; p.symlink_to(p); return str(p)

def _file_loop(d):
    c = corpus(d); os.remove(Path(c)/'train.txt'); (Path(c)/'train.txt').symlink_to(Path(c)/'train.txt'); return c

def _runjson(d, text):
    r = Path(d)/'r'; r.mkdir(); (r/'run.json').write_text(text); return str(r)

# (name, argv factory taking the temporary folder)
PROBES = [
    ('--lr nan', lambda d: ['search', *TINY, '--lr', 'nan']),
    ('--lr -1', lambda d: ['search', *TINY, '--lr', '-1']),
    ('--lr 0', lambda d: ['train', *TINY, '--lr', '0']),
    ('--arch-lr inf', lambda d: ['search', *TINY, '--arch-lr', 'inf']),
    ('--epochs 0', lambda d: ['search', *TINY, '--epochs', '0']),
    ('--epochs abc', lambda d: ['search', *TINY, '--epochs', 'abc']),
    ('--clip -1', lambda d: ['search', *TINY, '--clip', '-1']),
    ('--wd -1', lambda d: ['train', *TINY, '--wd', '-1']),
    ('--bs 0', lambda d: ['search', *TINY, '--bs', '0']),
    ('--bs larger than the train split', lambda d: ['search', *TINY, '--bs', '5000']),
    ('--bs too large for the valid split (search)', lambda d: ['search', *TINY, '--data', corpus(d, valid=" a b \n" * 6), '--bs', '2']),
    ('--eval-bs larger than the valid split', lambda d: ['search', *TINY, '--eval-bs', '100000']),
    ('train --test-bs larger than the test split', lambda d: ['train', *TINY, '--test-bs', '100000']),
    ('--bptt 1', lambda d: ['search', *TINY, '--bptt', '1']),
    ('--seed -1', lambda d: ['search', *TINY, '--seed', '-1']),
    ('--nhid 0', lambda d: ['search', *TINY, '--nhid', '0', '--emsize', '0']),
    ('--emsize != --nhid', lambda d: ['search', *TINY, '--emsize', '16']),
    ('--dropout 1.0', lambda d: ['search', *TINY, '--dropout', '1.0']),
    ('--dropouth -0.1', lambda d: ['train', *TINY, '--dropouth', '-0.1']),
    ('--mode third', lambda d: ['search', *TINY, '--mode', 'third']),
    ('--relax foo', lambda d: ['search', *TINY, '--relax', 'foo']),
    ('--on-nan never', lambda d: ['search', *TINY, '--on-nan', 'never']),
    ('train --nonmono 0', lambda d: ['train', *TINY, '--nonmono', '0']),
    ('--device gpu', lambda d: ['search', *TINY, '--device', 'gpu']),
    ('--device cuda (no GPU)', lambda d: ['search', *TINY, '--device', 'cuda']),
    ('--device cuda:7 (no GPU)', lambda d: ['search', *TINY, '--device', 'cuda:7']),
    ('--compile maybe', lambda d: ['search', *TINY, '--compile', 'maybe']),
    ('model too large for memory', lambda d: ['search', *TINY, '--emsize', '200000', '--nhid', '200000']),
    ('--settings is a folder', lambda d: ['search', *TINY, '--preset', 'quick', '--settings', d]),
    ('--settings file missing', lambda d: ['search', *TINY, '--preset', 'quick', '--settings', f'{d}/nope.ini']),
    ('settings: key before any [section]', lambda d: ['search', *TINY, '--preset', 'x', '--settings', _ini(d, 'lr = 3\n[x]\nnhid = 8\n')]),
    ('settings: line without =', lambda d: ['search', *TINY, '--preset', 'x', '--settings', _ini(d, '[x]\nnhid 8\n')]),
    ('settings: section twice', lambda d: ['search', *TINY, '--preset', 'x', '--settings', _ini(d, '[x]\nlr = 3\n[x]\nlr = 4\n')]),
    ('preset not in settings', lambda d: ['search', *TINY, '--preset', 'nope']),
    ('preset key no option knows', lambda d: ['search', *TINY, '--preset', 'x', '--settings', _ini(d, '[x]\nlrr = 3\n')]),
    ('preset value of the wrong type', lambda d: ['search', *TINY, '--preset', 'x', '--settings', _ini(d, '[x]\nnhid = sixteen\n')]),
    ('preset lr = nan', lambda d: ['search', '--preset', 'x', '--settings', _ini(d, '[x]\nlr = nan\n'), '--n-train', '3000', '--epochs', '1', '--bs', '8', '--bptt', '10', '--eval-bs', '4', '--emsize', '8', '--nhid', '8', '--device', 'cpu']),
    ('--settings without --preset', lambda d: ['search', *TINY, '--settings', _ini(d, '[x]\nlr = 3\n')]),
    ('--data folder missing', lambda d: ['search', *TINY, '--data', f'{d}/nope']),
    ('--data is a file', lambda d: ['search', *TINY, '--data', _ini(d, 'x')]),
    ('--data symlink loop', lambda d: ['search', *TINY, '--data', _loop(d)]),
    ('corpus file is a symlink loop', lambda d: ['search', *TINY, '--data', _file_loop(d)]),
    ('corpus split file missing', lambda d: ['search', *TINY, '--data', corpus(d), '--files', 'train.txt,valid.txt,nope.txt']),
    ('--files with 2 names', lambda d: ['search', *TINY, '--data', corpus(d), '--files', 'train.txt,valid.txt']),
    ('corpus file with a NUL byte', lambda d: ['search', *TINY, '--data', corpus(d, train=b" a b c \n b \x00 c \n" * 40)]),
    ('corpus file not UTF-8', lambda d: ['search', *TINY, '--data', corpus(d, train=" caf\xe9 a b \n".encode('latin-1') * 40)]),
    ('corpus split empty', lambda d: ['search', *TINY, '--data', corpus(d, test="\n\n")]),
    ('valid word not in train vocabulary', lambda d: ['search', *TINY, '--data', corpus(d, valid=" a zebra \n" * 40)]),
    ('--unk with --data numbers', lambda d: ['search', *TINY, '--unk', '<unk>']),
    ('--out is a file', lambda d: ['search', *TINY, '--out', _ini(d, 'x')]),
    ('fresh search into a folder holding a run', lambda d: ['search', *TINY, '--out', tiny_run(d)]),
    ('--resume with a different --lr', lambda d: ['search', *TINY, '--out', tiny_run(d), '--resume', '--lr', '3', '--epochs', '2']),
    ('--resume and --overwrite together', lambda d: ['search', *TINY, '--out', tiny_run(d), '--resume', '--overwrite']),
    ('train --genotype file missing', lambda d: ['train', *TINY, '--genotype', f'{d}/nope.json']),
    ('train --genotype not JSON', lambda d: ['train', *TINY, '--genotype', _ini(d, '{"recurrent": [')]),
    ('evaluate --split train', lambda d: ['evaluate', tiny_run(d), '--split', 'train', '--device', 'cpu']),
    ('evaluate folder missing', lambda d: ['evaluate', f'{d}/nope', '--device', 'cpu']),
    ('evaluate folder without run.json', lambda d: ['evaluate', d, '--device', 'cpu']),
    ('evaluate half-written run.json', lambda d: ['evaluate', _runjson(d, '{"command": "search", "sett'), '--device', 'cpu']),
    ('evaluate run.json not a run record', lambda d: ['evaluate', _runjson(d, '[1, 2]'), '--device', 'cpu']),
    ('evaluate --checkpoint file missing', lambda d: ['evaluate', tiny_run(d), '--checkpoint', f'{d}/nope.pth', '--device', 'cpu']),
    ('evaluate --checkpoint not a checkpoint', lambda d: ['evaluate', tiny_run(d), '--checkpoint', _ini(d, 'junk'), '--device', 'cpu']),
    ('evaluate a checkpoint of another model', lambda d: ['evaluate', tiny_run(d), '--checkpoint',
        str(Path(tiny_run(d, 'other', ['--nhid', '16', '--emsize', '16']))/'checkpoints'/'best.pth'), '--device', 'cpu']),
    ('report --fmt pdf', lambda d: ['report', tiny_run(d), '--fmt', 'pdf']),
    ('report folder missing', lambda d: ['report', f'{d}/nope']),
    ('bench --iters 0', lambda d: ['bench', '--small', '--iters', '0', '--device', 'cpu']),
    ('unknown command', lambda d: ['serach', '--preset', 'quick']),
    ('options before the command', lambda d: ['--preset', 'quick']),
    ('unknown flag', lambda d: ['search', *TINY, '--nhidd', '8']),
    ('NaN with --on-nan stop', lambda d: ['search', *TINY, '--lr', '1e38', '--clip', '1e38', '--on-nan', 'stop']),
]
HANDLED = [   # inputs that must be accepted and handled: (name, argv factory, check of the returned learner)
    ('corpus with a UTF-8 byte-order mark', lambda d: ['search', *TINY, '--data', corpus(d, train="\ufeff a b c \n b c a \n" * 40)],
     lambda learn: '\ufeff' not in ''.join(learn.dls.vocab)),
]

def _no_n_train_with_folders(argv):
    "--n-train sizes the generated corpus only: drop it when --data names a folder"
    if '--data' not in argv: return argv
    i = argv.index('--n-train')
    return argv[:i] + argv[i+2:]

def run_probe(argv_fn, check=None):
    from rnn_darts.cli import run_command
    d = tempfile.mkdtemp(); cwd = os.getcwd(); os.chdir(d)
    out, err = io.StringIO(), io.StringIO()
    try:
        argv = _no_n_train_with_folders(argv_fn(d))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try: res = run_command(argv)
            except SystemExit as e:
                lines = [l for l in err.getvalue().splitlines() if l.strip()]
                one = [l for l in lines if l.startswith('rnn-darts: error:') or ': error: ' in l]
                return ('clean' if e.code and one and 'Traceback' not in err.getvalue() else f'exit {e.code}'), (one or lines or [''])[-1]
            except BaseException as e: return 'traceback', f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        if check is not None: return ('handled' if check(res) else 'accepted (wrong)'), ''
        return 'accepted', ''
    finally: os.chdir(cwd)

if __name__ == '__main__':
    rows = [(n, *run_probe(f)) for n, f in PROBES] + [(n, *run_probe(f, c)) for n, f, c in HANDLED]
    from collections import Counter
    print(json.dumps(rows, indent=0))
    print(Counter(r[1] for r in rows), len(rows), file=sys.stderr)
