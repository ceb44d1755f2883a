"The command line end to end on tiny settings: flags reach the learners (bf16, fused loss), run folders are written."
import json
import pytest, torch
from rnn_darts import cli
from rnn_darts.engine.speed import BF16Autocast
from rnn_darts.engine.speed import FusedDecoderLoss

TINY = ['--data', 'numbers', '--n-train', '1000', '--epochs', '1', '--bs', '8', '--bptt', '10', '--eval-bs', '4',
        '--emsize', '8', '--nhid', '8', '--device', 'cpu', '--n-eval', '500']   # 12 training batches an epoch

@pytest.mark.slow
def test_search_with_bf16_flags(tmp_path):
    learn = cli.run_command(['search', *TINY, '--mode', 'first', '--precision', 'bf16', '--curvature', 'false', '--out', str(tmp_path/'s')])
    assert any(isinstance(cb, BF16Autocast) for cb in learn.cbs) and not learn.arch_param_update.arch_bf16
    assert any(isinstance(cb, FusedDecoderLoss) for cb in learn.cbs) and learn.model.runner.fused_loss
    assert json.loads((tmp_path/'s'/'run.json').read_text())['settings']['precision'] == 'bf16'
    assert (tmp_path/'s'/'genotype.json').exists() and learn.model.flat.data.dtype == torch.float32
    settings = json.loads((tmp_path/'s'/'run.json').read_text())['settings']   # a search records its own settings only
    assert 'genotype' not in settings and 'test_bs' not in settings and settings['op_decay'] == 0

@pytest.mark.slow
def test_train_with_plain_loss_from_a_preset(tmp_path):
    ini = tmp_path/'settings.ini'
    ini.write_text('[plain]\nfused_loss = false\narch_bf16 = false\n')
    learn = cli.run_command(['train', *TINY, '--settings', str(ini), '--preset', 'plain', '--out', str(tmp_path/'t')])
    assert not learn.model.runner.fused_loss and not any(isinstance(cb, FusedDecoderLoss) for cb in learn.cbs)
    assert not any(isinstance(cb, BF16Autocast) for cb in learn.cbs)
    assert (tmp_path/'t'/'log.csv').exists()
    info = json.loads((tmp_path/'t'/'run.json').read_text())
    assert info['settings']['genotype'] == 'DARTS_V2' and info['settings']['test_bs'] == 1 and info['test_ppl'] > 1

def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e: cli.run_command(['serach'])
    assert e.value.code == 2
    assert capsys.readouterr().err == "rnn-darts: error: unknown command 'serach' (did you mean search?); commands: search, train, study, evaluate, bench, check, report\n"

def test_wheel_ships_the_presets(tmp_path):
    "The built wheel holds rnn_darts/settings.ini, the same text as the checkout's settings.ini"
    import subprocess, sys, zipfile
    from pathlib import Path
    import shutil
    root, src = Path(__file__).resolve().parents[1], tmp_path/'src'   # build from a copy: setuptools writes build/ next to the sources
    for d in ('rnn_darts', 'callbacks'): shutil.copytree(root/d, src/d, symlinks=True, ignore=shutil.ignore_patterns('__pycache__'))
    for f in ('pyproject.toml', 'README.md', 'settings.ini'): shutil.copy(root/f, src/f)
    r = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', str(tmp_path), str(src)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode and 'No module named' in r.stderr: pytest.skip('pip wheel needs setuptools in this environment')
    assert r.returncode == 0, r.stderr
    whl, = tmp_path.glob('rnn_darts-*.whl')
    with zipfile.ZipFile(whl) as z:
        assert z.read('rnn_darts/settings.ini').decode() == (root/'settings.ini').read_text()
        code = {n: z.read(n).decode() for n in z.namelist() if n.endswith('.py')}
    assert 'rnn_darts/runs.py' in code and not any(n.startswith('tests/') for n in code)
    for n, text in code.items():   # the tests' plain reference (tests/_reference.py) stays out of the package
        assert 'PlainSearchRnn' not in text and 'plain_hypergrad' not in text, n

