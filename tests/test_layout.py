"""One room per idea (issue 28): no module of the package imports, directly or through others, a module that imports
it back, counting the imports inside functions too; the settings schema is read by the learners without importing
the command line."""
import ast
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ('rnn_darts', 'rnn_darts.callbacks', 'rnn_darts.engine')

def modules() -> dict:
    "module name -> file, for every module of the packages (their `__init__` files excepted: they import lazily, by name)"
    return {f"{p}.{f.stem}": f for p in PACKAGES for f in sorted((ROOT/p.replace('.', '/')).glob('*.py')) if f.stem != '__init__'}

def imports_of(path, mods) -> set:
    """The package modules `path` imports anywhere in it: at the top, inside functions, `from PACKAGE import module` too;
    a name of the engine's interface (`from rnn_darts.engine import linear`) as the module that defines it"""
    from rnn_darts.engine import INTERFACE
    res = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import): res |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            res.add(n.module)
            res |= {f"{n.module}.{INTERFACE.get(a.name, a.name) if n.module == 'rnn_darts.engine' else a.name}" for a in n.names}
    return res & set(mods)

def cycle(graph) -> list|None:
    "A circle of imports in `graph` (module -> modules it imports), as a list of modules, or None"
    state, stack = {}, []
    def visit(m):
        state[m] = 'open'; stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 'open': return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)): return c
        state[m] = 'done'; stack.pop()
    for m in sorted(graph):
        if m not in state and (c := visit(m)): return c

def test_cycle_finder_finds_a_planted_circle():
    assert cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': set()}) == ['a', 'b', 'c', 'a']
    assert cycle({'a': {'b'}, 'b': set(), 'c': {'a', 'b'}}) is None

def test_no_import_circle():
    mods = modules()
    graph = {m: imports_of(f, mods) - {m} for m, f in mods.items()}
    assert 'rnn_darts.options' in graph['rnn_darts.learner'] and 'rnn_darts.runs' in graph['rnn_darts.study']   # the graph sees function-level imports
    assert cycle(graph) is None, ' -> '.join(cycle(graph))

def test_the_command_line_is_imported_by_nothing_in_the_package():
    "`rnn_darts.cli` parses, dispatches and prints: the library (learners, presets, studies, runs) never reaches into it"
    mods = modules()
    users = [m for m, f in mods.items() if m != 'rnn_darts.cli' and 'rnn_darts.cli' in imports_of(f, mods)]
    assert users == []

def test_nothing_imports_a_top_level_callbacks_package():
    "The callbacks are `rnn_darts.callbacks`: no module, test or notebook imports `callbacks` (a PyPI package owns that name); the checkout's `callbacks/` is only a link"
    import json, re
    top = re.compile(r'^\s*(from\s+callbacks[\s.]|import\s+callbacks\b)', re.M)
    code = {f: f.read_text() for f in [*ROOT.glob('rnn_darts/**/*.py'), *ROOT.glob('tests/*.py'), *ROOT.glob('tools/*.py')]}
    code |= {f: ''.join(''.join(c['source']) + '\n' for c in json.loads(f.read_text())['cells'] if c['cell_type'] == 'code')
             for f in ROOT.glob('nbs/*.ipynb')}
    assert len(code) > 50 and any('from rnn_darts.callbacks.arch import' in t for t in code.values())
    assert [str(f) for f, t in code.items() if top.search(t)] == []
    assert (ROOT/'callbacks').is_symlink() and (ROOT/'callbacks').resolve() == (ROOT/'rnn_darts'/'callbacks').resolve()

