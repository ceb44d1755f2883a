"""For tests/test_memory.py (and the table of nbs/07a_options.ipynb): `rnn-darts search` (or `train`) at each shape given (one argument of flags each), in this one process
after a tiny warm-up run (every import and lazy start done), freed memory handed back to the system between runs;
prints each run's `run.json` "memory" (the estimate, and the peak `PeakMemory` measured) as a JSON line"""
import ctypes, gc, json, sys
from pathlib import Path
from rnn_darts import cli

def run(flags, out):
    "`rnn-darts search FLAGS` (`train FLAGS...` where the first flag is `train`) into `out`: its run.json's memory"
    cmd, flags = (flags[0], flags[1:]) if flags[:1] == ['train'] else ('search', flags)
    cli.run_command([cmd, '--threads', '1', '--device', 'cpu', '--compile', 'false', '--epochs', '1', '--eval-bs', '4', '--overwrite',
                     *flags, '--out', str(out)])
    return json.loads((Path(out)/'run.json').read_text())['memory']

if __name__ == '__main__':
    tmp = Path(sys.argv[1])
    run(['--nodes', '2', '--nhid', '8', '--emsize', '8', '--bs', '4', '--bptt', '5', '--n-train', '200', '--n-eval', '300'], tmp/'warm')
    for i, shape in enumerate(sys.argv[2:]):
        gc.collect(); ctypes.CDLL('libc.so.6').malloc_trim(0)   # what the last run freed, back to the system: this run's growth is its own
        print(json.dumps(dict(shape=shape, **run(shape.split(), tmp/f'run{i}'))), file=sys.stderr, flush=True)