def test_threads_default_is_the_idle_cores(monkeypatch, capsys):
    """On a CPU the default is the cores this process may use less those other processes keep busy, at least 1 (from
    `/proc/stat`; without it, the 1-minute load); --threads decides outright"""
    import os, torch
    from rnn_darts import runs, core
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(core, 'cpu_sample', lambda cpus=None: None)   # no /proc/stat
    for load, want in ((0.1, 4), (1.4, 3), (2.6, 1), (3.6, 1), (40., 1)):
        monkeypatch.setattr(os, 'getloadavg', lambda: (load, 0., 0.))
        assert core.idle_cores(0.) == want, (load, want)
    n = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, 'getloadavg', lambda: (2.6, 0., 0.))
        said = runs.set_threads(None, torch.device('cpu'))
        assert torch.get_num_threads() == 1 and said.startswith('1 thread: the idle cores'), said
        assert runs.set_threads(2, torch.device('cpu')) == '2 threads' and torch.get_num_threads() == 2
        monkeypatch.setenv('OMP_NUM_THREADS', '3')   # a launcher's choice (torchrun: 1 per process) stands; --threads still decides
        assert runs.set_threads(None, torch.device('cpu')) == '3 threads: OMP_NUM_THREADS' and torch.get_num_threads() == 3
        assert runs.set_threads(1, torch.device('cpu')) == '1 thread' and torch.get_num_threads() == 1
    finally: torch.set_num_threads(n)

def test_idle_cores_sees_a_busy_process():
    "`/proc/stat`'s per-core lines count a process that keeps a core busy (its share, as `idle_cores` and `FollowIdleCores` read it)"
    import subprocess, sys, time
    from rnn_darts import core
    if core.cpu_sample() is None: pytest.skip('no /proc/stat here')
    p = subprocess.Popen([sys.executable, '-c', "print('busy', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == 'busy\n'
        a = core.cpu_sample(); time.sleep(0.5)
        assert core.others_busy(a, core.cpu_sample()) >= 0.5
    finally: p.kill(); p.wait()

@pytest.mark.slow
def test_an_eager_run_follows_the_idle_cores(tmp_path, monkeypatch, capsys):
    """A search without --threads starts on the idle cores and follows them: when other work takes one of its 2 cores
    during the fit, it runs on the core left, and its first and last lines say so"""
    import os, time
    from rnn_darts import core
    from rnn_darts.engine import speed
    from tests._cli_probes import TINY
    calls = []
    def sample(cpus=None):   # nothing else runs while the run starts (2 idle cores); then another process keeps a core busy
        calls.append(time.monotonic()); own = time.process_time()
        return calls[-1], (calls[-1] - calls[2] if len(calls) > 3 else 0.) + own, own
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0, 1})
    monkeypatch.setattr(core, 'cpu_sample', sample); monkeypatch.setattr(speed, 'cpu_sample', sample)
    monkeypatch.setattr(speed.FollowIdleCores, 'every', 0.)
    n = torch.get_num_threads()
    try: cli.run_command(['search', *TINY, '--out', str(tmp_path/'run')])
    finally: torch.set_num_threads(n)
    out = capsys.readouterr().out.splitlines()
    assert '2 threads: the idle cores of' in out[0] and 'followed as they change' in out[0], out[0]
    assert 'threads followed the idle cores: 2, then 1 at epoch 0, training batch 1' in out, out

def test_readme_commands_parse():
    "Every `rnn-darts ...` line in the README's code blocks names a command and flags that exist"
    import re, shlex
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1]/'README.md').read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    lines = [l for b in blocks for part in b.splitlines() for l in re.split(r'\s*&&\s*', part) if l.strip().startswith('rnn-darts ')]
    assert len(lines) >= 5, lines
    for line in lines:
        argv = shlex.split(line.split('#')[0])[1:]
        cmd = argv[0]
        assert cmd in cli.COMMANDS, line
        cli.command_parser(cmd).parse_args([a for a in argv[1:] if a != '--debug'])

@pytest.mark.slow
def test_search_and_train_flags_come_from_one_table(tmp_path, capsys, monkeypatch):
    """--help lists every flag of `options.FLAGS` with its command's text, -h each with its summary in a screen (a line a
    flag, in groups: at most 100 lines at 80 columns); Python's `runs.search` takes the same names and refuses others"""
    from rnn_darts import runs
    from rnn_darts.options import FLAGS, FLAG_SUMMARY, command_flags
    for cmd in ('search', 'train'):
        for h_flag in ('--help', '-h'):
            monkeypatch.setenv('COLUMNS', '1000' if h_flag == '--help' else '80')   # --help: no line wrapped at a hyphen
            with pytest.raises(SystemExit): cli.run_command([cmd, h_flag])
            out = capsys.readouterr().out
            said = ' '.join(out.split())
            for k, (_, h) in command_flags(cmd).items():
                assert f"--{k.replace('_', '-')}" in said and ' '.join((h if h_flag == '--help' else FLAG_SUMMARY[k]).split()) in said, (cmd, h_flag, k)
            for k in set(FLAGS) - set(command_flags(cmd)): assert f"--{k.replace('_', '-')} " not in said, (cmd, k)   # the other command's own
            assert '(default: on) (default' not in said   # a default said once
        assert len(out.splitlines()) <= 100 and said.count('[') > 20, (cmd, len(out.splitlines()))   # -h: the defaults in brackets
    with pytest.raises(TypeError, match=r"search\(\) got an unexpected keyword argument 'epoch' \(it takes the flags of rnn-darts search -h\)"):
        runs.search(epoch=1)
    learn = runs.search(data='numbers', n_train=1000, n_eval=500, epochs=1, bs=8, bptt=10, eval_bs=4, emsize=8, nhid=8, device='cpu', mode='first',
                        curvature_windows=2, out=str(tmp_path/'s'))
    assert learn.curvature.windows == 2 and len(learn.curvature.history[-1]['lambda_max_windows']) == 2
    assert json.loads((tmp_path/'s'/'run.json').read_text())['settings']['curvature_windows'] == 2