@pytest.mark.slow
def test_the_wheel_holds_only_rnn_darts(tmp_path):
    "A wheel built from the checkout installs one top-level package, `rnn_darts` (with `rnn_darts/callbacks` and `rnn_darts/engine`), its presets, and no `callbacks`"
    import shutil, subprocess, sys, zipfile
    pytest.importorskip('setuptools', minversion='77', reason='building the wheel offline needs the setuptools pyproject.toml asks for (>= 77)')
    src = tmp_path/'src'
    shutil.copytree(ROOT/'rnn_darts', src/'rnn_darts', ignore=shutil.ignore_patterns('__pycache__'))   # links resolved (settings.ini)
    for f in ('pyproject.toml', 'README.md', 'settings.ini'): shutil.copy(ROOT/f, src/f)
    (src/'callbacks').symlink_to('rnn_darts/callbacks')   # as in the checkout
    r = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', '--no-build-isolation', '-w', str(tmp_path/'dist'), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    names = zipfile.ZipFile(next((tmp_path/'dist').glob('*.whl'))).namelist()
    tops = {n.split('/')[0] for n in names if not n.split('/')[0].endswith('.dist-info')}
    assert tops == {'rnn_darts'}, tops
    assert {'rnn_darts/callbacks/arch.py', 'rnn_darts/engine/graphs.py', 'rnn_darts/settings.ini'} <= set(names)

def _code_strings(path) -> list:
    "(line, text) of the string constants in `path` that are not docstrings"
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]

def test_a_run_folders_files_are_named_in_one_module():
    "`RunFolder` (rnn_darts/folder.py) names every file of a run or study folder; no other module spells one as a string (issue 77)"
    from rnn_darts.folder import RunFolder
    F = RunFolder
    names = {F.RECORD, F.LOG, F.HISTORY, F.GENOTYPE, F.CANDIDATES, F.CHECKPOINTS, F.BEST, F.MID_EPOCH, F.SCORING,
             F.STUDY_RECORD, F.STUDY_TABLE, F.STOP, F.RAY_PROBE, F.RAY_LOGS, *F.FIGURES.values(), *(f"{F.PAGE}.{x}" for x in ('md', 'html'))}
    # 'final' (a stage's kind), 'report' (a command) and '.lock' (any file lock's suffix) have other uses too: left out
    mods = modules()
    assert 'run.json' in names and 'curves.png' in names and len(names) > 20
    spelled = {m: [(line, s) for line, s in _code_strings(f) if s in names] for m, f in mods.items() if m != 'rnn_darts.folder'}
    assert {m: v for m, v in spelled.items() if v} == {}
    assert names - {f'{F.PAGE}.md', f'{F.PAGE}.html'} <= {s for _, s in _code_strings(mods['rnn_darts.folder'])}   # the finder sees them where they are

BATCH_EVENTS = {'before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch',
                '_do_one_batch'}   # a callback's batch events, and a learner's batch

def batch_path_lookups(tree, names) -> list:
    "(class, method, name) of each look-up of a learner's attribute `names` (a callback's, by name) in what a class runs per batch"
    res = []
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        meths = {f.name: f for f in c.body if isinstance(f, ast.FunctionDef)}
        own = {ast.unparse(n) for n in ast.walk(c) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}   # `self.x = ...`: its own
        todo, seen = [m for m in BATCH_EVENTS if m in meths], set()
        while todo:   # the batch events and the methods of the class they call
            m = todo.pop()
            if m in seen: continue
            seen.add(m)
            for n in ast.walk(meths[m]):
                if isinstance(n, ast.Attribute) and ast.unparse(n.value) == 'self' and n.attr in meths: todo.append(n.attr)
                named = (n.args[1].value if isinstance(n, ast.Call) and getattr(n.func, 'id', None) in ('getattr', 'hasattr') and len(n.args) > 1
                         and isinstance(n.args[1], ast.Constant) and ast.unparse(n.args[0]) in ('self', 'self.learn') else
                         'lr_finder' if isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'in_lr_find' else
                         n.attr if isinstance(n, ast.Attribute) and (ast.unparse(n.value) == 'self.learn' or   # a callback reads the learner's
                                                                     ast.unparse(n.value) == 'self' and ast.unparse(n) not in own) else None)
                if named in names: res.append((c.name, m, named))
    return res

