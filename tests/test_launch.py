"""The command line under the two launchers users reach for, `torchrun` and `accelerate launch`: 2 CPU processes (gloo)
each, the same tiny search, the same result."""
import json, os, shutil, socket, subprocess, sys
from pathlib import Path
import pytest, torch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

TINY = ['search', '--epochs', '1', '--n-train', '800', '--n-eval', '400', '--emsize', '16', '--nhid', '16', '--bs', '8', '--bptt', '10',
        '--eval-bs', '8', '--device', 'cpu', '--seed', '5', '--curvature', 'false', '--mode', 'first']   # the launchers are the point

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def launch(launcher, out):
    port = str(free_port())
    if launcher == 'torchrun':
        pre = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_addr', '127.0.0.1',
               '--master_port', port, '-m']
    else:
        pre = [shutil.which('accelerate'), 'launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
               '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', port, '-m']
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get('PYTHONPATH', '')]))
    r = subprocess.run(pre + ['rnn_darts.cli', *TINY, '--out', str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r

def run_result(out):
    log = (out/'log.csv').read_text().splitlines()
    return log[0], [l.rsplit(',', 1)[0] for l in log[1:]], json.loads((out/'genotype.json').read_text())   # time column dropped

@pytest.mark.slow
@pytest.mark.skipif(shutil.which('accelerate') is None, reason="accelerate is not installed (pip install -e '.[dev]')")
def test_torchrun_and_accelerate_launch_give_the_same_run(tmp_path):
    "Four processes in all, each importing torch and fastai on a 2-core machine: about a minute"
    a, b = tmp_path/'torchrun', tmp_path/'accelerate'
    launch('torchrun', a); launch('accelerate', b)
    head, rows, g = run_result(a)
    assert head.startswith('epoch,train_loss,valid_loss') and len(rows) == 1          # rank 0 alone writes the log
    assert run_result(b) == (head, rows, g)                                           # gloo, 2 ranks: bit-identical
    assert json.loads((b/'run.json').read_text())['settings']['bs'] == 8