def run_into_a_file(tmp_path, *argv):
    "`rnn-darts ARGV > file`, as a cluster's job log: (exit status, what the file holds, stderr)"
    import os, subprocess, sys
    from pathlib import Path
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with open(tmp_path/'out.txt', 'w') as f:
        r = subprocess.run([sys.executable, '-m', 'rnn_darts.cli', *argv], stdout=f, stderr=subprocess.PIPE, text=True, env=env)
    return r.returncode, (tmp_path/'out.txt').read_text(), r.stderr

@pytest.mark.slow
@pytest.mark.parametrize('mode', ['first', 'random'])
def test_output_into_a_file_is_a_line_per_epoch_without_bar_frames(tmp_path, mode):
    "Into a file: the table's header once and one line per epoch; no carriage return, no bar character (random: no scoring bar; evaluate: its line only)"
    more = ['--candidates', '4', '--top', '2'] if mode == 'random' else ['--curvature', 'false']   # the table, not λ_max, is the point
    code, text, err = run_into_a_file(tmp_path, 'search', *TINY[:5], '2', *TINY[6:], '--mode', mode, *more, '--threads', '1',
                                      '--out', str(tmp_path/'s'))
    assert code == 0 and err == '', err
    assert '\r' not in text and '█' not in text, text[:400]
    lines = text.splitlines()
    assert [l.split()[:3] for l in lines if l.startswith('epoch ') and 'train_loss' in l] == [['epoch', 'train_loss', 'valid_loss']]
    assert [l.split()[0] for l in lines if l[:1].isdigit()] == ['0', '1']
    if mode == 'first':   # evaluate's validation into a file: its one line, no bar frames
        code, text, err = run_into_a_file(tmp_path, 'evaluate', str(tmp_path/'s'), '--split', 'valid', '--threads', '1')
        assert code == 0 and err == '', err
        assert '\r' not in text and '█' not in text and len(text.splitlines()) == 1 and ' on valid: loss ' in text, text[:400]
        assert text.rstrip().endswith(f"(the search's supernet, each edge mixing every operation by α; the cell trained alone: rnn-darts train --genotype {tmp_path/'s'})"), text

def test_train_names_its_cell_in_its_first_line(tmp_path, capsys):
    "No --genotype: the first line says DARTS_V2 is the default; a search's run folder is read as its genotype.json"
    from rnn_darts.genotypes import ENAS, save_genotype, check_genotype
    from rnn_darts.runs import cell_name
    assert cell_name('DARTS_V2', 'default').startswith('DARTS_V2 (the default cell: no --genotype given')
    assert cell_name('ENAS', 'flag') == 'ENAS' and cell_name('runs/s', 'flag') == 'the cell in runs/s'
    run = tmp_path/'search'; run.mkdir(); save_genotype(ENAS, run/'genotype.json')
    learn = cli.run_command(['train', *TINY, '--n-train', '800', '--test-bs', '8', '--genotype', str(run), '--out', str(tmp_path/'t')])   # test bs 8: the paper's 1 would take most of the time
    assert learn.model.genotype() == check_genotype(ENAS)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"train the cell in {run} on ")
    # the table: its header and one row per epoch; the test set's evaluation is the labelled line, not a row of its own
    assert [l.split()[0] for l in lines if l[:1].isdigit()] == ['0'] and any(l.startswith('test loss ') for l in lines), lines

def test_n_eval_sizes_the_generated_valid_and_test_splits():
    "--n-eval sizes both generated evaluation splits and is part of the corpus's key; a run recorded before it existed keeps 20,000"
    from rnn_darts.runs import load_corpus, corpus_key
    s = dict(data='numbers', files='', unk='', seed=0, n_train=500, n_eval=300)
    c = load_corpus(s)
    assert 300 <= len(c.valid) < 320 and 300 <= len(c.test) < 320 and 500 <= len(c.train) < 520
    assert corpus_key(s) != corpus_key({**s, 'n_eval': 400})
    old = load_corpus({k: v for k, v in s.items() if k != 'n_eval'})
    assert len(old.valid) >= 20_000 and list(old.train) == list(c.train)