def test_no_callback_is_looked_up_by_name_in_a_batchs_path():
    "What depends on the fit (lr_find, the weights' clip) is decided in `before_fit`: no batch looks a callback up on the learner (issue 77)"
    names = {'lr_finder', 'flat_grad_clip', 'checkpoint', 'best_valid_loss', 'asgd_switch', 'recorder', 'cuda_graphs', 'random_arch'}
    planted = ast.parse("class C:\n def before_batch(self): self.f()\n def f(self): return hasattr(self.learn, 'lr_finder') or self.learn.recorder\n"
                        "class D:\n def _do_one_batch(self): return getattr(self, 'cuda_graphs', None) or self.recorder.train_metrics or self.checkpoint\n"
                        " def before_fit(self): self.checkpoint = 1")   # its own attribute: not a look-up
    assert batch_path_lookups(planted, names) == [('C', 'f', 'lr_finder'), ('C', 'f', 'recorder'), ('D', '_do_one_batch', 'cuda_graphs'),
                                                  ('D', '_do_one_batch', 'recorder')]
    assert {m: found for m, f in modules().items() if (found := batch_path_lookups(ast.parse(f.read_text()), names))} == {}

def test_a_methods_settings_are_applied_in_one_place():
    "`config.resolve` applies a method's settings and τ for the command line, the configs and the study; nothing else calls `with_method` (issue 77)"
    calls = []
    for m, f in modules().items():
        for fn in (n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.FunctionDef)):
            calls += [(m, fn.name) for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'with_method']
    assert calls == [('rnn_darts.config', 'resolve')]

MATHS = ('rnn_darts.model', 'rnn_darts.loss', 'rnn_darts.ops', 'rnn_darts.relax', 'rnn_darts.flat', 'rnn_darts.genotypes',
         'rnn_darts.space')   # what a step computes: the engine runs it

def beyond_interface(tree) -> list:
    "The top-level imports of `tree` that take from the engine more than its interface: a module of it, or a name not in `INTERFACE`"
    from rnn_darts.engine import INTERFACE
    return [ast.unparse(n) for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or '').startswith('rnn_darts.engine')
            and (n.module != 'rnn_darts.engine' or any(a.name not in INTERFACE for a in n.names))]

def test_the_maths_takes_only_the_engines_interface():
    """The model, its loss, the ops and the rest of the maths import from the engine only the names of its interface
    (`rnn_darts.engine.INTERFACE`), never a module of it (at their top: a fused step's Triton forms are an optional
    dependency, which the ops' registry imports when one asks); the cycle check follows the interface to its modules"""
    planted = ast.parse("from rnn_darts.engine.kernels import linear\nfrom rnn_darts.engine import runner_of, tanh\n"
                        "from rnn_darts.engine import linear, EAGER")
    assert beyond_interface(planted) == ['from rnn_darts.engine.kernels import linear', 'from rnn_darts.engine import runner_of, tanh']
    mods = modules()
    assert {m: b for m in MATHS if (b := beyond_interface(ast.parse(mods[m].read_text())))} == {}
    assert imports_of(mods['rnn_darts.model'], mods) >= {'rnn_darts.engine.kernels', 'rnn_darts.engine.runners'}

PATH_WORDS = ('compile', 'fuse', 'graph', 'bf16', 'precision', 'autocast', 'tf32')   # what the execution plan decides

def path_branches(tree) -> list:
    "The tests of `tree`'s branches (`if`, a conditional expression, `while`, a comprehension's `if`) that read a name of the execution path"
    tests = [t for n in ast.walk(tree) for t in ([n.test] if isinstance(n, (ast.If, ast.IfExp, ast.While)) else
                                                 n.ifs if isinstance(n, ast.comprehension) else [])]
    read = lambda t: [x for n in ast.walk(t) if (x := getattr(n, 'id', None) or getattr(n, 'attr', None))]
    return [ast.unparse(t) for t in tests if any(w in x.lower() for x in read(t) for w in PATH_WORDS)]

def test_only_the_engine_branches_on_the_execution_path():
    """No module outside `rnn_darts.engine` chooses a path by compile, fuse, CUDA graphs or precision (issue 91): the
    plan decides, and what runs its path (runners, `CudaGraphs`, `arch_precision`, `FusedDecoderLoss`) is the engine's"""
    planted = ast.parse("if self.graphed is None: pass\nx = a if c.fused_loss else b\n[w for w in ws if not compiled]\n"
                        "if g.get('fused'): pass\nwhile ok: pass")   # a string key is not a name of the path
    assert path_branches(planted) == ['self.graphed is None', 'c.fused_loss', 'not compiled']
    assert {m: b for m, f in modules().items() if not m.startswith('rnn_darts.engine.') and (b := path_branches(ast.parse(f.read_text())))} == {}
